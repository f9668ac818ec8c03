"""A start reads ahead the files of the chats it will restore (store/prescan.py): which ones (the decision, on
plain data), and that their pages really are in the page cache afterwards, on the real file system."""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import time
from pathlib import Path
from typing import Any

from slotkeeper.store.blockfiles import block_path
from slotkeeper.store.blocks import CellSection, Parts
from slotkeeper.store.conversations import ConversationStore
from slotkeeper.store.entries import Entry, pair_paths, write_json_atomic
from slotkeeper.store.prescan import chat_files, prefetch, prefetch_budget, prescan, recent_chats

FINGERPRINT = {"model": "m.gguf", "n_ctx": 4096}
SERVER = {"path": "/bin/llama-server", "size": 1, "mtime": 2}
FILE_BYTES = 20 << 20  # over the 8 MiB one read-ahead call reads here: the whole file must be asked for
PAGE = mmap.PAGESIZE


def new_entry(last_used: float, **fields: Any) -> Entry:
    """An entry of this test's configuration, used and saved at `last_used`."""
    return Entry(
        id=secrets.token_hex(8),
        keys=[],
        saved_at=last_used,
        last_used=last_used,
        fingerprint=dict(FINGERPRINT),
        seq_version=4,
        layout="packed-1",
        server=dict(SERVER),
        **fields,
    )


def write_durably(path: Path, nbytes: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())  # clean pages: the kernel can drop them (POSIX_FADV_DONTNEED) for the test


def write_block_entry(root: Path, *, last_used: float) -> tuple[str, list[Path]]:
    """An entry kept as blocks (a skeleton and two cell blocks, a store's layout since blocks), and its block
    files."""
    cell_bytes, block_cells, cells = 32 << 10, 256, 384  # blocks of 8 MiB and 4 MiB
    names = [secrets.token_hex(16) for _ in range(3)]
    parts = Parts(
        nbytes=PAGE + cells * cell_bytes,
        block_cells=block_cells,
        skeleton=names[0],
        sections=(CellSection(cells=cells, start=PAGE, shape=((cell_bytes, 1),), blocks=tuple(names[1:])),),
    )
    parts.check()
    entry = new_entry(last_used, n_tokens=cells, nbytes=parts.nbytes, parts=parts)
    files = []
    for name, size in parts.block_sizes().items():
        files.append(block_path(root / "blocks", name))
        write_durably(files[-1], size)
    write_json_atomic(pair_paths(root / "entries", entry.id)[1], entry.manifest(), fsync=False)
    return entry.id, files


def write_entry(root: Path, *, last_used: float, opening: bool = False) -> str:
    entry = new_entry(last_used, n_tokens=1000, nbytes=FILE_BYTES, opening=opening)
    bin_path, manifest_path = pair_paths(root / "entries", entry.id)
    write_durably(bin_path, FILE_BYTES)
    write_json_atomic(manifest_path, entry.manifest(), fsync=False)
    return entry.id


def resident_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore on a mapping that touches none)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = (size + PAGE - 1) // PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vector = (ctypes.c_ubyte * pages)()
            assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
            return sum(byte & 1 for byte in vector)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_the_most_recent_chats_are_chosen_not_openings() -> None:
    now = 1_000_000.0
    pairs = [
        ("old", {"last_used": now - 300}, 1),
        ("opening", {"last_used": now, "opening": True}, 1),
        ("newest", {"last_used": now - 1}, 1),
        ("saved-only", {"saved_at": now - 2}, 1),
        ("undated", {}, 1),
    ]
    assert recent_chats(pairs, 2) == ["newest", "saved-only"]
    assert recent_chats(pairs, 10) == ["newest", "saved-only", "old"]
    assert recent_chats([], 4) == []


def test_the_chats_a_start_restores_are_read_ahead_into_the_page_cache(tmp_path: Path) -> None:
    ConversationStore(tmp_path, None, FINGERPRINT).open()
    now = time.time()
    recent = [write_entry(tmp_path, last_used=now - i) for i in range(2)]
    older = write_entry(tmp_path, last_used=now - 3600)
    opening = write_entry(tmp_path, last_used=now + 1, opening=True)
    files = {entry_id: tmp_path / "entries" / f"{entry_id}.bin" for entry_id in [*recent, older, opening]}
    for path in files.values():
        evict(path)
    if any(resident_pages(path) for path in files.values()):  # a file system that keeps them (tmpfs)
        raise AssertionError(f"{tmp_path} keeps evicted pages: this test needs a disk-backed file system")

    prescan(tmp_path, SERVER, 2)

    whole = FILE_BYTES // PAGE
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(resident_pages(files[i]) < whole for i in recent):
        time.sleep(0.01)
    assert [resident_pages(files[i]) for i in recent] == [whole, whole], "the restored chats were not read ahead"
    assert resident_pages(files[older]) == 0 and resident_pages(files[opening]) == 0, "only what a start restores"


def test_what_does_not_fit_the_budget_is_left_to_the_restore(tmp_path: Path) -> None:
    """The page cache must hold the model llama-server is reading meanwhile: chats beyond a quarter of the
    available memory are not read ahead."""
    ConversationStore(tmp_path, None, FINGERPRINT).open()
    now = time.time()
    first, second = (write_entry(tmp_path, last_used=now - i) for i in range(2))
    files = [tmp_path / "entries" / f"{entry_id}.bin" for entry_id in (first, second)]
    for path in files:
        evict(path)
    assert 0 < prefetch_budget() < os.sysconf("SC_PHYS_PAGES") * PAGE
    assert prefetch([[path] for path in files], FILE_BYTES + PAGE) == 1
    whole = FILE_BYTES // PAGE
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and resident_pages(files[0]) < whole:
        time.sleep(0.01)
    assert [resident_pages(path) for path in files] == [whole, 0]


def test_a_chat_kept_as_blocks_is_read_ahead_block_by_block(tmp_path: Path) -> None:
    """Since the store keeps chats as blocks, a start reads ahead the blocks of the chats it restores (each
    block once), beside the one file of a chat saved before blocks."""
    ConversationStore(tmp_path, None, FINGERPRINT).open()
    now = time.time()
    as_blocks, blocks = write_block_entry(tmp_path, last_used=now)
    whole_file = write_entry(tmp_path, last_used=now - 1)
    files = [*blocks, tmp_path / "entries" / f"{whole_file}.bin"]
    for path in files:
        evict(path)
    if any(resident_pages(path) for path in files):  # a file system that keeps them (tmpfs)
        raise AssertionError(f"{tmp_path} keeps evicted pages: this test needs a disk-backed file system")
    assert chat_files(tmp_path, prescan(tmp_path, SERVER, 0).found.pairs, [as_blocks, whole_file]) == [
        blocks,
        files[-1:],
    ]

    prescan(tmp_path, SERVER, 2)

    wanted = [(path.stat().st_size + PAGE - 1) // PAGE for path in files]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [resident_pages(path) for path in files] != wanted:
        time.sleep(0.01)
    assert [resident_pages(path) for path in files] == wanted, "the restored chats' blocks were not read ahead"
