"""chatform's Responses and Anthropic converters against the real llama-server's own.

Two observables, both from one llama-server started here:

* the converted body itself: at ``-lv 5`` llama-server logs ``converted request: <json>``
  (``body.dump()`` of its conversion) for ``/v1/responses`` and ``/v1/messages``; our
  conversion, dumped the way nlohmann dumps, must equal that line byte for byte (key
  order, float format and all). This catches differences a token count cannot see.
* the token count: ``len(/tokenize(/apply-template(to_chat_form(body))))`` must equal what
  ``/v1/responses/input_tokens`` and ``/v1/messages/count_tokens`` report for the body.

The tiny model has no chat template, and llama-server's fallback (chatml) drops tools,
tool calls and reasoning, so the server gets a template that renders all of them.
Where llama-server rejects a body its error message must be our ValueError's.
"""

from __future__ import annotations

import http.client
import json
import math
import random
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotkeeper.chat.convert import _dump, _dump_float, anthropic_to_chat, responses_to_chat, to_chat_form
from slotkeeper.testing.harness import free_port

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
COUNT_PATH = {RESPONSES: "/v1/responses/input_tokens", MESSAGES: "/v1/messages/count_tokens"}

# Renders everything a converted body can carry, so that dropping or reordering any of it changes the count.
TEMPLATE = """\
{%- if tools -%}<|im_start|>tools
{{ tools | tojson }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
<|im_start|>{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}{% if m.tool_call_id %} call={{ m.tool_call_id }}{% endif %}
{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif -%}
{%- if m.content is string -%}{{ m.content }}{%- elif m.content -%}{%- for p in m.content -%}[{{ p.type }}]{{ p.text }}{%- endfor -%}{%- endif -%}
{%- if m.tool_calls -%}{%- for tc in m.tool_calls -%}<call id={{ tc.id }}>{{ tc.function.name }}:{{ tc.function.arguments | tojson }}</call>{%- endfor -%}{%- endif -%}
<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}
"""


class Child:
    """A llama-server on 127.0.0.1:port whose log (at debug verbosity) goes to `log`."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.log_offset = 0

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        data = json.dumps(body, ensure_ascii=False).encode()
        for attempt in (1, 2):
            try:
                self.conn.request("POST", path, data, {"Content-Type": "application/json"})
                reply = self.conn.getresponse()
                return reply.status, json.loads(reply.read())
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def new_conversions(self) -> list[str]:
        """The ``converted request:`` lines logged since the last call (complete lines only)."""
        with open(self.log, "rb") as f:
            f.seek(self.log_offset)
            data = f.read()
        data = data[: data.rfind(b"\n") + 1]
        self.log_offset += len(data)
        marker = b"converted request: "  # split on b"\n" only: str.splitlines() also splits at U+0085 etc.
        return [line.split(marker, 1)[1].decode() for line in data.split(b"\n") if marker in line]

    def converted(self, path: str, body: dict) -> str:
        """llama-server's own conversion of `body`, from its debug log, running the request."""
        assert self.new_conversions() == []
        self.post(path, body)  # may fail after the conversion (e.g. images on a text-only model)
        deadline = time.monotonic() + 5
        while not (lines := self.new_conversions()):  # the log is written by a worker thread
            assert time.monotonic() < deadline, f"no conversion logged for {body}"
            time.sleep(0.002)
        assert len(lines) == 1
        return lines[0]

    def prompt_tokens(self, chat: dict) -> tuple[int, Any]:
        """What slotkeeper does: /apply-template, then /tokenize with the completion path's flags."""
        status, reply = self.post("/apply-template", chat)
        if status != 200:
            return status, reply["error"]["message"]
        status, reply = self.post("/tokenize", {"content": reply["prompt"], "add_special": True, "parse_special": True})
        assert status == 200, reply
        return status, reply["tokens"]


