"""The conversation cache on the real llama-server: every chat comes back warm, under front-end traffic.

Traffic as a chat front end sends it: chats that share a system prompt, each turn followed by a short title
request to the same model (Open WebUI's pattern), more chats than slots. "Warm" is llama-server's own
`timings.cache_n`: the next turn reuses at least the whole previous prompt.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from dataclasses import dataclass, field

import pytest

from slotkeeper.testing.harness import http_call, stream_lines

BASE = ["-c", "16384", "-t", "2", "--no-warmup"]
STREAMED_TOKENS = 3000  # at most, each of four parallel streams (they stop once seen together)
STREAM_PATIENCE_S = 60  # how long the four streams may take to be seen generating together
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and kindly." for i in range(14))


@pytest.fixture
def real(starter, llama_server, models):
    """start(*extra, ...) around the real llama-server with model A."""

    def start(*extra: str, **kw):
        return starter(llama_server, ["-m", str(models["A"]), *BASE])(*extra, **kw)

    return start


@dataclass
class Chat:
    """One conversation as a front end keeps it: its messages, and what its last turn's prompt was."""

    n: int
    messages: list[dict[str, str]] = field(default_factory=list)
    last_prompt_tokens: int = 0
    last_prompt_tokens_before: int = 0  # before the round that is under way (a turn reuses at least that)

    def __post_init__(self) -> None:
        topic = ["the sea", "mountains", "old maps", "rivers", "lighthouses", "deserts", "forests", "cities"][
            self.n % 8
        ]
        self.messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Conversation {self.n}. Tell me about {topic}. " * 6},
        ]

    def turn(self, port: int, max_tokens: int = 8) -> dict:
        """Send the chat's next turn; returns llama-server's timings, and grows the chat."""
        reply = http_call(
            port,
            "POST",
            "/v1/chat/completions",
            {"messages": self.messages, "max_tokens": max_tokens, "temperature": 0},
        )
        assert reply.status == 200, reply.body
        timings = reply.body["timings"]
        self.last_prompt_tokens = timings["prompt_n"] + timings["cache_n"]
        self.messages.append({"role": "assistant", "content": reply.body["choices"][0]["message"]["content"]})
        self.messages.append({"role": "user", "content": f"Go on about part {len(self.messages) // 2}, please."})
        return timings

    def title(self, port: int) -> None:
        """The front end's title request: a short prompt of its own, on the same model."""
        excerpt = self.messages[1]["content"][:60]
        reply = http_call(
            port,
            "POST",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": f"Write a 3-word title for: {excerpt}"}],
                "max_tokens": 6,
                "temperature": 0,
            },
        )
        assert reply.status == 200, reply.body


def swap_out(sk) -> None:
    sk.killpg(signal.SIGTERM)
    assert sk.wait(60) == 0, sk.logs()


def warm(chat: Chat, timings: dict) -> bool:
    return timings["cache_n"] >= chat.last_prompt_tokens_before


def converse_round(chats: list[Chat], port: int, titles: bool = True) -> list[dict]:
    out = []
    for chat in chats:
        chat.last_prompt_tokens_before = chat.last_prompt_tokens
        out.append(chat.turn(port))
        if titles:
            chat.title(port)
    return out


@pytest.mark.parametrize(
    "slots, order",
    [([], "first-sent"), (["-np", "1"], "first-sent"), ([], "reversed")],
    ids=["default-slots", "np1", "default-slots-reversed"],
)
def test_six_chats_with_title_requests_all_come_back_warm_after_a_swap(real, slots, order):
    """Six chats sharing a system prompt, a title request after each turn, a swap: all six continue warm."""
    sk = real(*slots)
    chats = [Chat(i) for i in range(6)]
    converse_round(chats, sk.port)
    swap_out(sk)
    sk2 = real(*slots)
    returning = chats if order == "first-sent" else chats[::-1]
    results = converse_round(returning, sk2.port)
    cold = [(c.n, t["cache_n"], c.last_prompt_tokens_before) for c, t in zip(returning, results) if not warm(c, t)]
    assert not cold, f"cold chats (n, cache_n, previous prompt): {cold}\n{sk2.logs()[-4000:]}"


def test_a_chat_whose_slot_llama_server_would_take_stays_warm(real):
    """Two slots hold chats A and B; a new chat C shares their system prompt, so llama-server's own choice
    (longest common prefix over 10%) puts C on A's or B's slot. With slotkeeper, A and B both stay warm.
    Without placement (and without the RAM prompt cache to fall back on), one of them goes cold."""

    def run(own: tuple[str, ...]) -> list[bool]:
        sk = real("-np", "2", "--cache-ram", "0", own=own)
        a, b, c = Chat(0), Chat(1), Chat(2)
        converse_round([a, b], sk.port, titles=False)
        converse_round([c], sk.port, titles=False)
        results = converse_round([a, b], sk.port, titles=False)
        swap_out(sk)
        return [warm(x, t) for x, t in zip((a, b), results)]

    assert run(()) == [True, True]
    assert run(("--no-placement",)) != [True, True], "the scenario did not steal a slot without placement"


