"""What a chat that stays in its slot pays per turn, and what an on-demand restore costs.

On a model with a sizeable state: 8 layers x 512, 8 KV heads of 64, f16 KV, so 16 KiB per token and about 128
MiB for an 8k-token chat. Plain llama-server and slotkeeper run at the same time with the same llama-server
arguments (`--no-cache-idle-slots` given to both: slotkeeper adds it otherwise), each holding its own copy of
one ~8k-token chat. A second plain llama-server runs as a control: two identical llama-server processes can
differ by 10% or more in speed here (it is the process, not what is in front of it), so (a) also reports the
turn outside llama-server's own compute time and the CPU time each process used. Prints:

  (a) turn latency through slotkeeper / plain llama-server for back-to-back streamed turns of that chat,
      the order of the sides rotating; the median of the paired ratios (target <= 1.05), the control's
      ratio, the paired difference of the time outside llama-server's prompt_ms + predicted_ms, and CPU
      time per turn;
  (b) bytes written during those turns (slotkeeper runs with --autosave-idle 3600, so no idle save fires):
      the save directory's growth, and write_bytes from /proc/<pid>/io of slotkeeper and its llama-server,
      whose output goes to a pipe so that log lines are not counted (target 0);
  (c) placement's added time for that chat: `await Placement.place(path, body)` timed in this process, with a
      real ConversationStore and a LlamaClient over a ChildPool to the plain llama-server, on a slot table
      seeded with the chat's previous turn (the common case: a chat continuing in its slot; target p50 <= 2 ms);
      end to end, the same chat's request with max_tokens 1 repeated on both servers (slotkeeper minus plain,
      paired median: the proxy and placement together); and, for comparison, what the /apply-template +
      /tokenize round trip of a 10k-token chat costs (the path that common case skips);
  (d) an on-demand restore: `ConversationStore.restore` (and `Keeper.restore_into`) of entries of several
      sizes into a slot, from the page cache and from disk (the file's pages evicted with
      posix_fadvise(DONTNEED) first), against the file size divided by the read speed measured the same two
      ways (target: + at most 20 ms), with llama-server's own `restore_ms` alongside.

    uv run python benchmarks/turns.py [--tokens 7500] [--turns 24] [--generate 16] [--repeat 60]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchsetup import bench_model, llama_server, slotkeeper_args, work_dir

from slotkeeper.demo import Chat, stream_chat
from slotkeeper.llama.client import LlamaClient
from slotkeeper.placement.hook import Placement
from slotkeeper.placement.request import RequestView, read_request, request_key
from slotkeeper.proxy.upstream import ChildPool
from slotkeeper.store.conversations import ConversationStore
from slotkeeper.testing.harness import clean_env, free_port, http_call, wait_until
from slotkeeper.testing.tinymodel import TinyModelSpec

TURNS_MODEL = TinyModelSpec(n_layers=8, width=512, n_heads=8, n_kv_heads=8, f16=True, name="slotkeeper-bench-turns")
TOKENS_PER_NOTE = 48  # demo.Chat's notes, measured with the tiny models' tokenizer
SYSTEM_TOKENS = 777
CHAT_PATH = "/v1/chat/completions"
MB = 1_000_000


class Server:
    """A server process in its own process group whose output goes through a pipe to a log file, so that the
    log lines are not writes of its own (write_bytes then counts only the files it writes)."""

    def __init__(self, command: list[str], port: int, log_path: Path, env: dict[str, str]) -> None:
        self.port = port
        self.log_path = log_path
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._copier = threading.Thread(target=self._copy, daemon=True)
        self._copier.start()

    def _copy(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "ab") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()

    def wait_ready(self, timeout: float = 180.0) -> None:
        def healthy() -> bool:
            try:
                return http_call(self.port, "GET", "/health", timeout=2).status == 200
            except OSError:
                return self.proc.poll() is not None

        if not wait_until(healthy, timeout, interval=0.01) or self.proc.poll() is not None:
            raise RuntimeError(f"{self.proc.args!r} did not start; log: {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._copier.join(5)


def notes_for(tokens: int) -> int:
    return max(1, (tokens - SYSTEM_TOKENS) // TOKENS_PER_NOTE)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def io_write_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def cpu_seconds(pid: int) -> float:
    """Time the process (all its threads) has run on a CPU, from /proc/<pid>/schedstat (nanoseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def tree_bytes(root: Path) -> tuple[int, set[str]]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), {str(p.relative_to(root)) for p in files}