@pytest.fixture(scope="module")
def child(llama_server: str, models: dict[str, Path], tmp_path_factory) -> Iterator[Child]:
    root = tmp_path_factory.mktemp("chatform")
    (root / "template.jinja").write_text(TEMPLATE)
    port = free_port()
    log = root / "llama-server.log"
    # -t 1: with more compute threads than free CPUs a decode here sometimes stalled for ~1 s
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                llama_server,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-m",
                str(models["A"]),
                "-c",
                "4096",
                "-t",
                "1",
                "--no-warmup",
                "-lv",
                "5",
                "--chat-template-file",
                str(root / "template.jinja"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            finally:
                conn.close()
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.05)
        yield Child(proc, port, log)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def check(child: Child, path: str, body: Any) -> dict | None:
    """Assert chatform and llama-server agree on `body` for `path`; the conversion, or None if rejected."""
    try:
        chat = to_chat_form(path, body)
    except ValueError as exc:
        status, reply = child.post(COUNT_PATH[path], body)
        assert status in (400, 500), (body, reply)
        assert reply["error"]["message"] == str(exc)
        return None
    assert chat is not None
    assert child.converted(path, body) == _dump(chat)
    count_status, count = child.post(COUNT_PATH[path], body)
    status, tokens = child.prompt_tokens(chat)
    if count_status == 200:
        assert status == 200, tokens
        assert len(tokens) == count["input_tokens"]
    else:  # rejected after the conversion (e.g. an image on a text-only model): the same way
        assert (status, tokens) == (count_status, count["error"]["message"])
    return chat


# --- hand-written cases ------------------------------------------------------------------

TOOL_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}

