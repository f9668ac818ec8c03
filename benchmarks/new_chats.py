"""New chats only, plain llama-server vs slotkeeper, in alternating runs: what placement costs or saves a new chat.

`conversations.py`'s first round measured once per side, minutes apart, on a machine whose speed drifts. Here
each run starts a fresh server (plain llama-server, or slotkeeper around it), sends --chats new chats sharing a
system prompt, a front end's title request after each, and the sides alternate --pairs times. Per run: the
median first-token time of the chats after the first (the first has nothing to reuse on either side) and
llama-server's own prompt time for them; then the medians over the runs, and in how many pairs slotkeeper was
at least as fast.

    uv run python benchmarks/new_chats.py [--pairs 4] [--chats 6]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path
from typing import Any

from benchsetup import llama_server, model_e, slotkeeper_args, stop_slotkeeper, work_dir

from slotkeeper.demo import Chat, fmt_s
from slotkeeper.testing.harness import PlainServer, Slotkeeper, clean_env, free_port


def run(side: str, model: Path, binary: str, work: Path, chats: int) -> tuple[float, float, int]:
    """One fresh server, `chats` new chats with titles: median first token and prompt_ms of chats 2.., reused."""
    env = clean_env(binary)
    args = ["-m", str(model), "-c", "24576", "-t", "2"]
    port = free_port()
    server: Any
    if side == "plain":
        server = PlainServer(binary, args, port, work / "plain.log", env)
    else:
        server = Slotkeeper(
            slotkeeper_args(args, port, work / "cache"),
            env,
            work,
            port,
            work / "slotkeeper.log",
        ).start()
    try:
        server.wait_ready(180)
        turns = []
        for n in range(chats):
            chat = Chat(n)
            turns.append(chat.turn(port)[0])
            chat.title(port)
    finally:
        if side == "plain":
            server.stop()
        else:
            stop_slotkeeper(server, 120)
    later = turns[1:]
    return (
        statistics.median(t.first_token_s for t in later),
        statistics.median(t.timings.get("prompt_ms", 0.0) / 1000 for t in later),
        sum(t.cache_n for t in later),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=4, help="runs per side, alternating (default 4)")
    parser.add_argument("--chats", type=int, default=6, help="new chats per run (default 6, on 4 slots)")
    args = parser.parse_args()
    binary = llama_server()
    model = model_e()
    work = work_dir("new")
    results: dict[str, list[tuple[float, float, int]]] = {"plain": [], "slotkeeper": []}
    try:
        for pair in range(args.pairs):
            for side in ("plain", "slotkeeper") if pair % 2 == 0 else ("slotkeeper", "plain"):
                folder = work / f"{pair}-{side}"
                folder.mkdir()
                results[side].append(run(side, model, binary, folder, args.chats))
                first, prompt, reused = results[side][-1]
                print(
                    f"pair {pair + 1} {side:>10}: first token {fmt_s(first)}, llama-server's prompt time "
                    f"{fmt_s(prompt)}, tokens reused {reused:,}",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    plain, sk = results["plain"], results["slotkeeper"]
    faster = sum(s[0] <= p[0] for p, s in zip(plain, sk))
    print(
        f"\nnew chats ({args.chats - 1} per run after the first, titles between), medians over {args.pairs} runs "
        f"per side: first token plain {fmt_s(statistics.median(p[0] for p in plain))} vs slotkeeper "
        f"{fmt_s(statistics.median(s[0] for s in sk))}; llama-server's prompt time "
        f"{fmt_s(statistics.median(p[1] for p in plain))} vs {fmt_s(statistics.median(s[1] for s in sk))}; "
        f"slotkeeper at least as fast in {faster} of {args.pairs} pairs"
    )


if __name__ == "__main__":
    main()
