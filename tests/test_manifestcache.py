"""The store's own files and checks, without llama-server: the manifest cache (a start that reads one file finds
exactly what reading every manifest finds, and a manifest written after the cache, or a cache damaged or of
another version, is read from disk), and a restore whose checksum cannot be taken."""

from __future__ import annotations

import asyncio
import json
import marshal
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from slotkeeper.chat.prefix import block_keys, exact_key
from slotkeeper.store import manifestcache
from slotkeeper.store.conversations import ConversationStore
from slotkeeper.store.entries import Entry, pair_paths, write_json_atomic

FINGERPRINT = {"model": "m.gguf", "n_ctx": 4096}
SERVER = {"path": "/bin/llama-server", "size": 1, "mtime": 2}


def write_store(root: Path, n: int) -> list[str]:
    ConversationStore(root, None, FINGERPRINT).open()
    ids = []
    for i in range(n):
        tokens = [1] * 640 + [i + 2] * (64 * (1 + i % 3))
        entry = Entry(
            id=secrets.token_hex(8),
            n_tokens=len(tokens),
            nbytes=100 + i,
            keys=block_keys(tokens),
            saved_at=time.time(),
            last_used=time.time() - i,
            fingerprint=dict(FINGERPRINT),
            seq_version=2,
            layout="packed-1",
            server=dict(SERVER),
            message_keys=block_keys(tokens)[:3],
            exact=exact_key(tokens),
            boundary=bool(i % 2),
            checksum="xxh3_128:" + "0" * 32,
            images=((f"{i:064x}", 64), ("ab" * 32, 256)) if i % 3 == 0 else (),  # pictures: their ids, positions
            image_wrap=((7, 8), (9,)) if i % 3 == 0 else None,
        )
        bin_path, manifest_path = pair_paths(root / "entries", entry.id)
        bin_path.write_bytes(b"\0" * entry.nbytes)
        write_json_atomic(manifest_path, entry.manifest(), fsync=False)
        ids.append(entry.id)
    return ids


def opened(root: Path) -> ConversationStore:
    store = ConversationStore(root, None, FINGERPRINT, SERVER)
    store.open()
    return store


def seen(store: ConversationStore) -> dict[str, dict]:
    return {i: e.manifest() for i, e in store.entries.items()}


def test_a_start_from_the_cache_finds_what_the_manifests_say(tmp_path):
    write_store(tmp_path, 30)
    cold = opened(tmp_path)
    assert cold.cache_changes and not (tmp_path / manifestcache.CACHE_NAME).exists()
    asyncio.run(cold.write_cache())
    warm = opened(tmp_path)
    assert warm.cache_changes == 0, "every manifest was taken from the cache"
    assert seen(warm) == seen(cold) and len(warm.entries) == 30
    probe = block_keys([1] * 640 + [5] * 200)
    assert warm.lookup(probe)[0] == cold.lookup(probe)[0] is not None


def test_a_manifest_written_after_the_cache_is_read_from_disk(tmp_path):
    ids = write_store(tmp_path, 5)
    asyncio.run(opened(tmp_path).write_cache())
    manifest_path = pair_paths(tmp_path / "entries", ids[0])[1]
    data = json.loads(manifest_path.read_text())
    data["last_used"] = 12345.0
    write_json_atomic(manifest_path, data, fsync=False)
    store = opened(tmp_path)
    assert store.cache_changes == 1 and store.entries[ids[0]].last_used == 12345.0