RESPONSES_CASES: dict[str, dict] = {
    "plain text": {"input": "Hello there"},
    "instructions": {"instructions": "Be brief.", "input": "Hi"},
    "null instructions": {"instructions": None, "input": "Hi"},
    "message list with system and developer": {
        "input": [
            {"role": "system", "content": "You are a test."},
            {"role": "developer", "content": [{"type": "input_text", "text": "Dev note"}]},
            {"type": "message", "role": "user", "status": "completed", "id": "m1", "content": "Question?"},
        ]
    },
    "multi-turn with assistant turns": {
        "instructions": "sys",
        "input": [
            {"role": "user", "content": "one"},
            {
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "id": "msg_1",
                "content": [{"type": "output_text", "text": "two", "annotations": []}],
            },
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "three"}, {"type": "input_text", "text": "four"}],
            },
            {"type": "message", "role": "assistant", "content": "five"},
        ],
    },
    "refusal": {
        "input": [
            {"role": "user", "content": "x"},
            {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        ]
    },
    "tools, function call and outputs": {
        "input": [
            {"role": "user", "content": "weather?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "think"}],
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "weather",
                "arguments": '{"city": "Paris"}',
                "status": "completed",
            },
            {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": '{"city":"Rome"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "rain"}, {"type": "input_text", "text": " later"}],
            },
            {"type": "function_call", "call_id": "call_3", "name": "weather", "arguments": "{}"},
        ],
        "tools": [
            {"type": "function", "name": "weather", "description": "Get weather", "parameters": TOOL_SCHEMA},
            {"type": "web_search"},
            {"type": "function", "name": "noop", "strict": False, "parameters": {"type": "object"}},
        ],
        "tool_choice": "auto",
        "reasoning": {"effort": "high", "summary": "auto"},
        "temperature": 0.5,
    },
    "only non-function tools": {"input": "x", "tools": [{"type": "file_search"}]},
    "reasoning first, then message merged": {
        "input": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}], "content": "plan"},
            {"type": "message", "role": "assistant", "content": "done"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "again"}]},
        ]
    },
    "input image": {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "see"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                ],
            }
        ]
    },
    "image tool output": {
        "input": [
            {"type": "function_call", "call_id": "c", "name": "shot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image", "image_url": "u"}]},
        ]
    },
    "reasoning effort without reasoning object": {"input": "x", "reasoning": "low"},
    "empty previous_response_id": {"input": "x", "previous_response_id": ""},
    "missing input": {"instructions": "x"},
    "previous_response_id": {"input": "x", "previous_response_id": "resp_1"},
    "input not string or list": {"input": {"role": "user"}},
    "input_text without text": {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
    "input_file": {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
    "unknown input part": {"input": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
    "input_image without url": {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
    "output_text without text": {
        "input": [{"type": "message", "role": "assistant", "content": [{"type": "output_text"}]}]
    },
    "refusal without refusal": {"input": [{"type": "message", "role": "assistant", "content": [{"type": "refusal"}]}]},
    "unknown output part": {"input": [{"type": "message", "role": "assistant", "content": [{"type": "x"}]}]},
    "assistant without type": {"input": [{"role": "assistant", "content": "hi"}]},
    "unknown item": {"input": [{"type": "item_reference", "id": "x"}]},
    "string item": {"input": ["hello"]},
    "tool output part without type": {"input": [{"type": "function_call_output", "call_id": "c", "output": [{}]}]},
    "tool output part of other type": {
        "input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "output_text", "text": "x"}]}]
    },
    "tool output image without url": {
        "input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]
    },
    "reasoning without content": {"input": [{"type": "reasoning", "summary": []}]},
    "reasoning with empty content": {"input": [{"type": "reasoning", "summary": [], "content": []}]},
    "reasoning without text": {"input": [{"type": "reasoning", "summary": [], "content": [{"type": "x"}]}]},
    "tools not a list": {"input": "x", "tools": {"type": "function"}},
}


def non_shortest_floats(n: int) -> list[float]:
    """Doubles for which nlohmann's Grisu2 gives more digits than the shortest round trip (repr)."""

    def digits(s: str) -> str:
        return s.split("e")[0].lstrip("-").replace(".", "").strip("0")

    rnd, found = random.Random(0), list[float]()
    while len(found) < n:
        x = struct.unpack("<d", struct.pack("<Q", rnd.getrandbits(64)))[0]
        if math.isfinite(x) and len(digits(_dump_float(x))) > len(digits(repr(x))):
            found.append(x)
    return found


ANTHROPIC_CASES: dict[str, dict] = {
    "plain text": {"messages": [{"role": "user", "content": "Hello"}]},
    "system string and multi-turn": {
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": [{"type": "text", "text": "three"}, {"type": "text", "text": "four"}]},
        ],
        "max_tokens": 1,
    },
    "system blocks and billing header": {
        "system": [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;",
            },
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "image", "text": "skipped"},
        ],
        "messages": [{"role": "user", "content": "hi"}],
    },
    "billing header without cch": {
        "system": "x-anthropic-billing-header: cc_version=1;Hello",
        "messages": [{"role": "user", "content": "hi"}],
    },
    "billing header with short cch": {
        "system": "x-anthropic-billing-header: cch=ab;Hello",
        "messages": [{"role": "user", "content": "hi"}],
    },
    "empty system": {"system": [], "messages": [{"role": "user", "content": "hi"}]},
    "tool use and results": {
        "system": "tools",
        "max_tokens": 1,
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 5,
        "stop_sequences": ["END"],
        "metadata": {"user_id": "u-1"},
        "thinking": {"type": "enabled", "budget_tokens": 64},
        "tool_choice": {"type": "tool", "name": "weather"},
        "tools": [{"name": "weather", "description": "Get weather", "input_schema": TOOL_SCHEMA}, {"name": "bare"}],
        "messages": [
            {"role": "user", "content": "weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "need tools", "signature": "sig"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris", "days": 3}},
                    {
                        "type": "tool_use",
                        "id": "toolu_2",
                        "name": "weather",
                        "input": {
                            "city": "Rome",
                            "f": [1e15, 1e16, 1e-5, 0.1, -0.0, 123.0, 2**64, 2**70],
                            "grisu": non_shortest_floats(3),
                            "s": 'é\n"\x01/\x7f',
                        },
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "rain"}, {"type": "text", "text": " soon"}],
                    },
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
    },
    "tool use only, no input": {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
        ]
    },
    "thinking only": {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"}]},
        ]
    },
    "images": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
                    {"type": "image", "source": {"type": "file", "file_id": "f"}},
                    {"type": "text", "text": "what is this?"},
                ],
            }
        ]
    },
    "image tool result": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [
                            {"type": "text", "text": "shot"},
                            {"type": "image", "source": {"type": "base64", "data": "AAAA"}},
                        ],
                    }
                ],
            }
        ]
    },
    "odd messages": {
        "messages": [
            {"role": "assistant"},
            {"role": "user", "content": []},
            {"role": "user", "content": [{"type": "redacted_thinking", "data": "x"}]},
            {"role": "user", "content": "kept", "name": "bob"},
        ]
    },
    "tool choice auto, thinking disabled": {
        "messages": [{"role": "user", "content": "x"}],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "disabled"},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    },
    "tool choice none, default budget": {
        "messages": [{"role": "user", "content": "x"}],
        "tool_choice": {"type": "none"},
        "thinking": {"type": "enabled"},
        "metadata": {"user_id": ""},
    },
    "missing messages": {"system": "x"},
    "messages not a list": {"messages": {"role": "user", "content": "x"}},
}


