"""The shared tier against a real S3 server (rclone serve s3), never a mock of the client."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import obstore
import pytest
import xxhash

from slotkeeper.log import log
from slotkeeper.remote import tier as remote_tier
from slotkeeper.remote import uploads as remote_uploads
from slotkeeper.remote.tier import Fetched, RemoteConfig, RemoteMatch, RemoteTier
from slotkeeper.store.blockfiles import UNCLEAN_NAME, assemble, block_path
from slotkeeper.store.blocks import CellSection, Parts, block_hash, pieces
from slotkeeper.store.conversations import ConversationStore
from slotkeeper.store.entries import CHECKSUM_ALGORITHM, Entry
from slotkeeper.store.statelayout import RowRun
from slotkeeper.testing.harness import free_port
from slotkeeper.testing.s3server import ACCESS_KEY_ID, SECRET_ACCESS_KEY, S3Server

BUCKET = "slotkeeper"
URL = f"s3://{BUCKET}/team/cache"
MB = 1024 * 1024


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[S3Server]:
    server = S3Server(tmp_path / "s3", bucket=BUCKET).start()
    yield server
    server.kill()  # a graceful stop waits for uploads the tests left behind


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """slotkeeper's log lines, whether or not setup_logging() turned propagation off."""
    old_level, old_propagate = log.level, log.propagate
    log.addHandler(caplog.handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    yield caplog
    log.removeHandler(caplog.handler)
    log.setLevel(old_level)
    log.propagate = old_propagate


TierFactory = Callable[..., RemoteTier]


@pytest.fixture
async def make_tier(tmp_path: Path) -> Any:
    """make_tier(server, namespace=..., journal=..., **kw): tiers closed (deadline now) at teardown."""
    made: list[RemoteTier] = []

    def make(server: S3Server, namespace: str = "ns1", journal: Path | None = None, **kw: Any) -> RemoteTier:
        tier = RemoteTier(
            RemoteConfig.from_url(URL, server.env()), namespace, journal or tmp_path / f"journal-{namespace}", **kw
        )
        made.append(tier)
        return tier

    yield make
    for tier in made:
        await tier.close(time.monotonic())


def write_entry(
    directory: Path, entry_id: str, nbytes: int, blocks: list[str], block_tokens: int = 16
) -> tuple[Path, dict[str, Any]]:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{entry_id}.bin"
    with open(path, "wb") as f:
        for _ in range(nbytes // MB):
            f.write(os.urandom(MB))
        f.write(os.urandom(nbytes % MB))
    return path, {"bytes": nbytes, "blocks": blocks, "block_tokens": block_tokens, "tokens": len(blocks) * block_tokens}


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


async def until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


async def upload(tier: RemoteTier, path: Path, manifest: dict[str, Any], timeout: float = 20.0) -> None:
    done = tier.stats.uploads_done
    tier.schedule_upload(path.stem, path, manifest)
    await until(lambda: tier.stats.uploads_done > done, timeout, f"upload of {path.name}")


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ---- roundtrip ------------------------------------------------------------------------------------------------


async def test_upload_then_find_and_fetch_roundtrip(s3: S3Server, make_tier: TierFactory, tmp_path: Path) -> None:
    """Bytes come back identical; the remote manifest carries sha256 and bytes; another namespace sees nothing."""
    tier = make_tier(s3)
    path, manifest = write_entry(tmp_path / "local", "e1", 20 * MB + 123, ["b1", "b2", "b3"])  # > 2 parts
    await upload(tier, path, manifest)
    assert list(tier.journal_dir.iterdir()) == []  # done: the journal record is gone

    remote_json = json.loads(s3.object_path("team/cache/ns1/e1.json").read_text())
    assert remote_json == {**manifest, "sha256": sha256(path), "bytes": path.stat().st_size}

    other = make_tier(s3, namespace="ns2")
    assert await other.find(["b1", "b2", "b3"], 16) is None
    assert await other.list_entries() == []

    match = await tier.find(["b1", "b2", "b3", "b4"], 16)
    assert match is not None and (match.entry_id, match.matched_blocks) == ("e1", 3)
    assert tier.estimated_fetch_seconds(100 * MB) is None  # nothing measured yet
    fetched = await tier.fetch(match, tmp_path / "dest")  # type: ignore[arg-type]
    assert fetched is not None
    got, got_manifest = fetched
    assert got == tmp_path / "dest" / "e1.bin"
    assert sha256(got) == sha256(path) and got_manifest["sha256"] == sha256(path)
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == ["e1.bin"]  # no partial left
    assert tier.stats.download_bytes == path.stat().st_size and tier.stats.rejected == 0
    assert tier.estimated_fetch_seconds(100 * MB) is not None

    path2, manifest2 = write_entry(tmp_path / "local2", "e2", 1000, ["b1"])
    await upload(other, path2, manifest2)
    listing = await tier.list_all()
    assert {ns: [m["entry_id"] for m in entries] for ns, entries in listing.items()} == {"ns1": ["e1"], "ns2": ["e2"]}
    assert [m["entry_id"] for m in await tier.list_entries()] == ["e1"]


async def test_bin_without_manifest_is_not_an_entry(s3: S3Server, make_tier: TierFactory, tmp_path: Path) -> None:
    """The .json is the commit marker: a .bin without its manifest is not an entry."""
    tier = make_tier(s3)
    path, manifest = write_entry(tmp_path / "local", "e1", 1000, ["b1"])
    await upload(tier, path, manifest)
    reader = make_tier(s3, journal=tmp_path / "j2")
    assert await reader.find(["b1"], 16) is not None
    store = RemoteConfig.from_url(URL, s3.env()).store(timedelta(seconds=5), timedelta(seconds=5))
    await obstore.delete_async(store, "ns1/e1.json")
    assert await make_tier(s3, journal=tmp_path / "j3").find(["b1"], 16) is None
    assert s3.object_path("team/cache/ns1/e1.bin").exists()


# ---- choosing among entries -----------------------------------------------------------------------------------


async def test_longest_prefix_wins_and_index_refreshes(
    s3: S3Server, make_tier: TierFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host_a, host_b = make_tier(s3), make_tier(s3, journal=tmp_path / "journal-b")
    entries = {
        "short": (["h1", "h2"], 16),
        "long": (["h1", "h2", "h3", "h4"], 16),
        "sideways": (["h1", "x2", "x3", "x4", "x5"], 16),
        "other_block_size": (["h1", "h2", "h3", "h4", "h5"], 32),
    }
    for entry_id, (blocks, block_tokens) in entries.items():
        await upload(host_b, *write_entry(tmp_path / "b", entry_id, 100, blocks, block_tokens))
    foreign = make_tier(s3, namespace="ns2")
    await upload(foreign, *write_entry(tmp_path / "f", "foreign", 100, ["h1", "h2", "h3", "h4", "h5"]))

    match = await host_a.find(["h1", "h2", "h3", "h9"], 16)
    assert match is not None and (match.entry_id, match.matched_blocks) == ("long", 3)
    match = await host_a.find(["h1", "h2", "h3", "h4", "h5", "h6"], 16)
    assert match is not None and (match.entry_id, match.matched_blocks) == ("long", 4)  # not ns2's, not 32's
    match = await host_a.find(["h1", "h2", "h3"], 32)
    assert match is not None and match.entry_id == "other_block_size"
    assert await host_a.find(["zz"], 16) is None
    assert await host_a.find([], 16) is None
    assert (host_a.stats.remote_hits, host_a.stats.remote_misses) == (3, 2)

    # host B saves a better entry: host A sees it only once its index is INDEX_MAX_AGE_S old.
    monkeypatch.setattr(remote_tier, "INDEX_MAX_AGE_S", 3600.0)
    await upload(host_b, *write_entry(tmp_path / "b", "longer", 100, ["h1", "h2", "h3", "h4", "h5"]))
    match = await host_a.find(["h1", "h2", "h3", "h4", "h5"], 16)
    assert match is not None and match.entry_id == "long"
    monkeypatch.setattr(remote_tier, "INDEX_MAX_AGE_S", 0.0)
    match = await host_a.find(["h1", "h2", "h3", "h4", "h5"], 16)
    assert match is not None and (match.entry_id, match.matched_blocks) == ("longer", 5)


# ---- nothing remote is trusted ------------------------------------------------------------------------------


async def test_tampered_and_truncated_objects_are_rejected(
    s3: S3Server, make_tier: TierFactory, tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    uploader = make_tier(s3)
    for entry_id in ("tampered", "truncated"):
        await upload(uploader, *write_entry(tmp_path / "local", entry_id, 3 * MB, [entry_id]))
    tampered = s3.object_path("team/cache/ns1/tampered.bin")
    with open(tampered, "r+b") as f:  # same size, different bytes
        f.seek(MB)
        byte = f.read(1)
        f.seek(MB)
        f.write(bytes([byte[0] ^ 0xFF]))
    truncated = s3.object_path("team/cache/ns1/truncated.bin")
    os.truncate(truncated, 2 * MB)

    tier = make_tier(s3, journal=tmp_path / "j2")
    dest = tmp_path / "dest"
    dest.mkdir()
    for entry_id in ("tampered", "truncated"):
        match = await tier.find([entry_id], 16)
        assert match is not None and match.entry_id == entry_id
        assert await tier.fetch(match, dest) is None
        assert await tier.find([entry_id], 16) is None  # not offered again
    assert tier.stats.rejected == 2
    assert list(dest.iterdir()) == []  # neither the partial nor a final file
    rejected = [line for line in warnings(logs) if "rejected" in line]
    assert rejected == [
        "remote: entry tampered rejected: the downloaded bytes do not match its manifest's sha256; nothing was kept",
        "remote: entry truncated rejected: its object has 2097152 bytes, its manifest says 3145728",
    ]


async def test_malformed_remote_manifest_is_rejected(s3: S3Server, make_tier: TierFactory, tmp_path: Path) -> None:
    tier = make_tier(s3)
    await upload(tier, *write_entry(tmp_path / "local", "e1", 100, ["b1"]))
    s3.object_path("team/cache/ns1/e1.json").write_text('{"blocks": ["b1"], "block_tokens": 16, "bytes": 100}')
    reader = make_tier(s3, journal=tmp_path / "j2")
    assert await reader.find(["b1"], 16) is None  # no sha256: never offered
    assert reader.stats.rejected == 1


# ---- write-behind survives a dead link --------------------------------------------------------------------------


async def test_server_stopped_mid_upload_then_resumed_by_a_new_tier(
    s3: S3Server, make_tier: TierFactory, tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    s3.stop()
    s3.bwlimit = "16M"  # 64 MB take ~4 s: the server is stopped well before the end
    s3.start()
    journal = tmp_path / "journal"
    tier = make_tier(s3, journal=journal, request_timeout_s=3.0)
    path, manifest = write_entry(tmp_path / "local", "big", 64 * MB, ["b1"])
    before = (sha256(path), path.stat().st_mtime_ns)
    tier.schedule_upload("big", path, manifest)
    await until(lambda: (journal / "big.json").exists(), 5, "the journal record")
    await asyncio.sleep(1.0)
    s3.kill()
    await until(lambda: tier.stats.uploads_failed == 1, 15, "the upload to give up")
    assert tier.stats.uploads_done == 0 and tier.stats.uploads_pending == 0
    assert (sha256(path), path.stat().st_mtime_ns) == before  # the local file is untouched
    assert json.loads((journal / "big.json").read_text())["entry_id"] == "big"
    assert not s3.object_path("team/cache/ns1/big.json").exists()  # never committed
    assert [line for line in warnings(logs) if "upload failed" in line and "journal" in line]

    s3.bwlimit = None
    s3.start()
    resumed = make_tier(s3, journal=journal)
    assert resumed.resume() == 1
    await until(lambda: resumed.stats.uploads_done == 1, 20, "the resumed upload")
    assert list(journal.iterdir()) == []
    match = await resumed.find(["b1"], 16)
    assert match is not None
    fetched = await resumed.fetch(match, tmp_path / "dest")
    assert fetched is not None and sha256(fetched[0]) == before[0]


async def test_evicted_or_changed_files_are_dropped(
    s3: S3Server, make_tier: TierFactory, tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    journal = tmp_path / "journal"
    tier = make_tier(s3, journal=journal)
    gone, gone_manifest = write_entry(tmp_path / "local", "gone", 1000, ["b1"])
    changed, changed_manifest = write_entry(tmp_path / "local", "changed", 1000, ["b2"])
    gone.unlink()
    with open(changed, "ab") as f:
        f.write(b"more")
    tier.schedule_upload("gone", gone, gone_manifest)
    tier.schedule_upload("changed", changed, changed_manifest)
    await until(lambda: tier.stats.uploads_pending == 0, 10, "both uploads to be dropped")
    assert (tier.stats.uploads_done, tier.stats.uploads_failed) == (0, 0)
    assert list(journal.iterdir()) == []
    dropped = [r.getMessage() for r in logs.records if "dropped" in r.getMessage()]
    assert len(dropped) == 2
    assert not s3.object_path("team/cache/ns1/gone.bin").exists()
    assert not s3.object_path("team/cache/ns1/changed.bin").exists()

    # A journal record whose file was evicted while slotkeeper was down is not resumed.
    (journal / "old.json").write_text(
        json.dumps({"entry_id": "old", "bin_path": str(tmp_path / "nope.bin"), "manifest": {"bytes": 1}})
    )
    assert make_tier(s3, journal=journal).resume() == 0
    assert list(journal.iterdir()) == []


async def test_file_changed_during_upload_is_not_committed(
    s3: S3Server, make_tier: TierFactory, tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    """A file rewritten while it is read for upload (same size) never gets a remote manifest."""
    s3.stop()
    s3.bwlimit = "8M"  # 24 MB take ~3 s
    s3.start()
    tier = make_tier(s3)
    path, manifest = write_entry(tmp_path / "local", "moving", 24 * MB, ["b1"])
    tier.schedule_upload("moving", path, manifest)
    await asyncio.sleep(0.5)
    with open(path, "r+b") as f:
        f.write(os.urandom(MB))
    await until(lambda: tier.stats.uploads_pending == 0, 15, "the upload to end")
    assert (tier.stats.uploads_done, tier.stats.uploads_failed) == (0, 0)
    assert [r.getMessage() for r in logs.records if "dropped" in r.getMessage()] == [
        "remote: upload of entry moving dropped: moving.bin changed while it was uploaded"
    ]
    assert not s3.object_path("team/cache/ns1/moving.json").exists()
    assert not s3.object_path("team/cache/ns1/moving.bin").exists()  # completed, then removed
    assert list(tier.journal_dir.iterdir()) == []


# ---- reachability and stopping ----------------------------------------------------------------------------------


async def test_unreachable_at_start(make_tier: TierFactory, tmp_path: Path, logs: pytest.LogCaptureFixture) -> None:
    nobody = S3Server(tmp_path / "never-started", port=free_port())  # refused: nothing listens there
    tier = make_tier(nobody)
    started = time.monotonic()
    assert await tier.probe(1.0) is False
    assert time.monotonic() - started < 1.5
    assert warnings(logs) == [
        f"remote store {URL} unreachable (connection refused); continuing with the local store only"
    ]

    logs.clear()
    with socket.socket() as silent:  # accepts connections (kernel backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        tier = make_tier(S3Server(tmp_path / "silent", port=silent.getsockname()[1]))
        started = time.monotonic()
        assert await tier.probe(1.0) is False
        elapsed = time.monotonic() - started
    assert 0.9 < elapsed < 1.5
    assert warnings(logs) == [
        f"remote store {URL} unreachable (no answer within 1 s); continuing with the local store only"
    ]


class StallingServer:
    """Answers every request with the head of a big object and a few bytes, then sends nothing more."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            conn.recv(65536)
            conn.sendall(
                b'HTTP/1.1 200 OK\r\nContent-Length: 3145728\r\nETag: "x"\r\n'
                b"Last-Modified: Tue, 01 Dec 2026 08:00:00 GMT\r\n\r\n" + b"\0" * 1000
            )

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


async def test_stalled_download_gives_up_after_the_request_timeout(
    make_tier: TierFactory, tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    stalling = StallingServer()
    try:
        tier = make_tier(S3Server(tmp_path / "stall", port=stalling.port), request_timeout_s=1.0)
        match = RemoteMatch("e1", {"bytes": 3 * MB, "sha256": "0" * 64, "blocks": ["b1"], "block_tokens": 16}, 1)
        started = time.monotonic()
        assert await asyncio.wait_for(tier.fetch(match, tmp_path / "dest"), 10) is None
        assert time.monotonic() - started < 2.5
    finally:
        stalling.close()
    assert tier.stats.fetches_failed == 1 and tier.stats.rejected == 0
    assert list((tmp_path / "dest").iterdir()) == []
    assert warnings(logs) == ["remote: entry e1 fetch failed (no answer within 1 s)"]


async def test_probe_reachable(s3: S3Server, make_tier: TierFactory) -> None:
    assert await make_tier(s3).probe(2.0) is True


async def test_concurrent_fetches_download_once(s3: S3Server, make_tier: TierFactory, tmp_path: Path) -> None:
    await upload(make_tier(s3), *write_entry(tmp_path / "local", "e1", 24 * MB, ["b1"]))
    tier = make_tier(s3, journal=tmp_path / "j2")
    match = await tier.find(["b1"], 16)
    assert match is not None
    results = await asyncio.gather(*(tier.fetch(match, tmp_path / "dest") for _ in range(4)))
    assert all(r is not None and r[0] == tmp_path / "dest" / "e1.bin" for r in results)
    assert sha256(tmp_path / "dest" / "e1.bin") == match.manifest["sha256"]
    assert tier.stats.download_bytes == 24 * MB  # one download, not four


async def test_close_returns_by_its_deadline_with_uploads_pending(
    s3: S3Server, make_tier: TierFactory, tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    s3.stop()
    s3.bwlimit = "1M"
    s3.start()
    journal = tmp_path / "journal"
    tier = make_tier(s3, journal=journal, concurrency=1)
    first, first_manifest = write_entry(tmp_path / "local", "slow1", 16 * MB, ["b1"])
    second, second_manifest = write_entry(tmp_path / "local", "slow2", 8 * MB, ["b2"])
    tier.schedule_upload("slow1", first, first_manifest)
    tier.schedule_upload("slow2", second, second_manifest)
    await asyncio.sleep(0.5)
    started = time.monotonic()
    await tier.close(started + 1.0)
    elapsed = time.monotonic() - started
    assert 0.9 < elapsed < 1.0 + remote_tier.CANCEL_GRACE_S
    assert tier.stats.uploads_pending == 2 and tier.stats.uploads_done == 0
    assert sorted(p.name for p in journal.iterdir()) == ["slow1.json", "slow2.json"]
    assert [r.getMessage() for r in logs.records if "pending" in r.getMessage()] == [
        "remote: 2 upload(s) pending (25.2 MB); they resume at the next start"
    ]


# ---- entries kept as blocks --------------------------------------------------------------------------------------

FP = {"model": "m.gguf", "n_ctx_slot": 4096, "test": "blocks"}  # the configuration of every store below
CELL = 1000  # bytes per cell of the hand-made entries' one KV stream
BLOCK_CELLS = 4  # cells per cell block: each cell block is 4,000 bytes


def data(tag: str, n: int = BLOCK_CELLS * CELL) -> bytes:
    """Bytes of their own for each tag, the same at every call."""
    return random.Random(tag).randbytes(n)


def block_entry(save_dir: Path, entry_id: str, skeleton: bytes, cells: list[bytes]) -> dict[str, Any]:
    """An entry kept as blocks, as the store commits one: its blocks (its skeleton, then a cell block per
    BLOCK_CELLS cells) under their hashes in blocks/, then its version-3 manifest in entries/; its prefix keys
    name its cells (k0, k1, ...), so that a longer chat extends a shorter one. Returns the manifest."""
    blocks: dict[str, bytes] = {}
    for chunk in (skeleton, *cells):
        name = block_hash(chunk)
        blocks[name] = chunk
        path = block_path(save_dir / "blocks", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(chunk)
    parts = Parts(
        nbytes=len(skeleton) + len(cells) * BLOCK_CELLS * CELL,
        block_cells=BLOCK_CELLS,
        skeleton=block_hash(skeleton),
        sections=(
            CellSection.of_runs(len(cells) * BLOCK_CELLS, (RowRun(16, CELL),), tuple(block_hash(c) for c in cells)),
        ),
    )
    digest = xxhash.xxh3_128()
    for piece in pieces(parts, blocks):
        digest.update(piece)
    now = time.time()
    entry = Entry(
        id=entry_id,
        n_tokens=len(cells) * 64,
        nbytes=parts.nbytes,
        keys=[f"k{i}" for i in range(len(cells))],
        saved_at=now,
        last_used=now,
        fingerprint=dict(FP),
        seq_version=4,
        layout="packed-1",
        checksum=f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}",
        parts=parts,
    )
    manifest = entry.manifest()
    (save_dir / "entries").mkdir(parents=True, exist_ok=True)
    (save_dir / "entries" / f"{entry_id}.json").write_text(json.dumps(manifest))
    return manifest


async def upload_entry(tier: RemoteTier, save_dir: Path, manifest: dict[str, Any], timeout: float = 20.0) -> None:
    """As the store's on_commit hands a committed entry kept as blocks to the tier, and its upload's end."""
    done = tier.stats.uploads_done
    tier.schedule_upload(manifest["id"], save_dir / "blocks", manifest)
    await until(lambda: tier.stats.uploads_done > done, timeout, f"upload of {manifest['id']}")


def bucket(s3: S3Server, namespace: str = "ns1") -> dict[str, Path]:
    """The objects of a namespace, by key under it (`<id>.json`, `blocks/<name>`)."""
    root = s3.object_path(f"team/cache/{namespace}")
    return {str(p.relative_to(root)): p for p in root.rglob("*") if p.is_file()} if root.exists() else {}


def blocks_of(manifest: dict[str, Any]) -> dict[str, int]:
    return Parts.from_json(manifest["parts"]).block_sizes()


def store_at(root: Path) -> ConversationStore:
    """A host's local store (no llama-server: only what a download and `adopt` need)."""
    root.mkdir(parents=True, exist_ok=True)
    store = ConversationStore(root, None, dict(FP), fsync=False, ram_staging=False)
    store.open()
    return store


def local_blocks(root: Path) -> set[str]:
    """The files in a store's blocks/ (blocks and partial ones), not its marker."""
    folder = root / "blocks"
    return {p.name for p in folder.rglob("*") if p.is_file() and p.name != UNCLEAN_NAME} if folder.exists() else set()


async def test_a_block_entry_uploads_its_blocks_then_its_manifest_and_a_grown_chat_only_what_is_new(
    s3: S3Server,
    make_tier: TierFactory,
    tmp_path: Path,
    logs: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each block is an object named by its hash, the manifest (the local one, as it is) comes last; the next
    save of the grown chat sends only its new blocks (its skeleton and its new cells), looking up only those (the
    others it sent itself), and another host that saves a chat sharing blocks sends only those the bucket
    lacks."""
    a = tmp_path / "host-a"
    tier = make_tier(s3)
    first = block_entry(a, "e1", data("skeleton 1", 100), [data("x"), data("y")])
    await upload_entry(tier, a, first)
    assert list(tier.journal_dir.iterdir()) == []
    objects = bucket(s3)
    assert set(objects) == {"e1.json"} | {f"blocks/{name}" for name in blocks_of(first)}
    assert json.loads(objects["e1.json"].read_text()) == first  # the local manifest: parts, checksum, bytes
    for name, size in blocks_of(first).items():
        assert objects[f"blocks/{name}"].read_bytes() == block_path(a / "blocks", name).read_bytes()
        assert len(objects[f"blocks/{name}"].read_bytes()) == size
    assert tier.stats.upload_bytes == sum(blocks_of(first).values()) == first["bytes"]
    store = RemoteConfig.from_url(URL, s3.env()).store(timedelta(seconds=5), timedelta(seconds=5))
    metas = {m["path"]: m for m in await obstore.list(store, "ns1/").collect_async()}
    assert all(metas["ns1/e1.json"]["last_modified"] >= m["last_modified"] for m in metas.values())

    grown = block_entry(a, "e2", data("skeleton 2", 120), [data("x"), data("y"), data("z")])
    looked_up: list[str] = []
    head_block = tier.bucket.head_block

    async def counted(namespace: str, name: str) -> Any:
        looked_up.append(name)
        return await head_block(namespace, name)

    monkeypatch.setattr(tier.bucket, "head_block", counted)
    await upload_entry(tier, a, grown)
    new = {block_hash(data("skeleton 2", 120)), block_hash(data("z"))}
    assert sorted(looked_up) == sorted(new)
    assert set(bucket(s3)) == set(objects) | {"e2.json"} | {f"blocks/{name}" for name in new}
    assert tier.stats.upload_bytes - first["bytes"] == 120 + BLOCK_CELLS * CELL < grown["bytes"]
    assert re.search(r"remote: entry e2 uploaded: 4\.1 KB in [\d.]+ s \(2 of its 4 blocks, of 12\.1 KB\)", logs.text)

    other = make_tier(s3, journal=tmp_path / "journal-b")  # another host: it knows nothing of the bucket yet
    b = tmp_path / "host-b"
    shared = block_entry(b, "f1", data("skeleton 3", 90), [data("x"), data("w")])
    await upload_entry(other, b, shared)
    assert other.stats.upload_bytes == 90 + BLOCK_CELLS * CELL  # x was there: looked up, not sent
    assert len([key for key in bucket(s3) if key.startswith("blocks/")]) == 7


async def test_uploads_of_two_entries_at_once_send_a_block_they_share_once(
    s3: S3Server, make_tier: TierFactory, tmp_path: Path
) -> None:
    tier = make_tier(s3)
    a = tmp_path / "host-a"
    one = block_entry(a, "e1", data("skeleton 1", 100), [data("x"), data("y")])
    two = block_entry(a, "e2", data("skeleton 2", 100), [data("x"), data("y"), data("z")])
    tier.schedule_upload("e1", a / "blocks", one)
    tier.schedule_upload("e2", a / "blocks", two)
    await until(lambda: tier.stats.uploads_done == 2, 20, "both uploads")
    assert tier.stats.upload_bytes == 200 + 3 * BLOCK_CELLS * CELL  # x and y once


async def test_a_second_host_downloads_only_the_blocks_it_lacks(
    s3: S3Server, make_tier: TierFactory, tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    """Host B holds the chat's first save (it was fetched earlier, or B saved the same opening); the grown chat
    saved on host A comes down as its manifest and the blocks B lacks, each checked, and the store holds it:
    put together from its blocks, it is the file A saved, byte for byte."""
    a, b = tmp_path / "host-a", tmp_path / "host-b"
    uploader = make_tier(s3)
    first = block_entry(a, "e1", data("skeleton 1", 100), [data("x"), data("y")])
    block_entry(b, "e1", data("skeleton 1", 100), [data("x"), data("y")])
    grown = block_entry(a, "e2", data("skeleton 2", 120), [data("x"), data("y"), data("z")])
    for manifest in (first, grown):
        await upload_entry(uploader, a, manifest)
    store = store_at(b)
    assert set(store.entries) == {"e1"}
    tier = make_tier(s3, journal=tmp_path / "journal-b")
    match = await tier.find(["k0", "k1", "k2", "k3"], 64)
    assert match is not None and (match.entry_id, match.matched_blocks) == ("e2", 3)
    assert await tier.fetch_into(match, store, None) is Fetched.ADOPTED
    assert set(store.entries) == {"e1", "e2"}
    assert tier.stats.download_bytes == 120 + BLOCK_CELLS * CELL  # its skeleton and z: x and y were here
    assert tier.estimated_fetch_seconds(MB) is not None
    assert local_blocks(b) == local_blocks(a)  # no partial left, nothing else
    for name in blocks_of(grown):
        assert block_path(b / "blocks", name).read_bytes() == block_path(a / "blocks", name).read_bytes()
    assert json.loads((b / "entries" / "e2.json").read_text())["checksum"] == grown["checksum"]
    parts = Parts.from_json(grown["parts"])
    assert assemble(b / "blocks", parts, tmp_path / "e2.restored") == grown["checksum"]  # as a restore checks it
    assert re.search(
        r"remote: entry e2 fetched: 4\.1 KB in [\d.]+ s \(\S+ \S+/s; 2 of its 4 blocks, of 12\.1 KB\)", logs.text
    )
    assert warnings(logs) == []

    # a host with nothing downloads every block; one that holds them all, none
    c = tmp_path / "host-c"
    empty = store_at(c)
    fresh = make_tier(s3, journal=tmp_path / "journal-c")
    assert await fresh.fetch_into(match, empty, None) is Fetched.ADOPTED
    assert fresh.stats.download_bytes == grown["bytes"] and local_blocks(c) == set(blocks_of(grown))
    assert store.entries["e2"].nbytes == empty.entries["e2"].nbytes == grown["bytes"]


@pytest.mark.parametrize("damage", ["flipped", "truncated", "missing"])
async def test_a_damaged_remote_block_is_rejected_and_nothing_is_kept(
    s3: S3Server,
    make_tier: TierFactory,
    tmp_path: Path,
    logs: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    damage: str,
) -> None:
    """A block whose bytes are not its name's (same size or not), or that is gone: the entry is rejected in one
    line and not offered again, no block of it stays in the local store (those that came down before it go
    again), and the chat starts cold. The next upload that counts on that block writes it again (the bucket is
    repaired)."""
    monkeypatch.setattr(remote_tier, "BLOCK_CONCURRENCY", 1)  # in file order: the skeleton and x come first
    a, b = tmp_path / "host-a", tmp_path / "host-b"
    uploader = make_tier(s3)
    manifest = block_entry(a, "e1", data("skeleton 1", 100), [data("x"), data("y"), data("z")])
    await upload_entry(uploader, a, manifest)
    y = block_hash(data("y"))
    damaged = bucket(s3)[f"blocks/{y}"]
    raw = bytearray(damaged.read_bytes())
    store = RemoteConfig.from_url(URL, s3.env()).store(timedelta(seconds=5), timedelta(seconds=5))
    if damage == "flipped":  # behind the server's back
        raw[len(raw) // 2] ^= 0xFF
        damaged.write_bytes(bytes(raw))
    elif damage == "truncated":  # through S3 (rclone caches what it was told of an object's size)
        await obstore.put_async(store, f"ns1/blocks/{y}", bytes(raw[:1000]))
    else:
        await obstore.delete_async(store, f"ns1/blocks/{y}")
    host = store_at(b)
    tier = make_tier(s3, journal=tmp_path / "journal-b")
    match = await tier.find(["k0", "k1", "k2"], 64)
    assert match is not None
    assert await tier.fetch_into(match, host, None) is Fetched.FAILED
    assert host.entries == {} and local_blocks(b) == set()  # what came down before it went again
    assert not list((b / "entries").iterdir())
    assert tier.stats.rejected == 1 and tier.stats.download_bytes == 0
    why = {
        "flipped": "does not match its name (the xxh3_128 of its bytes)",
        "truncated": f"has 1000 bytes, its manifest says {BLOCK_CELLS * CELL}",
        "missing": f"is not in {URL} (pruned?)",
    }[damage]
    assert warnings(logs) == [f"remote: entry e1 rejected: its block {y} {why}"]
    assert await tier.find(["k0", "k1", "k2"], 64) is None  # not offered again

    # host B saves a chat that uses y (its own bytes of it): its upload writes y again
    mine = block_entry(b, "f1", data("skeleton 9", 100), [data("x"), data("y")])
    await upload_entry(tier, b, mine)
    assert bucket(s3)[f"blocks/{y}"].read_bytes() == data("y")
    reader = make_tier(s3, journal=tmp_path / "journal-c")
    match = await reader.find(["k0", "k1", "k2"], 64)
    assert match is not None and match.entry_id == "e1"
    assert await reader.fetch_into(match, store_at(tmp_path / "host-c"), None) is Fetched.ADOPTED


async def test_a_block_gone_before_its_upload_drops_it_and_the_journal_resumes_block_entries(
    s3: S3Server,
    make_tier: TierFactory,
    tmp_path: Path,
    logs: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An entry superseded (a block of its own removed) before its upload is dropped in one line, nothing of it
    sent; a journaled upload of an entry kept as blocks resumes at the next start, or is dropped the same way
    when one of its blocks went meanwhile."""
    monkeypatch.setattr(remote_uploads, "BLOCK_CONCURRENCY", 1)  # in file order: its last block last
    a = tmp_path / "host-a"
    journal = tmp_path / "journal"
    gone = block_entry(a, "gone", data("skeleton 1", 100), [data("x"), data("q")])
    q = block_hash(data("q"))
    block_path(a / "blocks", q).unlink()
    tier = make_tier(s3, journal=journal)
    tier.schedule_upload("gone", a / "blocks", gone)
    await until(lambda: tier.stats.uploads_pending == 0, 10, "the upload to be dropped")
    assert (tier.stats.uploads_done, tier.stats.uploads_failed) == (0, 0)
    assert [r.getMessage() for r in logs.records if "dropped" in r.getMessage()] == [
        f"remote: upload of entry gone dropped: block {q} is gone (superseded or evicted?)"
    ]
    assert bucket(s3) == {} and list(journal.iterdir()) == []

    # written to the journal while stopping, resumed by the next run
    await tier.close(time.monotonic())
    kept = block_entry(a, "kept", data("skeleton 2", 100), [data("x"), data("y")])
    lost = block_entry(a, "lost", data("skeleton 3", 100), [data("x"), data("z")])
    tier.schedule_upload("kept", a / "blocks", kept)
    tier.schedule_upload("lost", a / "blocks", lost)
    records = {p.name: json.loads(p.read_text()) for p in journal.iterdir()}
    assert records["kept.json"] == {"entry_id": "kept", "blocks_dir": str(a / "blocks"), "manifest": kept}
    block_path(a / "blocks", block_hash(data("z"))).unlink()
    logs.clear()
    resumed = make_tier(s3, journal=journal)
    assert resumed.resume() == 1
    await until(lambda: resumed.stats.uploads_done == 1, 20, "the resumed upload")
    assert list(journal.iterdir()) == []
    assert {"kept.json", *(f"blocks/{name}" for name in blocks_of(kept))} == set(bucket(s3))
    assert [r.getMessage() for r in logs.records if "dropped" in r.getMessage()] == [
        f"remote: upload of entry lost dropped: block {block_hash(data('z'))} is gone"
    ]


async def test_a_damaged_local_block_is_never_sent(
    s3: S3Server, make_tier: TierFactory, tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    a = tmp_path / "host-a"
    manifest = block_entry(a, "e1", data("skeleton 1", 100), [data("x")])
    x = block_hash(data("x"))
    path = block_path(a / "blocks", x)
    raw = bytearray(path.read_bytes())
    raw[7] ^= 0xFF
    path.write_bytes(bytes(raw))
    tier = make_tier(s3)
    tier.schedule_upload("e1", a / "blocks", manifest)
    await until(lambda: tier.stats.uploads_pending == 0, 10, "the upload to be dropped")
    assert warnings(logs) == [
        f"remote: upload of entry e1 dropped: its local block {x} does not match its name and size (damaged?); not sent"
    ]
    assert f"blocks/{x}" not in bucket(s3) and "e1.json" not in bucket(s3)


async def test_an_old_block_an_upload_counts_on_is_written_again(
    s3: S3Server, make_tier: TierFactory, tmp_path: Path
) -> None:
    """A block the bucket has had for over a day is written again when a new entry counts on it: a lifecycle rule
    expiring objects by age does not take it from under the new entry."""
    a, b = tmp_path / "host-a", tmp_path / "host-b"
    first = block_entry(a, "e1", data("skeleton 1", 100), [data("x"), data("y")])
    await upload_entry(make_tier(s3), a, first)
    x, y = block_hash(data("x")), block_hash(data("y"))
    old = time.time() - remote_uploads.BLOCK_RENEW_AGE_S - 3600
    os.utime(bucket(s3)[f"blocks/{x}"], (old, old))
    later = block_entry(b, "e2", data("skeleton 2", 100), [data("x"), data("y")])
    tier = make_tier(s3, journal=tmp_path / "journal-b")
    await upload_entry(tier, b, later)
    assert tier.stats.upload_bytes == 100 + BLOCK_CELLS * CELL  # its skeleton, and x again; y was young enough
    assert time.time() - bucket(s3)[f"blocks/{x}"].stat().st_mtime < 600
    assert time.time() - bucket(s3)[f"blocks/{y}"].stat().st_mtime < 600


@pytest.mark.parametrize("flaw", ["no checksum", "bytes not its parts'", "a block name not a hash"])
async def test_a_block_manifest_without_its_checksum_or_whole_parts_is_never_offered(
    s3: S3Server, make_tier: TierFactory, tmp_path: Path, logs: pytest.LogCaptureFixture, flaw: str
) -> None:
    a = tmp_path / "host-a"
    manifest = block_entry(a, "e1", data("skeleton 1", 100), [data("x")])
    await upload_entry(make_tier(s3), a, manifest)
    reader = make_tier(s3, journal=tmp_path / "journal-b")
    assert await reader.find(["k0"], 64) is not None
    parts = manifest["parts"]
    bad = {
        "no checksum": {**manifest, "checksum": ""},
        "bytes not its parts'": {**manifest, "bytes": manifest["bytes"] + 1},
        "a block name not a hash": {**manifest, "parts": {**parts, "skeleton": "../" + parts["skeleton"][3:]}},
    }[flaw]
    store = RemoteConfig.from_url(URL, s3.env()).store(timedelta(seconds=5), timedelta(seconds=5))
    await obstore.put_async(store, "ns1/e1.json", json.dumps(bad).encode())
    fresh = make_tier(s3, journal=tmp_path / "journal-c")
    assert await fresh.find(["k0"], 64) is None
    assert fresh.stats.rejected == 1
    assert warnings(logs) == [
        "remote: entry e1 rejected: its manifest is not an entry's (bytes, and parts and checksum, or sha256)"
    ]


async def test_a_bucket_of_whole_files_is_still_fetched_into_the_store(
    s3: S3Server, make_tier: TierFactory, tmp_path: Path
) -> None:
    """An entry uploaded before blocks (a version-2 manifest with sha256, and its .bin) comes down as its .bin and
    is taken in as an entry kept whole, beside the entries kept as blocks."""
    a = tmp_path / "host-a"
    manifest = block_entry(a, "e1", data("skeleton 1", 100), [data("x"), data("y")])
    parts = Parts.from_json(manifest["parts"])
    blocks = {name: block_path(a / "blocks", name).read_bytes() for name in parts.block_sizes()}
    whole = b"".join(bytes(piece) for piece in pieces(parts, blocks))  # the file, as it was kept before blocks
    old = {key: value for key, value in manifest.items() if key != "parts"} | {"version": 2, "id": "old1"}
    bin_path = a / "entries" / "old1.bin"
    bin_path.write_bytes(whole)
    await upload(make_tier(s3), bin_path, old)  # as the tier uploaded every entry before blocks
    assert {"old1.bin", "old1.json"} <= set(bucket(s3))
    store = store_at(tmp_path / "host-b")
    tier = make_tier(s3, journal=tmp_path / "journal-b")
    match = await tier.find(["k0", "k1"], 64)
    assert match is not None and match.entry_id == "old1"
    assert await tier.fetch_into(match, store, None) is Fetched.ADOPTED
    assert store.entries["old1"].parts is None
    assert (tmp_path / "host-b" / "entries" / "old1.bin").read_bytes() == whole
    assert tier.stats.download_bytes == len(whole)


# ---- configuration ----------------------------------------------------------------------------------------------


def test_from_url_environment() -> None:
    env = {
        "AWS_ACCESS_KEY_ID": "AKIDENV",
        "AWS_SECRET_ACCESS_KEY": "secret-env",
        "AWS_SESSION_TOKEN": "tok",
        "AWS_ENDPOINT_URL": "http://general:9000",
        "AWS_ENDPOINT_URL_S3": "http://minio:9000/",
        "AWS_DEFAULT_REGION": "eu-west-1",
        "AWS_REGION": "eu-central-1",
        "HOME": "/nonexistent",
    }
    config = RemoteConfig.from_url("s3://my-bucket/some/prefix/", env)
    assert (config.bucket, config.prefix, config.endpoint, config.region) == (
        "my-bucket",
        "some/prefix",
        "http://minio:9000",
        "eu-central-1",
    )
    assert (config.access_key_id, config.secret_access_key, config.session_token) == ("AKIDENV", "secret-env", "tok")
    assert "secret-env" not in repr(config) and "tok" not in repr(config)
    assert config.url == "s3://my-bucket/some/prefix"

    bare = RemoteConfig.from_url("s3://my-bucket", {"HOME": "/nonexistent", "AWS_DEFAULT_REGION": "us-west-2"})
    assert (bare.prefix, bare.endpoint, bare.region, bare.access_key_id) == ("", None, "us-west-2", None)


def test_from_url_profile_files(tmp_path: Path) -> None:
    credentials, config_file = tmp_path / "credentials", tmp_path / "config"
    credentials.write_text(
        "[default]\naws_access_key_id = AKIDDEFAULT\naws_secret_access_key = s%default\n\n"
        "[dev]\naws_access_key_id = AKIDDEV\naws_secret_access_key = secret-dev\n"
    )
    config_file.write_text(
        "[default]\nregion = us-east-2\n\n"
        "[profile dev]\nregion = ap-south-1\nendpoint_url = http://general:1\n"
        "s3 =\n  endpoint_url = http://127.0.0.1:9000\n"
    )
    files = {"AWS_SHARED_CREDENTIALS_FILE": str(credentials), "AWS_CONFIG_FILE": str(config_file)}

    dev = RemoteConfig.from_url("s3://bucket/p", {**files, "AWS_PROFILE": "dev"})
    assert (dev.access_key_id, dev.secret_access_key, dev.region, dev.endpoint, dev.profile) == (
        "AKIDDEV",
        "secret-dev",
        "ap-south-1",
        "http://127.0.0.1:9000",
        "dev",
    )

    default = RemoteConfig.from_url("s3://bucket/p", files)
    assert (default.access_key_id, default.secret_access_key, default.region, default.endpoint) == (
        "AKIDDEFAULT",
        "s%default",
        "us-east-2",
        None,
    )

    # ~/.aws is found through HOME; environment keys and region win over the profile's
    (tmp_path / ".aws").mkdir()
    credentials.rename(tmp_path / ".aws" / "credentials")
    config_file.rename(tmp_path / ".aws" / "config")
    mixed = RemoteConfig.from_url(
        "s3://bucket",
        {
            "HOME": str(tmp_path),
            "AWS_PROFILE": "dev",
            "AWS_ACCESS_KEY_ID": "AKIDENV",
            "AWS_SECRET_ACCESS_KEY": "env",
            "AWS_REGION": "eu-north-1",
        },
    )
    assert (mixed.access_key_id, mixed.secret_access_key, mixed.region, mixed.endpoint) == (
        "AKIDENV",
        "env",
        "eu-north-1",
        "http://127.0.0.1:9000",
    )


async def test_profile_credentials_reach_a_real_server(s3: S3Server, tmp_path: Path) -> None:
    """Credentials and endpoint from a profile alone (no AWS_ACCESS_KEY_ID) sign requests the server accepts."""
    (tmp_path / "credentials").write_text(
        f"[ci]\naws_access_key_id = {ACCESS_KEY_ID}\naws_secret_access_key = {SECRET_ACCESS_KEY}\n"
    )
    (tmp_path / "config").write_text(f"[profile ci]\nendpoint_url = {s3.endpoint}\n")
    env = {
        "AWS_PROFILE": "ci",
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"),
        "AWS_CONFIG_FILE": str(tmp_path / "config"),
        "HOME": str(tmp_path),
    }
    tier = RemoteTier(RemoteConfig.from_url(URL, env), "ns1", tmp_path / "journal")
    assert await tier.probe(2.0) is True
    wrong = RemoteConfig.from_url(URL, {**env, "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID, "AWS_SECRET_ACCESS_KEY": "wrong"})
    assert await RemoteTier(wrong, "ns1", tmp_path / "journal").probe(2.0) is False


@pytest.mark.parametrize(
    "url, env, message",
    [
        ("http://bucket/prefix", {}, "--remote-store must look like s3://bucket/prefix"),
        ("bucket/prefix", {}, "--remote-store must look like s3://bucket/prefix"),
        ("s3://", {}, "--remote-store must look like s3://bucket/prefix"),
        ("s3://bucket?x=1", {}, "--remote-store must look like s3://bucket/prefix"),
        ("s3://Bad_Bucket/p", {}, "is not an S3 bucket name"),
        ("s3://bucket/a//b", {}, "prefix"),
        ("s3://bucket", {"AWS_PROFILE": "missing"}, "AWS_PROFILE=missing: no such profile"),
        ("s3://bucket", {"AWS_ACCESS_KEY_ID": "AKID"}, "have no secret access key"),
        ("s3://bucket", {"AWS_ENDPOINT_URL": "localhost:9000"}, "endpoint must look like http(s)://host[:port]"),
    ],
)
def test_from_url_rejects_bad_input(tmp_path: Path, url: str, env: dict[str, str], message: str) -> None:
    env = {"HOME": str(tmp_path), **env}
    with pytest.raises(ValueError) as caught:
        RemoteConfig.from_url(url, env)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_unreadable_profile_file_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "config").write_text("this is not an ini file\n")
    with pytest.raises(ValueError) as caught:
        RemoteConfig.from_url("s3://bucket", {"HOME": str(tmp_path), "AWS_CONFIG_FILE": str(tmp_path / "config")})
    assert "cannot read" in str(caught.value) and "\n" not in str(caught.value)


def test_without_remote_store_the_shared_tier_is_not_even_imported():
    """Start-up pays for obstore (~20 ms of imports) only with --remote-store: run mode imports the daemon and
    everything it uses at start, and neither the shared tier nor obstore is among them."""
    probe = "import sys, slotkeeper.daemon; print(sorted(m for m in sys.modules if m.startswith(('obstore', 'slotkeeper.remote'))))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
