"""The shared tier end to end: real llama-servers, a real S3 server (rclone serve s3), two "hosts".

Each host is a slotkeeper with its own save directory; they share only the bucket. What one processed, the
other continues warm, with identical output; the object server going away never costs a turn or a start.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import obstore
import pytest
import xxhash

from slotkeeper.remote.tier import RemoteConfig
from slotkeeper.store.blockfiles import block_path
from slotkeeper.store.blocks import Parts, pieces
from slotkeeper.store.entries import read_json
from slotkeeper.testing.harness import http_call, wait_until
from slotkeeper.testing.s3server import S3Server

BASE = ["-c", "16384", "-t", "2", "--no-warmup", "-np", "2"]
BUCKET = "shared"
URL = f"s3://{BUCKET}/kv"
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and kindly." for i in range(14))


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[S3Server]:
    server = S3Server(tmp_path / "s3", bucket=BUCKET).start()
    yield server
    server.kill()


@pytest.fixture
def host(starter, llama_server, models, tmp_path):
    """host(name, s3_env, *extra, own=...) -> a slotkeeper with its own save directory and --remote-store."""

    def start(name: str, s3_env: dict[str, str], *extra: str, own: tuple[str, ...] = (), **kw):
        return starter(llama_server, ["-m", str(models["A"]), *BASE])(
            *extra, own=("--remote-store", URL, *own), env=s3_env, save_dir=tmp_path / f"host-{name}", **kw
        )

    return start


def chat_body(n: int) -> dict:
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Conversation {n}. Tell me about the sea. " * 8},
        ],
        "max_tokens": 12,
        "temperature": 0,
    }


def turn(sk, body: dict) -> dict:
    reply = sk.call("POST", "/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    return reply.body


def own_time(sk, body: dict) -> float:
    """A turn's wall time less llama-server's own work on it (its timings): what slotkeeper and the hops add.
    Under a CPU-bound neighbour llama-server's decode alone takes up to ~0.2 s a token (its two threads spin
    waiting for each other), so wall times compare the scheduler, not a wait of slotkeeper's."""
    started = time.monotonic()
    timings = turn(sk, body)["timings"]
    return time.monotonic() - started - (timings["prompt_ms"] + timings["predicted_ms"]) / 1000


def stop(sk) -> None:
    sk.killpg(signal.SIGTERM)
    assert sk.wait(60) == 0, sk.logs()


def remote_objects(s3: S3Server) -> list[Path]:
    root = s3.object_path("kv")
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def namespace_of(s3: S3Server, path: Path) -> str:
    """The namespace an object of the bucket lies in (`kv/<namespace>/...`)."""
    return path.relative_to(s3.object_path("kv")).parts[0]


def uploaded(s3: S3Server, n: int = 1) -> bool:
    return len([p for p in remote_objects(s3) if p.suffix == ".json"]) >= n


def ensure_uploaded(s3: S3Server, host_start, name: str, n: int = 1) -> None:
    """The stop's budget may end before the upload: then the host's next start finishes it."""
    if wait_until(lambda: uploaded(s3, n), 2):
        return
    sk = host_start(name, s3.env())
    assert wait_until(lambda: uploaded(s3, n), 30), sk.logs()
    stop(sk)


def test_a_chat_processed_on_one_host_continues_warm_on_another(s3, host):
    """Host A converses and uploads in the background; host B, with an empty save directory, continues the chat
    with cache_n covering its previous prompt, and its answer is identical to host A's."""
    a = host("a", s3.env())
    first = turn(a, chat_body(0))
    prompt_tokens = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
    stop(a)  # the stop-time save commits the entry locally; its upload goes on within the budget or resumes later
    assert "saved from slot" in a.logs()
    ensure_uploaded(s3, host, "a", 2)  # the chat, and its opening (the system prompt)
    b = host("b", s3.env())
    again = turn(b, chat_body(0))
    assert again["timings"]["cache_n"] >= prompt_tokens - 1, (again["timings"], b.logs()[-3000:])
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert "fetched" in b.logs()
    status = http_call(b.port, "GET", "/slotkeeper/status").body
    assert status["remote"]["remote_hits"] >= 1 and status["remote"]["download_bytes"] > 0, status


UPLOADED = re.compile(
    r"remote: entry (\w+) uploaded: ([\d.]+ \w?B) in \S+ s \((\d+) of its (\d+) blocks, of ([\d.]+ \w?B)\)"
)
FETCHED = re.compile(
    r"remote: entry (\w+) fetched: ([\d.]+ \w?B) in \S+ s \(.*?; (\d+) of its (\d+) blocks, of ([\d.]+ \w?B)\)"
)