@pytest.mark.parametrize("name", RESPONSES_CASES)
def test_responses_cases(child: Child, name: str) -> None:
    check(child, RESPONSES, {**RESPONSES_CASES[name], "max_output_tokens": 1})


@pytest.mark.parametrize("name", ANTHROPIC_CASES)
def test_anthropic_cases(child: Child, name: str) -> None:
    check(child, MESSAGES, {**ANTHROPIC_CASES[name], "max_tokens": 1})


@pytest.mark.parametrize("path, body", [(RESPONSES, []), (RESPONSES, None), (MESSAGES, "x"), (MESSAGES, [1])])
def test_bodies_that_are_not_objects(child: Child, path: str, body: Any) -> None:
    assert check(child, path, body) is None


def test_the_cases_reach_what_they_claim(child: Child) -> None:
    """Guards against a vacuous check: the key cases convert as intended and are not all errors."""
    chat = responses_to_chat(RESPONSES_CASES["tools, function call and outputs"])
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "tool", "tool", "assistant"]
    assistant = chat["messages"][1]
    assert assistant["reasoning_content"] == "think" and len(assistant["tool_calls"]) == 2
    assert [t["function"]["name"] for t in chat["tools"]] == ["weather", "noop"]
    assert chat["reasoning_effort"] == "high" and "reasoning" not in chat

    chat = anthropic_to_chat(ANTHROPIC_CASES["tool use and results"])
    assert chat["messages"][0] == {"role": "system", "content": "tools"}
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "user", "tool", "tool"]
    assert chat["tool_choice"] == "required" and chat["thinking_budget_tokens"] == 64
    assert (
        '"f":[1e+15,1e+16,1e-05,0.1,-0.0,123.0,1.8446744073709552e+19,1.1805916207174113e+21]'
        in chat["messages"][2]["tool_calls"][1]["function"]["arguments"]
    )
    billing = anthropic_to_chat(ANTHROPIC_CASES["system blocks and billing header"])["messages"][0]["content"]
    assert "cch=fffff;" in billing

    # the token counts are not trivially equal: the template sees tools, calls and reasoning
    status, with_tools = child.prompt_tokens(anthropic_to_chat(ANTHROPIC_CASES["tool use and results"]))
    body = {**ANTHROPIC_CASES["tool use and results"], "tools": []}
    status2, without = child.prompt_tokens(anthropic_to_chat(body))
    assert status == status2 == 200 and len(with_tools) > len(without)


def test_to_chat_form_paths() -> None:
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert to_chat_form("/v1/chat/completions", body) is body
    assert to_chat_form("/chat/completions", body) is body
    assert to_chat_form("/responses", {"input": "x"}) == responses_to_chat({"input": "x"})
    assert to_chat_form("/v1/messages", body) == anthropic_to_chat(body)
    for path in ("/completion", "/completions", "/v1/completions", "/infill", "/v1/messages/count_tokens"):
        assert to_chat_form(path, {"prompt": "x"}) is None


