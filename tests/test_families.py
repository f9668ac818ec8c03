"""Every chat comes back warm on the models people run: full attention, hybrid (attention plus a recurrent
state, with thinking on and off), and sliding window with --swa-full; on the real llama-server.

Traffic as a chat front end sends it: chats sharing a system prompt, a title request after each turn, more
chats than slots, a swap. "Warm" is llama-server's own `timings.cache_n`. On hybrid and sliding-window
models llama-server reuses a restored state only when the request extends all of its tokens, so these pass
only when chats are saved at their turn boundaries and restored only where they are extended; and a
restore must never change what the model answers.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from slotkeeper.demo import PlainServer, clean_env
from slotkeeper.testing.harness import free_port, http_call
from slotkeeper.testing.tinymodel import PRESETS, TinyModelSpec, write_tiny_model

BASE = ["-c", "16384", "-t", "2", "--no-warmup"]
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and kindly." for i in range(14))
COLOURS = ("red", "blue", "green", "amber", "violet")
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
PAUSE_S = 0.6  # a user reading the reply: longer than placement.SETTLE_AFTER_S
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
    "gemma3-270m-swa-full": Family("gemma3-270m", ("--swa-full", "--chat-template-file",
                                                   str(TEMPLATES / "gemma3.jinja"))),
}


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family-models")
    models = {"llama": write_tiny_model(root / "llama.gguf", TinyModelSpec(seed=1))}
    for arch in ("qwen35", "lfm2", "gemma3"):
        models[arch] = write_tiny_model(root / f"{arch}.gguf", PRESETS[arch])
    return models


@pytest.fixture(scope="session")
def real_gemma() -> Path:
    """The real Gemma 3 270M (F16); CI requires it, as it requires llama-server."""
    from slotkeeper.testing.realmodel import RealModelUnavailable, gemma3_270m

    try:
        return gemma3_270m()
    except RealModelUnavailable as exc:
        if os.environ.get("SLOTKEEPER_REQUIRE_LLAMA_SERVER"):
            pytest.fail(f"the real Gemma 3 270M is required here: {exc}")
        pytest.skip(str(exc))


def model_path(name: str, family_models: dict[str, Path], request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue("real_gemma") if name == "gemma3-270m" else family_models[name]


@pytest.fixture
def family_start(starter, llama_server, family_models, request):
    """family_start(family, *extra, **kw): slotkeeper around the real llama-server with that family's model."""
    def start(family: Family, *extra: str, **kw):
        model = model_path(family.model, family_models, request)
        return starter(llama_server, ["-m", str(model), *BASE, *family.args])(*extra, **kw)
    return start


@dataclass
class Chat:
    """One conversation as a front end keeps it: its messages (replies as it re-sends them: content only)."""

    n: int
    request: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    last_prompt_tokens: int = 0
    previous_prompt_tokens: int = 0
    reasoning: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Conversation {self.n}. " + " ".join(
                             f"Fact {i}: item {self.n * 7 + i} is {COLOURS[i % 5]}." for i in range(40))}]

    def send(self, port: int, messages: list[dict[str, Any]], **extra: Any) -> dict:
        body = {"messages": messages, "max_tokens": 8, "temperature": 0, **self.request, **extra}
        reply = http_call(port, "POST", "/v1/chat/completions", body)
        assert reply.status == 200, reply.body
        return reply.body

    def turn(self, port: int) -> dict:
        """The chat's next turn; returns llama-server's timings, and grows the chat."""
        body = self.send(port, self.messages)
        timings = body["timings"]
        self.previous_prompt_tokens, self.last_prompt_tokens = self.last_prompt_tokens, \
            timings["prompt_n"] + timings["cache_n"]
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


@pytest.mark.parametrize("name", list(FAMILIES))
def test_six_chats_with_title_requests_come_back_warm_on_every_family(family_start, name):
    """Six chats sharing a system prompt on four slots, a title request after each turn: the second round
    (chats restored on demand) and the round after a swap reuse at least 90% of each chat's previous prompt."""
    family = FAMILIES[name]
    sk = family_start(family)
    chats = [Chat(i, family.request) for i in range(6)]
    converse(chats, sk.port)
    within = converse(chats, sk.port)
    assert not cold_ones(chats, within), (cold_ones(chats, within), sk.logs()[-5000:])
    swap_out(sk)
    sk2 = family_start(family)
    after = converse(chats, sk2.port)
    assert not cold_ones(chats, after), (cold_ones(chats, after), sk2.logs()[-5000:])
    if family.reasoning:
        assert all(all(chat.reasoning) for chat in chats), "the replies carried no reasoning"
    status = http_call(sk2.port, "GET", "/slotkeeper/status").body
    expected = "prefix" if name == "llama" else "extend-only"
    assert status["model_memory"]["policy"] == expected, status["model_memory"]