def long_chat(turns: int) -> dict:
    """A chat of several cell blocks (256 cells each) that grows by more than one at each turn."""
    messages = [{"role": "system", "content": SYSTEM}]
    for n in range(turns):
        if n:
            messages.append({"role": "assistant", "content": f"Answer {n}: the sea is wide and deep."})
        messages.append({"role": "user", "content": f"Part {n}. Tell me about the tides and the waves. " * 40})
    return {"messages": messages, "max_tokens": 8, "temperature": 0}


def manifests(s3: S3Server) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in remote_objects(s3) if p.suffix == ".json"}


def ensure_uploaded_tokens(s3: S3Server, host_start, name: str, tokens: int) -> None:
    """Until an entry of at least `tokens` tokens is committed in the bucket (a stop's budget may end first)."""

    def there() -> bool:
        return any(m["tokens"] >= tokens for m in manifests(s3).values())

    if wait_until(there, 2):
        return
    sk = host_start(name, s3.env())
    assert wait_until(there, 30), sk.logs()
    stop(sk)


def test_a_grown_chat_moves_between_hosts_as_the_blocks_each_side_lacks(s3, host):
    """Host A saves a chat; host B continues it warm, downloading all of it. The chat grows on host A: its next
    save uploads only the blocks the bucket lacks (its skeleton, and the cells past the last whole block it had),
    and host B, continuing it again, downloads only the blocks it lacks, warm, with host A's answer."""
    a = host("a", s3.env())
    one = turn(a, long_chat(1))
    stop(a)
    ensure_uploaded_tokens(s3, host, "a", one["timings"]["prompt_n"] + one["timings"]["cache_n"])
    b = host("b", s3.env())
    resumed = turn(b, long_chat(1))
    assert resumed["timings"]["cache_n"] >= one["timings"]["prompt_n"] - 1, (resumed["timings"], b.logs()[-3000:])
    stop(b)

    a = host("a", s3.env())
    two = turn(a, long_chat(2))
    whole = two["timings"]["prompt_n"] + two["timings"]["cache_n"]
    assert two["timings"]["cache_n"] >= one["timings"]["prompt_n"], two["timings"]  # warm from A's own store
    stop(a)
    ensure_uploaded_tokens(s3, host, "a", whole)
    grown_id, grown = max(manifests(s3).items(), key=lambda item: item[1]["tokens"])
    uploads = {m[1]: m for m in UPLOADED.finditer(a.logs())}
    if grown_id in uploads:  # (else the upload was finished by a later start: its line is there)
        sent = uploads[grown_id]
        assert 0 < int(sent[3]) < int(sent[4]), sent[0]  # some of its blocks only
    objects = {p.name: p.stat().st_size for p in remote_objects(s3) if p.parent.name == "blocks"}
    assert set(blocks_of(grown)) <= set(objects)

    b = host("b", s3.env())  # it holds the chat's first save (its own, of the same bytes but its skeleton)
    for n in (7, 8):  # two other chats take both slots: the chat is in B's store only, as its first save
        turn(b, chat_body(n))
    again = turn(b, long_chat(2))
    assert again["timings"]["cache_n"] >= whole - 1, (again["timings"], b.logs()[-3000:])
    assert again["choices"][0]["message"]["content"] == two["choices"][0]["message"]["content"]
    fetched = [m for m in FETCHED.finditer(b.logs()) if m[1] == grown_id]
    assert len(fetched) == 1, b.logs()[-3000:]
    assert 0 < int(fetched[0][3]) < int(fetched[0][4]), fetched[0][0]  # only the blocks B lacked
    status = b.call("GET", "/slotkeeper/status").body
    grown_bytes = sum(blocks_of(grown).values())
    assert 0 < status["remote"]["download_bytes"] < grown_bytes, (status["remote"], grown_bytes)
    stop(b)


def test_a_bucket_written_before_blocks_still_resumes_chats_warm(s3, host, tmp_path):
    """The bucket as a slotkeeper before blocks left it (each entry its whole file, `<id>.bin`, and a version-2
    manifest with its sha256): a host continues the chat warm from it, with the answer the first host gave."""
    a = host("a", s3.env())
    first = turn(a, chat_body(6))
    prompt_tokens = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
    stop(a)
    ensure_uploaded(s3, host, "a", 2)
    bucket = RemoteConfig.from_url(URL, s3.env()).store(timedelta(seconds=10), timedelta(seconds=10))
    for path in [p for p in remote_objects(s3) if p.suffix == ".json"]:
        manifest = json.loads(path.read_text())
        parts = Parts.from_json(manifest.pop("parts"))
        blocks = {name: (path.parent / "blocks" / name).read_bytes() for name in parts.block_sizes()}
        whole = b"".join(bytes(piece) for piece in pieces(parts, blocks))  # the file, as it was uploaded before
        assert f"xxh3_128:{xxhash.xxh3_128_hexdigest(whole)}" == manifest["checksum"]
        key = f"{namespace_of(s3, path)}/{path.stem}"
        obstore.put(bucket, f"{key}.bin", whole)
        old = {**manifest, "version": 2, "sha256": hashlib.sha256(whole).hexdigest(), "bytes": len(whole)}
        obstore.put(bucket, f"{key}.json", json.dumps(old).encode())
    for path in [p for p in remote_objects(s3) if p.parent.name == "blocks"]:
        obstore.delete(bucket, f"{namespace_of(s3, path)}/blocks/{path.name}")
    assert {p.suffix for p in remote_objects(s3)} == {".bin", ".json"}
    b = host("b", s3.env())
    again = turn(b, chat_body(6))
    assert again["timings"]["cache_n"] >= prompt_tokens - 1, (again["timings"], b.logs()[-3000:])
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert "fetched" in b.logs()
    stop(b)


