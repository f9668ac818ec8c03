"""A model swap with plain llama-server vs through slotkeeper, on benchmark model "E".

Prints, from one run:
  (a) first-token time after a restart with plain llama-server (a cold prefill of the whole prompt)
  (b) the same through slotkeeper (restored cache); target b/a <= 1/50
  (c) slotkeeper's time-to-ready - plain llama-server's time-to-ready - llama-server's restore_ms; target <= 50 ms
  (d) slotkeeper's SIGTERM-to-exit - llama-server's save_ms; target <= 100 ms
  (e) with --drop-caches (root): the page cache is dropped before each start, plain's and slotkeeper's;
      slotkeeper's time-to-ready - plain llama-server's - reading the saved chat's file cold (its blocks, or
      its one file from a store before blocks); target <= 100 ms
  (f) the store on disk after the restarts (each block once) against the state its entries hold
(c), (d) and (e) are medians over --repeat restarts. Run against the store of an older checkout with its src on
PYTHONPATH (benchsetup.py), side by side.

    uv run python benchmarks/swap.py [--tokens 7500] [--repeat 5] [--ctx 16384] [--drop-caches]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from slotkeeper.cmdline import find_llama_server
from slotkeeper.demo import DEMO_SEED_TEXT
from slotkeeper.store.layout import cache_root
from slotkeeper.testing.harness import Slotkeeper, free_port, http_call, stream_completion, wait_until
from slotkeeper.testing.tinymodel import BENCH_MODEL_E, write_tiny_model

SERVER_ARGS = ["-c", "16384", "-np", "2", "-t", "2"]
RESTORED = re.compile(r"restored into slot \d+: [^\n]* in ([\d,]+) ms")  # the log's line of each restore


def store_files(cache: Path) -> list[Path]:
    """Every file of the store (entries, their blocks), not llama-server's snapshots/."""
    return [p for p in cache.rglob("*") if p.is_file() and "snapshots" not in p.parts]


def chat_files(cache: Path) -> list[Path]:
    """The files holding the saved chats' bytes: the blocks (the chat is the only one), or .bin files."""
    return [p for p in store_files(cache) if p.suffix == ".bin" or p.parent.parent.name == "blocks"]


def health(port: int) -> int:
    try:
        return http_call(port, "GET", "/health", timeout=2).status
    except OSError:
        return 0