def test_four_chats_at_once_on_four_slots_run_in_parallel_and_stay_warm(real):
    """-np 4: four chats streamed at the same time all generate at once (llama-server's /slots, asked while they
    stream, shows all four slots processing together), and after a swap all four continue warm.

    Why /slots and not the readers' clocks: on a loaded two-core machine a descheduled reader read all 320 of its
    lines in 29 ms, 120 ms before another saw its first, while the server had run all four at once. Why the
    streams go on until /slots has seen them together (then their readers hang up, as a user's stop button does)
    rather than for a fixed number of tokens: four 320-token streams lasted 0.4 s, and in one CI run none of the
    seven polls that answered fell inside that window."""
    sk = real("-np", "4")
    chats = [Chat(i) for i in range(4)]
    converse_round(chats, sk.port, titles=False)
    for chat in chats:
        chat.last_prompt_tokens_before = chat.last_prompt_tokens

    together: list[int] = []  # slots processing at once, each time /slots answered during the streams
    seen_together = threading.Event()
    timings: list[dict] = [{} for _ in chats]
    start = threading.Barrier(4)
    give_up = time.monotonic() + STREAM_PATIENCE_S

    def one(i: int) -> None:
        start.wait()
        body = {
            "messages": chats[i].messages,
            "max_tokens": STREAMED_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "timings_per_token": True,
        }
        with contextlib.closing(stream_lines(sk.port, "/v1/chat/completions", body, timeout=120)) as lines:
            for _, line in lines:
                if line.startswith(b"data: {"):
                    timings[i] = json.loads(line[6:]).get("timings", timings[i])
                if timings[i] and (seen_together.is_set() or time.monotonic() > give_up):
                    return  # hangs up: llama-server stops this answer

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        reply = http_call(sk.port, "GET", "/slots")
        if reply.status == 200:
            together.append(sum(1 for slot in reply.body if slot.get("is_processing")))
            if together[-1] == 4:
                seen_together.set()
    for t in threads:
        t.join(STREAM_PATIENCE_S)
    assert seen_together.is_set(), (
        f"not in parallel: at most {max(together, default=0)} of 4 slots processing in {len(together)} looks at /slots"
    )
    assert all(warm(c, t) for c, t in zip(chats, timings)), [t.get("cache_n") for t in timings]
    swap_out(sk)
    sk2 = real("-np", "4")
    results = converse_round(chats, sk2.port, titles=False)
    assert all(warm(c, t) for c, t in zip(chats, results)), [t["cache_n"] for t in results]


def test_the_victim_is_saved_before_a_restore_overwrites_it(real):
    """-np 1, three chats in turn: each returning chat is restored into the one slot, after the chat that
    held it was saved; every one is warm at every return, without any restart."""
    sk = real("-np", "1")
    chats = [Chat(i) for i in range(3)]
    converse_round(chats, sk.port, titles=False)
    for _ in range(2):
        results = converse_round(chats, sk.port, titles=False)
        assert all(warm(c, t) for c, t in zip(chats, results)), [t["cache_n"] for t in results]
    lines = [line for line in sk.logs().splitlines() if "(before it is reused)" in line or "restored into" in line]
    restores = [i for i, line in enumerate(lines) if "restored into slot 0" in line]
    assert len(restores) == 6, lines
    # each restore overwrote a slot whose chat had just been saved
    assert all(i > 0 and "saved from slot 0 (before it is reused)" in lines[i - 1] for i in restores), lines


def test_a_branch_from_an_early_answer_saves_the_later_turns_first(real):
    """-np 1: a chat's later turns continue in its slot without being tokenized, so slotkeeper's keys of the
    slot are its first turn's. A regenerate of the first answer shares all of those keys: the slot is saved
    before it runs. The new branch goes on a turn; back on the old branch, its next turn is restored, warm."""
    sk = real("-np", "1")
    old = Chat(0)
    for _ in range(3):
        old.turn(sk.port)
    branch = Chat(0)  # the same chat, its first answer asked again
    branch.turn(sk.port)
    branch.messages[-1]["content"] = "Tell me something else instead."
    branch.turn(sk.port)
    assert "saved from slot 0 (before it is reused)" in sk.logs(), sk.logs()[-3000:]
    old.last_prompt_tokens_before = old.last_prompt_tokens  # type: ignore[attr-defined]
    timings = old.turn(sk.port)
    assert warm(old, timings), (timings, old.last_prompt_tokens_before, sk.logs()[-3000:])


