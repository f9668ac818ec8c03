"""When llama-server drops the chats itself, slotkeeper vs plain llama-server side by side in one run: its own
sleep (`--sleep-idle-seconds`) and its router mode (`--models-dir`, `--models-max 1`).

Sleep: both run with the same arguments (`--sleep-idle-seconds 3`, the bench-sized full-attention model and
the hybrid): --chats chats take a turn on each, both are left idle until each says it sleeps (`GET /props`:
`is_sleeping`, which wakes neither), then each chat's next turn goes to both, the order of the sides
alternating per chat. Prints per family the first token of a returning chat after the sleep, cold (plain) vs
warm (slotkeeper), the prompt tokens reused, and how often each child fell asleep and woke (its log).

Router: both run `--models-dir` with the two bench models and `--models-max 1`: --chats chats on the llama
model, one request for the hybrid (the llama model is unloaded), then each llama chat's next turn. Prints the
switch (the first request for the other model: its load, and through slotkeeper the save and unload before it,
and the restore after) and the returning chats' first token, both sides.

    uv run python benchmarks/hosts.py [--chats 4] [--families llama,qwen35] [--sleep 3] [--parts sleep,router]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

from benchsetup import bench_model, llama_server, model_e, slotkeeper_args, stop_slotkeeper, work_dir
from families import bench_spec

from slotkeeper.demo import Chat, Turn, fmt_s, stream_chat
from slotkeeper.testing.harness import PlainServer, Slotkeeper, clean_env, free_port, http_call, wait_until

REQUESTS = {"llama": {}, "qwen35": {"chat_template_kwargs": {"enable_thinking": False}}}
BASE = ["-c", "16384", "-np", "4", "-t", "2", "--no-warmup"]


def asleep(port: int) -> bool:
    return http_call(port, "GET", "/props").body.get("is_sleeping") is True


def sleep_round(family: str, model: Path, chats_n: int, sleep_s: int, work: Path) -> dict[str, list[Turn]]:
    binary = llama_server()
    env = clean_env(binary)
    args = ["-m", str(model), *BASE, "--sleep-idle-seconds", str(sleep_s)]
    plain = PlainServer(binary, args, free_port(), work / "plain.log", env)
    port = free_port()
    sk = Slotkeeper(slotkeeper_args(args, port, work / "cache"), env, work, port, work / "slotkeeper.log").start()
    try:
        plain.wait_ready(300)
        sk.wait_ready(300)
        sides = {"plain": plain.port, "slotkeeper": sk.port}
        chats = {side: [Chat(i, request=dict(REQUESTS[family])) for i in range(chats_n)] for side in sides}
        for i in range(chats_n):
            for side, side_port in sides.items():
                chats[side][i].turn(side_port)
        for side_port in sides.values():
            if not wait_until(partial(asleep, side_port), 10 * sleep_s, interval=0.2):
                raise RuntimeError(f"llama-server on port {side_port} did not fall asleep")
        time.sleep(1.0)
        turns: dict[str, list[Turn]] = {side: [] for side in sides}
        for i in range(chats_n):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for side in order:
                turns[side].append(chats[side][i].turn(sides[side])[0])
        for side, log in (("plain", plain.log_path), ("slotkeeper", sk.log_path)):
            text = Path(log).read_text(errors="replace")
            print(
                f"    {family:8} {side:10} fell asleep {text.count('server is entering sleeping state')}x, "
                f"woke {text.count('server is exiting sleeping state')}x"
            )
        return turns
    finally:
        plain.stop()
        stop_slotkeeper(sk, 60)


def router_round(chats_n: int, work: Path) -> dict[str, dict[str, Any]]:
    binary = llama_server()
    env = clean_env(binary)
    models = work / "models"
    models.mkdir()
    (models / "a.gguf").symlink_to(model_e())
    (models / "b.gguf").symlink_to(bench_model("model-qwen35.gguf", bench_spec("qwen35")))
    args = ["--models-dir", str(models), "--models-max", "1", *BASE]
    plain = PlainServer(binary, args, free_port(), work / "plain.log", env)
    port = free_port()
    sk = Slotkeeper(slotkeeper_args(args, port, work / "cache"), env, work, port, work / "slotkeeper.log").start()
    out: dict[str, dict[str, Any]] = {}
    try:
        plain.wait_ready(300)
        sk.wait_ready(300)
        for side, side_port in (("plain", plain.port), ("slotkeeper", sk.port)):
            chats = [Chat(i, request={"model": "a"}) for i in range(chats_n)]
            for chat in chats:
                chat.turn(side_port)
            other = {"model": "b", **REQUESTS["qwen35"]}
            started = time.monotonic()
            stream_chat(side_port, [{"role": "user", "content": "Say hello."}], 1, request=other)
            switch = time.monotonic() - started
            turns = [chat.turn(side_port)[0] for chat in chats]
            out[side] = {"switch": switch, "turns": turns}
        return out
    finally:
        plain.stop()
        stop_slotkeeper(sk, 60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--families", default="llama,qwen35")
    parser.add_argument("--sleep", type=int, default=3, help="--sleep-idle-seconds of both servers")
    parser.add_argument("--parts", default="sleep,router")
    args = parser.parse_args()
    parts = args.parts.split(",")
    work = work_dir("hosts")
    try:
        if "router" in parts:
            (work / "router").mkdir()
            got = router_round(args.chats, work / "router")
            print("a router (--models-dir, --models-max 1): chats on model a, a request for b, a's chats again:")
            for side in ("plain", "slotkeeper"):
                turns = got[side]["turns"]
                first = statistics.median(t.first_token_s for t in turns)
                reused = statistics.median(t.cache_n for t in turns)
                prompt = statistics.median(t.prompt_tokens for t in turns)
                print(
                    f"    {side:10}  switch to b {fmt_s(got[side]['switch']):>8}   a's returning chats: first token "
                    f"{fmt_s(first):>8}, reused {reused:,.0f} of {prompt:,.0f}"
                )
        if "sleep" not in parts:
            return
        print(f"a returning chat's next turn after llama-server slept (--sleep-idle-seconds {args.sleep}):")
        rows = []
        for family in args.families.split(","):
            model = model_e() if family == "llama" else bench_model(f"model-{family}.gguf", bench_spec(family))
            (work / family).mkdir()
            turns = sleep_round(family, model, args.chats, args.sleep, work / family)
            rows.append((family, turns))
        print(
            f"\n    {'family':8} {'first token plain (cold)':>26} {'slotkeeper (warm)':>18}"
            f" {'reused plain / slotkeeper':>28}"
        )
        for family, turns in rows:
            cold = statistics.median(t.first_token_s for t in turns["plain"])
            warm = statistics.median(t.first_token_s for t in turns["slotkeeper"])
            reused = f"{statistics.median(t.cache_n for t in turns['plain']):,.0f} / "
            reused += f"{statistics.median(t.cache_n for t in turns['slotkeeper']):,.0f}"
            prompt = statistics.median(t.prompt_tokens for t in turns["slotkeeper"])
            print(
                f"    {family:8} {fmt_s(cold):>26} {fmt_s(warm):>18} {reused:>20} of {prompt:,.0f}"
                f"  ({cold / warm:.1f}x)"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
