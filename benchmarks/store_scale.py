"""A store of tens of thousands of saved chats: what it costs slotkeeper's start, a new chat, `ls` and `prune`.

Real entries first: slotkeeper runs once on benchmark model E with an empty save directory, --seed-chats chats
(the demo's, ~2,600 tokens each, a title request after each) go through it, and a SIGTERM saves them. Then, per
size, a store of that many entries is synthesized from them: the real ones as they are, and copies of the real
chats' files (hard links) under new random ids, with manifests derived from the real ones': the same fingerprint
and state format (so every one is usable), their own last blocks, exact key and last request unit (so the
indexes hold one distinct chat per entry), and a last use spread over the past 30 days (the real chats stay the
most recent, so they are the ones restored at start). Per size, one row:

  ready         time from spawning to /health 200: plain llama-server, then slotkeeper on that store: its first
                start (the synthesized manifests were never seen: each is read), then the next start (what
                every start after a stop is: the manifest cache the first one left is read instead)
  new chat      median first-token time of --chats short new chats (each its own system prompt, so nothing is
                reused on either side, and under --min-save-tokens, so nothing is saved): placement's look-up
  a save        then --saves chats worth saving, through slotkeeper only, on the system prompt every entry shares
                (each parks the one before it): the median of the log's save times (`... in N ms`, the store's
                admission included)
  ls, ls --json, prune --dry-run --older-than 7d: wall time of each command as a process, on the synthesized
                store (its manifests never seen: each is read) and again once slotkeeper has run on it (what
                it leaves at a stop: the manifest cache)
  RSS           slotkeeper's own (the daemon, not llama-server: VmRSS), after ready and after the chats

With --starts N, the stores are kept until every row is done, and then N rounds of starts follow, alternated
(plain llama-server, then slotkeeper on each store): medians of the time to ready, and each store's growth over
the smallest one's, side by side in one run (a single start, as in the table, swings by 100-300 ms here).

With --profile, the slotkeeper side runs under cProfile with the store's threads run in line (so that one
profile sees store.open and the saves' work; the timings then include the profiler's cost), and the busiest
functions of the largest size are printed after the table.

    uv run python benchmarks/store_scale.py [--sizes 10,1000,5000,20000] [--chats 6] [--saves 3]
        [--seed-chats 4] [--starts N] [--profile] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchsetup import llama_server, model_e, slotkeeper_args, stop_slotkeeper, work_dir

from slotkeeper.demo import SYSTEM_PROMPT, TOPICS, Chat, Turn, fmt_s, stream_chat
from slotkeeper.testing.harness import PlainServer, Slotkeeper, clean_env, free_port, wait_until

SERVER_ARGS = ["-c", "24576", "-t", "2"]  # llama-server's default 4 slots, sharing one unified KV cache
# Every synthesized entry counts its real one's bytes though they share one file: a cap of half the disk would
# evict most of a large store at its first save.
OWN_ARGS = ["--max-cache-bytes", str(10**15)]
NEW_CHAT_TOKENS = 8
PRUNE_AGE = "7d"
SPREAD_S = 30 * 86400  # synthesized entries were last used up to this long ago
PROFILE_TOP = 14
# The store's work, looked up by name in the profile (those that exist in this version of the code).
PROFILE_NAMES = (
    "open",
    "_admit",
    "_admit_saved",
    "_index",
    "evict_over_cap",
    "save_slot",
    "_commit",
    "lookup",
    "find_exact",
    "lookup_extended",
    "restore_recent",
    "judge",
    "read_manifest",
    "from_manifest",
)

# Runs slotkeeper's main() under cProfile, with asyncio.to_thread in line: a profile sees only its own thread.
PROFILED_MAIN = """
import asyncio, cProfile, os, sys

async def _in_line(func, /, *args, **kwargs):
    return func(*args, **kwargs)

asyncio.to_thread = _in_line
from slotkeeper.cli import main