def drop_page_cache() -> None:
    """Every file is read from the disk again (root only): a start as after a reboot or a long while."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def cold_read_s(path: Path) -> float:
    """Seconds to read a file with the page cache dropped (then dropped again)."""
    drop_page_cache()
    started = time.monotonic()
    with open(path, "rb") as f:
        while f.read(1 << 22):
            pass
    elapsed = time.monotonic() - started
    drop_page_cache()
    return elapsed


def plain_ready_time(binary: str, model: Path, port: int) -> tuple[float, subprocess.Popen[bytes]]:
    started = time.monotonic()
    proc = subprocess.Popen(
        [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert wait_until(lambda: health(port) == 200, 120, interval=0.002), "llama-server never became ready"
    return time.monotonic() - started, proc


def stop_plain(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


def build_prompt(port: int, tokens: int) -> str:
    probe = DEMO_SEED_TEXT * 8
    per_char = len(http_call(port, "POST", "/tokenize", {"content": probe}).body["tokens"]) / len(probe)
    return "".join(f"{i}. {DEMO_SEED_TEXT}" for i in range(int(tokens / (per_char * len(DEMO_SEED_TEXT))) + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=7500)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--model", type=Path, help="any GGUF instead of benchmark model E (e.g. one that loads slowly)")
    parser.add_argument("--ctx", type=int, default=16384, help="-c (two slots share it)")
    parser.add_argument("--drop-caches", action="store_true", help="start plain and slotkeeper from a cold page cache")
    args = parser.parse_args()
    SERVER_ARGS[1] = str(args.ctx)

    binary = find_llama_server(None, os.environ)[0]
    cache = Path(cache_root(os.environ)) / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    model = args.model or cache / "model-e.gguf"
    if not model.exists():
        write_tiny_model(model, BENCH_MODEL_E)
    work = Path(tempfile.mkdtemp(prefix="slotkeeper-bench-"))
    body = {"n_predict": 8, "temperature": 0, "cache_prompt": True}
    try:
        port = free_port()
        stop_plain(plain_ready_time(binary, model, port)[1])  # warm the page cache once
        _, proc = plain_ready_time(binary, model, port)
        prompt = build_prompt(port, args.tokens)
        n_prompt = len(http_call(port, "POST", "/tokenize", {"content": prompt}).body["tokens"])
        cold = stream_completion(port, {"prompt": prompt, **body})
        stop_plain(proc)

        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_ARG_", "SLOTKEEPER_"))}
        env["LLAMA_SERVER"] = binary
        sk_args = ["-m", str(model), "--port", str(port), "--slot-save-path", str(work / "cache"), *SERVER_ARGS]

        def start(n: int) -> tuple[Slotkeeper, float]:
            t0 = time.monotonic()
            sk = Slotkeeper(sk_args, env, work, port, work / f"sk-{n}.log").start()
            assert wait_until(lambda: sk.health() == 200, 120, interval=0.002), sk.logs()
            return sk, time.monotonic() - t0

        def stop(sk: Slotkeeper) -> float:
            t0 = time.monotonic()
            sk.killpg(signal.SIGTERM)
            assert sk.wait(60) == 0, sk.logs()
            elapsed = time.monotonic() - t0
            sk.stop()
            return elapsed

        sk, _ = start(0)
        stream_completion(port, {"prompt": prompt, **body})
        stop(sk)

        plain_readies, ready_overheads, stop_overheads, firsts, restores, saves = [], [], [], [], [], []
        first_polls, cold_overheads, cold_reads = [], [], []
        for i in range(args.repeat):
            if args.drop_caches:
                cold_reads.append(sum(cold_read_s(path) for path in chat_files(work / "cache")))
            p_ready, proc = plain_ready_time(binary, model, port)
            stop_plain(proc)
            plain_readies.append(p_ready)
            if args.drop_caches:
                drop_page_cache()
            sk, ready = start(i + 1)
            if args.drop_caches:
                cold_overheads.append((ready - p_ready - cold_reads[-1]) * 1000)
            restore_ms = sum(float(ms.replace(",", "")) for ms in RESTORED.findall(sk.logs()))
            warm = stream_completion(port, {"prompt": prompt, **body})
            assert warm.timings.get("cache_n", 0) >= n_prompt - 1, "the cache was not reused"
            firsts.append(warm.first_token_s)
            restores.append(restore_ms)
            ready_overheads.append((ready - p_ready) * 1000 - restore_ms)
            # make the slot dirty again with the same tokens so every stop really saves
            http_call(port, "POST", "/slots/0?action=erase", {})
            stream_completion(port, {"prompt": prompt, **body, "id_slot": 0})
            found = re.search(r"answered healthy at ([\d,]+) ms", sk.logs())
            if found:
                first_polls.append(float(found.group(1).replace(",", "")))
            stop_s = stop(sk)
            manifests = [p for p in (work / "cache").rglob("*.json")]
            save_ms = max(json.loads(p.read_text()).get("save_ms") or 0 for p in manifests)
            saves.append(save_ms)
            stop_overheads.append(stop_s * 1000 - save_ms)
        on_disk = sum(p.stat().st_size for p in store_files(work / "cache"))
        state = sum(json.loads(p.read_text())["bytes"] for p in (work / "cache" / "entries").glob("*.json"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    a, b = cold.first_token_s, statistics.median(firsts)
    name = (
        f"model {model.name}"
        if args.model
        else f"benchmark model E: {BENCH_MODEL_E.n_layers} layers x {BENCH_MODEL_E.width}, f16"
    )
    print(f"{name}, {model.stat().st_size / 1e6:.1f} MB; prompt {n_prompt:,} tokens; {' '.join(SERVER_ARGS)}")
    print(f"(a) first token after restart, plain llama-server (cold prefill): {a * 1000:10.1f} ms")
    print(f"(b) first token after restart, slotkeeper (restored):              {b * 1000:10.1f} ms")
    print(f"    b/a = 1/{a / b:.0f}   (target <= 1/50)")
    print(
        f"    plain time-to-ready {statistics.median(plain_readies) * 1000:.1f} ms, "
        f"restore_ms {statistics.median(restores):.1f}, save_ms {statistics.median(saves):.1f}"
    )
    print(
        f"(c) slotkeeper ready - plain ready - restore_ms: median {statistics.median(ready_overheads):6.1f} ms "
        f"(min {min(ready_overheads):.1f}, max {max(ready_overheads):.1f}; target <= 50 ms)"
    )
    if first_polls:
        print(
            f"    llama-server answered slotkeeper's health poll {statistics.median(first_polls):.0f} ms after "
            f"slotkeeper spawned it (plain llama-server: {statistics.median(plain_readies) * 1000:.0f} ms to ready)"
        )
    print(
        f"(d) slotkeeper SIGTERM-to-exit - save_ms:         median {statistics.median(stop_overheads):6.1f} ms "
        f"(min {min(stop_overheads):.1f}, max {max(stop_overheads):.1f}; target <= 100 ms)"
    )
    if cold_overheads:
        print(
            "(e) page cache dropped: slotkeeper ready - plain ready - reading the chat's file cold: median "
            f"{statistics.median(cold_overheads):6.1f} ms (min {min(cold_overheads):.1f}, "
            f"max {max(cold_overheads):.1f}; target <= 100 ms); "
            f"the cold read {statistics.median(cold_reads) * 1000:.0f} ms"
        )
    print(f"(f) the store on disk: {on_disk / 1e6:.1f} MB for {state / 1e6:.1f} MB of state in its entries")


if __name__ == "__main__":
    main()
