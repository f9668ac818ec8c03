"""Image chats after a swap: a returning chat's first token, cold (plain llama-server) vs warm (slotkeeper).

Both sides run the same arguments with the tiny random projector (`--mmproj`, 64 positions a picture) on one
slot: the bench-sized llama, model E (full attention) and the real Gemma 3 270M with --swa-full (extend-only: saved at
turn boundaries). --chats chats, each with its own picture and a long text, take a turn on both; both are
stopped and started again (a llama-swap swap: slotkeeper saves first); then each chat's next turn goes to
both, the order of the sides alternating per chat. Prints per family the median first token, the prompt tokens
reused, a turn of a chat that stays in its slot (slotkeeper's own cost per turn), and what the vision encoder
costs a cold turn: llama-server b11434 logs no encoder time by default, so
the cold server is asked afterwards for a prompt of one picture alone and for one of as many text tokens
(`/completion`, `n_predict: 0`, slot erased before each), and the difference is the encoder's (medians of 3).

    uv run python benchmarks/images.py [--chats 4] [--families llama,gemma3-270m]
"""

from __future__ import annotations

import argparse
import base64
import shutil
import statistics
from pathlib import Path
from typing import Any

from benchsetup import llama_server, model_e, slotkeeper_args, stop_slotkeeper, work_dir

from slotkeeper.demo import Chat, Turn, fmt_s
from slotkeeper.testing.harness import PlainServer, Slotkeeper, clean_env, free_port, http_call
from slotkeeper.testing.tinymodel import image_part, solid_png, write_tiny_mmproj

BASE = ["-c", "16384", "-np", "1", "-t", "2", "--no-warmup"]
TEMPLATES = Path(__file__).resolve().parent.parent / "src" / "slotkeeper" / "testing" / "templates"
COLOURS = [(230, 20, 20), (20, 20, 230), (20, 200, 20), (230, 200, 20), (150, 20, 200), (20, 200, 200)]
PROBES = 3
IN_SLOT_TURNS = 6


def family_args(family: str, work: Path) -> list[str]:
    """The model, its projector and its own arguments."""
    if family == "llama":
        model, width, extra = model_e(), 512, []
    else:
        from slotkeeper.testing.realmodel import gemma3_270m

        model, width = gemma3_270m(), 640
        extra = ["--swa-full", "--no-repack", "--chat-template-file", str(TEMPLATES / "gemma3.jinja")]
    mmproj = write_tiny_mmproj(work / f"mmproj-{width}.gguf", width)
    return ["-m", str(model), "--mmproj", str(mmproj), *BASE, *extra]


def picture_chat(i: int) -> Chat:
    chat = Chat(i)
    chat.messages[1]["content"] = [  # type: ignore[assignment]
        {"type": "text", "text": chat.messages[1]["content"]},
        image_part(solid_png(COLOURS[i % len(COLOURS)])),
    ]
    return chat


def encoder_ms(port: int) -> float:
    """The vision encoder's time for one picture: a prompt of the picture alone vs as many text tokens."""
    marker = http_call(port, "GET", "/props").body["media_marker"]
    picture = base64.b64encode(solid_png(COLOURS[0])).decode()
    text = http_call(port, "POST", "/tokenize", {"content": "word " * 400}).body["tokens"]

    def prompt_ms(prompt: Any) -> tuple[float, int]:
        http_call(port, "POST", "/slots/0?action=erase", {})
        reply = http_call(port, "POST", "/completion", {"prompt": prompt, "n_predict": 0, "cache_prompt": False})
        return reply.body["timings"]["prompt_ms"], reply.body["timings"]["prompt_n"]

    differences = []
    for _ in range(PROBES):
        with_picture, n = prompt_ms({"prompt_string": marker, "multimodal_data": [picture]})
        differences.append(with_picture - prompt_ms(text[:n])[0])
    return statistics.median(differences)


def round_of(family: str, chats_n: int, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    binary = llama_server()
    env = clean_env(binary)
    args = family_args(family, work)
    plain_port, sk_port = free_port(), free_port()
    chats = {side: [picture_chat(i) for i in range(chats_n)] for side in ("plain", "slotkeeper")}

    def start_sides() -> tuple[PlainServer, Slotkeeper]:
        plain = PlainServer(binary, args, plain_port, work / "plain.log", env)
        sk = Slotkeeper(slotkeeper_args(args, sk_port, work / "cache"), env, work, sk_port, work / "slotkeeper.log")
        sk.start()
        plain.wait_ready(300)
        sk.wait_ready(300)
        return plain, sk

    plain, sk = start_sides()
    for i in range(chats_n):
        chats["plain"][i].turn(plain.port)
        chats["slotkeeper"][i].turn(sk.port)
    plain.stop()
    stop_slotkeeper(sk, 120)
    plain, sk = start_sides()
    try:
        turns: dict[str, list[Turn]] = {"plain": [], "slotkeeper": []}
        for i in range(chats_n):
            order = ["plain", "slotkeeper"] if i % 2 == 0 else ["slotkeeper", "plain"]
            for side in order:
                turns[side].append(chats[side][i].turn(plain.port if side == "plain" else sk.port)[0])
        in_slot: dict[str, list[Turn]] = {"plain": [], "slotkeeper": []}
        for i in range(IN_SLOT_TURNS):  # the last chat stays in its slot on both sides: slotkeeper's own cost
            order = ["plain", "slotkeeper"] if i % 2 == 0 else ["slotkeeper", "plain"]
            for side in order:
                in_slot[side].append(chats[side][-1].turn(plain.port if side == "plain" else sk.port)[0])
        return {"turns": turns, "in_slot": in_slot, "encoder_ms": encoder_ms(plain.port)}
    finally:
        plain.stop()
        stop_slotkeeper(sk, 120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--families", default="llama,gemma3-270m")
    args = parser.parse_args()
    work = work_dir("images")
    try:
        print(f"a returning image chat's next turn after a swap ({args.chats} chats, one picture each, -np 1):")
        for family in args.families.split(","):
            result = round_of(family, args.chats, work / family)
            turns = result["turns"]
            cold = statistics.median(t.first_token_s for t in turns["plain"])
            warm = statistics.median(t.first_token_s for t in turns["slotkeeper"])
            reused = {side: sum(t.cache_n for t in ts) for side, ts in turns.items()}
            total = sum(t.prompt_tokens for t in turns["plain"])
            encode = result["encoder_ms"]
            print(
                f"  {family:12} first token cold {fmt_s(cold)}, warm {fmt_s(warm)} ({cold / max(warm, 1e-6):.1f}x); "
                f"tokens reused plain {reused['plain']:,} / slotkeeper {reused['slotkeeper']:,} of {total:,}; "
                f"vision encoder per cold picture ~{encode:.0f} ms"
            )
            in_slot = {side: statistics.median(t.first_token_s for t in ts) for side, ts in result["in_slot"].items()}
            print(
                f"  {'':12} a turn in its slot (median of {IN_SLOT_TURNS}): first token plain "
                f"{fmt_s(in_slot['plain'])}, slotkeeper {fmt_s(in_slot['slotkeeper'])} "
                f"({in_slot['slotkeeper'] / max(in_slot['plain'], 1e-6):.2f}x)"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
