"""What the real-server tests of model families share: the families, a chat as a front end keeps it, a swap,
and comparing an answer with a cold run's."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from slotkeeper.testing.harness import http_call

BASE = ["-c", "16384", "-t", "2", "--no-warmup"]
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and kindly." for i in range(14))
COLOURS = ("red", "blue", "green", "amber", "violet")
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
PAUSE_S = 0.6  # a user reading the reply: longer than placement.settle.SETTLE_AFTER_S
LOGPROB_TOLERANCE = 0.05  # batch splits differ between a warm and a cold run: f32 sums differ slightly
TEMPLATES = Path(__file__).resolve().parent.parent / "src" / "slotkeeper" / "testing" / "templates"


@dataclass(frozen=True)
class Family:
    model: str  # a key of the family_models fixture
    args: tuple[str, ...] = ()
    request: dict[str, Any] = field(default_factory=dict)  # extra fields of every chat request
    reasoning: bool = False  # its replies carry reasoning_content


FAMILIES = {
    "llama": Family("llama"),
    "qwen35-thinking-off": Family("qwen35", request=NO_THINKING),
    "qwen35-thinking-on": Family("qwen35", reasoning=True),
    "lfm2": Family("lfm2", request=NO_THINKING),
    "gemma3-swa-full": Family("gemma3", ("--swa-full",)),
    "gemma3-270m-swa-full": Family(
        "gemma3-270m", ("--swa-full", "--chat-template-file", str(TEMPLATES / "gemma3.jinja"))
    ),
}


def model_path(name: str, family_models: dict[str, Path], request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue("real_gemma") if name == "gemma3-270m" else family_models[name]


@dataclass
class Chat:
    """One conversation as a front end keeps it: its messages (replies as it re-sends them: content only)."""

    n: int
    request: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    last_prompt_tokens: int = 0
    previous_prompt_tokens: int = 0
    reasoning: list[str] = field(default_factory=list)
    system: str = SYSTEM
    facts: int = 40  # the length of its first message
    timeout: float = 60.0  # for each reply: longer for a turn that waits behind another model's long answer

    def __post_init__(self) -> None:
        self.messages = [
            {"role": "system", "content": self.system},
            {
                "role": "user",
                "content": f"Conversation {self.n}. "
                + " ".join(f"Fact {i}: item {self.n * 7 + i} is {COLOURS[i % 5]}." for i in range(self.facts)),
            },
        ]

    def send(self, port: int, messages: list[dict[str, Any]], **extra: Any) -> dict:
        body = {"messages": messages, "max_tokens": 8, "temperature": 0, **self.request, **extra}
        reply = http_call(port, "POST", "/v1/chat/completions", body, timeout=self.timeout)
        assert reply.status == 200, reply.body
        return reply.body

    def turn(self, port: int) -> dict:
        """The chat's next turn; returns llama-server's timings, and grows the chat."""
        body = self.send(port, self.messages)
        timings = body["timings"]
        self.previous_prompt_tokens, self.last_prompt_tokens = (
            self.last_prompt_tokens,
            timings["prompt_n"] + timings["cache_n"],
        )
        message = body["choices"][0]["message"]
        self.reasoning.append(message.get("reasoning_content") or "")
        self.messages.append({"role": "assistant", "content": message.get("content") or ""})
        self.messages.append({"role": "user", "content": f"Go on about part {len(self.messages) // 2}, please."})
        return timings

    def title(self, port: int) -> None:
        excerpt = self.messages[1]["content"][:60]
        self.send(port, [{"role": "user", "content": f"Write a 3-word title for: {excerpt}"}], max_tokens=6)

    def reused_enough(self, timings: dict) -> bool:
        """The turn reused at least 90% of the chat's previous prompt."""
        return timings["cache_n"] >= 0.9 * self.previous_prompt_tokens


def converse(chats: list[Chat], port: int) -> list[dict]:
    results = []
    for chat in chats:
        results.append(chat.turn(port))
        chat.title(port)
    return results


def swap_out(sk) -> None:
    sk.killpg(signal.SIGTERM)
    assert sk.wait(60) == 0, sk.logs()


def cold_ones(chats: list[Chat], results: list[dict]) -> list[tuple[int, int, int]]:
    return [(c.n, t["cache_n"], c.previous_prompt_tokens) for c, t in zip(chats, results) if not c.reused_enough(t)]


def tokens_of(port: int, chat: Chat, messages: list[dict[str, Any]]) -> list[int]:
    rendered = http_call(port, "POST", "/apply-template", {"messages": messages, **chat.request}).body["prompt"]
    return http_call(port, "POST", "/tokenize", {"content": rendered, "add_special": True, "parse_special": True}).body[
        "tokens"
    ]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def answer(port: int, chat: Chat, messages: list[dict[str, Any]]) -> tuple[str, list[list[tuple[str, float]]]]:
    """The greedy reply and, per token, its top five alternatives with their log-probabilities."""
    body = chat.send(port, messages, max_tokens=12, logprobs=True, top_logprobs=5)
    choice = body["choices"][0]
    tops = [[(alt["token"], alt["logprob"]) for alt in item["top_logprobs"]] for item in choice["logprobs"]["content"]]
    return choice["message"].get("content") or "", tops


def max_difference(a: tuple[str, list], b: tuple[str, list]) -> float:
    """The largest log-probability difference of a token both answers list at the same position."""
    worst = 0.0
    for x, y in zip(a[1], b[1]):
        other = dict(y)
        worst = max([worst, *(abs(p - other[t]) for t, p in x if t in other)])
    return worst


def same_answer(a: tuple[str, list], b: tuple[str, list], tolerance: float) -> bool:
    """The same greedy reply, and the same log-probabilities within `tolerance` (near-ties may swap places)."""
    return a[0] == b[0] and len(a[1]) == len(b[1]) and max_difference(a, b) <= tolerance


def same_answer_up_to_a_tie(a: tuple[str, list], b: tuple[str, list], tolerance: float) -> bool:
    """`same_answer`, but where the two greedy replies first part at a near-tie (the two tokens within
    `tolerance` of each other in both runs: a random-weight model has many, and batch splits move f32 sums by
    ~0.001), only what comes before that token is compared: after it each run goes on from its own choice."""
    for position, (x, y) in enumerate(zip(a[1], b[1])):
        if x[0][0] == y[0][0]:
            continue
        mine, theirs = dict(x), dict(y)
        tied = (
            all(
                token in mine and token in theirs and abs(mine[x[0][0]] - mine[y[0][0]]) <= tolerance
                for token in (x[0][0], y[0][0])
            )
            and abs(theirs[x[0][0]] - theirs[y[0][0]]) <= tolerance
        )
        return tied and max_difference((a[0], a[1][:position]), (b[0], b[1][:position])) <= tolerance
    return same_answer(a, b, tolerance)
