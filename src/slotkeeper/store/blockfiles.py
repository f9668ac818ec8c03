"""The blocks on disk: `blocks/<2 hex>/<32 hex>`, each written once, read back to put a file together, removed
when no entry uses it.

Why apart from blocks.py: that module says what a block is; this one writes, reads and removes them, in the
store's threads. A block is written as a partial file (a random name), fsynced, then renamed to its name: a
reader sees all of it or nothing, and two saves writing the same block write the same bytes under the same
name. What is written, what removed, and when, is the store's (conversations.py): it writes only blocks no
entry uses yet, and removes blocks only while no save is under way, so that a save never counts on a block
that goes while it runs.

A crash between a save's blocks and its manifest leaves blocks no manifest names. A marker file
(`blocks/.unclean`), made before a run's first block write and removed at its clean stop, tells the next start
to look for them (`sweep`); a start after a clean stop does not list blocks/ at all.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import xxhash

from .blocks import Buffer, Parts, block_hash, is_block_name, pieces
from .entries import CHECKSUM_ALGORITHM, PARTIAL_SUFFIX, discard, fsync_path

UNCLEAN_NAME = ".unclean"
WRITE_BATCH = 8 << 20  # bytes gathered per write when a file is put together
IOV_MAX = 1024  # slices per os.writev (POSIX's minimum IOV_MAX; Linux and macOS allow 1024)


def block_path(blocks_dir: Path, name: str) -> Path:
    return blocks_dir / name[:2] / name


class BlockWriter:
    """The `keep` of blocks.cut, in a save's thread: writes each block not in `present` (the blocks some
    entry uses) and not written yet by this save; `undo` removes what it wrote."""

    def __init__(self, blocks_dir: Path, present: frozenset[str], *, fsync: bool) -> None:
        self.blocks_dir = blocks_dir
        self._present = present
        self._fsync = fsync
        self._folders: set[Path] = set()
        self.written: dict[str, int] = {}  # name -> bytes, of the blocks this save wrote

    @property
    def written_bytes(self) -> int:
        return sum(self.written.values())

    def __call__(self, name: str, data: Buffer) -> None:
        if name in self._present or name in self.written:
            return
        final = block_path(self.blocks_dir, name)
        if not final.parent.is_dir():
            final.parent.mkdir(parents=True, exist_ok=True)
            self._folders.add(final.parent.parent)
        partial = final.with_name(f"{name}.{secrets.token_hex(4)}{PARTIAL_SUFFIX}")
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(partial, final)
        except BaseException:
            discard(partial)
            raise
        self.written[name] = len(data)
        self._folders.add(final.parent)

    def finish(self) -> None:
        """The renames made durable (fsync of each folder they were made in), before the manifest commits."""
        if self._fsync:
            for folder in sorted(self._folders, key=lambda p: len(p.parts), reverse=True):
                fsync_path(folder)

    def undo(self) -> None:
        """Remove the blocks this save wrote (a failed save leaves nothing behind): only while no other save is
        under way, as every removal (the store calls it so)."""
        for name in self.written:
            discard(block_path(self.blocks_dir, name))


@contextlib.contextmanager
def mapped_blocks(blocks_dir: Path, names: Iterable[str]) -> Iterator[dict[str, Buffer]]:
    """Each named block's bytes, memory-mapped (links never followed). FileNotFoundError for one missing."""
    maps: dict[str, Buffer] = {}
    try:
        for name in names:
            if name in maps:
                continue
            fd = os.open(block_path(blocks_dir, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                size = os.fstat(fd).st_size
                maps[name] = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b""
            finally:
                os.close(fd)
        yield maps
    finally:
        for data in maps.values():
            if isinstance(data, mmap.mmap):
                with contextlib.suppress(BufferError):  # a slice still alive (an exception's frame): unmapped
                    data.close()  # when it is collected


def assemble(blocks_dir: Path, parts: Parts, dest: Path) -> str:
    """Put an entry's file together at `dest` (a new file) from its blocks; returns its checksum (as
    entries.file_checksum's), which the caller compares with the entry's. OSError (FileNotFoundError: a block
    is missing) and ValueError (a block of the wrong size) leave no `dest` behind."""
    digest = xxhash.xxh3_128()
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with mapped_blocks(blocks_dir, (name for name, _ in parts.sized_blocks())) as blocks:
            batch: list[memoryview] = []
            gathered = 0
            for piece in pieces(parts, blocks):
                digest.update(piece)
                batch.append(piece)
                gathered += len(piece)
                if gathered >= WRITE_BATCH or len(batch) >= IOV_MAX:
                    _write_all(fd, batch)
                    batch, gathered = [], 0
            _write_all(fd, batch)
            batch = []
    except BaseException:
        os.close(fd)
        discard(dest)
        raise
    os.close(fd)
    return f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}"


def _write_all(fd: int, batch: list[memoryview]) -> None:
    if not batch:
        return
    written = os.writev(fd, batch)
    total = sum(len(piece) for piece in batch)
    if written < total:  # a short write (rare on regular files): the rest, one piece at a time
        rest = memoryview(b"".join(batch))[written:]
        while rest:
            rest = rest[os.write(fd, rest) :]


def bad_blocks(blocks_dir: Path, names: Iterable[str]) -> list[str]:
    """Those of the named blocks that are missing, unreadable, or whose bytes no longer hash to their name."""
    bad = []
    for name in dict.fromkeys(names):
        try:
            with mapped_blocks(blocks_dir, [name]) as blocks:
                if block_hash(blocks[name]) != name:
                    bad.append(name)
        except OSError:
            bad.append(name)
    return bad


def remove_blocks(blocks_dir: Path, names: Iterable[str]) -> int:
    """Remove these blocks; returns how many could not be (a read-only remount: left for the next start's
    sweep, which a marker asks for)."""
    failed = 0
    for name in names:
        if not discard(block_path(blocks_dir, name)):
            failed += 1
    return failed


def mark_unclean(blocks_dir: Path) -> None:
    """Before a run's first block write: a crash from here on may leave blocks no manifest names."""
    blocks_dir.mkdir(exist_ok=True)
    marker = blocks_dir / UNCLEAN_NAME
    if not marker.exists():
        with open(marker, "wb"):
            pass


def is_unclean(blocks_dir: Path) -> bool:
    return (blocks_dir / UNCLEAN_NAME).exists()


def mark_clean(blocks_dir: Path) -> None:
    """At a clean stop, once no save is under way and every removal is done."""
    discard(blocks_dir / UNCLEAN_NAME)


def sweep(blocks_dir: Path, used: Callable[[str], bool]) -> tuple[int, int]:
    """Remove the blocks no entry uses (`used` says which are) and partial files: what a crash in a save left.
    Returns (files removed, their bytes). Anything else in blocks/ is left as it is."""
    removed = freed = 0
    try:
        folders = [entry for entry in os.scandir(blocks_dir) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return 0, 0
    for folder in folders:
        try:
            items = list(os.scandir(folder.path))
        except OSError:
            continue
        for item in items:
            name = item.name
            partial = name.endswith(PARTIAL_SUFFIX)
            if not item.is_file(follow_symlinks=False) or not (partial or (is_block_name(name) and not used(name))):
                continue
            with contextlib.suppress(OSError):
                size = item.stat(follow_symlinks=False).st_size
                os.unlink(item.path)
                removed += 1
                freed += size
    return removed, freed