def test_a_request_with_its_own_id_slot_keeps_it(real):
    """A client that sets id_slot keeps its choice; what that slot held is saved first, so it stays warm."""
    sk = real("-np", "2", "--cache-ram", "0")
    a, b = Chat(0), Chat(1)
    converse_round([a], sk.port, titles=False)
    # b asks for slot 0 by itself, where a is
    reply = http_call(
        sk.port, "POST", "/completion", {"prompt": "x" * 400, "n_predict": 2, "id_slot": 0, "temperature": 0}
    )
    assert reply.status == 200 and reply.body["id_slot"] == 0
    results = converse_round([a], sk.port, titles=False)
    assert warm(a, results[0]), (results, sk.logs()[-3000:])
    del b


def test_no_per_turn_cost_for_a_chat_in_its_own_slot(real):
    """Back-to-back turns of one chat in its slot write nothing (no save per turn) and need no tokenize."""
    sk = real("-np", "2", "--cache-ram", "0", own=("--autosave-idle", "0"))
    chat = Chat(0)
    converse_round([chat], sk.port, titles=False)
    entries = sk.extra["save_dir"] / "entries"
    before = sorted(p.name for p in entries.iterdir())
    asked = http_call(sk.port, "GET", "/slotkeeper/status").body["prompt_tokenizations"]
    for _ in range(3):
        results = converse_round([chat], sk.port, titles=False)
        assert warm(chat, results[0])
    assert sorted(p.name for p in entries.iterdir()) == before
    status = http_call(sk.port, "GET", "/slotkeeper/status").body
    assert status["placements"].get("resident", 0) >= 3, status
    assert status["prompt_tokenizations"] == asked, status


def test_entries_outlive_restarts_and_a_foreign_model_never_uses_them(real, starter, llama_server, models):
    """Chats saved with model A are kept, but a start with model B (same shape) restores none of them.
    (--recompute 0: B recomputing them from their tokens is tests/test_recompute.py's.)"""
    sk = real()
    chats = [Chat(i) for i in range(2)]
    converse_round(chats, sk.port, titles=False)
    swap_out(sk)
    other = starter(llama_server, ["-m", str(models["B"]), *BASE])(own=("--recompute", "0"))
    results = converse_round(chats, other.port, titles=False)
    assert all(t["cache_n"] < c.last_prompt_tokens_before for c, t in zip(chats, results)), results
    assert "saved for another configuration" in other.logs()
    swap_out(other)
    time.sleep(0.1)


def _responses_turn(port: int, chat: Chat) -> dict:
    body = {"instructions": SYSTEM, "input": [m for m in chat.messages[1:]], "max_output_tokens": 8, "temperature": 0}
    reply = http_call(port, "POST", "/v1/responses", body)
    assert reply.status == 200, reply.body
    return reply.body


def _messages_turn(port: int, chat: Chat) -> dict:
    body = {"system": SYSTEM, "messages": chat.messages[1:], "max_tokens": 8, "temperature": 0}
    reply = http_call(port, "POST", "/v1/messages", body)
    assert reply.status == 200, reply.body
    return reply.body


def test_every_completion_api_comes_back_warm_after_a_swap(real):
    """/completion (prompt form), /v1/responses and /v1/messages chats, among chats of the other kinds and
    more of them than slots, all continue warm after a swap. (/v1/messages cannot be pinned: llama-server
    b11434 drops id_slot when it converts an Anthropic body; its slot is prepared where llama-server's own
    choice will put it.)"""
    sk = real("-np", "2", "--cache-ram", "0")
    prompts = [SYSTEM + f" Text number {i}: " + "the quick brown fox jumps over the lazy dog. " * 8 for i in range(2)]
    chats = {"responses": Chat(10), "messages": Chat(11)}
    for prompt in prompts:
        assert sk.call("POST", "/completion", {"prompt": prompt, "n_predict": 4, "temperature": 0}).status == 200
    first = {
        "responses": _responses_turn(sk.port, chats["responses"]),
        "messages": _messages_turn(sk.port, chats["messages"]),
    }
    swap_out(sk)
    sk2 = real("-np", "2", "--cache-ram", "0")
    for prompt in prompts:
        reply = sk2.call("POST", "/completion", {"prompt": prompt + " More.", "n_predict": 4, "temperature": 0})
        assert reply.body["timings"]["cache_n"] >= len(prompt) // 2, (reply.body["timings"], sk2.logs()[-3000:])
    again = _responses_turn(sk2.port, chats["responses"])
    assert again["usage"]["input_tokens_details"]["cached_tokens"] >= first["responses"]["usage"]["input_tokens"] - 1, (
        again
    )
    again = _messages_turn(sk2.port, chats["messages"])
    assert again["usage"]["cache_read_input_tokens"] >= first["messages"]["usage"]["input_tokens"] - 1, again