def tokens_of(port: int, chat: Chat, messages: list[dict[str, Any]]) -> list[int]:
    rendered = http_call(port, "POST", "/apply-template", {"messages": messages, **chat.request}).body["prompt"]
    return http_call(port, "POST", "/tokenize", {"content": rendered, "add_special": True,
                                                 "parse_special": True}).body["tokens"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("name", ["qwen35-thinking-off", "lfm2", "gemma3-swa-full", "llama"])
def test_a_regenerate_and_an_edit_after_a_swap_reuse_the_previous_boundary(family_start, name):
    """After a swap, a regenerate of the last reply and an edit of the last user message both reuse at least
    everything before the last user message (the common prefix of the two requests' tokens)."""
    family = FAMILIES[name]
    sk = family_start(family)
    chat = Chat(0, family.request)
    chat.turn(sk.port)
    chat.turn(sk.port)
    swap_out(sk)
    sk2 = family_start(family)
    regenerate = chat.messages[:-2]  # the last request again
    edit = [*chat.messages[:-3], {"role": "user", "content": "Instead, say something about rivers."}]
    boundary = common_prefix(tokens_of(sk2.port, chat, regenerate), tokens_of(sk2.port, chat, edit))
    assert boundary > 0.5 * chat.last_prompt_tokens
    for messages in (regenerate, edit):
        timings = chat.send(sk2.port, messages)["timings"]
        assert timings["cache_n"] >= boundary, (timings, boundary, sk2.logs()[-4000:])


def answer(port: int, chat: Chat, messages: list[dict[str, Any]]) -> tuple[str, list[list[tuple[str, float]]]]:
    """The greedy reply and, per token, its top five alternatives with their log-probabilities."""
    body = chat.send(port, messages, max_tokens=12, logprobs=True, top_logprobs=5)
    choice = body["choices"][0]
    tops = [[(alt["token"], alt["logprob"]) for alt in item["top_logprobs"]]
            for item in choice["logprobs"]["content"]]
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


def test_with_swa_full_a_request_diverging_inside_a_restored_window_answers_as_a_cold_run(
        family_start, llama_server, family_models, tmp_path):
    """Sliding window with --swa-full: after a swap, a request that changes an earlier reply (inside the last
    window of the chat's saved state) gets the same reply and top log-probabilities as a cold llama-server.
    The control shows the scenario is sensitive: restoring by common prefix, as on a full-attention model,
    changes the answer."""
    family = FAMILIES["gemma3-swa-full"]

    def after_a_swap(*own: str) -> tuple[str, list]:
        chat = Chat(0, family.request)
        sk = family_start(family, own=own, save_dir=tmp_path / ("cache" + "-".join(own)))
        for _ in range(4):  # the last window then holds the chat's distinct turns
            chat.turn(sk.port)
        swap_out(sk)
        sk2 = family_start(family, own=own, save_dir=tmp_path / ("cache" + "-".join(own)))
        # An edit of the second reply of four: some 100 tokens before the end, inside the last window
        diverging = [dict(m) for m in chat.messages]
        diverging[4]["content"] = "Also. " + diverging[4]["content"]
        try:
            return answer(sk2.port, chat, diverging)
        finally:
            swap_out(sk2)
            diverging_requests.append(diverging)

    diverging_requests: list[list[dict[str, Any]]] = []
    warm = after_a_swap()
    port = free_port()
    plain = PlainServer(llama_server, ["-m", str(family_models["gemma3"]), *BASE, *family.args], port,
                        tmp_path / "plain.log", clean_env(llama_server))
    try:
        plain.wait_ready()
        cold = answer(port, Chat(0, family.request), diverging_requests[0])
    finally:
        plain.stop()
    print("max logprob difference warm vs cold:", max_difference(warm, cold))
    assert same_answer(warm, cold, LOGPROB_TOLERANCE), (warm, cold)
    prefix_restored = after_a_swap("--model-memory", "full")
    print("control:", prefix_restored[0], cold[0], max_difference(prefix_restored, cold))
    assert not same_answer(prefix_restored, cold, LOGPROB_TOLERANCE), "the scenario does not show a wrong restore"


def test_sliding_window_without_swa_full_says_so_saves_nothing_and_keeps_chats_apart(family_start):
    """No --swa-full: one line at start says llama-server reuses no restored chat and what --swa-full would
    cost; no save or restore is spent, and three chats with title requests each keep their own slot."""
    family = Family("gemma3")
    sk = family_start(family)
    chats = [Chat(i, family.request) for i in range(3)]
    converse(chats, sk.port)
    results = converse(chats, sk.port)
    assert not cold_ones(chats, results), (cold_ones(chats, results), sk.logs()[-4000:])
    swap_out(sk)
    logs = sk.logs()
    line = [x for x in logs.splitlines() if "sliding window" in x]
    assert len(line) == 1 and "unless --swa-full (KV " in line[0], logs
    assert " saved " not in logs and "restored into" not in logs, logs
    assert not list((sk.extra["save_dir"] / "entries").iterdir())


def test_resident_turns_on_the_hybrid_write_nothing_and_reach_no_boundary(family_start):
    """A hybrid chat's turns in its own slot, the user pausing between them: no file written, no save-time
    boundary reached, no tokenize; and each turn reuses the whole previous one (the slot was brought to its
    boundary while the user paused: plain llama-server rolls back to its checkpoint at the last user message)."""
    family = FAMILIES["qwen35-thinking-off"]
    sk = family_start(family, "-np", "2", own=("--autosave-idle", "0"))
    chat = Chat(0, family.request)
    chat.turn(sk.port)
    entries = sk.extra["save_dir"] / "entries"
    before = sorted(p.name for p in entries.iterdir())
    asked = http_call(sk.port, "GET", "/slotkeeper/status").body
    for _ in range(4):
        time.sleep(PAUSE_S)
        timings = chat.turn(sk.port)
        assert chat.reused_enough(timings), timings
    status = http_call(sk.port, "GET", "/slotkeeper/status").body
    assert sorted(p.name for p in entries.iterdir()) == before
    assert status["placements"].get("resident", 0) >= 4, status
    assert status["prompt_tokenizations"] == asked["prompt_tokenizations"], status
    assert status["extend_only"]["boundaries_reached"] == 0, status
    assert status["extend_only"]["boundaries_settled"] >= 4, status


def test_more_chats_than_slots_on_the_hybrid_stay_warm_on_one_slot(family_start):
    """-np 1 on the hybrid: three chats in turn, each restored into the one slot at its boundary after the
    chat before it was saved there; every return is warm, without any restart."""
    family = FAMILIES["qwen35-thinking-off"]
    sk = family_start(family, "-np", "1")
    chats = [Chat(i, family.request) for i in range(3)]
    for chat in chats:
        chat.turn(sk.port)
    for _ in range(2):
        results = [chat.turn(sk.port) for chat in chats]
        assert not cold_ones(chats, results), (cold_ones(chats, results), sk.logs()[-4000:])
    saves = [line for line in sk.logs().splitlines() if " saved from slot " in line]
    assert saves and all("at its turn boundary" in line for line in saves), saves


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}


