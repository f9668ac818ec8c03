"""The slot files on their way between llama-server and entries/: transient names, space, progress, commit.

Why apart from conversations.py: llama-server never sees the store. It writes a save into snapshots/ (its
--slot-save-path) under a random transient name, and this module makes such names, says whether the disk has
room for a save, reports a long save's progress, and commits a saved file into entries/ (checksum, fsync,
rename, manifest last), leaving nothing behind when any of it fails. What to save, and what becomes of the
entry, is the store's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..chat.prefix import block_keys, exact_key
from ..log import fmt_bytes, log
from . import blockfiles
from .blockfiles import BlockWriter
from .blocks import cut
from .entries import (
    BIN_SUFFIX,
    TRANSIENT_PREFIX,
    Entry,
    discard,
    file_checksum,
    fsync_path,
    pair_paths,
    write_json_atomic,
)
from .statefile import StateFileError, StateHeader, read_header

FREE_SPACE_HEADROOM = 1.1  # a save needs the expected size plus 10% free
PROGRESS_INTERVAL_S = 2.0


def transient_path(snapshots_dir: Path) -> Path:
    """A new unguessable name in snapshots/ (entries.TRANSIENT_NAME), for one save or one restore."""
    return snapshots_dir / f"{TRANSIENT_PREFIX}{secrets.token_hex(16)}{BIN_SUFFIX}"


def low_space(root: Path, expected: int) -> str | None:
    """Why a save of about `expected` bytes should not start (too little free space), or None."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return None  # the save itself will say what is wrong
    if free < expected * FREE_SPACE_HEADROOM:
        return f"only {fmt_bytes(free)} free in {root}, ~{fmt_bytes(expected)} needed"
    return None


async def report_progress(label: str, path: Path, expected: int) -> None:
    """For long saves: `slot 0 saving: 1.2 GB of ~3.4 GB` every couple of seconds, until cancelled."""
    of_expected = f" of ~{fmt_bytes(expected)}" if expected else ""
    while True:
        await asyncio.sleep(PROGRESS_INTERVAL_S)
        with contextlib.suppress(OSError):
            log.info("%s saving: %s%s", label, fmt_bytes(path.stat().st_size), of_expected)


@dataclass(frozen=True)
class SavedFile:
    """What a saved slot file holds, read once in a thread: its header, and what slotkeeper keys it by."""

    header: StateHeader
    keys: list[str]  # prefix.block_keys of its view (pictures standing for their ids)
    exact: str  # prefix.exact_key of its view
    checksum: str  # entries.file_checksum of its bytes


def read_saved(transient: Path) -> SavedFile:
    """Read a file llama-server just saved: its header, its keys and its checksum (in a thread: a large file's
    view and checksum take milliseconds to hundreds of them). StateFileError when it is not a slot file."""
    header = read_header(transient)
    view = header.view
    return SavedFile(header, block_keys(view), exact_key(view), file_checksum(transient))


def commit_blocks(
    transient: Path, entry: Entry, entries_dir: Path, writer: BlockWriter, *, fsync: bool, mark: bool
) -> tuple[Entry, int]:
    """Make a saved file `entry`, kept as blocks: cut it (`writer` writes the blocks the store lacks, fsynced,
    their folders too), then write the manifest (the commit). Returns the entry with its parts, and the bytes
    written. The transient
    file is removed whatever happens, never fsynced: a file removed before the kernel writes it back costs
    the disk nothing. What the writer wrote before a failure is the caller's to remove (blockfiles.py: when).
    `mark`: the run's first block write, which first marks the blocks unclean. Runs in a thread; the entry is
    not the store's yet."""
    try:
        if mark:
            blockfiles.mark_unclean(writer.blocks_dir)
        parts = cut(transient, writer)
        if parts.nbytes != entry.nbytes:
            raise StateFileError(f"the file has {parts.nbytes} bytes, {entry.nbytes} expected")
        writer.finish()
        committed = dataclasses.replace(entry, parts=parts)
        write_json_atomic(pair_paths(entries_dir, entry.id)[1], committed.manifest(), fsync)
    finally:
        discard(transient)
    return committed, writer.written_bytes


def commit_file(transient: Path, entry: Entry, entries_dir: Path, *, fsync: bool) -> tuple[Entry, int]:
    """Make a saved file `entry`, kept as one file (`commit`); returns the entry and its size."""
    commit(transient, entry.id, entry.manifest(), entries_dir, fsync=fsync)
    return entry, entry.nbytes


def commit(transient: Path, entry_id: str, manifest: dict[str, Any], entries_dir: Path, *, fsync: bool) -> None:
    """Make a saved file the entry `manifest` describes: fsync it, rename it into entries/, write its manifest
    last (the commit). Whatever fails, nothing it made is left: not the file, not a partial manifest. Runs in a
    thread, on plain data: the store alone makes and changes entries, on the event loop."""
    bin_path, manifest_path = pair_paths(entries_dir, entry_id)
    renamed = False
    try:
        if fsync:
            fsync_path(transient)
        os.replace(transient, bin_path)
        renamed = True
        write_json_atomic(manifest_path, manifest, fsync)
    except BaseException:
        discard(transient)
        if renamed:
            discard(manifest_path)  # manifest first, as remove_pair: never a manifest without its file
            discard(bin_path)
        raise
