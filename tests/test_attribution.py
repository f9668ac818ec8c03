"""Claude Code's attribution line: dropped from a request's system part, every other byte kept as sent."""

from __future__ import annotations

import json

import pytest

from slotkeeper.chat.attribution import AttributionFilter, drop_attribution_line, is_attribution_line
from slotkeeper.proxy.hook import Placed

LINE = "x-anthropic-billing-header: cc_version=2.1.197.58e; cc_entrypoint=sdk-cli;"
OLD_LINE = "x-anthropic-billing-header: cc_version=1.0.44.d7d; cc_entrypoint=cli; cch=3a9f1;"


@pytest.mark.parametrize(
    "text",
    [LINE, OLD_LINE, LINE + "\n", "x-anthropic-billing-header:cc_version=2.1;", "x-anthropic-billing-header: a=; b=c;"],
)
def test_an_attribution_line_is_the_prefix_and_key_value_pairs(text):
    assert is_attribution_line(text)


@pytest.mark.parametrize(
    "text",
    [
        "x-anthropic-billing-header:",  # no pair
        "x-anthropic-billing-header: cc_version=2.1.197.58e",  # no closing semicolon
        LINE + " You are Claude Code.",  # more than the line
        LINE + "\nYou are Claude Code.",
        "Note: x-anthropic-billing-header: cc_version=1;",  # mentions it
        "X-Anthropic-Billing-Header: cc_version=1;",
        None,
        3,
    ],
)
def test_other_texts_are_not_attribution_lines(text):
    assert not is_attribution_line(text)


def test_the_leading_anthropic_system_block_is_cut_out_byte_for_byte():
    body = (
        b'{"model":"claude", "messages":[{"role":"user","content":"Hi \\u00e9 \xc3\xa9"}],\n'
        b'  "system": [ {"type":"text","text":"' + LINE.encode() + b'"} ,\n'
        b'   {"type": "text", "text": "You are Claude Code.", "cache_control": {"type":"ephemeral"}}],'
        b' "max_tokens": 1.0e3, "temperature":0}'
    )
    out = drop_attribution_line("/v1/messages", body)
    assert out == (
        b'{"model":"claude", "messages":[{"role":"user","content":"Hi \\u00e9 \xc3\xa9"}],\n'
        b'  "system": [ {"type": "text", "text": "You are Claude Code.", "cache_control": {"type":"ephemeral"}}],'
        b' "max_tokens": 1.0e3, "temperature":0}'
    )


def test_a_lone_attribution_block_leaves_an_empty_system_list():
    body = json.dumps({"system": [{"type": "text", "text": OLD_LINE}], "messages": []}).encode()
    out = drop_attribution_line("/v1/messages", body)
    assert out is not None and json.loads(out) == {"system": [], "messages": []}


@pytest.mark.parametrize(
    "system",
    [
        [{"type": "text", "text": "You are Claude Code."}, {"type": "text", "text": LINE}],  # not leading
        [{"type": "text", "text": "About x-anthropic-billing-header: cc_version=1; in our logs."}],  # mentions it
        [{"type": "image", "text": LINE}],  # not a text block
        LINE + "\nYou are Claude Code.",  # a string, not a block
        LINE,
    ],
)
def test_other_system_parts_are_left_alone(system):
    body = json.dumps({"system": system, "messages": [{"role": "user", "content": LINE}]}).encode()
    assert drop_attribution_line("/v1/messages", body) is None


def test_the_last_of_duplicate_system_members_is_the_one_read():
    body = b'{"system":[{"type":"text","text":"' + LINE.encode() + b'"}],"system":"plain","messages":[]}'
    assert drop_attribution_line("/v1/messages", body) is None
    body = b'{"system":"plain","system":[{"type":"text","text":"' + LINE.encode() + b'"},{"type":"text","text":"x"}]}'
    assert drop_attribution_line("/v1/messages", body) == b'{"system":"plain","system":[{"type":"text","text":"x"}]}'


def test_chat_completions_drop_the_leading_part_of_a_system_message():
    messages = [
        {
            "role": "system",
            "content": [{"type": "text", "text": LINE}, {"type": "text", "text": "You are Claude Code."}],
        },
        {"role": "user", "content": "Hi"},
    ]
    out = drop_attribution_line("/v1/chat/completions", json.dumps({"messages": messages}).encode())
    assert out is not None
    assert json.loads(out)["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "You are Claude Code."}]},
        {"role": "user", "content": "Hi"},
    ]


def test_chat_completions_drop_a_system_message_that_is_only_the_line():
    messages = [
        {"role": "system", "content": LINE},
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "Hi"},
    ]
    out = drop_attribution_line("/chat/completions", json.dumps({"messages": messages}).encode())
    assert out is not None and json.loads(out)["messages"] == messages[1:]
    alone = [{"role": "system", "content": LINE}]  # nothing after it: left as it is
    assert drop_attribution_line("/chat/completions", json.dumps({"messages": alone}).encode()) is None


def test_responses_drop_the_leading_part_of_a_developer_message():
    item = {
        "role": "developer",
        "content": [{"type": "input_text", "text": LINE}, {"type": "input_text", "text": "Hi"}],
    }
    out = drop_attribution_line("/v1/responses", json.dumps({"input": [item], "model": "m"}).encode())
    assert out is not None
    assert json.loads(out) == {
        "input": [{"role": "developer", "content": [{"type": "input_text", "text": "Hi"}]}],
        "model": "m",
    }


@pytest.mark.parametrize(
    "path, body",
    [
        ("/completion", {"prompt": LINE, "system": [{"type": "text", "text": LINE}, {"type": "text", "text": "x"}]}),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": LINE}, {"type": "text", "text": "x"}]}
                ]
            },
        ),
        ("/v1/messages", [1, 2]),
    ],
)
def test_prompts_user_parts_and_other_shapes_are_left_alone(path, body):
    assert drop_attribution_line(path, json.dumps(body).encode()) is None


def test_a_body_that_is_not_json_goes_as_sent():
    assert drop_attribution_line("/v1/messages", b'{"system":[{"type":"text","text":"' + LINE.encode() + b'"},') is None
    assert drop_attribution_line("/v1/messages", LINE.encode()) is None


class _Inner:
    def __init__(self) -> None:
        self.seen: list[bytes] = []

    def wants(self, method: bytes, path: str) -> bool:
        return path == "/slots"

    async def place(self, path: str, body: bytes) -> Placed:
        self.seen.append(body)
        return Placed(body + b" ")


async def test_the_filter_hands_the_dropped_body_on_and_counts_it():
    body = json.dumps({"system": [{"type": "text", "text": LINE}, {"type": "text", "text": "x"}]}).encode()
    inner = _Inner()
    hook = AttributionFilter(inner)
    assert hook.wants(b"POST", "/v1/messages") and hook.wants(b"POST", "/slots")
    assert not hook.wants(b"GET", "/v1/messages") and not hook.wants(b"POST", "/completion")
    placed = await hook.place("/v1/messages", body)
    assert inner.seen == [b'{"system": [{"type": "text", "text": "x"}]}'] and placed.body == inner.seen[0] + b" "
    assert hook.dropped == 1
    alone = AttributionFilter(None)
    assert (await alone.place("/v1/messages", body)).body == inner.seen[0] and alone.dropped == 1
    assert (await alone.place("/v1/messages", b"{}")).body == b"{}" and alone.dropped == 1