def test_input_is_not_modified() -> None:
    for cases, convert in ((RESPONSES_CASES, responses_to_chat), (ANTHROPIC_CASES, anthropic_to_chat)):
        for body in cases.values():
            before = json.dumps(body)
            try:
                convert(body)
            except ValueError:
                pass
            assert json.dumps(body) == before


# --- generated cases -------------------------------------------------------------------

text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
word = st.text("abcxyz_", min_size=1, max_size=6)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(word, inner, max_size=3),
    max_leaves=8,
)
schemas = st.fixed_dictionaries(
    {
        "type": st.just("object"),
        "properties": st.dictionaries(word, st.fixed_dictionaries({"type": st.just("string")}), max_size=2),
    }
)


def maybe(strategy: st.SearchStrategy, key: str) -> st.SearchStrategy:
    return st.one_of(st.just({}), strategy.map(lambda v: {key: v}))


def merged(*parts: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(*parts).map(lambda ds: {k: v for d in ds for k, v in d.items()})


input_parts = st.one_of(
    st.builds(lambda t: {"type": "input_text", "text": t}, text),
    st.just({"type": "input_image", "image_url": "data:image/png;base64,AAAA"}),
    st.sampled_from([{"type": "input_text"}, {"type": "input_file"}, {"type": "nope"}, "bare"]),
)
output_parts = st.one_of(
    st.builds(lambda t: {"type": "output_text", "text": t, "annotations": []}, text),
    st.builds(lambda t: {"type": "refusal", "refusal": t}, text),
    st.sampled_from([{"type": "output_text"}, {"type": "refusal"}, {"type": "input_text", "text": "in"}]),
)
responses_items = st.one_of(
    merged(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "user", "system", "developer"]),
                "content": text | st.lists(input_parts, max_size=3),
            }
        ),
        maybe(st.just("message"), "type"),
        maybe(st.just("completed"), "status"),
    ),
    merged(
        st.fixed_dictionaries(
            {
                "type": st.just("message"),
                "role": st.just("assistant"),
                "content": text | st.lists(output_parts, max_size=2),
            }
        ),
        maybe(st.just("msg_1"), "id"),
        maybe(st.just("completed"), "status"),
    ),
    st.builds(
        lambda c, n, a: {"type": "function_call", "call_id": c, "name": n, "arguments": a},
        word,
        word,
        json_values.map(json.dumps) | text,
    ),
    st.builds(
        lambda c, o: {"type": "function_call_output", "call_id": c, "output": o},
        word,
        text | st.lists(st.builds(lambda t: {"type": "input_text", "text": t}, text), max_size=2),
    ),
    st.builds(lambda t: {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": t}]}, text),
    st.sampled_from(
        [
            {"type": "reasoning", "summary": []},
            {"type": "item_reference", "id": "x"},
            {"role": "assistant", "content": "untyped"},
        ]
    ),
)
responses_tools = st.one_of(
    merged(
        st.fixed_dictionaries({"type": st.just("function"), "name": word, "parameters": schemas}),
        maybe(text, "description"),
        maybe(st.booleans(), "strict"),
    ),
    st.just({"type": "web_search"}),
)
responses_bodies = merged(
    st.fixed_dictionaries({"input": text | st.lists(responses_items, max_size=6)}),
    maybe(text | st.none(), "instructions"),
    maybe(st.lists(responses_tools, max_size=3), "tools"),
    maybe(st.fixed_dictionaries({"effort": st.sampled_from(["low", "medium", "high"])}), "reasoning"),
    maybe(st.floats(0, 2), "temperature"),
    maybe(st.sampled_from(["", "resp_1"]), "previous_response_id"),
    st.just({"max_output_tokens": 1}),
)

image_source = st.sampled_from(
    [
        {"type": "base64", "media_type": "image/png", "data": "AAAA"},
        {"type": "url", "url": "https://example.com/i.png"},
        {"type": "file"},
    ]
)
result_content = st.one_of(
    text,
    st.none(),
    st.lists(
        st.one_of(
            st.builds(lambda t: {"type": "text", "text": t}, text),
            st.builds(lambda s: {"type": "image", "source": s}, image_source),
        ),
        max_size=3,
    ),
)
blocks = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, text),
    st.builds(lambda t: {"type": "text", "text": t, "cache_control": {"type": "ephemeral"}}, text),
    st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": "s"}, text),
    st.builds(lambda i, n, v: {"type": "tool_use", "id": i, "name": n, "input": v}, word, word, json_values),
    st.builds(lambda i, c: {"type": "tool_result", "tool_use_id": i, "content": c}, word, result_content),
    st.builds(lambda s: {"type": "image", "source": s}, image_source),
    st.sampled_from([{"type": "redacted_thinking", "data": "x"}, {"type": "tool_use"}, 7]),
)
anthropic_messages = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant"]), "content": text | st.lists(blocks, max_size=4)}
    ),
    st.sampled_from([{"role": "assistant"}]),
)
system = st.one_of(
    text,
    st.none(),
    st.lists(st.one_of(st.builds(lambda t: {"type": "text", "text": t}, text), st.just({"type": "other"})), max_size=2),
    st.builds(
        lambda c, t: f"x-anthropic-billing-header: cc_version=2.1; cch={c};{t}", st.text("abc0123é;", max_size=7), text
    ),
)
anthropic_bodies = merged(
    st.fixed_dictionaries({"messages": st.lists(anthropic_messages, min_size=1, max_size=5)}),
    maybe(system, "system"),
    maybe(
        st.lists(
            merged(st.fixed_dictionaries({"name": word}), maybe(text, "description"), maybe(schemas, "input_schema")),
            max_size=2,
        ),
        "tools",
    ),
    maybe(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])}), "tool_choice"),
    maybe(st.lists(word, max_size=2), "stop_sequences"),
    maybe(
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(["enabled", "disabled"]),
                "budget_tokens": st.integers(0, 2**40) | st.floats(-10, 1e12),
            }
        ),
        "thinking",
    ),
    maybe(st.fixed_dictionaries({"user_id": word}), "metadata"),
    maybe(st.floats(0, 1), "temperature"),
    st.just({"max_tokens": 1}),
)

