"""Every model family after a swap: slotkeeper vs plain llama-server (restarted), side by side in one run.

Families: full attention (llama), hybrid (qwen35 with thinking off and on, lfm2: attention plus a recurrent
state), sliding window (gemma3 with --swa-full), and the real Gemma 3 270M with --swa-full. The bench-sized
random-weight models (8 layers x 512, f16) prefill at a few hundred tokens a second on 2 cores, so a cold
prompt shows.

Per family, the traffic of a chat front end: --chats chats sharing a system prompt on llama-server's default
four slots, a title request after every turn; a first round (new chats), a second (chats restored on
demand), a swap (SIGTERM to the process group), and a third round through slotkeeper (warm) and on plain
llama-server started again with the chats as they stood (cold). Prints:
  - the warm fraction after the swap (turns that reused at least the previous turn's whole prompt);
  - first token after the swap, cold vs warm (medians);
  - tokens llama-server prefilled, and ms spent, to bring slots to turn boundaries, per save, and per turn
    on hybrids (where idle slots go to their boundary once a turn is over, off its critical path);
  - bytes per entry.
Then, on the hybrid: a resident chat's turn latency through slotkeeper / plain llama-server, back to back and
with a pause between turns (when slotkeeper brings the slot to its boundary off the critical path), and the
bytes written per turn.

    uv run python benchmarks/families.py [--chats 6] [--notes 20] [--families llama,qwen35,...] [--turns 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slotkeeper.cmdline import find_llama_server
from slotkeeper.demo import Chat, Turn, fmt_s
from slotkeeper.store.layout import cache_root
from slotkeeper.testing.harness import PlainServer, Slotkeeper, clean_env, free_port, http_call
from slotkeeper.testing.tinymodel import BENCH_MODEL_E, PRESETS, TinyModelSpec, write_tiny_model

REACHED = re.compile(r"\(([\d,]+) prefilled to reach it in ([\d.,]+) (ms|s)\)")
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TEMPLATES = Path(__file__).resolve().parent.parent / "src" / "slotkeeper" / "testing" / "templates"


def bench_spec(arch: str) -> TinyModelSpec:
    extra: dict[str, Any] = {"sliding_window": 512} if arch == "gemma3" else {}
    return dataclasses.replace(
        PRESETS[arch],
        n_layers=8,
        width=512,
        n_heads=8,
        n_kv_heads=2,
        f16=True,
        name=f"slotkeeper-bench-{arch}",
        **extra,
    )


@dataclass(frozen=True)
class Family:
    model: str
    args: tuple[str, ...] = ()
    request: dict[str, Any] = field(default_factory=dict)


FAMILIES = {
    "llama": Family("llama"),
    "qwen35": Family("qwen35", request=NO_THINKING),
    "qwen35-thinking": Family("qwen35"),
    "lfm2": Family("lfm2", request=NO_THINKING),
    "gemma3-swa-full": Family("gemma3", ("--swa-full",)),
    "gemma3-270m-swa-full": Family(
        "gemma3-270m", ("--swa-full", "--chat-template-file", str(TEMPLATES / "gemma3.jinja"))
    ),
}


def model_file(name: str, cache: Path) -> Path:
    if name == "gemma3-270m":
        from slotkeeper.testing.realmodel import gemma3_270m

        return gemma3_270m()
    path = cache / f"bench-{name}.gguf"
    if not path.exists():
        write_tiny_model(path, BENCH_MODEL_E if name == "llama" else bench_spec(name))
    return path


@dataclass
class FamilyResult:
    warm: int
    chats: int
    cold_first: float
    warm_first: float
    saves: int
    boundary_tokens: int
    boundary_ms: float
    entries: int
    entry_bytes: int
    policy: str
    settles: int = 0
    settle_tokens: int = 0
    settle_ms: float = 0.0


def converse(chats: list[Chat], port: int) -> list[tuple[Turn, bool]]:
    out = []
    for chat in chats:
        out.append(chat.turn(port))
        chat.title(port)
    return out


def saves_from_metrics(port: int) -> int:
    text = http_call(port, "GET", "/slotkeeper/metrics").body
    text = text if isinstance(text, str) else str(text)
    for line in text.splitlines():
        if line.startswith('slotkeeper_saves_total{outcome="saved"}'):
            return int(float(line.split()[-1]))
    return 0


def run_family(family: Family, model: Path, binary: str, work: Path, chats_n: int, notes: int) -> FamilyResult:
    env = clean_env(binary)
    work.mkdir(parents=True)
    port = free_port()
    server_args = ["-m", str(model), "-c", "32768", "-t", "2", *family.args]
    sk_args = [*server_args, "--port", str(port), "--slot-save-path", str(work / "cache")]
    chats = [Chat(i, notes=notes, request=family.request) for i in range(chats_n)]
    sk = Slotkeeper(sk_args, env, work, port, work / "slotkeeper-1.log").start()
    try:
        sk.wait_ready(180)
        converse(chats, port)
        converse(chats, port)
        status = http_call(port, "GET", "/slotkeeper/status").body
        saves_before_stop = saves_from_metrics(port)
        sk.killpg(signal.SIGTERM)
        assert sk.wait(120) == 0, sk.logs()[-3000:]
    finally:
        sk.stop()
    extend = status["extend_only"]
    stop_saves = [line for line in sk.logs().splitlines() if " saved from slot " in line and "(at stop)" in line]
    stops = [m for m in map(REACHED.search, stop_saves) if m is not None]
    stop_tokens = sum(int(m[1].replace(",", "")) for m in stops)
    stop_ms = sum(float(m[2].replace(",", "")) * (1000 if m[3] == "s" else 1) for m in stops)
    entries = [p.stat().st_size for p in (work / "cache" / "entries").glob("*.bin")]  # as the stop left them
    cold_chats = [chat.copy() for chat in chats]
    sk = Slotkeeper(sk_args, env, work, port, work / "slotkeeper-2.log").start()
    try:
        sk.wait_ready(180)
        warm_turns = converse(chats, port)
        sk.killpg(signal.SIGTERM)
        sk.wait(120)
    finally:
        sk.stop()
    plain = PlainServer(binary, server_args, port, work / "plain.log", env)
    try:
        plain.wait_ready(180)
        cold_turns = converse(cold_chats, port)
    finally:
        plain.stop()
    return FamilyResult(
        warm=sum(w for _, w in warm_turns),
        chats=chats_n,
        cold_first=statistics.median(t.first_token_s for t, _ in cold_turns),
        warm_first=statistics.median(t.first_token_s for t, _ in warm_turns),
        saves=saves_before_stop + len(stop_saves),
        settles=extend.get("boundaries_settled", 0),
        settle_tokens=extend.get("settle_prefill_tokens", 0),
        settle_ms=extend.get("settle_ms", 0.0),
        boundary_tokens=extend["boundary_prefill_tokens"] + stop_tokens,
        boundary_ms=extend["boundary_ms"] + stop_ms,
        entries=len(entries),
        entry_bytes=sum(entries),
        policy=status["model_memory"]["policy"],
    )


def turn_latency(
    model: Path, binary: str, work: Path, request: dict[str, Any], turns: int, pause: float, notes: int
) -> tuple[float, float, int]:
    """Median turn time of one resident chat through slotkeeper and on plain llama-server (both run twice,
    alternating), and the bytes slotkeeper wrote during the turns."""
    env = clean_env(binary)
    server_args = ["-m", str(model), "-c", "32768", "-t", "2"]
    times: dict[str, list[float]] = {"plain": [], "slotkeeper": []}
    written = 0
    for rep, sides in enumerate((("plain", "slotkeeper"), ("slotkeeper", "plain"))):
        for side in sides:
            port = free_port()
            save = work / f"turns-{rep}-{side}"
            if side == "plain":
                server: Any = PlainServer(binary, server_args, port, work / f"turns-{rep}.log", env)
                server.wait_ready(180)
            else:
                server = Slotkeeper(
                    ["--autosave-idle", "0", "--", *server_args, "--port", str(port), "--slot-save-path", str(save)],
                    env,
                    work,
                    port,
                    work / f"turns-sk-{rep}.log",
                ).start()
                server.wait_ready(180)
            try:
                chat = Chat(0, notes=notes, request=request)
                chat.turn(port)
                before = sum(p.stat().st_size for p in save.rglob("*") if p.is_file()) if side != "plain" else 0
                for _ in range(turns):
                    time.sleep(pause)
                    turn, _ = chat.turn(port)
                    times[side].append(turn.total_s)
                if side != "plain":
                    written += sum(p.stat().st_size for p in save.rglob("*") if p.is_file()) - before
            finally:
                server.stop()
    return statistics.median(times["plain"]), statistics.median(times["slotkeeper"]), written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=6)
    parser.add_argument("--notes", type=int, default=20, help="length of each chat's opening (notes of ~48 tokens)")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated: " + ", ".join(FAMILIES))
    parser.add_argument("--turns", type=int, default=8, help="resident turns per side for the turn latency")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    binary = find_llama_server(None, os.environ)[0]
    cache = Path(cache_root(os.environ)) / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="slotkeeper-bench-families-"))
    results: dict[str, FamilyResult] = {}
    started = time.monotonic()
    try:
        for name in args.families.split(","):
            family = FAMILIES[name]
            print(f"{name} ...", flush=True)
            results[name] = run_family(
                family, model_file(family.model, cache), binary, work / name, args.chats, args.notes
            )
        print("hybrid turn latency ...", flush=True)
        hybrid = model_file("qwen35", cache)
        latency = {
            pause: turn_latency(hybrid, binary, work, NO_THINKING, args.turns, pause, args.notes)
            for pause in (0.0, 1.0)
        }
    finally:
        if args.keep:
            print(f"(kept in {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        f"{args.chats} chats sharing a system prompt, 4 slots, a title request after every turn, a swap; "
        f"{time.monotonic() - started:.0f} s in all"
    )
    print()
    print(
        f"  {'family':<22} {'policy':<12} {'warm after swap':>16} {'first token cold':>17} {'warm':>8} "
        f"{'boundary per save':>22} {'settle per turn':>20} {'bytes per entry':>16}"
    )
    for name, r in results.items():
        per_save = f"{r.boundary_tokens / r.saves:,.0f} tok, {r.boundary_ms / r.saves:.0f} ms" if r.saves else "-"
        per_entry = f"{r.entry_bytes / r.entries / 1e6:.1f} MB" if r.entries else "-"
        per_settle = f"{r.settle_tokens / r.settles:,.0f} tok, {r.settle_ms / r.settles:.0f} ms" if r.settles else "-"
        print(
            f"  {name:<22} {r.policy:<12} {f'{r.warm} of {r.chats}':>16} {fmt_s(r.cold_first):>17} "
            f"{fmt_s(r.warm_first):>8} {per_save:>22} {per_settle:>20} {per_entry:>16}"
        )
    print()
    for pause, (plain, sk, written) in latency.items():
        what = "back to back" if not pause else f"{pause:.0f} s between turns"
        print(
            f"  hybrid resident turn, {what}: plain {plain * 1000:.0f} ms, slotkeeper {sk * 1000:.0f} ms "
            f"(ratio {sk / plain:.2f}); bytes written during the turns: {written}"
        )


if __name__ == "__main__":
    main()