def test_a_chat_with_tool_calls_comes_back_warm_and_its_tool_result_is_a_boundary(family_start):
    """A hybrid chat with tools, a tool call and its result: after a swap its next turn is warm, and a request
    with another tool result reuses everything before the result (the boundary before a tool message)."""
    family = FAMILIES["qwen35-thinking-off"]
    sk = family_start(family)
    chat = Chat(0, {**family.request, "tools": TOOLS})
    chat.messages += [CALL, {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C, light wind."}]
    chat.turn(sk.port)
    swap_out(sk)
    sk2 = family_start(family)
    asked = chat.messages[:-2]  # the request that got the last reply
    other = [*asked[:-1], {"role": "tool", "tool_call_id": "call_1", "content": "Rain all day."}]
    boundary = common_prefix(tokens_of(sk2.port, chat, asked), tokens_of(sk2.port, chat, other))
    timings = chat.send(sk2.port, other)["timings"]
    assert timings["cache_n"] >= boundary, (timings, boundary, sk2.logs()[-4000:])
    chat.last_prompt_tokens = chat.previous_prompt_tokens = 0
    timings = chat.turn(sk2.port)
    swap_out(sk2)
    sk3 = family_start(family)
    timings = chat.turn(sk3.port)
    assert chat.reused_enough(timings), (timings, chat.previous_prompt_tokens, sk3.logs()[-4000:])