def blocks_of(manifest: dict) -> dict[str, int]:
    return Parts.from_json(manifest["parts"]).block_sizes()


def test_a_new_chat_on_another_host_starts_from_the_opening_saved_on_the_first(s3, host):
    """Host A saves a chat's opening (its system prompt) as it starts; host B, with an empty save directory,
    starts another chat with that system prompt from the opening, fetched from the shared tier."""
    a = host("a", s3.env())
    turn(a, chat_body(0))
    opening = a.call("GET", "/slotkeeper/status").body["openings"]["prefill_tokens"]
    assert opening > 0, a.logs()[-3000:]
    stop(a)
    ensure_uploaded(s3, host, "a", 2)
    b = host("b", s3.env())
    other = {
        **chat_body(0),
        "messages": [
            chat_body(0)["messages"][0],
            {"role": "user", "content": "Something else: the mountains, please."},
        ],
    }
    reply = turn(b, other)
    assert reply["timings"]["cache_n"] >= opening, (reply["timings"], b.logs()[-3000:])
    status = b.call("GET", "/slotkeeper/status").body
    assert status["openings"]["hits"] == 1 and status["remote"]["download_bytes"] > 0, status


def assert_cold(sk, reply: dict, prompt_tokens: int) -> None:
    """Nothing was restored for the turn: what it reused is only the opening slotkeeper prefilled just before
    (to save it for new chats), well under the whole prompt."""
    status = sk.call("GET", "/slotkeeper/status").body
    assert status["on_demand_restores"] == 0, status
    reused = reply["timings"]["cache_n"]
    assert reused <= status["openings"]["prefill_tokens"] and reused < prompt_tokens * 3 // 4, (reply, status)