profile = cProfile.Profile()
code = profile.runcall(main, sys.argv[2:])
profile.dump_stats(sys.argv[1])
sys.stdout.flush()
os._exit(code)
"""


@dataclass
class Side:
    ready_s: float
    turns: list[Turn]

    @property
    def first_token(self) -> float:
        return statistics.median(t.first_token_s for t in self.turns)


@dataclass
class Row:
    entries: int
    plain: Side
    first_ready_s: float  # slotkeeper's first start on the synthesized store
    slotkeeper: Side  # its next start
    rss_ready: float
    rss_after: float
    catalog_s: tuple[float, float, float]  # ls, ls --json, prune --dry-run on the synthesized store (no cache)
    catalog_cached_s: tuple[float, float, float]  # ... once slotkeeper has run on it (the manifest cache written)
    save_ms: list[float]


class ProfiledSlotkeeper(Slotkeeper):
    """The harness's slotkeeper, started under PROFILED_MAIN when `profile_path` is set."""

    profile_path: Path | None = None

    def start(self) -> Slotkeeper:
        if self.profile_path is None:
            return super().start()
        self.log_file = open(self.log_path, "ab")  # noqa: SIM115 - slotkeeper's output, open until stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PROFILED_MAIN, str(self.profile_path), *self.args],
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self


def rss_mb(pid: int) -> float:
    """VmRSS of one process (not its children), in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# ---- the store ----------------------------------------------------------------------------------------------------


def seed_store(binary: str, model: Path, work: Path, chats: int) -> Path:
    """A save directory of real entries: `chats` demo chats through slotkeeper, saved at its stop."""
    save_dir = work / "seed"
    port = free_port()
    sk = Slotkeeper(
        slotkeeper_args(["-m", str(model), *SERVER_ARGS], port, save_dir, OWN_ARGS),
        clean_env(binary),
        work,
        port,
        work / "seed.log",
    ).start()
    try:
        sk.wait_ready(300)
        for n in range(chats):
            chat = Chat(n)
            chat.turn(port)
            chat.title(port)
    finally:
        stop_slotkeeper(sk, 300)
    return save_dir


def synthesize(seed: Path, target: Path, total: int, now: float) -> int:
    """`total` entries in `target`: the seed's own, and copies of its chats under new ids (see the docstring).
    Returns how many there are."""
    rng = random.Random(total)
    entries = target / "entries"
    entries.mkdir(parents=True)
    (target / "snapshots").mkdir()
    templates: list[tuple[dict[str, object], Path | None]] = []
    count = 0
    if (seed / "blocks").is_dir():  # entries kept as blocks: the copies share the seed's (hard links)
        for block in (seed / "blocks").glob("*/*"):
            (target / "blocks" / block.parent.name).mkdir(parents=True, exist_ok=True)
            os.link(block, target / "blocks" / block.parent.name / block.name)
    for manifest_path in sorted((seed / "entries").glob("*.json")):
        data = json.loads(manifest_path.read_text())
        bin_path: Path | None = manifest_path.with_suffix(".bin")
        if data.get("parts") is not None:
            bin_path = None
        elif bin_path is None or not bin_path.is_file():
            continue
        else:
            os.link(bin_path, entries / bin_path.name)
        shutil.copy2(manifest_path, entries / manifest_path.name)
        count += 1
        if not data.get("opening") and data.get("blocks"):
            templates.append((data, None if bin_path is None else entries / bin_path.name))
    if not templates:
        raise SystemExit(f"the seed run saved no chat to copy; see {seed.parent / 'seed.log'}")

    def key(digits: int) -> str:
        return f"{rng.getrandbits(digits * 4):0{digits}x}"

    for i in range(max(0, total - count)):
        data, bin_path = templates[i % len(templates)]
        entry_id = key(16)
        blocks = list(data["blocks"])  # type: ignore[call-overload]
        tail = min(2, len(blocks))
        blocks[len(blocks) - tail :] = [key(16) for _ in range(tail)]
        units = list(data.get("units") or [])  # type: ignore[call-overload]
        if units:
            units[-1] = key(16)
        used = now - rng.uniform(3600, SPREAD_S)
        manifest = {
            **data,
            "id": entry_id,
            "blocks": blocks,
            "units": units,
            "exact": key(32),
            "saved_at": used - rng.uniform(0, 3600),
            "last_used": used,
        }
        if bin_path is not None:
            os.link(bin_path, entries / f"{entry_id}.bin")
        (entries / f"{entry_id}.json").write_text(json.dumps(manifest, separators=(",", ":")), encoding="utf-8")
        count += 1
    return count


def time_command(argv: list[str], env: dict[str, str]) -> float:
    """Wall time of `slotkeeper ARGV` as a process (output discarded); NaN when it fails."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "slotkeeper.cli", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        check=False,
    )
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        print(
            f"  slotkeeper {' '.join(argv[:2])} failed ({proc.returncode}): {proc.stderr.decode()[-300:]}", flush=True
        )
        return float("nan")
    return elapsed


