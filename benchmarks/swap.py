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
  (g) the modes side by side: Linux's own calls (prctl's parent-death signal, pidfd, /dev/shm staging) and the
      portable mode (SLOTKEEPER_PORTABLE=1: the paths of macOS and the BSDs, a watch in llama-server's process
      group, the child's exit polled every 50 ms, saves staged on disk): time-to-ready, (c), SIGTERM-to-exit,
      (d), and the time from slotkeeper's exit until llama-server's process group is empty, after that stop and
      after a SIGKILL of slotkeeper alone (the parent-death signal, or the watch, kills the group)
(b)-(e) are the first mode's (linux unless --modes leaves it out); (c)-(e) and (g) are medians over --repeat
restarts, the modes interleaved in each (linux, portable, linux, ...) so that the machine's load hits both
alike; the SIGKILLs come after all of them (a killed run's next start is not a clean one). Slotkeeper's exit is
seen by a pidfd (Popen.wait polls every 50 ms). Run against the store of an older checkout with its src on
PYTHONPATH (benchsetup.py), side by side.

    uv run python benchmarks/swap.py [--tokens 7500] [--repeat 5] [--ctx 16384] [--drop-caches]
                                     [--modes linux,portable] [--no-kill]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from slotkeeper.cmdline import find_llama_server
from slotkeeper.demo import DEMO_SEED_TEXT
from slotkeeper.portable import VARIABLE as PORTABLE_VARIABLE
from slotkeeper.store.layout import cache_root
from slotkeeper.testing.harness import Slotkeeper, free_port, http_call, stream_completion, wait_until
from slotkeeper.testing.tinymodel import BENCH_MODEL_E, write_tiny_model

SERVER_ARGS = ["-c", "16384", "-np", "2", "-t", "2"]
RESTORED = re.compile(r"restored into slot \d+: [^\n]* in ([\d,]+) ms")  # the log's line of each restore
MODES = {"linux": {}, "portable": {PORTABLE_VARIABLE: "1"}}  # what each mode adds to slotkeeper's environment


@dataclass
class Samples:
    """One mode's measurements: a value per restart (ms unless said)."""

    plain_readies: list[float] = field(default_factory=list)  # s
    readies: list[float] = field(default_factory=list)  # s
    ready_overheads: list[float] = field(default_factory=list)  # (c)
    stops: list[float] = field(default_factory=list)  # s
    stop_overheads: list[float] = field(default_factory=list)  # (d)
    firsts: list[float] = field(default_factory=list)  # s
    restores: list[float] = field(default_factory=list)
    saves: list[float] = field(default_factory=list)
    first_polls: list[float] = field(default_factory=list)
    cold_overheads: list[float] = field(default_factory=list)  # (e)
    cold_reads: list[float] = field(default_factory=list)  # s
    empty_after_stop: list[float] = field(default_factory=list)
    empty_after_kill: list[float] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)  # llama-server's group once ready: 2 with a watch


def store_files(cache: Path) -> list[Path]:
    """Every file of the store (entries, their blocks), not llama-server's snapshots/."""
    return [p for p in cache.rglob("*") if p.is_file() and "snapshots" not in p.parts]


def chat_files(cache: Path) -> list[Path]:
    """The files holding the saved chats' bytes: the blocks (the chat is the only one), or .bin files."""
    return [p for p in store_files(cache) if p.suffix == ".bin" or p.parent.parent.name == "blocks"]


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """A process's (state, parent, process group); None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[2])


def llama_server_group(slotkeeper_pid: int) -> tuple[int, list[int]]:
    """llama-server's process group (its pid: slotkeeper's child that leads a group) and its live members."""
    stats = {int(p.name): proc_stat(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    leader = next(pid for pid, st in stats.items() if st and st[1] == slotkeeper_pid and st[2] == pid)
    return leader, [pid for pid, st in stats.items() if st and st[2] == leader and st[0] != "Z"]


def group_alive(group: int, members: list[int]) -> bool:
    """Whether a member of the group is still alive (a zombie holds no memory; nothing in it forks)."""
    return any((st := proc_stat(pid)) is not None and st[0] != "Z" and st[2] == group for pid in members)


def exit_time(pid: int, timeout: float) -> float:
    """time.monotonic() when the process exits (a pidfd, not Popen.wait's polls of up to 50 ms)."""
    fd = os.pidfd_open(pid)
    try:
        assert select.select([fd], [], [], timeout)[0], f"process {pid} still running after {timeout} s"
        return time.monotonic()
    finally:
        os.close(fd)


def empty_after(group: int, members: list[int], exited: float) -> float:
    """ms from `exited` until the group has no live member."""
    assert wait_until(lambda: not group_alive(group, members), 10, interval=0.0005), f"group {group} lives on"
    return (time.monotonic() - exited) * 1000


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
    parser.add_argument(
        "--modes",
        type=lambda text: text.split(","),
        default=list(MODES),
        help="comma-separated, interleaved in this order: linux (Linux's own calls), portable (SLOTKEEPER_PORTABLE=1)",
    )
    parser.add_argument("--no-kill", action="store_true", help="no SIGKILLs of slotkeeper in (g)")
    args = parser.parse_args()
    if not args.modes or set(args.modes) - set(MODES) or len(set(args.modes)) < len(args.modes):
        parser.error(f"--modes: each of {', '.join(MODES)} at most once")
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

        def start(n: int, mode: str) -> tuple[Slotkeeper, float]:
            t0 = time.monotonic()
            sk = Slotkeeper(sk_args, {**env, **MODES[mode]}, work, port, work / f"sk-{mode}-{n}.log").start()
            assert wait_until(lambda: sk.health() == 200, 120, interval=0.002), sk.logs()
            return sk, time.monotonic() - t0

        def stop(sk: Slotkeeper, samples: Samples | None = None) -> float:
            group, members = llama_server_group(sk.pid)
            t0 = time.monotonic()
            sk.killpg(signal.SIGTERM)
            exited = exit_time(sk.pid, 60)
            if samples is not None:
                samples.group_sizes.append(len(members))
                samples.empty_after_stop.append(empty_after(group, members, exited))
            assert sk.wait(60) == 0, sk.logs()
            sk.stop()
            return exited - t0

        def kill(sk: Slotkeeper, samples: Samples) -> None:
            """SIGKILL slotkeeper alone (llama-swap's group kill reaches no further: llama-server has a group of
            its own); what it leaves (its runtime directory, a RAM folder) is removed here, not by a next start."""
            group, members = llama_server_group(sk.pid)
            os.kill(sk.pid, signal.SIGKILL)
            samples.empty_after_kill.append(empty_after(group, members, exit_time(sk.pid, 10)))
            sk.wait(10)
            sk.stop()
            for base, name in ((tempfile.gettempdir(), f"{sk.pid}-"), ("/dev/shm", f"{os.getuid()}-{sk.pid}-")):
                for left in Path(base).glob(f"slotkeeper-{name}*"):
                    shutil.rmtree(left, ignore_errors=True)

        modes = args.modes
        for mode in modes:  # the store's chat, then one start of each mode before any is timed
            sk, _ = start(0, mode)
            stream_completion(port, {"prompt": prompt, **body})
            stop(sk)

        results = {mode: Samples() for mode in modes}
        for i in range(args.repeat):
            for mode in modes:
                m = results[mode]
                if args.drop_caches:
                    m.cold_reads.append(sum(cold_read_s(path) for path in chat_files(work / "cache")))
                p_ready, proc = plain_ready_time(binary, model, port)
                stop_plain(proc)
                m.plain_readies.append(p_ready)
                if args.drop_caches:
                    drop_page_cache()
                sk, ready = start(i + 1, mode)
                m.readies.append(ready)
                if args.drop_caches:
                    m.cold_overheads.append((ready - p_ready - m.cold_reads[-1]) * 1000)
                restore_ms = sum(float(ms.replace(",", "")) for ms in RESTORED.findall(sk.logs()))
                warm = stream_completion(port, {"prompt": prompt, **body})
                assert warm.timings.get("cache_n", 0) >= n_prompt - 1, "the cache was not reused"
                m.firsts.append(warm.first_token_s)
                m.restores.append(restore_ms)
                m.ready_overheads.append((ready - p_ready) * 1000 - restore_ms)
                # make the slot dirty again with the same tokens so every stop really saves
                http_call(port, "POST", "/slots/0?action=erase", {})
                stream_completion(port, {"prompt": prompt, **body, "id_slot": 0})
                found = re.search(r"answered healthy at ([\d,]+) ms", sk.logs())
                if found:
                    m.first_polls.append(float(found.group(1).replace(",", "")))
                stop_s = stop(sk, m)
                m.stops.append(stop_s)
                manifests = [p for p in (work / "cache").rglob("*.json")]
                save_ms = max(json.loads(p.read_text()).get("save_ms") or 0 for p in manifests)
                m.saves.append(save_ms)
                m.stop_overheads.append(stop_s * 1000 - save_ms)
        on_disk = sum(p.stat().st_size for p in store_files(work / "cache"))
        state = sum(json.loads(p.read_text())["bytes"] for p in (work / "cache" / "entries").glob("*.json"))
        if not args.no_kill:
            for i in range(args.repeat):
                for mode in modes:
                    sk, _ = start(args.repeat + i + 1, mode)
                    kill(sk, results[mode])
    finally:
        shutil.rmtree(work, ignore_errors=True)

    m = results[modes[0]]
    plain_readies, ready_overheads, stop_overheads = m.plain_readies, m.ready_overheads, m.stop_overheads
    firsts, restores, saves, first_polls = m.firsts, m.restores, m.saves, m.first_polls
    cold_overheads, cold_reads = m.cold_overheads, m.cold_reads
    a, b = cold.first_token_s, statistics.median(firsts)
    name = (
        f"model {model.name}"
        if args.model
        else f"benchmark model E: {BENCH_MODEL_E.n_layers} layers x {BENCH_MODEL_E.width}, f16"
    )
    print(f"{name}, {model.stat().st_size / 1e6:.1f} MB; prompt {n_prompt:,} tokens; {' '.join(SERVER_ARGS)}")
    if len(modes) > 1:
        print(f"(b)-(e): the {modes[0]} mode; (g) sets the modes side by side")
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
    print_modes(results, args.repeat)


def print_modes(results: dict[str, Samples], repeat: int) -> None:
    """(g): each mode's medians, a row each, and each mode's paired differences with the first."""

    def med(values: list[float], scale: float = 1.0) -> str:
        return f"{statistics.median(values) * scale:8.1f}" if values else f"{'-':>8}"

    print(f"(g) the modes side by side, interleaved, medians of {repeat} (ms):")
    print(
        f"    {'mode':<9} {'ready':>8} {'(c)':>8} {'stop':>8} {'(d)':>8} {'save_ms':>8} {'restore':>8}  "
        "group empty after exit: SIGTERM stop, SIGKILL  (processes in it)"
    )
    for mode, m in results.items():
        print(
            f"    {mode:<9} {med(m.readies, 1000)} {med(m.ready_overheads)} {med(m.stops, 1000)} "
            f"{med(m.stop_overheads)} {med(m.saves)} {med(m.restores)}  "
            f"{med(m.empty_after_stop)} {med(m.empty_after_kill)}  ({'/'.join(map(str, sorted(set(m.group_sizes))))})"
        )
    first, *others = results
    for mode in others:
        a, b = results[first], results[mode]

        def paired(x: list[float], y: list[float], scale: float = 1.0) -> str:
            return f"{statistics.median([(q - p) * scale for p, q in zip(x, y, strict=True)]):+.1f}"

        print(
            f"    {mode} - {first}, median of the paired differences: ready {paired(a.readies, b.readies, 1000)}, "
            f"(c) {paired(a.ready_overheads, b.ready_overheads)}, stop {paired(a.stops, b.stops, 1000)}, "
            f"(d) {paired(a.stop_overheads, b.stop_overheads)}"
        )


if __name__ == "__main__":
    main()
