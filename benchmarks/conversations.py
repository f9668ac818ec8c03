"""Chats across model swaps: plain llama-server (restarted) vs slotkeeper, side by side in one run.

The traffic of a chat front end: --chats conversations sharing a system prompt, more of them than llama-server
has slots, a short title request after every turn. Between rounds, a swap: SIGTERM to the server's process
group (as llama-swap sends it), then a start with the same arguments. Both sides get the same chats in the
same order (shuffled per round with a fixed seed); which side runs a round first alternates.

Prints, per round and chat, first-token time and tokens reused (`timings.cache_n` of the prompt) on each side,
then:
  (a) the warm fraction of returning chats after a swap: turns that reused at least their whole previous
      prompt (target: all, through slotkeeper);
  (b) returning chats' first-token time, plain llama-server (cold) vs slotkeeper (warm): medians and ratio;
  (c) new chats (the first round): first-token time on both sides, what placement costs or saves a new chat.

    uv run python benchmarks/conversations.py [--chats 8] [--rounds 3] [--parallel 4] [--notes 38]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from slotkeeper.cmdline import find_llama_server
from slotkeeper.demo import NOTES_PER_CHAT, Chat, Turn, fmt_s, reuse
from slotkeeper.store.layout import cache_root
from slotkeeper.testing.harness import PlainServer, Slotkeeper, clean_env, free_port, http_call
from slotkeeper.testing.tinymodel import BENCH_MODEL_E, write_tiny_model


@dataclass
class Result:
    chat: int
    turn: Turn
    warm: bool


def run_round(port: int, chats: list[Chat], order: list[int]) -> list[Result]:
    results = []
    for i in order:
        turn, warm = chats[i].turn(port)
        chats[i].title(port)
        results.append(Result(i, turn, warm))
    return results


def store_size(cache: Path) -> tuple[int, int]:
    """The store's bytes on disk (entries, blocks: each once; not llama-server's snapshots/) and the bytes of
    state its entries hold."""
    files = [p for p in cache.rglob("*") if p.is_file() and "snapshots" not in p.parts]
    state = sum(json.loads(p.read_text())["bytes"] for p in (cache / "entries").glob("*.json"))
    return sum(p.stat().st_size for p in files), state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=8, help="conversations (default 8: twice the default slots)")
    parser.add_argument("--rounds", type=int, default=3, help="turns per chat, with a swap between rounds (default 3)")
    parser.add_argument(
        "--parallel", "-np", type=int, default=None, help="llama-server's -np (default: its own, 4 slots)"
    )
    parser.add_argument(
        "--notes",
        type=int,
        default=NOTES_PER_CHAT,
        help=f"length of each chat's opening message, in notes of ~48 tokens (default {NOTES_PER_CHAT})",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the per-round chat order")
    parser.add_argument("--model", type=Path, help="any GGUF instead of benchmark model E")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs, caches)")
    args = parser.parse_args()

    binary = find_llama_server(None, os.environ)[0]
    cache = Path(cache_root(os.environ)) / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    model = args.model or cache / "model-e.gguf"
    if not model.exists():
        write_tiny_model(model, BENCH_MODEL_E)
    work = Path(tempfile.mkdtemp(prefix="slotkeeper-bench-conv-"))
    env = clean_env(binary)
    server_args = ["-m", str(model), "-c", "24576", "-t", "2"]
    if args.parallel:
        server_args += ["-np", str(args.parallel)]
    port = free_port()
    sk_args = [*server_args, "--port", str(port), "--slot-save-path", str(work / "cache")]
    rng = random.Random(args.seed)
    chats = {
        "plain": [Chat(i, notes=args.notes) for i in range(args.chats)],
        "slotkeeper": [Chat(i, notes=args.notes) for i in range(args.chats)],
    }
    results: dict[str, list[list[Result]]] = {"plain": [], "slotkeeper": []}
    restores: list[int] = []
    store_sizes: list[tuple[int, int]] = []  # (bytes on disk, bytes of state in its entries) after each round
    n_slots = 0
    started = time.monotonic()
    try:
        for r in range(args.rounds):
            order = list(range(args.chats))
            rng.shuffle(order)
            sides = ["plain", "slotkeeper"] if r % 2 == 0 else ["slotkeeper", "plain"]
            for side in sides:
                print(f"round {r + 1}/{args.rounds}, {side} ...", flush=True)
                if side == "plain":
                    server = PlainServer(binary, server_args, port, work / f"plain-{r}.log", env)
                    try:
                        server.wait_ready()
                        results[side].append(run_round(port, chats[side], order))
                    finally:
                        server.stop()
                else:
                    sk = Slotkeeper(sk_args, env, work, port, work / f"slotkeeper-{r}.log").start()
                    try:
                        sk.wait_ready(120)
                        results[side].append(run_round(port, chats[side], order))
                        status = http_call(port, "GET", "/slotkeeper/status").body
                        n_slots = status["total_slots"]
                        restores.append(status["on_demand_restores"])
                        sk.killpg(signal.SIGTERM)
                        assert sk.wait(60) == 0, sk.logs()[-3000:]
                        store_sizes.append(store_size(work / "cache"))
                    finally:
                        sk.stop()
    finally:
        if args.keep:
            print(f"(logs and caches kept in {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(
        f"model {model.name} ({model.stat().st_size / 1e6:.1f} MB); {args.chats} chats on {n_slots} slots, "
        f"{args.rounds} rounds, a swap between rounds, a title request after every turn; "
        f"llama-server {' '.join(server_args[2:])}; {time.monotonic() - started:.0f} s in all"
    )
    print()
    print(" round  chat  prompt   plain: first token   reused        slotkeeper: first token   reused        warm")
    for r in range(args.rounds):
        by_chat = {x.chat: x for x in results["slotkeeper"][r]}
        for p in results["plain"][r]:
            s = by_chat[p.chat]
            warm = "-" if r == 0 else ("yes" if s.warm else "NO")
            print(
                f" {r + 1:>5}  {p.chat + 1:>4}  {s.turn.prompt_tokens:>6,}   {fmt_s(p.turn.first_token_s):>18}   "
                f"{reuse(p.turn):<12}  {fmt_s(s.turn.first_token_s):>23}   {reuse(s.turn):<12}  {warm}"
            )
        if r:
            print(
                f"        slotkeeper restored {restores[r]} chat(s) on demand in this round "
                f"(after restoring {n_slots} at start)"
            )
    returning = {side: [x for rnd in results[side][1:] for x in rnd] for side in results}
    print()
    if returning["slotkeeper"]:
        n = len(returning["slotkeeper"])
        w_sk = sum(x.warm for x in returning["slotkeeper"])
        w_plain = sum(x.warm for x in returning["plain"])
        cold_s = statistics.median(x.turn.first_token_s for x in returning["plain"])
        warm_s = statistics.median(x.turn.first_token_s for x in returning["slotkeeper"])
        print(
            f"(a) warm after a swap: slotkeeper {w_sk} of {n} ({w_sk / n:.0%}; target: all), "
            f"plain llama-server {w_plain} of {n}"
        )
        worst = max(x.turn.first_token_s for x in returning["slotkeeper"])
        print(
            f"(b) returning chats' first token, median: plain {fmt_s(cold_s)} vs slotkeeper {fmt_s(warm_s)} "
            f"({cold_s / warm_s:.0f}x); slotkeeper worst {fmt_s(worst)}"
        )
    on_disk, state = store_sizes[-1]
    print(
        f"    the store after each round: {', '.join(f'{d / 1e6:.1f}' for d, _ in store_sizes)} MB on disk; at the "
        f"end {on_disk / 1e6:.1f} MB for {state / 1e6:.1f} MB of state in its entries ({state / on_disk:.1f}x)"
    )
    new = {side: results[side][0] for side in results}
    first = {side: statistics.median(x.turn.first_token_s for x in new[side]) for side in new}
    reused_new = {side: sum(x.turn.cache_n for x in new[side]) for side in new}
    print(
        f"(c) new chats (round 1) first token, median: plain {fmt_s(first['plain'])} vs slotkeeper "
        f"{fmt_s(first['slotkeeper'])}; tokens reused: plain {reused_new['plain']:,}, slotkeeper "
        f"{reused_new['slotkeeper']:,}"
    )


if __name__ == "__main__":
    main()