def test_tampered_and_foreign_objects_are_never_restored(s3, host, starter, llama_server, models, tmp_path):
    """A remote entry whose bytes were changed, and one saved for another model (same shape, other weights,
    uploaded under this model's namespace by hand), are not restored: the chat starts cold, one line each."""
    a = host("a", s3.env())
    first = turn(a, chat_body(1))
    whole = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
    stop(a)
    ensure_uploaded(s3, host, "a", 2)  # the chat, and its opening (the system prompt)
    manifests = [json.loads(p.read_text()) for p in remote_objects(s3) if p.suffix == ".json"]
    block_objects = [p for p in remote_objects(s3) if p.parent.name == "blocks"]
    assert len(manifests) == 2 and {p.name for p in block_objects} == {  # the blocks, and nothing else
        name for m in manifests for name in Parts.from_json(m["parts"]).block_sizes()
    }, (manifests, block_objects)
    assert not [p for p in remote_objects(s3) if p.suffix == ".bin"]
    for block_object in block_objects:  # same size, other bytes
        data = bytearray(block_object.read_bytes())
        data[len(data) // 2] ^= 0xFF
        block_object.write_bytes(bytes(data))
    b = host("b", s3.env())
    tampered = turn(b, chat_body(1))
    assert_cold(b, tampered, whole)
    assert "does not match its name" in b.logs(), b.logs()[-3000:]
    taken = {p.stem for p in (tmp_path / "host-b" / "entries").glob("*.json")}
    assert not taken & {m["id"] for m in manifests}, "no remote entry was taken in"
    stop(b)
    # foreign: model B's entry, placed under model A's namespace with A's fingerprint claimed in its manifest
    other = starter(llama_server, ["-m", str(models["B"]), *BASE])(
        own=("--remote-store", URL), env=s3.env(), save_dir=tmp_path / "host-other"
    )
    turn(other, chat_body(2))
    stop(other)
    assert wait_until(lambda: uploaded(s3, 4), 30), other.logs()
    namespaces = {namespace_of(s3, p) for p in remote_objects(s3)}
    assert len(namespaces) == 2, namespaces  # two models never share a folder
    a_ns = namespace_of(s3, block_objects[0])
    (b_ns,) = namespaces - {a_ns}
    bucket = RemoteConfig.from_url(URL, s3.env()).store(timedelta(seconds=10), timedelta(seconds=10))
    for meta in obstore.list(bucket, f"{a_ns}/").collect():  # only the foreign entry is left to find
        obstore.delete(bucket, meta["path"].removeprefix("kv/"))
    for meta in obstore.list(bucket, f"{b_ns}/").collect():  # copied through S3 (rclone caches its listings)
        key = meta["path"].removeprefix("kv/")
        obstore.put(bucket, f"{a_ns}/{key.split('/', 1)[1]}", bytes(obstore.get(bucket, key).bytes()))
    c = host("c", s3.env())
    foreign = turn(c, chat_body(2))
    assert_cold(c, foreign, whole)
    assert "not used and removed: saved for another configuration" in c.logs(), c.logs()[-3000:]


def test_an_unreachable_object_server_costs_no_readiness_and_no_turn(s3, host, tmp_path):
    """The object server is down at start: slotkeeper is ready as fast as without a remote (one line says it
    is unreachable); turns work and the entry is saved locally; the uploads resume at the next start."""
    s3.stop()
    t0 = time.monotonic()
    a = host("a", s3.env())
    ready_with = time.monotonic() - t0
    assert wait_until(lambda: "unreachable" in a.logs(), 15), a.logs()
    assert turn(a, chat_body(3))["timings"]["prompt_n"] > 0
    stop(a)
    saved = [read_json(p) for p in (tmp_path / "host-a" / "entries").glob("*.json")]
    assert saved and all(m and "parts" in m for m in saved), "saved locally all the same (as blocks)"
    assert all(
        block_path(tmp_path / "host-a" / "blocks", name).is_file()
        for m in saved
        for name in Parts.from_json(m["parts"]).block_sizes()  # type: ignore[index]
    )
    t0 = time.monotonic()
    plain = host("plain", s3.env(), own=())
    ready_plain = time.monotonic() - t0
    stop(plain)
    assert ready_with < ready_plain + 1.0, (ready_with, ready_plain)
    s3.start()
    a = host("a", s3.env())
    assert wait_until(lambda: uploaded(s3), 30), a.logs()
    stop(a)


def test_a_slow_object_server_does_not_slow_a_turn_nor_the_stop(tmp_path, host):
    """With the object server throttled (rclone --bwlimit), a turn takes as long as without a remote, and a stop
    with an upload pending stays within --save-timeout; the upload resumes at the next start."""
    slow = S3Server(tmp_path / "s3slow", bucket=BUCKET, bwlimit="20k").start()
    try:
        a = host("a", slow.env(), own=("--save-timeout", "3"))
        body = chat_body(4)
        turn(a, body)
        with_remote = own_time(a, body)
        stop_started = time.monotonic()
        stop(a)
        assert time.monotonic() - stop_started < 3 + 2.0, a.logs()
        assert "pending" in a.logs()
        plain = host("plain", slow.env(), own=("--no-placement",))  # a second host for the baseline turn
        turn(plain, body)
        without = own_time(plain, body)
        stop(plain)
        assert with_remote < without * 2 + 0.5, (with_remote, without)
        journal = tmp_path / "host-a" / "remote-pending"
        assert any(journal.glob("*.json")), "the pending upload is recorded for the next start"
    finally:
        slow.kill()


def test_a_download_is_estimated_by_the_blocks_the_store_lacks(tmp_path):
    """Whether to fetch a chat or prefill it is judged by what the download moves: the blocks this host lacks
    (a chat whose system prompt's blocks are here downloads the rest), the whole file of an entry kept whole,
    and the whole size when its parts are unusable (its download then says why)."""
    from slotkeeper.remote.tier import bytes_to_fetch
    from slotkeeper.store.blocks import CellSection

    names = [f"{n:032x}" for n in range(1, 5)]
    parts = Parts(
        nbytes=1000 + 700 * 64,
        block_cells=256,
        skeleton=names[0],
        sections=(CellSection(cells=700, start=1000, shape=((64, 1),), blocks=tuple(names[1:])),),
    )
    parts.check()
    sizes = parts.block_sizes()
    blocks_dir = tmp_path / "blocks"
    for name in names[:2]:  # the skeleton and the first cell block are here
        block_path(blocks_dir, name).parent.mkdir(parents=True, exist_ok=True)
        block_path(blocks_dir, name).write_bytes(b"x" * sizes[name])
    manifest = {"bytes": parts.nbytes, "parts": parts.to_json()}
    assert bytes_to_fetch(manifest, blocks_dir) == sizes[names[2]] + sizes[names[3]] == (256 + 188) * 64
    assert bytes_to_fetch({"bytes": 5000}, blocks_dir) == 5000
    assert bytes_to_fetch({"bytes": 5000, "parts": {"sections": "no"}}, blocks_dir) == 5000
