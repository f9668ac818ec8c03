"""The pieces of turn boundaries, in process: the reply a front end re-sends, the turns of a chat, exact keys.

The claims (every chat warm on hybrid and sliding-window models) run against the real llama-server in
test_families.py; these pin the rules down.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from slotkeeper.chat.apis import Api
from slotkeeper.chat.boundary import turns_of
from slotkeeper.chat.prefix import exact_key, extends_exactly
from slotkeeper.chat.replies import MAX_REPLY_BYTES, ReplyReader, Usage


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
    body = json.dumps(
        {
            "choices": [
                {"message": {"role": "assistant", "content": "Hi there", "reasoning_content": "The user greets me."}}
            ]
        }
    ).encode()
    assert read(body[:7], body[7:]) == {"role": "assistant", "content": "Hi there"}


def test_a_streamed_reply_joins_its_content_and_drops_its_reasoning():
    body = sse(
        delta(role="assistant"),
        delta(reasoning_content="Think"),
        delta(content="Hel"),
        delta(content="lo"),
        delta("stop"),
    )
    for split in (1, 10, len(body) // 2):  # pieces arrive cut anywhere
        assert read(body[:split], body[split:]) == {"role": "assistant", "content": "Hello"}


def test_streamed_tool_calls_are_merged_by_index():
    body = sse(
        delta(tool_calls=[{"index": 0, "id": "c1", "type": "function", "function": {"name": "get_", "arguments": ""}}]),
        delta(tool_calls=[{"index": 0, "function": {"name": "weather", "arguments": '{"city":'}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": '"Oslo"}'}}]),
        delta("tool_calls"),
    )
    assert read(body) == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
        ],
    }


def test_a_cut_off_or_oversized_reply_is_unknown():
    assert read(sse(delta(content="Hel"), done=False)) is None
    assert read(b'{"choices": [') is None
    assert read(b"x" * (MAX_REPLY_BYTES + 1)) is None


SYSTEM = {"role": "system", "content": "Be brief."}
U1, A1, U2 = (
    {"role": "user", "content": "one"},
    {"role": "assistant", "content": "1"},
    {"role": "user", "content": "two"},
)
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
    calls = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    current, _ = turns_of([SYSTEM, U1], calls)
    assert current is not None and current.next_role == "tool"
    results: list[dict[str, Any]] = [SYSTEM, U1, calls, {"role": "tool", "tool_call_id": "c1", "content": "42"}]
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


def read_form(form, *pieces: bytes) -> ReplyReader:
    reader = ReplyReader(form)
    for piece in pieces:
        reader.feed(piece)
    return reader


def events(*payloads: dict) -> bytes:
    return b"".join(b"event: " + p["type"].encode() + b"\ndata: " + json.dumps(p).encode() + b"\n\n" for p in payloads)


RESPONSE_OUTPUT = [
    {
        "type": "message",
        "status": "completed",
        "id": "msg_1",
        "role": "assistant",
        "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": "Reading it."}],
    },
    {
        "id": "fc_1",
        "type": "function_call",
        "status": "completed",
        "arguments": '{"path":"a.py"}',
        "call_id": "call_1",
        "name": "read_file",
    },
]
RESPONSE_USAGE = {
    "input_tokens": 120,
    "output_tokens": 9,
    "total_tokens": 129,
    "input_tokens_details": {"cached_tokens": 100},
}


def test_a_responses_reply_is_its_output_items_in_chat_form_whole_or_streamed():
    """The Responses client re-sends the output items; llama-server merges them into one assistant message."""
    expected = {
        "id": "msg_1",
        "role": "assistant",
        "content": [{"text": "Reading it.", "type": "text"}],
        "tool_calls": [
            {"function": {"arguments": '{"path":"a.py"}', "name": "read_file"}, "id": "call_1", "type": "function"}
        ],
    }
    whole = json.dumps({"object": "response", "output": RESPONSE_OUTPUT, "usage": RESPONSE_USAGE}).encode()
    streamed = events(
        {"type": "response.output_text.delta", "delta": "Reading it."},
        {"type": "response.completed", "response": {"output": RESPONSE_OUTPUT, "usage": RESPONSE_USAGE}},
    )
    for body in (whole, streamed):
        reader = read_form(Api.RESPONSES, body[:11], body[11:])
        assert reader.message() == expected
        assert reader.usage() == Usage(120, 100, 9)
    assert read_form(Api.RESPONSES, streamed[: len(streamed) // 2]).message() is None  # cut off


ANTHROPIC_CONTENT = [
    {"type": "text", "text": "Reading it."},
    {"type": "tool_use", "id": "tu_1", "name": "read_file", "input": {"path": "a.py"}},
]


def test_an_anthropic_reply_is_its_content_blocks_in_chat_form_whole_or_streamed():
    expected = {
        "role": "assistant",
        "content": [{"type": "text", "text": "Reading it."}],
        "tool_calls": [
            {"id": "tu_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"a.py"}'}}
        ],
    }
    whole = json.dumps(
        {
            "type": "message",
            "content": ANTHROPIC_CONTENT,
            "usage": {"cache_read_input_tokens": 100, "input_tokens": 20, "output_tokens": 9},
        }
    ).encode()
    streamed = events(
        {
            "type": "message_start",
            "message": {"usage": {"cache_read_input_tokens": 100, "input_tokens": 20, "output_tokens": 0}},
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Reading"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " it."}},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "tu_1", "name": "read_file"},
        },
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"path":'}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '"a.py"}'}},
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}},
        {"type": "message_stop"},
    )
    for body in (whole, streamed):
        reader = read_form(Api.MESSAGES, body[:5], body[5:])
        assert reader.message() == expected
        assert reader.usage() == Usage(120, 100, 9)
    assert read_form(Api.MESSAGES, streamed[:-30]).message() is None  # no message_stop: cut off


def test_an_anthropic_thinking_block_is_sent_back_as_reasoning():
    """Anthropic clients re-send thinking blocks; llama-server's conversion makes them reasoning_content."""
    body = json.dumps(
        {
            "content": [{"type": "thinking", "thinking": "Hmm.", "signature": ""}, {"type": "text", "text": "Hi"}],
            "usage": {},
        }
    ).encode()
    assert read_form(Api.MESSAGES, body).message() == {
        "role": "assistant",
        "content": [{"type": "text", "text": "Hi"}],
        "reasoning_content": "Hmm.",
    }
