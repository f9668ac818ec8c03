"""The store's manifests in one file, so that a start reads one file, not one per entry.

A store of 20,000 entries is 20,000 manifests: opened, read and parsed one by one, they were most of a start
(about a second here, on top of llama-server's own). The manifests stay the truth; this file only says what
each one held when it was last seen, with its inode, mtime and size. Every manifest write is a rename
(entries.write_json_atomic: a new inode, a new mtime), so a manifest whose stamp matches is the one cached,
and any other is read from disk as before. A missing, damaged or foreign cache costs only time.

Stdlib only, like entries.py: `slotkeeper ls` may read it too.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .entries import MANIFEST_SUFFIX, Entry, write_json_atomic
from .prefix import KeyChain

CACHE_NAME = "manifests.cache"  # in the save directory, beside entries/
CACHE_VERSION = 1

SHARED = ("fingerprint", "llama_server")  # what the entries of one configuration repeat: stored once
Stamp = tuple[int, int, int]  # (inode, mtime_ns, size) of a manifest file


def stamp_of(st: os.stat_result) -> Stamp:
    return st.st_ino, st.st_mtime_ns, st.st_size


def load(root: Path) -> dict[str, tuple[Stamp, dict[str, Any]]]:
    """Entry id -> (the stamp of its manifest when cached, the manifest); empty when there is no usable cache."""
    try:
        with open(root / CACHE_NAME, "rb") as f:
            data = json.loads(f.read())
        if data.get("version") != CACHE_VERSION:
            return {}
        shared = data["shared"]
        return {row[0]: ((row[1], row[2], row[3]), _expanded(row[4], shared)) for row in data["entries"]}
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return {}


def save(root: Path, entries: Iterable[Entry]) -> int:
    """Write the cache for these entries (their manifests as they are on disk now); returns how many rows.

    An entry whose manifest cannot be looked at is left out (the next start reads it). The file is replaced
    atomically and not fsynced: losing it costs one slow start.
    """
    manifests = root / "entries"
    rows = []
    shared: dict[str, list[Any]] = {name: [] for name in SHARED}
    for entry in entries:
        try:
            st = os.lstat(manifests / f"{entry.id}{MANIFEST_SUFFIX}")
        except OSError:
            continue
        rows.append([entry.id, *stamp_of(st), _compact(entry.manifest(), shared)])
    write_json_atomic(root / CACHE_NAME, {"version": CACHE_VERSION, "shared": shared, "entries": rows}, fsync=False)
    return len(rows)


def remove(root: Path) -> None:
    with contextlib.suppress(OSError):
        (root / CACHE_NAME).unlink()


def _compact(manifest: dict[str, Any], shared: dict[str, list[Any]]) -> dict[str, Any]:
    """A manifest with its key lists as one hex string each (a tenth of the parsing), and the objects that
    the entries of one configuration repeat (fingerprint, llama-server) as an index into `shared`."""
    for name in ("blocks", "units"):
        joined = KeyChain(manifest[name]).hex()
        if joined is not None:
            manifest[name] = joined
    for name, table in shared.items():
        value = manifest[name]
        if value not in table:
            table.append(value)
        manifest[name] = table.index(value)
    return manifest


def _expanded(manifest: dict[str, Any], shared: dict[str, list[Any]]) -> dict[str, Any]:
    for name in ("blocks", "units"):
        if isinstance(manifest.get(name), str):
            manifest[name] = KeyChain.from_hex(manifest[name])
    for name, table in shared.items():
        manifest[name] = table[manifest[name]]
    return manifest
