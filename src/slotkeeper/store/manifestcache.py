"""The store's manifests in one file, so that a start reads one file, not one per entry.

A store of 20,000 entries is 20,000 manifests: opened, read and parsed one by one, they were most of a start
(about two seconds here, on top of llama-server's own). The manifests stay the truth; this file only says
what each one held when it was last seen, with its inode, mtime and size. Every manifest write is a rename
(entries.write_json_atomic: a new inode, a new mtime), so a manifest whose stamp matches is the one cached,
and any other is read from disk as before. A missing, damaged or foreign cache costs only time.

One line per entry after a JSON header: `<id> <inode> <mtime_ns> <size>` and the entry's fields, tab-separated
(its keys as one hex string). A start makes an Entry of each line it uses without a JSON parser, and a stop
rewrites only the lines whose manifest changed (the others are copied as they are). Stdlib only, like
entries.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..chat.prefix import KeyChain
from .entries import MANIFEST_SUFFIX, PARTIAL_SUFFIX, Entry
from .layout import ENTRIES_DIR

CACHE_NAME = "manifests.cache"  # in the save directory, beside entries/
CACHE_VERSION = 5
SHARED = ("fingerprint", "llama_server")  # what the entries of one configuration repeat: stored once, by index

Stamp = tuple[int, int, int]  # (inode, mtime_ns, size) of a manifest file


def stamp_of(st: os.stat_result) -> Stamp:
    return st.st_ino, st.st_mtime_ns, st.st_size


def read(root: Path, stamps: dict[str, Stamp]) -> dict[str, Entry]:
    """The entries cached for the manifests that still have the stamps cached with them (`stamps`: each
    manifest's now, by entry id); empty when there is no usable cache. One pass over the file, nothing kept
    but what is used."""
    found: dict[str, Entry] = {}
    try:
        with open(root / CACHE_NAME, "rb") as f:
            shared = _header(f.readline())
            if shared is None:
                return found
            for line in f:
                entry_id, stamp, raw = _split(line)
                if stamps.get(entry_id) == stamp:
                    with contextlib.suppress(ValueError, IndexError, TypeError):
                        found[entry_id] = _entry(entry_id, raw, shared)
    except (OSError, ValueError):
        pass
    return found


def save(root: Path, entries: Iterable[Entry]) -> int:
    """Write the cache for these entries, as their manifests are on disk now; returns how many lines.

    A line whose manifest is unchanged since the last cache is copied as it is. An entry whose manifest
    cannot be looked at is left out (the next start reads it). The file is replaced atomically and not
    fsynced: losing it costs one slow start.
    """
    manifests = root / ENTRIES_DIR
    current: dict[str, tuple[Stamp, Entry]] = {}
    for entry in entries:
        with contextlib.suppress(OSError):
            current[entry.id] = (stamp_of(os.lstat(manifests / f"{entry.id}{MANIFEST_SUFFIX}")), entry)
    path = root / CACHE_NAME
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    shared: dict[str, list[Any]] = {name: [] for name in SHARED}
    lines: list[bytes] = []
    with contextlib.suppress(OSError, ValueError), open(path, "rb") as old:
        shared = _header(old.readline()) or shared
        for line in old:
            entry_id, stamp, _ = _split(line)
            if entry_id in current and current[entry_id][0] == stamp:
                lines.append(line)
                del current[entry_id]
    for entry_id, (stamp, entry) in current.items():
        raw = _line(entry, shared)
        if raw is not None:
            lines.append(b"%s %d %d %d %s" % (entry_id.encode(), *stamp, raw))
    header = json.dumps({"version": CACHE_VERSION, "shared": shared}, separators=(",", ":")).encode() + b"\n"
    try:
        with open(partial, "wb") as f:
            f.write(header)
            f.writelines(lines)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise
    return len(lines)


def _header(line: bytes) -> dict[str, list[Any]] | None:
    header = json.loads(line)
    if not isinstance(header, dict) or header.get("version") != CACHE_VERSION:
        return None
    return {name: list(header["shared"][name]) for name in SHARED}


def _split(line: bytes) -> tuple[str, Stamp, bytes]:
    entry_id, ino, mtime_ns, size, raw = line.split(b" ", 4)
    return entry_id.decode(), (int(ino), int(mtime_ns), int(size)), raw


def _line(entry: Entry, shared: dict[str, list[Any]]) -> bytes | None:
    """An entry as one line of fields (a tenth of parsing its manifest); None for one whose keys are not
    digests (made-up keys in tests: read from its manifest). The objects that the entries of one
    configuration repeat are an index into `shared`, which only grows, so that old lines stay valid."""
    keys, units = KeyChain(entry.keys).hex(), KeyChain(entry.message_keys).hex()
    if keys is None or units is None:
        return None
    refs = []
    for name, value in (("fingerprint", entry.fingerprint), ("llama_server", entry.server)):
        table = shared[name]
        if value not in table:
            table.append(value)
        refs.append(table.index(value))
    fields = (
        entry.n_tokens,
        entry.nbytes,
        keys,
        repr(entry.saved_at),
        repr(entry.last_used),
        refs[0],
        entry.seq_version,
        entry.layout or "-",
        refs[1],
        units or "-",
        "" if entry.save_ms is None else repr(float(entry.save_ms)),
        entry.exact or "-",
        int(entry.boundary),
        int(entry.opening),
        entry.uses,
        entry.checksum or "-",
        ",".join(f"{ident}:{n}" for ident, n in entry.images) or "-",
        "-" if entry.image_wrap is None else ";".join(",".join(map(str, part)) for part in entry.image_wrap),
        entry.vocabulary or "-",
    )
    return "\t".join(map(str, fields)).encode() + b"\n"


def _entry(entry_id: str, raw: bytes, shared: dict[str, list[Any]]) -> Entry:
    (
        tokens,
        nbytes,
        keys,
        saved_at,
        last_used,
        fingerprint,
        seq_version,
        layout,
        server,
        units,
        save_ms,
        exact,
        boundary,
        opening,
        uses,
        checksum,
        images,
        wrap,
        vocabulary,
    ) = raw.decode().rstrip("\n").split("\t")
    return Entry(
        id=entry_id,
        n_tokens=int(tokens),
        nbytes=int(nbytes),
        keys=KeyChain.from_hex(keys),
        saved_at=float(saved_at),
        last_used=float(last_used),
        fingerprint=shared["fingerprint"][int(fingerprint)],
        seq_version=int(seq_version),
        layout="" if layout == "-" else sys.intern(layout),
        server=shared["llama_server"][int(server)],
        message_keys=KeyChain.from_hex("" if units == "-" else units),
        save_ms=float(save_ms) if save_ms else None,
        exact="" if exact == "-" else exact,
        boundary=boundary == "1",
        opening=opening == "1",
        uses=int(uses),
        checksum="" if checksum == "-" else checksum,
        images=() if images == "-" else tuple(_image(item) for item in images.split(",")),
        image_wrap=None if wrap == "-" else _wrap(wrap),
        vocabulary="" if vocabulary == "-" else sys.intern(vocabulary),
    )


def _image(item: str) -> tuple[str, int]:
    ident, _, n = item.rpartition(":")
    return ident, int(n)


def _wrap(text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    begin, end = (tuple(int(t) for t in part.split(",") if t) for part in text.split(";"))
    return begin, end
