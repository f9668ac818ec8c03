"""`slotkeeper demo`: chats that outlive a model swap, on a real llama-server, with the numbers that matter.

Writes a small random-weight model (no download) and sends the traffic a chat front end sends: six chats
that share a system prompt, a short title request after every turn, more chats than llama-server has slots.
Then it swaps the model out the way llama-swap does (SIGTERM to slotkeeper's process group), starts it again
and sends each chat's next turn. The same turns then go to plain llama-server, restarted, which is what a
swap costs without slotkeeper. Per chat: first-token time cold vs warm, and the tokens llama-server reused
(`timings.cache_n`).

The pieces (Chat, stream_chat) are shared with benchmarks/conversations.py and benchmarks/turns.py; plain
llama-server is run by `testing.harness.PlainServer`.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cmdline import ConfigError, find_llama_server
from .log import fmt_bytes
from .store.layout import cache_root

DEMO_CHATS = 6
DEMO_TURNS_BEFORE_SWAP = 2
DEMO_SEED_TEXT = (  # benchmarks/swap.py builds its long prompt from it
    "Slot caches hold the attention keys and values of every token a conversation has seen. "
    "Swapping the model out throws them away, and the next message pays for the whole prompt again. "
)
SYSTEM_PROMPT = "You are a careful assistant for a team of editors. " + " ".join(
    f"Rule {i}: answer briefly, cite the page you used, and keep the tone kind." for i in range(1, 17)
)
TOPICS = [
    "lighthouses",
    "old maps",
    "rivers",
    "mountain passes",
    "desert towns",
    "night trains",
    "harbours",
    "glaciers",
    "orchards",
    "observatories",
    "canals",
    "salt marshes",
]
NOTES_PER_CHAT = 38  # about 1,800 tokens of notes: with the system prompt, a chat opens at ~2,600 tokens
TURN_TOKENS = 24
TITLE_TOKENS = 6


def say(message: str, end: str = "\n") -> None:
    print(message, end=end, flush=True)


def fmt_s(seconds: float) -> str:
    """`45 ms` under a second, `2.41 s` above."""
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def demo_cache_dir() -> Path:
    return Path(cache_root(os.environ)) / "demo"


# ---- the traffic --------------------------------------------------------------------------------------------


@dataclass
class Turn:
    """One streamed chat completion as the user feels it, and what llama-server says it reused."""

    first_token_s: float
    total_s: float
    content: str
    cache_n: int
    prompt_n: int
    server_ms: float = 0.0  # llama-server's own prompt_ms + predicted_ms
    timings: dict[str, Any] = field(default_factory=dict)  # all of them, for the benchmarks

    @property
    def prompt_tokens(self) -> int:
        return self.cache_n + self.prompt_n


def stream_chat(
    port: int,
    messages: list[dict[str, str]],
    max_tokens: int,
    timeout: float = 600.0,
    request: dict[str, Any] | None = None,
) -> Turn:
    """POST /v1/chat/completions with stream: time to the first content (or reasoning), and the final timings.
    `request`: more fields of the body (e.g. chat_template_kwargs)."""
    from .testing.harness import stream_events

    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, **(request or {})}
    stream = stream_events(port, "/v1/chat/completions", body, first=_chat_text, timeout=timeout)
    content: list[str] = []
    timings: dict[str, Any] = {}
    for event in stream.events:
        for choice in event.get("choices") or ():
            text = (choice.get("delta") or {}).get("content")
            if text:
                content.append(text)
        timings = event.get("timings", timings)
    return Turn(
        stream.first_s,
        stream.total_s,
        "".join(content),
        int(timings.get("cache_n", 0)),
        int(timings.get("prompt_n", 0)),
        timings.get("prompt_ms", 0.0) + timings.get("predicted_ms", 0.0),
        timings,
    )


def _chat_text(event: dict[str, Any]) -> bool:
    """A chat completion event that brings text (content, or reasoning: the first token either way)."""
    return any(
        (choice.get("delta") or {}).get("content") or (choice.get("delta") or {}).get("reasoning_content")
        for choice in event.get("choices") or ()
    )


@dataclass
class Chat:
    """One conversation as a front end keeps it: its messages, and how long its last turn's prompt was."""

    n: int
    messages: list[dict[str, str]] = field(default_factory=list)
    last_prompt_tokens: int = 0  # the previous turn's whole prompt: a warm turn reuses at least that much
    notes: int = NOTES_PER_CHAT  # the length of its opening message
    request: dict[str, Any] = field(default_factory=dict)  # more fields of each request (chat_template_kwargs)

    def __post_init__(self) -> None:
        if not self.messages:
            topic = TOPICS[self.n % len(TOPICS)]
            notes = " ".join(
                f"Note {i}: on {topic}, page {i + 3} says the {i}th entry was logged at dusk."
                for i in range(1, self.notes + 1)
            )
            self.messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {
                    "role": "user",
                    "content": f"Chat {self.n + 1}. Here are my notes on {topic}. {notes} What stands out?",
                },
            ]

    @property
    def label(self) -> str:
        return f"chat {self.n + 1}"

    def copy(self) -> Chat:
        return Chat(self.n, [dict(m) for m in self.messages], self.last_prompt_tokens, self.notes, self.request)

    def turn(self, port: int, max_tokens: int = TURN_TOKENS) -> tuple[Turn, bool]:
        """Send the next turn and grow the chat; returns it and whether it was warm."""
        turn = stream_chat(port, self.messages, max_tokens, request=self.request)
        warm = self.last_prompt_tokens > 0 and turn.cache_n >= self.last_prompt_tokens
        self.last_prompt_tokens = turn.prompt_tokens
        self.messages.append({"role": "assistant", "content": turn.content})
        self.messages.append(
            {"role": "user", "content": f"Thanks. Now go on about note {len(self.messages) // 2}, please."}
        )
        return turn, warm

    def title(self, port: int) -> None:
        """The front end's title request after a turn: a short prompt of its own, on the same model."""
        excerpt = self.messages[1]["content"][:80]
        stream_chat(
            port,
            [{"role": "user", "content": f"Write a 3-word title for this chat: {excerpt}"}],
            TITLE_TOKENS,
            request=self.request,
        )