# ---- the traffic --------------------------------------------------------------------------------------------------


def new_chats(port: int, tag: str, n: int) -> list[Turn]:
    """`n` short new chats (~60 tokens: under --min-save-tokens, so nothing is saved or parked for them), each
    with a system prompt of its own: nothing to reuse on either side, what slotkeeper adds is placement's look."""
    turns = []
    for i in range(n):
        messages = [
            {"role": "system", "content": f"Session {tag}-{i}. You are a careful assistant."},
            {"role": "user", "content": f"Chat {i + 1}: what should I read first about {TOPICS[i % len(TOPICS)]}?"},
        ]
        turns.append(stream_chat(port, messages, NEW_CHAT_TOKENS))
    return turns


def saving_chats(port: int, tag: str, n: int) -> None:
    """`n` new chats worth saving, on the seed chats' system prompt (as every synthesized entry opens, so that
    each save is admitted among all of them) and a few hundred tokens of their own: each parks (saves) the chat
    before it, and the last one is saved at the stop."""
    for i in range(n):
        notes = " ".join(f"Note {k}: session {tag}-{i} logged entry {k} at dusk." for k in range(1, 9))
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Chat {tag}-{i}. {notes} What stands out?"},
        ]
        stream_chat(port, messages, NEW_CHAT_TOKENS)


SAVE_LINE = re.compile(r"slotkeeper: (?:chat|opening) \w+ saved from slot .* in ([\d,.]+) ms")


def save_times(log: str) -> list[float]:
    """The `... saved from slot N ...: T tokens, B in X ms` lines' X (the whole save, its admission included)."""
    return [float(m.group(1).replace(",", "")) for m in SAVE_LINE.finditer(log)]


def run_plain(binary: str, model: Path, work: Path, tag: str, chats: int) -> Side:
    port = free_port()
    started = time.monotonic()
    server = PlainServer(binary, ["-m", str(model), *SERVER_ARGS], port, work / f"plain-{tag}.log", clean_env(binary))
    try:
        server.wait_ready(300)
        ready = time.monotonic() - started
        return Side(ready, new_chats(port, f"plain-{tag}", chats))
    finally:
        server.stop()


def run_slotkeeper(
    binary: str, model: Path, save_dir: Path, work: Path, tag: str, chats: int, saves: int, profile: Path | None
) -> tuple[Side, float, float, list[float]]:
    port = free_port()
    sk = ProfiledSlotkeeper(
        slotkeeper_args(["-m", str(model), *SERVER_ARGS], port, save_dir, OWN_ARGS),
        clean_env(binary),
        work,
        port,
        work / f"sk-{tag}.log",
    )
    sk.profile_path = profile
    started = time.monotonic()
    sk.start()
    try:
        proc = sk.proc
        assert proc is not None
        if (
            not wait_until(lambda: proc.poll() is not None or sk.health() == 200, 600, interval=0.002)
            or proc.poll() is not None
        ):
            raise SystemExit(f"slotkeeper did not become ready on {save_dir}:\n{sk.logs()[-2000:]}")
        ready = time.monotonic() - started
        rss_ready = rss_mb(sk.pid)
        turns = new_chats(port, f"sk-{tag}", chats)
        saving_chats(port, f"sk-saving-{tag}", saves)
        rss_after = rss_mb(sk.pid)
    finally:
        stop_slotkeeper(sk, 300)
    return Side(ready, turns), rss_ready, rss_after, save_times(sk.logs())


