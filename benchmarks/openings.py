"""Agent sessions sharing an opening of ~8k tokens of tool definitions, after a swap: slotkeeper vs plain
llama-server, side by side in one run.

An agent opens every session with the same system prompt and tool definitions. Per model (the tiny llama,
benchmark model E with the Qwen3 template, which renders tools, and the tiny hybrid qwen35 with thinking
off; the models of benchmarks/families.py): one session runs (through slotkeeper, its
opening is saved then), the server is swapped out (SIGTERM to its process group, as llama-swap does) and
started again, then --sessions new sessions run one after another, each one first turn. Which side runs first
alternates per model. Prints, per session, first-token time and tokens reused (`timings.cache_n`) on both
sides; then the medians, and the first session after the swap on its own (plain llama-server has nothing then).

    uv run python benchmarks/openings.py [--sessions 10] [--tools 16] [--models llama,qwen35]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import FAMILIES, model_file

from slotkeeper.cmdline import find_llama_server
from slotkeeper.demo import Turn, fmt_s, stream_chat
from slotkeeper.store.layout import cache_root
from slotkeeper.testing.harness import PlainServer, Slotkeeper, clean_env, free_port, http_call
from slotkeeper.testing.tinymodel import BENCH_MODEL_E, write_tiny_model

SYSTEM = (
    "You are a coding agent working in the user's repository. Use the tools to read, search and change "
    "files; run the tests after every change; answer briefly."
)
AREAS = ("files", "search", "git", "tests", "build", "docs", "issues", "shell")


def tools(n: int) -> list[dict[str, Any]]:
    """`n` tool definitions in the OpenAI form, like an agent's (names, descriptions, JSON-schema parameters)."""
    out = []
    for i in range(n):
        area = AREAS[i % len(AREAS)]
        out.append(
            {
                "type": "function",
                "function": {
                    "name": f"{area}_action_{i}",
                    "description": f"Performs action {i} on the {area} of the workspace. Use it when the task needs "
                    f"the {area} changed or inspected; it returns a short report, or an error line.",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "path": {
                                "type": "string",
                                "description": f"The {area} path, relative to the repository root",
                            },
                            "query": {"type": "string", "description": "What to look for, or the new content"},
                            "limit": {"type": "integer", "description": "At most this many results (default 20)"},
                            "dry_run": {"type": "boolean", "description": "Report what would change, change nothing"},
                        },
                        "required": ["path"],
                    },
                },
            }
        )
    return out


def session(k: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": f"Session {k}: the test test_case_{k} fails after commit {k * 7919:x}. "
            "Find out why, and fix it.",
        },
    ]


def opening_tokens(port: int, request: dict[str, Any]) -> int:
    def tokens(text: str) -> list[int]:
        body = {**request, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]}
        prompt = http_call(port, "POST", "/apply-template", body).body["prompt"]
        return http_call(
            port, "POST", "/tokenize", {"content": prompt, "add_special": True, "parse_special": True}
        ).body["tokens"]

    a, b = tokens("A"), tokens("7")
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_side(
    side: str, model: Path, binary: str, work: Path, request: dict[str, Any], sessions: int, n_ctx: int
) -> tuple[list[Turn], int, dict[str, Any]]:
    """One session, a swap, then `sessions` new sessions; their turns, the opening's length, slotkeeper's
    status (empty for plain llama-server)."""
    env = clean_env(binary)
    server_args = ["-m", str(model), "-c", str(n_ctx), "-t", "2"]
    turns: list[Turn] = []
    n_opening = 0
    status: dict[str, Any] = {}
    for start in range(2):
        port = free_port()
        if side == "plain":
            server: Any = PlainServer(binary, server_args, port, work / f"{side}-{start}.log", env)
        else:
            server = Slotkeeper(
                [*server_args, "--port", str(port), "--slot-save-path", str(work / "cache")],
                env,
                work,
                port,
                work / f"{side}-{start}.log",
            ).start()
        try:
            server.wait_ready(180)
            if start == 0:
                n_opening = opening_tokens(port, request)
                stream_chat(port, session(0), 8, request=request)  # the opening is saved through slotkeeper
            else:
                turns = [stream_chat(port, session(k), 8, request=request) for k in range(1, sessions + 1)]
                if side != "plain":
                    status = http_call(port, "GET", "/slotkeeper/status").body
        finally:
            if side == "plain":
                server.stop()
            else:
                server.killpg(signal.SIGTERM)
                server.wait(120)
                server.stop()
    return turns, n_opening, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=10, help="new sessions after the swap (default 10)")
    parser.add_argument(
        "--tools",
        type=int,
        default=16,
        help="tool definitions in the opening (default 16: ~8k tokens on the tiny models' tokenizer)",
    )
    parser.add_argument("--models", default="llama,qwen35", help="families of benchmarks/families.py")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs, caches)")
    args = parser.parse_args()

    binary = find_llama_server(None, os.environ)[0]
    cache = Path(cache_root(os.environ)) / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="slotkeeper-bench-openings-"))
    definitions = tools(args.tools)
    results = {}
    try:
        for i, name in enumerate(args.models.split(",")):
            family = FAMILIES[name]
            request = {**family.request, "tools": definitions}
            model = model_file(family.model, cache)
            if family.model == "llama":  # model E embeds no template; llama-server's default renders no tools
                model = cache / "bench-llama-qwen3-template.gguf"
                if not model.exists():
                    write_tiny_model(model, dataclasses.replace(BENCH_MODEL_E, template="qwen3"))
            sides = ("plain", "slotkeeper") if i % 2 == 0 else ("slotkeeper", "plain")
            per_side = {}
            for side in sides:
                print(f"{name}, {side} ...", flush=True)
                folder = work / name / side
                folder.mkdir(parents=True)
                per_side[side] = run_side(side, model, binary, folder, request, args.sessions, 4 * 12288)
            results[name] = per_side
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(
        f"{args.sessions} new agent sessions after a swap, each opening with a system prompt and {args.tools} tool "
        "definitions; first turn of each; llama-server's default 4 slots"
    )
    for name, per_side in results.items():
        plain, n_opening, _ = per_side["plain"]
        warm, _, status = per_side["slotkeeper"]
        print(f"\n{name}: opening {n_opening:,} tokens")
        print(" session   plain: first token   reused     slotkeeper: first token   reused")
        for k, (p, s) in enumerate(zip(plain, warm), start=1):
            print(
                f"  {k:>5}   {fmt_s(p.first_token_s):>19}   {p.cache_n:>6,}   {fmt_s(s.first_token_s):>23}   "
                f"{s.cache_n:>6,}"
            )
        median_plain = statistics.median(t.first_token_s for t in plain)
        median_sk = statistics.median(t.first_token_s for t in warm)
        print(
            f"  median first token: plain {fmt_s(median_plain)} vs slotkeeper {fmt_s(median_sk)} "
            f"(ratio {median_sk / median_plain:.2f}); first session after the swap: plain "
            f"{fmt_s(plain[0].first_token_s)} vs slotkeeper {fmt_s(warm[0].first_token_s)}"
        )
        print(
            f"  tokens reused: plain {sum(t.cache_n for t in plain):,} vs slotkeeper "
            f"{sum(t.cache_n for t in warm):,}; openings: {status.get('openings')}"
        )


if __name__ == "__main__":
    main()