def chat_body(messages: list[dict[str, str]], max_tokens: int = 32) -> bytes:
    return json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()


def evict(path: Path) -> None:
    """Drop a file's pages from the page cache (they are clean: the store fsyncs what it writes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_seconds(path: Path) -> float:
    buffer = bytearray(4 << 20)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - started


# ---- (c) and (d): in this process, against the plain llama-server -----------------------------------------


async def in_process(port: int, store_root: Path, chat: Chat, long_chat: Chat, repeat: int) -> dict[str, Any]:
    pool = ChildPool(port=port)
    client = LlamaClient(pool, None)
    store = ConversationStore(store_root, client, {"bench": "turns"}, {}, fsync=True)
    store.open()
    out: dict[str, Any] = {}

    # (c) the hook, for a chat continuing in its slot: the slot table as the previous turn left it
    placement = Placement(store, client, 2)
    previous = chat_body(chat.messages[:-2])
    body = chat_body(chat.messages)
    previous_fast, _ = request_key(CHAT_PATH, json.loads(previous))
    slot = placement.slots[0]
    times = []
    for _ in range(repeat * 5):
        placement.slots.ran(slot, RequestView(key=previous_fast), resident=True, chat=None, reply=None)  # the last turn
        started = time.perf_counter()
        placed = await placement.place(CHAT_PATH, body)
        times.append(time.perf_counter() - started)
        assert placed.done is not None and b'"id_slot":0' in placed.body[-20:], "not placed on its slot"
        placed.done(200)
    assert placement.metrics.placements["resident"] == repeat * 5, dict(placement.metrics.placements)
    assert placement.metrics.prompt_tokenizations == 0
    out["place"] = times
    out["body_bytes"] = len(body)

    # (c) for comparison: the /apply-template + /tokenize round trip for a 10k-token chat
    long_body = chat_body(long_chat.messages)
    long_request = read_request(CHAT_PATH, long_body, len(placement.slots))
    assert long_request is not None
    rendered = await placement.keeper.render_prompt(long_request)
    assert rendered is not None, "the long chat was not tokenized"
    out["long_tokens"] = len(rendered.token_ids)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        await placement.keeper.render_prompt(long_request)
        times.append(time.perf_counter() - started)
    out["tokenize"] = times
    times = []
    long_fast_prev, _ = request_key(CHAT_PATH, json.loads(chat_body(long_chat.messages[:-2])))
    for _ in range(repeat * 5):  # the hook on that 10k-token chat, continuing in its slot
        placement.slots.ran(slot, RequestView(key=long_fast_prev), resident=True, chat=None, reply=None)
        started = time.perf_counter()
        placed = await placement.place(CHAT_PATH, long_body)
        times.append(time.perf_counter() - started)
        assert placed.done is not None
        placed.done(200)
    out["place_long"] = times

    # (d) entries of several sizes: the chat as its slot holds it (llama-server chose that slot), then prefixes
    # of it (the slot truncated to them by a request for the prefix itself, so nothing is computed again)
    request = read_request(CHAT_PATH, body, len(placement.slots))
    assert request is not None
    rendered = await placement.keeper.render_prompt(request)
    assert rendered is not None, "the chat was not tokenized"
    tokens = rendered.token_ids
    slots = (await client.slots()).body
    held = max(slots, key=lambda s: s.get("n_prompt_tokens", 0))["id"]
    other = 1 - held
    entries = []
    for size in [None, *(n for n in (4096, 2048, 1024) if n < len(tokens))]:
        if size is not None:
            reply = await client.call_json(
                "POST",
                "/completion",
                {"prompt": tokens[:size], "id_slot": held, "n_predict": 1, "temperature": 0, "cache_prompt": True},
            )
            assert reply.ok and reply.body["timings"]["cache_n"] >= size - 1, reply.body
        saved = await store.save_slot(held)
        assert saved.entry is not None, saved.reason
        entries.append(saved.entry)
    out["sizes"] = []
    for entry in entries:
        path = store.entries_dir / f"{entry.id}.bin"
        row: dict[str, Any] = {"tokens": entry.n_tokens, "bytes": entry.nbytes}
        for mode in ("page cache", "disk"):
            walls, direct, own = [], [], []
            for _ in range(5):
                if mode == "disk":
                    evict(path)
                started = time.perf_counter()
                result = await store.restore(entry, other)
                walls.append(time.perf_counter() - started)
                assert result.ok, result.reason
                # llama-server's own restore_ms, on a link of the same file (same cache state)
                if mode == "disk":
                    evict(path)
                link = store.snapshots_dir / f"bench-{entry.id}.bin"
                os.link(path, link)
                try:
                    started = time.perf_counter()
                    reply = await client.slot_action(other, "restore", link.name)
                    direct.append(time.perf_counter() - started)
                finally:
                    link.unlink()
                own.append(reply.body["timings"]["restore_ms"] / 1000)
            row[mode] = (statistics.median(walls), statistics.median(direct), statistics.median(own))
        times = []
        target = placement.slots[other]
        for _ in range(3):
            placement.slots.reserve(target)
            started = time.perf_counter()
            ok = await placement.keeper.restore_into(target, entry)
            times.append(time.perf_counter() - started)
            placement.slots.release(target)
            assert ok
        row["restore_into"] = statistics.median(times)
        out["sizes"].append(row)

    # (d) read speed of the largest entry file, from disk (pages evicted) and from the page cache
    largest = store.entries_dir / f"{entries[0].id}.bin"
    disk, cached = [], []
    for _ in range(3):
        evict(largest)
        disk.append(entries[0].nbytes / read_seconds(largest))
        cached.append(entries[0].nbytes / read_seconds(largest))
    out["read_disk"], out["read_cache"] = statistics.median(disk), statistics.median(cached)

    # (d) the whole hook for a chat that is in the store only (tokenize, choose a slot, restore)
    times = []
    full_body = chat_body(chat.messages)
    for _ in range(3):
        fresh = Placement(store, client, 2)
        started = time.perf_counter()
        placed = await fresh.place(CHAT_PATH, full_body)
        times.append(time.perf_counter() - started)
        assert fresh.metrics.placements["restored"] == 1, dict(fresh.metrics.placements)
        assert placed.done is not None
        placed.done(200)
    out["place_restore"] = times
    await store.flush()
    pool.close()
    return out


# ---- the run -------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tokens",
        type=int,
        default=7500,
        help="the chat's length at the start (default 7500 tokens; each turn adds about 100)",
    )
    parser.add_argument(
        "--turns", type=int, default=24, help="back-to-back turns per side for (a) and (b) (default 24)"
    )
    parser.add_argument("--generate", type=int, default=16, help="tokens generated per turn (default 16)")
    parser.add_argument("--repeat", type=int, default=60, help="repeats for (c) (the in-process hook: 5x this)")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs, caches)")
    args = parser.parse_args()

    binary = llama_server()
    model = bench_model("model-turns.gguf", TURNS_MODEL)
    work = work_dir("turns")
    env = clean_env(binary)
    server_args = [
        "-m",
        str(model),
        "-c",
        "32768",
        "-np",
        "2",
        "-t",
        "2",
        "-ctk",
        "f16",
        "-ctv",
        "f16",
        "--no-cache-idle-slots",
    ]
    store_root = work / "plain-store"
    store_root.mkdir()
    ConversationStore(store_root, None, {}).open()  # the layout, so that llama-server's save path exists
    plain_port, sk_port, control_port = free_port(), free_port(), free_port()
    plain = Server(
        [
            binary,
            *server_args,
            "--slot-save-path",
            str(store_root / "snapshots"),
            "--host",
            "127.0.0.1",
            "--port",
            str(plain_port),
        ],
        plain_port,
        work / "plain.log",
        env,
    )
    sk_dir = work / "sk-cache"
    sk = Server(
        [
            sys.executable,
            "-m",
            "slotkeeper.cli",
            *slotkeeper_args(server_args, sk_port, sk_dir, ["--autosave-idle", "3600"]),
        ],
        sk_port,
        work / "slotkeeper.log",
        env,
    )
    (work / "control-slots").mkdir()
    control = Server(
        [
            binary,
            *server_args,
            "--slot-save-path",
            str(work / "control-slots"),
            "--host",
            "127.0.0.1",
            "--port",
            str(control_port),
        ],
        control_port,
        work / "control.log",
        env,
    )
    started = time.monotonic()
    try:
        plain.wait_ready()
        sk.wait_ready()
        control.wait_ready()
        n_ctx = http_call(plain_port, "GET", "/props").body["default_generation_settings"]["n_ctx"]
        sides = {
            "plain": (plain_port, Chat(0, notes=notes_for(args.tokens))),
            "slotkeeper": (sk_port, Chat(0, notes=notes_for(args.tokens))),
            "control": (control_port, Chat(0, notes=notes_for(args.tokens))),
        }  # a second plain llama-server
        for name, (port, chat) in sides.items():
            print(f"{name}: the chat's first turn (a prefill) ... ", end="", flush=True)
            turn, _ = chat.turn(port, max_tokens=32)
            print(f"{turn.prompt_tokens:,} tokens in {turn.first_token_s:.1f} s", flush=True)

        # (a) and (b)
        child_pid = http_call(sk_port, "GET", "/slotkeeper/status").body["child_pid"]
        sk_pid = sk.proc.pid
        io_before = {pid: io_write_bytes(pid) for pid in (sk_pid, child_pid)}
        dir_before = tree_bytes(sk_dir)
        lat: dict[str, list[float]] = {name: [] for name in sides}
        ttft: dict[str, list[float]] = {name: [] for name in sides}
        server: dict[str, list[float]] = {name: [] for name in sides}
        outside: dict[str, list[float]] = {name: [] for name in sides}  # the turn outside llama-server's compute
        new_tokens: dict[str, int] = {name: 0 for name in sides}
        pids = {"plain": plain.proc.pid, "slotkeeper": sk_pid, "child": child_pid, "control": control.proc.pid}
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        warm = {name: 0 for name in sides}
        orders = list(itertools.permutations(sides))
        first_len = sides["plain"][1].last_prompt_tokens
        print(f"(a) {args.turns} back-to-back turns per side, the order of the sides rotating ... ", end="", flush=True)
        for i in range(args.turns):
            for name in orders[i % len(orders)]:
                port, chat = sides[name]
                turn, was_warm = chat.turn(port, max_tokens=args.generate)
                lat[name].append(turn.total_s)
                ttft[name].append(turn.first_token_s)
                server[name].append(turn.server_ms / 1000)
                outside[name].append(turn.total_s - turn.server_ms / 1000)
                new_tokens[name] += turn.prompt_n
                warm[name] += was_warm
        print("done", flush=True)
        cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
        io_after = {pid: io_write_bytes(pid) for pid in (sk_pid, child_pid)}
        dir_after = tree_bytes(sk_dir)
        status = http_call(sk_port, "GET", "/slotkeeper/status").body

        # (c) end to end: the chat's request with max_tokens 1, repeated (the slot holds it each time)
        e2e: dict[str, list[float]] = {"plain": [], "slotkeeper": []}
        e2e_outside: dict[str, list[float]] = {"plain": [], "slotkeeper": []}
        print(f"(c) {args.repeat} repeated 1-token requests per side ... ", end="", flush=True)
        for i in range(args.repeat):
            for name in ("plain", "slotkeeper") if i % 2 == 0 else ("slotkeeper", "plain"):
                port, chat = sides[name]
                turn = stream_chat(port, chat.messages, 1)
                e2e[name].append(turn.total_s)
                e2e_outside[name].append(turn.total_s - turn.server_ms / 1000)
        print("done", flush=True)
        sk.stop()
        control.stop()

        print("(c), (d) in this process, against the plain llama-server ...", flush=True)
        long_chat = Chat(1, notes=notes_for(10_000))
        long_chat.messages += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Go on."}]
        got = asyncio.run(in_process(plain_port, store_root, sides["plain"][1], long_chat, args.repeat))
    finally:
        sk.stop()
        control.stop()
        plain.stop()
        if args.keep:
            print(f"(logs and caches kept in {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)

    last_len = sides["plain"][1].last_prompt_tokens
    ratios = [s / p for s, p in zip(lat["slotkeeper"], lat["plain"])]
    print()
    print(
        f"model {TURNS_MODEL.n_layers} layers x {TURNS_MODEL.width}, {TURNS_MODEL.n_kv_heads} KV heads, f16 KV "
        f"({model.stat().st_size / 1e6:.0f} MB); llama-server {' '.join(server_args[2:])} "
        f"(n_ctx per slot {n_ctx:,}); "
        f"{time.monotonic() - started:.0f} s in all"
    )
    print(
        f"(a) turn latency, {args.turns} turns per side of a {first_len:,}-{last_len:,}-token chat ({args.generate} "
        f"tokens generated, streamed): plain median {statistics.median(lat['plain']) * 1000:.0f} ms, slotkeeper "
        f"{statistics.median(lat['slotkeeper']) * 1000:.0f} ms; "
        f"first token {statistics.median(ttft['plain']) * 1000:.0f}"
        f" vs {statistics.median(ttft['slotkeeper']) * 1000:.0f} ms"
    )
    controls = [c / p for c, p in zip(lat["control"], lat["plain"])]
    versus_control = [s / c for s, c in zip(lat["slotkeeper"], lat["control"])]
    print(
        f"    slotkeeper / plain: median of paired ratios {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.2f}-{max(ratios):.2f}; target <= 1.05); warm turns: plain {warm['plain']}, "
        f"slotkeeper {warm['slotkeeper']} of {args.turns}"
    )
    print(
        f"    control, a second plain llama-server / plain: {statistics.median(controls):.3f} "
        f"(range {min(controls):.2f}-{max(controls):.2f}): how much two identical llama-server processes differ; "
        f"slotkeeper / that second one: {statistics.median(versus_control):.3f}"
    )
    server_ratios = [s / p for s, p in zip(server["slotkeeper"], server["plain"])]
    control_ratios = [c / p for c, p in zip(server["control"], server["plain"])]
    added = [(s - p) * 1000 for s, p in zip(outside["slotkeeper"], outside["plain"])]
    plain_median = statistics.median(lat["plain"]) * 1000
    print(
        f"    the turn outside llama-server's own prompt_ms + predicted_ms (HTTP, templating, and slotkeeper): plain "
        f"median {statistics.median(outside['plain']) * 1000:.1f} ms, slotkeeper "
        f"{statistics.median(outside['slotkeeper']) * 1000:.1f} ms; paired difference median "
        f"{statistics.median(added):+.2f} ms, i.e. a ratio of {1 + statistics.median(added) / plain_median:.4f} "
        f"on the {plain_median:.0f} ms turn"
    )
    print(
        f"    llama-server's own time per turn (prompt_ms + predicted_ms), slotkeeper's child / plain: median of "
        f"paired ratios {statistics.median(server_ratios):.3f} "
        f"(control / plain {statistics.median(control_ratios):.3f});"
        f" prompt tokens computed: plain {new_tokens['plain']:,}, slotkeeper's child {new_tokens['slotkeeper']:,}"
    )
    print(
        f"    CPU time per turn (schedstat): plain llama-server {cpu['plain'] / args.turns * 1000:.0f} ms, "
        f"slotkeeper's child {cpu['child'] / args.turns * 1000:.0f} ms, "
        f"slotkeeper {cpu['slotkeeper'] / args.turns * 1000:.2f} ms; "
        f"(child + slotkeeper) / plain = {(cpu['child'] + cpu['slotkeeper']) / cpu['plain']:.3f}; control "
        f"{cpu['control'] / args.turns * 1000:.0f} ms"
    )
    written = {pid: io_after[pid] - io_before[pid] for pid in io_before}
    print(
        f"(b) during those turns: the save directory went from {dir_before[0]:,} to {dir_after[0]:,} bytes "
        f"({len(dir_after[1] - dir_before[1])} new files); write_bytes (/proc/<pid>/io; their log goes to a pipe): "
        f"slotkeeper {written[sk_pid]:,}, its llama-server {written[child_pid]:,} (target 0)"
    )
    print(f"    placements: {status['placements']}, prompt tokenizations: {status['prompt_tokenizations']}")
    place = [t * 1000 for t in got["place"]]
    print(
        f"(c) Placement.place() in-process, the {last_len:,}-token chat continuing in its slot "
        f"({got['body_bytes'] / 1000:.0f} kB body): p50 {pct(place, 0.5):.3f} ms, p90 {pct(place, 0.9):.3f} ms, "
        f"max {max(place):.3f} ms (target p50 <= 2 ms)"
    )
    place_long = [t * 1000 for t in got["place_long"]]
    tok = [t * 1000 for t in got["tokenize"]]
    print(
        f"    the same for a {got['long_tokens']:,}-token chat: p50 {pct(place_long, 0.5):.3f} ms; its "
        f"/apply-template + /tokenize round trip (not paid on this path): p50 {pct(tok, 0.5):.1f} ms, "
        f"p90 {pct(tok, 0.9):.1f} ms"
    )
    diffs = [(s - p) * 1000 for s, p in zip(e2e["slotkeeper"], e2e["plain"])]
    print(
        f"    end to end, the chat's request with max_tokens 1 repeated: plain median "
        f"{statistics.median(e2e['plain']) * 1000:.1f} ms, "
        f"slotkeeper {statistics.median(e2e['slotkeeper']) * 1000:.1f} ms; "
        f"paired difference median {statistics.median(diffs):+.2f} ms (IQR {pct(diffs, 0.25):+.1f} to "
        f"{pct(diffs, 0.75):+.1f}): proxy and placement together"
    )
    diffs = [(s - p) * 1000 for s, p in zip(e2e_outside["slotkeeper"], e2e_outside["plain"])]
    print(
        f"    ... outside llama-server's own timings: paired difference median {statistics.median(diffs):+.2f} ms "
        f"(IQR {pct(diffs, 0.25):+.2f} to {pct(diffs, 0.75):+.2f})"
    )
    rd, rc = got["read_disk"], got["read_cache"]
    print(
        f"(d) read speed of an entry file: disk {rd / MB:,.0f} MB/s (pages evicted with posix_fadvise), page "
        f"cache {rc / MB:,.0f} MB/s"
    )
    print(
        "    medians of 5; ms      file        from   size/speed   ConversationStore.restore   excess   "
        "the slot action alone   llama-server's restore_ms   Keeper.restore_into"
    )
    for row in got["sizes"]:
        for mode, speed in (("page cache", rc), ("disk", rd)):
            wall, direct, own = row[mode]
            expected = row["bytes"] / speed
            into = f"{row['restore_into'] * 1000:.1f}" if mode == "page cache" else ""
            print(
                f"    {row['tokens']:>6,} tokens  {row['bytes'] / MB:>6.1f} MB  {mode:>10}  {expected * 1000:>11.1f}"
                f"  {wall * 1000:>26.1f}  {(wall - expected) * 1000:>+7.1f}  {direct * 1000:>22.1f}"
                f"  {own * 1000:>26.1f}  {into:>20}"
            )
    pr = [t * 1000 for t in got["place_restore"]]
    print(
        f"    the whole hook for the chat in the store only (tokenize, choose, restore "
        f"{got['sizes'][0]['bytes'] / MB:.0f} MB from the page cache): median {statistics.median(pr):.1f} ms"
    )


if __name__ == "__main__":
    main()