ODD_VALUES: list[Any] = [None, 0, -1, 2.5, True, "", "text", [], [1], {}, {"type": "text"}, {"type": "input_text"}]


def scramble(body: Any, rnd: random.Random) -> Any:
    """`body` with about one value in eight swapped for a value of another type (or dropped)."""
    if isinstance(body, dict):
        out = {}
        for key, value in body.items():
            roll = 1.0 if key in ("max_tokens", "max_output_tokens") else rnd.random()  # keep generation short
            if roll < 0.04:
                continue
            out[key] = rnd.choice(ODD_VALUES) if roll < 0.12 else scramble(value, rnd)
        return out
    if isinstance(body, list):
        return [rnd.choice(ODD_VALUES) if rnd.random() < 0.08 else scramble(v, rnd) for v in body]
    return body


GENERATED = settings(max_examples=150, deadline=None, derandomize=True, database=None)


@GENERATED
@given(body=responses_bodies)
def test_generated_responses_bodies(child: Child, body: dict) -> None:
    check(child, RESPONSES, body)


@GENERATED
@given(body=anthropic_bodies)
def test_generated_anthropic_bodies(child: Child, body: dict) -> None:
    check(child, MESSAGES, body)


@GENERATED
@given(body=st.builds(lambda b, seed: scramble(b, random.Random(seed)), responses_bodies, st.integers(0, 2**32)))
def test_scrambled_responses_bodies(child: Child, body: dict) -> None:
    """Fields of the wrong type, missing or null: the json_value() defaults and the error paths."""
    check(child, RESPONSES, body)


@GENERATED
@given(body=st.builds(lambda b, seed: scramble(b, random.Random(seed)), anthropic_bodies, st.integers(0, 2**32)))
def test_scrambled_anthropic_bodies(child: Child, body: dict) -> None:
    check(child, MESSAGES, body)
