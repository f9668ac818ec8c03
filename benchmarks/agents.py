"""Agent sessions after a swap, over each API agents speak: slotkeeper vs plain llama-server, in one run.

Per family (full attention, and the Qwen3.5-style hybrid with thinking off; bench-sized random-weight models,
so that a cold prompt shows) and per API (chat completions, Responses, Anthropic Messages): an agent session
(a ~3,700-token system prompt and six tools) takes three turns through slotkeeper, slotkeeper is swapped
out (SIGTERM to its process group) and started again, and the session's next turn goes through it (warm);
the same request then goes to plain llama-server, started fresh (cold). Prints, per case, the prompt tokens
reused (the API's own count) of the previous prompt, and the turn's time (8 generated tokens) both ways.

Then, per family, a new Claude Code session (its per-session attribution line, the identity block, the same
system prompt and tools): another session saved the opening, slotkeeper is swapped, and the new session's first
request (streamed) goes through it; on plain llama-server the other session's cache is live (plain's best
case) and the new one's first request follows. Prints the tokens prefilled for it each way (slotkeeper's: by the
request and to reach its opening, none when the saved one serves it) and the time to its first token.

    uv run python benchmarks/agents.py [--families llama,qwen35] [--apis chat,responses,messages] [--stream]
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import statistics
import tempfile
from pathlib import Path

from families import bench_spec

from slotkeeper.cmdline import find_llama_server
from slotkeeper.demo import fmt_s
from slotkeeper.testing.agents import APIS, AgentSession, claude_code_session
from slotkeeper.testing.harness import PlainServer, Slotkeeper, clean_env, free_port
from slotkeeper.testing.tinymodel import BENCH_MODEL_E, write_tiny_model

REQUESTS = {"llama": {}, "qwen35": {"chat_template_kwargs": {"enable_thinking": False}}}
BASE = ["-c", "16384", "-t", "2", "--no-warmup"]


def run_case(binary: str, model: Path, family: str, api: str, stream: bool, work: Path) -> tuple:
    env = clean_env(binary)
    save = work / "cache"
    server_args = ["-m", str(model), *BASE]

    def slotkeeper(n: int) -> Slotkeeper:
        port = free_port()
        sk = Slotkeeper(
            ["--", *server_args, "--port", str(port), "--slot-save-path", str(save)],
            env,
            work,
            port,
            work / f"slotkeeper-{n}.log",
        ).start()
        sk.wait_ready(300)
        return sk

    session = AgentSession(1, api, stream, dict(REQUESTS[family]))
    sk = slotkeeper(1)
    try:
        for _ in range(3):
            session.turn(sk.port)
        os.killpg(sk.pid, signal.SIGTERM)
        assert sk.proc is not None and sk.proc.wait(120) == 0, sk.logs()[-2000:]
    finally:
        sk.stop()
    cold_session = copy.deepcopy(session)
    sk = slotkeeper(2)
    try:
        warm = session.turn(sk.port)
        os.killpg(sk.pid, signal.SIGTERM)
        sk.wait(120)
    finally:
        sk.stop()
    plain = PlainServer(binary, server_args, free_port(), work / "plain.log", env)
    try:
        plain.wait_ready(300)
        cold = cold_session.turn(plain.port)
    finally:
        plain.stop()
    return session.turns[-2].prompt, warm, cold


def run_new_session(binary: str, model: Path, family: str, work: Path) -> tuple:
    """A new Claude Code session's first request (streamed): through slotkeeper, after another session saved
    the opening and a swap; and on plain llama-server, with that other session's cache live (its best case).
    Returns the opening's tokens and both turns, with what slotkeeper prefilled for its opening beside them."""
    env = clean_env(binary)
    server_args = ["-m", str(model), *BASE]
    request = dict(REQUESTS[family])
    firsts = ("What does calc.py do?", "Hello there")

    def slotkeeper(n: int) -> Slotkeeper:
        port = free_port()
        sk = Slotkeeper(
            ["--", *server_args, "--port", str(port), "--slot-save-path", str(work / "cache")],
            env,
            work,
            port,
            work / f"slotkeeper-new-{n}.log",
        ).start()
        sk.wait_ready(300)
        return sk

    sk = slotkeeper(1)
    try:
        claude_code_session(1, firsts[0], request).turn(sk.port)
        os.killpg(sk.pid, signal.SIGTERM)
        assert sk.proc is not None and sk.proc.wait(120) == 0, sk.logs()[-2000:]
    finally:
        sk.stop()
    sk = slotkeeper(2)
    try:
        warm = claude_code_session(2, firsts[1], request, stream=True).turn(sk.port)
        prefilled_for_opening = sk.call("GET", "/slotkeeper/status").body["openings"]["prefill_tokens"]
        os.killpg(sk.pid, signal.SIGTERM)
        sk.wait(120)
    finally:
        sk.stop()
    plain = PlainServer(binary, server_args, free_port(), work / "plain-new.log", env)
    try:
        plain.wait_ready(300)
        claude_code_session(1, firsts[0], request).turn(plain.port)
        cold = claude_code_session(2, firsts[1], request, stream=True).turn(plain.port)
    finally:
        plain.stop()
    return warm, prefilled_for_opening, cold


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="llama,qwen35")
    parser.add_argument("--apis", default=",".join(APIS))
    parser.add_argument("--stream", action="store_true", help="stream every reply")
    args = parser.parse_args()
    binary = find_llama_server(None, os.environ)[0]
    with tempfile.TemporaryDirectory(prefix="slotkeeper-bench-agents-") as tmp:
        root = Path(tmp)
        print(f"{'family':8} {'api':10} {'reused after the swap (slotkeeper / plain)':>44}  turn time warm vs cold")
        speedups = []
        for family in args.families.split(","):
            spec = BENCH_MODEL_E if family == "llama" else bench_spec(family)
            model = write_tiny_model(root / f"{family}.gguf", spec)
            for api in args.apis.split(","):
                work = root / f"{family}-{api}"
                work.mkdir()
                previous, warm, cold = run_case(binary, model, family, api, args.stream, work)
                reused = f"{warm.reused:,} / {cold.reused:,} of {previous:,}"
                print(f"{family:8} {api:10} {reused:>44}  {fmt_s(warm.seconds)} vs {fmt_s(cold.seconds)}", flush=True)
                speedups.append(cold.seconds / warm.seconds)
            if "messages" in args.apis.split(","):
                work = root / f"{family}-new-session"
                work.mkdir()
                warm, extra, cold = run_new_session(binary, model, family, work)
                prefilled = (
                    f"prefilled {warm.prompt - warm.reused + extra:,} of {warm.prompt:,} / "
                    f"{cold.prompt - cold.reused:,} of {cold.prompt:,}"
                )
                print(
                    f"{family:8} {'new sess.':10} {prefilled:>44}  first token {fmt_s(warm.first_token_s)} vs "
                    f"{fmt_s(cold.first_token_s)}",
                    flush=True,
                )
        print(f"median: the returning turn {statistics.median(speedups):.1f}x faster through slotkeeper")


if __name__ == "__main__":
    main()