def measure(
    binary: str, model: Path, seed: Path, root: Path, size: int, chats: int, saves: int, profile: Path | None
) -> Row:
    save_dir = root / f"store-{size}"
    entries = synthesize(seed, save_dir, size, time.time())
    env = clean_env(binary)
    catalog = time_catalog(save_dir, env)
    plain = run_plain(binary, model, root, str(size), chats)
    first, *_ = run_slotkeeper(binary, model, save_dir, root, f"{size}-first", 1, 0, None)
    sk, rss_ready, rss_after, saved = run_slotkeeper(binary, model, save_dir, root, str(size), chats, saves, profile)
    catalog_cached = time_catalog(save_dir, env)
    return Row(entries, plain, first.ready_s, sk, rss_ready, rss_after, catalog, catalog_cached, saved)


def alternated_ready(binary: str, model: Path, work: Path, sizes: list[int], starts: int) -> None:
    """`starts` rounds of plain llama-server, then slotkeeper on each store (its next start: no traffic, stopped
    at once); prints the medians of the time to ready and each store's growth over the smallest's."""
    ready: dict[str, list[float]] = {"plain": [], **{f"{size:,}": [] for size in sizes}}
    for n in range(starts):
        ready["plain"].append(run_plain(binary, model, work, f"alternated-{n}", 0).ready_s)
        for size in sizes:
            side = run_slotkeeper(binary, model, work / f"store-{size}", work, f"alternated-{size}-{n}", 0, 0, None)[0]
            ready[f"{size:,}"].append(side.ready_s)
    medians = {name: statistics.median(times) for name, times in ready.items()}
    smallest = medians[f"{min(sizes):,}"]
    print(f"\nready, medians of {starts} alternated starts (ms; min-max):")
    for name, median in medians.items():
        growth = "" if name == "plain" else f"  {(median - medians['plain']) * 1000:+.0f} over plain, "
        growth += "" if name == "plain" else f"{(median - smallest) * 1000:+.0f} over the smallest store"
        label = name if name == "plain" else f"{name} entries"
        low, high = min(ready[name]) * 1000, max(ready[name]) * 1000
        print(f"  {label:>16} {median * 1000:6.0f} ({low:.0f}-{high:.0f}){growth}", flush=True)


def time_catalog(save_dir: Path, env: dict[str, str]) -> tuple[float, float, float]:
    """`ls`, `ls --json` and `prune --dry-run`, each as a process."""
    return (
        time_command(["ls", str(save_dir)], env),
        time_command(["ls", str(save_dir), "--json"], env),
        time_command(["prune", str(save_dir), "--dry-run", "--older-than", PRUNE_AGE], env),
    )


# ---- the report ---------------------------------------------------------------------------------------------------


HEADER = (
    "| saved chats | ready: plain / slotkeeper first start, next start | new chat's first token: plain / "
    "slotkeeper (added) | "
    "a save (median, count) | `ls`: no cache / cached | `ls --json` | `prune --dry-run` | "
    "slotkeeper RSS: ready / after chats |\n"
    "|---|---|---|---|---|---|---|---|"
)


def table_row(row: Row) -> str:
    added = (row.slotkeeper.first_token - row.plain.first_token) * 1000
    save = f"{statistics.median(row.save_ms):.0f} ms ({len(row.save_ms)})" if row.save_ms else "-"
    return (
        f"| {row.entries:,} | {fmt_s(row.plain.ready_s)} / {fmt_s(row.first_ready_s)}, "
        f"{fmt_s(row.slotkeeper.ready_s)} | "
        f"{fmt_s(row.plain.first_token)} / {fmt_s(row.slotkeeper.first_token)} ({added:+.0f} ms) | {save} | "
        + " | ".join(f"{a:.2f} / {b:.2f} s" for a, b in zip(row.catalog_s, row.catalog_cached_s))
        + " | "
        f"{row.rss_ready:.0f} / {row.rss_after:.0f} MB |"
    )


