"""The store's manifests in one file, so that a start reads one file, not one per entry.

A store of 20,000 entries is 20,000 manifests: opened, read and parsed one by one, they were most of a start
(about two seconds here, on top of llama-server's own). The manifests stay the truth; this file only says
what each one held when it was last seen, with its inode, mtime and size. Every manifest write is a rename
(entries.write_json_atomic: a new inode, a new mtime), so a manifest whose stamp matches is the one cached,
and any other is read from disk as before. A missing, damaged or foreign cache costs only time.

A magic line, then frames in Python's marshal format (its .pyc files' own), each after its length: the format
and the objects the entries of one configuration repeat (fingerprints and llama-server identities, stored
once, by index), then chunks of rows, one per entry, `(id, (inode, mtime_ns, size), fields...)`, builtins
only. marshal loads them in C: at 20,000 entries, the cache's read went from ~160 ms (text lines:
tab-separated fields, hex keys) to ~100. marshal's format is the running Python's, so a cache written by
another Python version is foreign. A stop rewrites only the rows whose manifest changed (the others are kept
as they are). Stdlib only, like entries.py.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..chat.prefix import KeyChain
from .blocks import Parts
from .entries import MANIFEST_SUFFIX, PARTIAL_SUFFIX, Entry
from .layout import ENTRIES_DIR

CACHE_NAME = "manifests.cache"  # in the save directory, beside entries/
MAGIC = b"slotkeeper manifest cache\n"
CACHE_VERSION = 8
CHUNK_ROWS = 1000  # rows per marshal frame
FORMAT = (CACHE_VERSION, marshal.version, tuple(sys.version_info[:2]))

Stamp = tuple[int, int, int]  # (inode, mtime_ns, size) of a manifest file
Row = tuple[Any, ...]  # (id, stamp, the fields of `_row`)


def stamp_of(st: os.stat_result) -> Stamp:
    return st.st_ino, st.st_mtime_ns, st.st_size


def read(root: Path, stamps: dict[str, Stamp]) -> dict[str, Entry]:
    """The entries cached for the manifests that still have the stamps cached with them (`stamps`: each
    manifest's now, by entry id); empty when there is no usable cache. A damaged part ends the reading:
    what it held is read from the manifests."""
    found: dict[str, Entry] = {}
    cache = _open(root / CACHE_NAME)
    if cache is None:
        return found
    fingerprints, servers, chunks = cache
    try:
        for chunk in chunks:
            for row in chunk:
                if stamps.get(row[0]) == row[1]:
                    try:  # (not contextlib.suppress: a context manager per row was a tenth of this loop)
                        found[row[0]] = _entry(row, fingerprints, servers)
                    except (ValueError, IndexError, TypeError):  # a row of another shape: its manifest is read
                        pass
    except (ValueError, EOFError, TypeError):
        pass
    return found


def save(root: Path, entries: Iterable[Entry]) -> int:
    """Write the cache for these entries, as their manifests are on disk now; returns how many rows.

    A row whose manifest is unchanged since the last cache is kept as it is. An entry whose manifest cannot
    be looked at is left out (the next start reads it). The file is replaced atomically and not fsynced:
    losing it costs one slow start.
    """
    manifests = root / ENTRIES_DIR
    current: dict[str, tuple[Stamp, Entry]] = {}
    for entry in entries:
        with contextlib.suppress(OSError):
            current[entry.id] = (stamp_of(os.lstat(manifests / f"{entry.id}{MANIFEST_SUFFIX}")), entry)
    path = root / CACHE_NAME
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    fingerprints: list[Any] = []
    servers: list[Any] = []
    rows: list[Row] = []
    old = _open(path)
    if old is not None:
        fingerprints, servers = list(old[0]), list(old[1])
        with contextlib.suppress(ValueError, EOFError, TypeError):  # a damaged part: its rows are made again
            for chunk in old[2]:
                for row in chunk:
                    entry_id = row[0]
                    if entry_id in current and current[entry_id][0] == row[1]:
                        rows.append(row)
                        del current[entry_id]
    for stamp, entry in current.values():
        new_row = _row(entry, stamp, fingerprints, servers)
        if new_row is not None:
            rows.append(new_row)
    frames = [(FORMAT, fingerprints, servers)] + [rows[i : i + CHUNK_ROWS] for i in range(0, len(rows), CHUNK_ROWS)]
    try:
        with open(partial, "wb") as f:
            f.write(MAGIC)
            for frame in frames:
                data = marshal.dumps(frame)
                f.write(len(data).to_bytes(4, "little"))
                f.write(data)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise
    return len(rows)


def _open(path: Path) -> tuple[list[Any], list[Any], Iterator[list[Row]]] | None:
    """The shared tables of a cache of this format, and its rows a chunk at a time; None for none, or a
    foreign one. The chunks raise ValueError, EOFError or TypeError where the file is damaged."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if not data.startswith(MAGIC):
        return None
    frames = _frames(memoryview(data)[len(MAGIC) :])
    try:
        header = next(frames)
    except (StopIteration, ValueError, EOFError, TypeError):
        return None
    if not (isinstance(header, tuple) and len(header) == 3 and header[0] == FORMAT):
        return None
    _, fingerprints, servers = header
    if not (isinstance(fingerprints, list) and isinstance(servers, list)):
        return None
    return fingerprints, servers, frames


def _frames(view: memoryview) -> Iterator[Any]:
    """The file's frames: a 4-byte length, then that many bytes of marshal. One at a time, so that one chunk's
    rows are in memory, not all of them (at 20,000 entries, all of them at once left 7 MB more RSS)."""
    pos = 0
    while pos < len(view):
        size = int.from_bytes(view[pos : pos + 4], "little")
        pos += 4
        if pos + size > len(view):
            raise EOFError("the manifest cache is cut short")
        frame = marshal.loads(view[pos : pos + size])
        if not isinstance(frame, (tuple, list)):
            raise TypeError("not a frame of the manifest cache")
        yield frame
        pos += size


def _row(entry: Entry, stamp: Stamp, fingerprints: list[Any], servers: list[Any]) -> Row | None:
    """An entry as a row of builtins; None for one whose keys are not digests (made-up keys in tests: read
    from its manifest). The objects that the entries of one configuration repeat are an index into the
    shared tables, which only grow, so that old rows stay valid."""
    keys, units = KeyChain(entry.keys).packed(), KeyChain(entry.message_keys).packed()
    if keys is None or units is None:
        return None
    refs = []
    for table, value in ((fingerprints, entry.fingerprint), (servers, entry.server)):
        if value not in table:
            table.append(value)
        refs.append(table.index(value))
    return (
        entry.id,
        stamp,
        entry.n_tokens,
        entry.nbytes,
        keys,
        float(entry.saved_at),
        float(entry.last_used),
        refs[0],
        entry.seq_version,
        entry.layout,
        refs[1],
        units,
        None if entry.save_ms is None else float(entry.save_ms),
        entry.exact,
        entry.boundary,
        entry.opening,
        entry.uses,
        entry.checksum,
        tuple((ident, n) for ident, n in entry.images),
        entry.image_wrap,
        entry.vocabulary,
        None if entry.parts is None else entry.parts.to_tuple(),
    )


def _entry(row: Row, fingerprints: list[Any], servers: list[Any]) -> Entry:
    (
        entry_id,
        _,
        n_tokens,
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
        parts,
    ) = row
    return Entry(
        id=entry_id,
        n_tokens=n_tokens,
        nbytes=nbytes,
        keys=KeyChain.from_packed(keys),
        saved_at=saved_at,
        last_used=last_used,
        fingerprint=fingerprints[fingerprint],
        seq_version=seq_version,
        layout=sys.intern(layout),
        server=servers[server],
        message_keys=KeyChain.from_packed(units),
        save_ms=save_ms,
        exact=exact,
        boundary=boundary,
        opening=opening,
        uses=uses,
        checksum=checksum,
        images=images,
        image_wrap=wrap,
        vocabulary=sys.intern(vocabulary),
        parts=None if parts is None else Parts.from_tuple(parts),
    )
