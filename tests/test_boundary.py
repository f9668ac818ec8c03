"""The pieces of turn boundaries, in process: the reply a front end re-sends, the turns of a chat, exact keys.

The claims (every chat warm on hybrid and sliding-window models) run against the real llama-server in
test_families.py; these pin the rules down.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from slotkeeper.boundary import turns_of
from slotkeeper.prefix import exact_key, extends_exactly
from slotkeeper.replies import MAX_REPLY_BYTES, ReplyReader


def read(*pieces: bytes) -> dict | None:
    reader = ReplyReader()
    for piece in pieces:
        reader.feed(piece)
    return reader.message()


def sse(*chunks: dict, done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return body + (b"data: [DONE]\n\n" if done else b"")


def delta(finish: str | None = None, **fields) -> dict:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": finish}]}


def test_a_json_reply_is_re_sent_without_its_reasoning():
    body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Hi there",
                                                "reasoning_content": "The user greets me."}}]}).encode()
    assert read(body[:7], body[7:]) == {"role": "assistant", "content": "Hi there"}


def test_a_streamed_reply_joins_its_content_and_drops_its_reasoning():
    body = sse(delta(role="assistant"), delta(reasoning_content="Think"), delta(content="Hel"),
               delta(content="lo"), delta("stop"))
    for split in (1, 10, len(body) // 2):  # pieces arrive cut anywhere
        assert read(body[:split], body[split:]) == {"role": "assistant", "content": "Hello"}


def test_streamed_tool_calls_are_merged_by_index():
    body = sse(delta(tool_calls=[{"index": 0, "id": "c1", "type": "function",
                                  "function": {"name": "get_", "arguments": ""}}]),
               delta(tool_calls=[{"index": 0, "function": {"name": "weather", "arguments": "{\"city\":"}}]),
               delta(tool_calls=[{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]),
               delta("tool_calls"))
    assert read(body) == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]}


def test_a_cut_off_or_oversized_reply_is_unknown():
    assert read(sse(delta(content="Hel"), done=False)) is None
    assert read(b"{\"choices\": [") is None
    assert read(b"x" * (MAX_REPLY_BYTES + 1)) is None


SYSTEM = {"role": "system", "content": "Be brief."}
U1, A1, U2 = ({"role": "user", "content": "one"}, {"role": "assistant", "content": "1"},
              {"role": "user", "content": "two"})
REPLY = {"role": "assistant", "content": "2"}


def test_a_chat_has_its_latest_boundary_and_the_one_before_its_last_message():
    current, previous = turns_of([SYSTEM, U1, A1, U2], REPLY)
    assert current is not None and previous is not None
    assert (current.history, current.next_role) == ([SYSTEM, U1, A1, U2, REPLY], "user")
    assert (previous.history, previous.next_role) == ([SYSTEM, U1, A1], "user")


def test_the_first_turns_fallback_is_the_opening():
    _, previous = turns_of([SYSTEM, U1], REPLY)
    assert previous is not None and previous.history == [SYSTEM]
    assert turns_of([U1], REPLY)[1] is None  # no opening to fall back to


def test_after_tool_calls_the_next_message_is_a_tool_result():
    calls = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                   "function": {"name": "f", "arguments": "{}"}}]}
    current, _ = turns_of([SYSTEM, U1], calls)
    assert current is not None and current.next_role == "tool"
    results = [SYSTEM, U1, calls, {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    _, previous = turns_of(results, REPLY)
    assert previous is not None and (previous.history, previous.next_role) == ([SYSTEM, U1, calls], "tool")


def test_without_a_known_reply_only_the_fallback_remains():
    current, previous = turns_of([SYSTEM, U1, A1, U2], None)
    assert current is None and previous is not None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=200), st.lists(st.integers(0, 5), max_size=200))
def test_an_exact_key_matches_only_a_request_that_extends_every_token(saved, request):
    """A state is reused only when the request holds all of its tokens and at least one more."""
    expected = len(request) > len(saved) and request[: len(saved)] == saved
    assert extends_exactly(request, len(saved), exact_key(saved)) == expected