def print_profile(path: Path, size: int) -> None:
    stats = pstats.Stats(str(path))
    raw = stats.stats  # type: ignore[attr-defined]
    print(
        f"\nprofile of slotkeeper on {size:,} entries (whole run, the store's threads in line): "
        f"the store's functions (calls, own time, cumulative)"
    )
    for (filename, line, name), (_, calls, own, cumulative, _) in sorted(raw.items(), key=lambda kv: -kv[1][3]):
        if "slotkeeper" in filename and name in PROFILE_NAMES:
            print(
                f"  {Path(filename).name}:{line} {name}: {calls:,} calls, {own:.3f} s own, {cumulative:.3f} s "
                f"cumulative ({cumulative / calls * 1000:.2f} ms a call)"
            )
    print(f"busiest functions by own time (top {PROFILE_TOP}; the event loop's own time, its waiting, left out):")
    busy = [item for item in raw.items() if not item[0][0].endswith("runners.py")]
    for (filename, line, name), (_, calls, own, cumulative, _) in sorted(busy, key=lambda kv: -kv[1][2])[:PROFILE_TOP]:
        where = f"{Path(filename).name}:{line}" if filename != "~" else "builtin"
        print(f"  {where} {name}: {calls:,} calls, {own:.3f} s own, {cumulative:.3f} s cumulative")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sizes",
        default="10,1000,5000,20000",
        help="comma-separated store sizes in entries (default 10,1000,5000,20000)",
    )
    parser.add_argument("--chats", type=int, default=6, help="short new chats per side and size (default 6)")
    parser.add_argument(
        "--saves",
        type=int,
        default=3,
        help="then chats worth saving, through slotkeeper only, for the save column (default 3)",
    )
    parser.add_argument("--seed-chats", type=int, default=4, help="real chats saved first (default 4)")
    parser.add_argument(
        "--starts",
        type=int,
        default=0,
        metavar="N",
        help="then N alternated rounds of starts: plain, slotkeeper on each store (medians of ready; default 0)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="run slotkeeper under cProfile; print the profile of the largest size"
    )
    parser.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="build the stores in DIR and keep them (default: a temporary directory, removed)",
    )
    args = parser.parse_args()
    try:
        sizes = [int(s.replace("_", "")) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes takes comma-separated numbers, not {args.sizes!r}")
    binary = llama_server()
    model = model_e()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    work = args.keep or work_dir("scale")
    try:
        warm = PlainServer(binary, ["-m", str(model), *SERVER_ARGS], free_port(), work / "warm.log", clean_env(binary))
        try:  # the model and llama-server into the page cache, so that the first size's ready times compare
            warm.wait_ready(300)
        finally:
            warm.stop()
        seed = seed_store(binary, model, work, args.seed_chats)
        real = len(list((seed / "entries").glob("*.json")))
        print(
            f"benchmark model E; {' '.join(SERVER_ARGS)}; {real} real entries saved by {args.seed_chats} chats; "
            f"{args.chats} short new chats per side and size, then {args.saves} saving ones through slotkeeper; "
            f"prune --dry-run --older-than {PRUNE_AGE}" + ("; slotkeeper under cProfile" if args.profile else ""),
            flush=True,
        )
        print(HEADER, flush=True)
        profiles: dict[int, Path] = {}
        for size in sizes:
            profile = work / f"slotkeeper-{size}.prof" if args.profile else None
            row = measure(binary, model, seed, work, size, args.chats, args.saves, profile)
            print(table_row(row), flush=True)
            if profile is not None:
                profiles[row.entries] = profile
            if not args.keep and not args.starts:
                shutil.rmtree(work / f"store-{size}", ignore_errors=True)
        if args.starts:
            alternated_ready(binary, model, work, sizes, args.starts)
        if profiles:
            largest = max(profiles)
            print_profile(profiles[largest], largest)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
