"""Chats that survive a change between two starts, on benchmark model "E": plain llama-server vs slotkeeper.

For each change (a llama-server upgrade b11349 -> b11434, -np 1 -> 2, an f16 -> f32 K cache, a model file of
the same vocabulary and shape with other weights), --chats chats of about --notes notes each are saved through
slotkeeper under the old configuration; then, side by side in one run:

  cold first token     each chat's next turn on plain llama-server of the new configuration (median)
  recomputed           the same turn through slotkeeper once its idle recompute is done (median)
  recompute prefill    slotkeeper's prefill of all those chats, in idle time (its status)
  plain prefill        plain llama-server's prefill of the same chats' turns (sum of their prompt_ms)

    uv run python benchmarks/upgrade.py [--chats 3] [--notes 40] [--changes upgrade,np,ctk,requant]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchsetup import bench_model, llama_server, model_e, slotkeeper_args, stop_slotkeeper, work_dir

from slotkeeper.demo import Chat, fmt_s
from slotkeeper.testing.harness import PlainServer, Slotkeeper, clean_env, free_port, http_call, wait_until
from slotkeeper.testing.olderserver import B11349, older_llama_server
from slotkeeper.testing.tinymodel import BENCH_MODEL_E

SERVER_ARGS = ["-c", "32768", "-t", "2"]
RECOMPUTE_TIMEOUT_S = 900.0


def configurations(change: str, new_server: str) -> tuple[str, list[str], list[str]]:
    """(the old llama-server, its arguments, the new arguments) of a change; the new server is `new_server`."""
    model = ["-m", str(model_e())]
    if change == "upgrade":
        old = older_llama_server(B11349)
        if old is None:
            raise SystemExit(f"llama-server b{B11349} could not be installed")
        return str(old), [*model, *SERVER_ARGS, "-np", "1"], [*model, *SERVER_ARGS, "-np", "1"]
    if change == "np":
        return new_server, [*model, *SERVER_ARGS, "-np", "1"], [*model, *SERVER_ARGS, "-np", "2"]
    if change == "ctk":
        return new_server, [*model, *SERVER_ARGS, "-np", "1"], [*model, *SERVER_ARGS, "-np", "1", "-ctk", "f32"]
    if change == "requant":
        other = bench_model("model-e-other-weights.gguf", replace(BENCH_MODEL_E, seed=BENCH_MODEL_E.seed + 1))
        return new_server, [*model, *SERVER_ARGS, "-np", "1"], ["-m", str(other), *SERVER_ARGS, "-np", "1"]
    raise SystemExit(f"unknown change {change!r}")


def start(server: str, args: list[str], save_dir: Path, work: Path, name: str) -> Slotkeeper:
    port = free_port()
    env = clean_env(server)
    sk = Slotkeeper(slotkeeper_args(args, port, save_dir), env, work, port, work / f"{name}.log")
    sk.start()
    sk.wait_ready(300)
    return sk


def measure(change: str, chats_n: int, notes: int, new_server: str, work: Path) -> dict[str, Any]:
    old_server, old_args, new_args = configurations(change, new_server)
    save_dir = work / f"store-{change}"
    chats = [Chat(i, notes=notes) for i in range(chats_n)]
    sk = start(old_server, old_args, save_dir, work, f"{change}-before")
    for chat in chats:
        chat.turn(sk.port)
    stop_slotkeeper(sk, 120)

    port = free_port()
    plain = PlainServer(new_server, new_args, port, work / f"{change}-plain.log", clean_env(new_server))
    plain.wait_ready()
    try:
        cold = [chat.copy().turn(port)[0] for chat in chats]
    finally:
        plain.stop()

    sk = start(new_server, new_args, save_dir, work, f"{change}-after")
    try:
        waited = time.monotonic()
        assert wait_until(
            lambda: http_call(sk.port, "GET", "/slotkeeper/status").body["recompute"]["pending"] == 0,
            RECOMPUTE_TIMEOUT_S,
            interval=0.2,
        ), sk.logs()[-3000:]
        status = http_call(sk.port, "GET", "/slotkeeper/status").body["recompute"]
        waited = time.monotonic() - waited
        warm = [chat.copy().turn(sk.port)[0] for chat in chats]
    finally:
        stop_slotkeeper(sk, 120)
    return {
        "change": change,
        "tokens": sum(turn.prompt_tokens for turn in cold),
        "cold_first": statistics.median(t.first_token_s for t in cold),
        "warm_first": statistics.median(t.first_token_s for t in warm),
        "warm_reused": sum(t.cache_n for t in warm),
        "recomputed": status["recomputed"],
        "recompute_s": status["seconds"],
        "plain_prefill_s": sum(t.timings.get("prompt_ms", 0.0) for t in cold) / 1000,
        "waited_s": waited,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--notes", type=int, default=40)
    parser.add_argument("--changes", default="upgrade,np,ctk,requant")
    options = parser.parse_args()
    server = llama_server()
    work = work_dir("upgrade")
    print(
        f"{'change':<9} {'chats':>5} {'tokens':>7} {'cold first token':>17} {'recomputed':>11} "
        f"{'reused':>7} {'recompute prefill':>18} {'plain prefill':>14}",
        flush=True,
    )
    try:
        for change in options.changes.split(","):
            row = measure(change, options.chats, options.notes, server, work)
            print(
                f"{row['change']:<9} {row['recomputed']:>5} {row['tokens']:>7,} {fmt_s(row['cold_first']):>17} "
                f"{fmt_s(row['warm_first']):>11} {row['warm_reused']:>7,} {fmt_s(row['recompute_s']):>18} "
                f"{fmt_s(row['plain_prefill_s']):>14}",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