def test_a_damaged_cache_costs_only_time(tmp_path):
    write_store(tmp_path, 5)
    cold = opened(tmp_path)
    asyncio.run(cold.write_cache())
    whole = (tmp_path / manifestcache.CACHE_NAME).read_bytes()
    magic = manifestcache.MAGIC

    def frame(value: Any) -> bytes:
        data = marshal.dumps(value)
        return len(data).to_bytes(4, "little") + data

    header = frame((manifestcache.FORMAT, [], []))
    damages = (
        b"{not json",  # the text format of version 5 and before
        json.dumps({"version": 99, "shared": {}, "entries": []}).encode(),
        b"",
        whole[: len(whole) // 2],  # cut short
        magic + b"\xff" * 64,  # not marshal
        magic + marshal.dumps((manifestcache.FORMAT, [], [], [])),  # not framed
        magic + frame(((5, marshal.version, (3, 10)), [], [])),  # another version, another Python
        magic + frame((manifestcache.FORMAT, [], [], "more")),  # a header of another shape
        magic + header + frame("rows"),  # a chunk of another shape
        magic + header + frame([("x",) * 3]),  # rows of another shape
        magic + header + b"\x10\x00\x00\x00" + b"\xff" * 16,  # a damaged chunk
    )
    for damage in damages:
        (tmp_path / manifestcache.CACHE_NAME).write_bytes(damage)
        store = opened(tmp_path)
        assert seen(store) == seen(cold) and store.cache_changes >= 5, "every manifest read from disk"


class FakeChild:
    """llama-server's slot actions, recorded (the store is what is under test)."""

    def __init__(self) -> None:
        self.actions: list[str] = []

    async def slot_action(self, slot_id: int, action: str, filename: str | None = None):
        from slotkeeper.llama.client import ChildReply

        self.actions.append(action)
        return ChildReply(200, {"n_restored": 700, "n_read": 100})


def test_an_entry_whose_file_cannot_be_checked_leaves_nothing_in_its_slot(tmp_path, monkeypatch):
    """The checksum runs while llama-server restores: when the file cannot be read for it, what llama-server
    read is erased (unchecked, it could be rotten), the restore fails in one reason, and the entry stays."""
    write_store(tmp_path, 1)
    child = FakeChild()
    store = ConversationStore(tmp_path, child, FINGERPRINT, SERVER)  # type: ignore[arg-type]
    store.open()
    (entry,) = store.entries.values()

    def unreadable(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("slotkeeper.store.restores.file_checksum", unreadable)
    result = asyncio.run(store.restore(entry, 0))
    assert not result.ok and result.reason == "its file could not be checked: Input/output error", result
    assert child.actions == ["restore", "erase"]
    assert entry.id in store.entries, "an entry that could not be read is not judged bad"


class BusyMachineChild(FakeChild):
    """A busy machine: llama-server reads the file in half a millisecond (its own `restore_ms`), and its answer
    reaches slotkeeper 0.2 s later, each hand-off between the processes having waited for a core."""

    async def slot_action(self, slot_id: int, action: str, filename: str | None = None):
        from slotkeeper.llama.client import ChildReply

        self.actions.append(action)
        await asyncio.sleep(0.2)
        return ChildReply(200, {"n_restored": 700, "n_read": 100, "timings": {"restore_ms": 0.5}})


def test_a_restore_is_timed_by_its_reading_not_by_the_hand_offs_around_it(tmp_path, monkeypatch):
    """What a restore is expected to cost decides whether a new chat's opening is restored or prefilled
    (placement.decide.slow_restore). It grows with the file; the hand-offs around the read do not. Counted as
    reading, 0.2 s of waiting for a core made a 2,000-token opening look slower to restore than to prefill."""
    write_store(tmp_path, 2)
    store = ConversationStore(tmp_path, BusyMachineChild(), FINGERPRINT, SERVER)  # type: ignore[arg-type]
    store.open()
    first, second = store.entries.values()
    monkeypatch.setattr("slotkeeper.store.restores.file_checksum", lambda path: first.checksum)
    result = asyncio.run(store.restore(first, 0))
    assert result.ok and result.seconds >= 0.2, result
    expected = second.nbytes / 100 * 0.0005  # at the pace llama-server read the first one's 100 bytes
    assert store.restore_seconds(second) == pytest.approx(expected, rel=0.5), store.restore_bytes_per_s