# ---- the demo -----------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:  # noqa: C901 - the demo's run, step by step
    import argparse

    parser = argparse.ArgumentParser(
        prog="slotkeeper demo",
        description="Chats sharing a system prompt, title requests between turns, more chats than slots, a model "
        "swap: each chat's next turn on plain llama-server restarted (cold) vs through slotkeeper (warm).",
    )
    parser.add_argument("--chats", type=int, default=DEMO_CHATS, help=f"chats (default {DEMO_CHATS})")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs, caches) and say where")
    parser.add_argument(
        "--model",
        type=Path,
        help="your own GGUF instead of the small random-weight one; any "
        "other arguments go to llama-server as they are (e.g. --swa-full, -c 8192)",
    )
    parser.add_argument(
        "--no-thinking", action="store_true", help="send chat_template_kwargs enable_thinking: false (reasoning models)"
    )
    options, llama_args = parser.parse_known_args(argv)
    if options.model is not None and not options.model.is_file():
        print(f"slotkeeper demo: no such model file: {options.model}", file=sys.stderr)
        return 2
    try:
        binary = find_llama_server(None, os.environ)
    except ConfigError as exc:
        print(f"slotkeeper demo: {exc}", file=sys.stderr)
        return 2
    try:
        from .testing.harness import PlainServer, Slotkeeper, clean_env, free_port, http_call
        from .testing.tinymodel import BENCH_MODEL_E, write_tiny_model
    except ImportError as exc:
        print(
            f"slotkeeper demo: needs the llama extra ({exc.name} missing): uv run --extra llama slotkeeper demo",
            file=sys.stderr,
        )
        return 2

    n_chats = max(1, options.chats)
    say(
        f"slotkeeper demo: {n_chats} chats sharing a system prompt, a title request after every turn, a model swap;\n"
        "then each chat's next turn on plain llama-server restarted (cold) vs through slotkeeper (warm)\n"
    )
    cache = demo_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    if options.model is not None:
        model = options.model.resolve()
        say(f"[1/7] your model: {model.name}, {fmt_bytes(model.stat().st_size)}")
    else:
        model = cache / "model-e.gguf"
        say(f"[1/7] demo model ({BENCH_MODEL_E.n_layers} layers x {BENCH_MODEL_E.width}, random weights) ... ", end="")
        started = time.monotonic()
        if not model.exists():
            write_tiny_model(model, BENCH_MODEL_E)
        say(f"{fmt_bytes(model.stat().st_size)} in {time.monotonic() - started:.1f} s")

    work = Path(tempfile.mkdtemp(prefix="slotkeeper-demo-"))
    env = clean_env(binary[0])
    port = free_port()
    server_args = [
        "-m",
        str(model),
        "-c",
        "24576",
        "-t",
        str(min(os.cpu_count() or 2, 4)),  # default slots
        *llama_args,
    ]
    args = [*server_args, "--port", str(port), "--slot-save-path", str(work / "cache")]

    def start(n: int) -> tuple[Slotkeeper, float]:
        t0 = time.monotonic()
        sk = Slotkeeper(args, env, work, port, work / f"slotkeeper-{n}.log").start()
        sk.wait_ready(120)
        return sk, time.monotonic() - t0

    request = {"chat_template_kwargs": {"enable_thinking": False}} if options.no_thinking else {}
    chats = [Chat(i, request=request) for i in range(n_chats)]
    sk: Slotkeeper | None = None
    try:
        say("[2/7] starting slotkeeper around llama-server ... ", end="")
        sk, ready_s = start(1)
        status = http_call(port, "GET", "/slotkeeper/status").body
        n_slots, memory = status["total_slots"], status["model_memory"]
        say(
            f"ready in {ready_s:.2f} s; llama-server has {n_slots} slots; {memory['architecture']}: "
            f"{memory['kind']} memory, cache policy {memory['policy']}"
        )

        for t in range(DEMO_TURNS_BEFORE_SWAP):
            say(
                "[3/7] each chat's first turn (a new chat: a cold prefill):"
                if t == 0
                else f"[4/7] each chat's next turn ({n_chats} chats, {n_slots} slots: slotkeeper saves a slot's chat "
                "before it gives the slot to another, and restores it when it comes back):"
            )
            warm_count = 0
            for chat in chats:
                turn, warm = chat.turn(port)
                warm_count += warm
                chat.title(port)
                say(
                    f"      {chat.label}: {turn.prompt_tokens:,}-token prompt, first token after "
                    f"{fmt_s(turn.first_token_s)}" + (f", {turn.cache_n:,} reused" if t else "") + "; then a title"
                )
            if t:
                say(
                    f"      {warm_count} of {n_chats} came back warm "
                    f"({http_call(port, 'GET', '/slotkeeper/status').body['on_demand_restores']} restored on demand)"
                )

        say("[5/7] swapping the model out (SIGTERM to the process group, as llama-swap does) ... ", end="")
        t0 = time.monotonic()
        sk.killpg(signal.SIGTERM)
        code = sk.wait(60)
        stop_s = time.monotonic() - t0
        sk.stop()
        if code != 0:
            say(f"failed (exit {code}); log: {sk.log_path}")
            return 1
        entries = list((work / "cache" / "entries").glob("*.bin"))
        say(
            f"saved and exited in {stop_s:.2f} s; on disk: {len(entries)} entries, "
            f"{fmt_bytes(sum(p.stat().st_size for p in entries))}"
        )

        # Both sides get the very same next turns: the chats as they stand now.
        cold_chats = [chat.copy() for chat in chats]

        say("[6/7] swapping back in; each chat's next turn through slotkeeper (warm):")
        sk, ready2_s = start(2)
        say(f"      ready in {ready2_s:.2f} s (it restored the {n_slots} most recent chats before saying so)")
        warm_turns: list[tuple[Turn, bool]] = []
        for chat in chats:
            turn, warm = chat.turn(port)
            chat.title(port)
            warm_turns.append((turn, warm))
            say(
                f"      {chat.label}: first token after {fmt_s(turn.first_token_s)}, "
                f"{turn.cache_n:,} of {turn.prompt_tokens:,} tokens reused"
            )
        on_demand = http_call(port, "GET", "/slotkeeper/status").body["on_demand_restores"]
        sk.killpg(signal.SIGTERM)
        sk.wait(60)
        sk.stop()
        sk = None

        say("[7/7] the same turns on plain llama-server, restarted (cold: what a swap costs without slotkeeper):")
        plain = PlainServer(binary[0], server_args, port, work / "llama-server.log", env)
        try:
            plain.wait_ready()
            cold_turns: list[Turn] = []
            for chat in cold_chats:
                turn, _ = chat.turn(port)
                chat.title(port)
                cold_turns.append(turn)
                say(
                    f"      {chat.label}: first token after {fmt_s(turn.first_token_s)}, "
                    f"{turn.cache_n:,} of {turn.prompt_tokens:,} tokens reused"
                )
        finally:
            plain.stop()
    finally:
        if sk is not None:
            sk.stop()
        if options.keep:
            say(f"(logs and caches kept in {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)

    say("")
    say("  chat    prompt   cold: first token   reused       warm: first token   reused")
    for chat, cold, (hot, _) in zip(chats, cold_turns, warm_turns, strict=True):
        say(
            f"  {chat.n + 1:>4}  {hot.prompt_tokens:>8,}   {fmt_s(cold.first_token_s):>17}   {reuse(cold):<11}"
            f"  {fmt_s(hot.first_token_s):>17}   {reuse(hot)}"
        )
    n_warm = sum(warm for _, warm in warm_turns)
    cold_median = statistics.median(t.first_token_s for t in cold_turns)
    warm_median = statistics.median(t.first_token_s for t, _ in warm_turns)
    say("")
    say("  cold: plain llama-server started again after the swap, with the same arguments. It kept nothing: it")
    say("  recomputes each chat, reusing at most what it computed since it started (the shared system prompt).")
    say(
        f"  warm: slotkeeper restored the {n_slots} most recent chats before it reported ready; {on_demand} restores on"
    )
    say("  demand followed, as chats came back to a slot holding another (that one saved first if it had changed).")
    say("")
    say(
        f"{n_warm} of {n_chats} chats came back warm; first token {fmt_s(cold_median)} cold vs {fmt_s(warm_median)} "
        f"warm (median), {cold_median / max(warm_median, 1e-6):.0f}x faster"
    )
    return 0 if n_warm == n_chats else 1


def reuse(turn: Turn) -> str:
    share = turn.cache_n / turn.prompt_tokens if turn.prompt_tokens else 0.0
    return f"{turn.cache_n:,} ({share:.0%})"
