"""The assistant message a client will send back, read from llama-server's response, in each API's form.

Why: on hybrid and sliding-window models a saved state is reused only when the next request extends all of
its tokens, so a chat must be saved at its *turn boundary*: the history with the last reply as the client
re-sends it, rendered by the model's template. Each API's clients send the reply back in that API's form:

* chat completions: the message's `content` and `tool_calls`, never its `reasoning_content` (front ends drop
  it; the template decides the rest);
* Responses: the response's `output` items as they came (messages, function calls, reasoning);
* Anthropic Messages: the response's `content` blocks as they came (text, tool_use, thinking).

The last two are put in chat form by the same conversion llama-server applies to the next request
(`convert`), so the boundary is rendered from exactly what that request will hold. The body is kept as it
arrives (a list append per piece, off the parsing path) and parsed once, only when it is needed: for a
boundary, or for the token counts that tell which slot ran an unpinnable request (`usage`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from . import convert
from .apis import Api

MAX_REPLY_BYTES = 8 * 1024 * 1024  # a longer response is not kept: its chat is saved without a boundary


@dataclass(frozen=True)
class Usage:
    """What the response says llama-server did: the prompt's tokens, how many it reused, how many it made."""

    prompt: int
    cached: int
    generated: int


@dataclass
class _Read:
    """A response body as parsed: the assistant message (None: not one) and its usage."""

    message: dict[str, Any] | None
    usage: Usage | None


class ReplyReader:
    """Collects one response body; `message()` parses it into the assistant message in chat form, or None."""

    __slots__ = ("_api", "_parts", "_read", "_size")

    def __init__(self, api: Api = Api.CHAT) -> None:
        """`api`: the request's, one of the templated ones (its response is in that API's form)."""
        self._api = api
        self._parts: list[bytes] | None = []
        self._size = 0
        self._read: _Read | None = None

    def feed(self, data: bytes) -> None:
        parts = self._parts
        if parts is None:
            return
        self._size += len(data)
        if self._size > MAX_REPLY_BYTES:
            self._parts = None
            return
        parts.append(data)
        self._read = None

    def message(self) -> dict[str, Any] | None:
        """The assistant message as the client re-sends it, in chat form."""
        return self._parsed().message

    def usage(self) -> Usage | None:
        """The response's token counts, when it carries them whole."""
        return self._parsed().usage

    def _parsed(self) -> _Read:
        if self._read is not None:
            return self._read
        read = _Read(None, None)
        if self._parts is not None:
            body = b"".join(self._parts)
            try:
                read = _PARSERS[self._api](body, body.lstrip().startswith(b"{"))
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                pass
        self._read = read
        return read


def _events(body: bytes) -> list[Any]:
    """The JSON payloads of a server-sent event stream's `data:` lines (`[DONE]` as None)."""
    events: list[Any] = []
    for line in body.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            events.append(None if payload == b"[DONE]" else json.loads(payload))
    return events


# ---- chat completions -------------------------------------------------------------------------------------


def _chat(body: bytes, whole: bool) -> _Read:  # noqa: C901 - whole or streamed, each field as it arrives
    if whole:
        data = json.loads(body)
        message = data["choices"][0]["message"]
        if not isinstance(message, dict):
            return _Read(None, None)
        return _Read(_sent_back(message.get("content"), message.get("tool_calls")), _chat_usage(data))
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finished = False
    usage = None
    for event in _events(body):
        if event is None:
            finished = True
            break
        usage = _chat_usage(event) or usage
        choices = event.get("choices") or []
        if not choices:
            continue
        choice = choices[0]
        delta = choice.get("delta") or {}
        if isinstance(delta.get("content"), str):
            content.append(delta["content"])
        for call in delta.get("tool_calls") or ():
            merged = calls.setdefault(int(call.get("index", 0)), {"function": {"name": "", "arguments": ""}})
            for key in ("id", "type"):
                if call.get(key):
                    merged[key] = call[key]
            function = call.get("function") or {}
            for key in ("name", "arguments"):
                if isinstance(function.get(key), str):
                    merged["function"][key] += function[key]
        if choice.get("finish_reason"):
            finished = True
    if not finished:
        return _Read(None, None)  # cut off: the client did not see a whole reply either
    tool_calls = [calls[i] for i in sorted(calls)]
    return _Read(_sent_back("".join(content) if content or not tool_calls else None, tool_calls), usage)


def _chat_usage(data: dict[str, Any]) -> Usage | None:
    timings = data.get("timings")
    if isinstance(timings, dict) and "prompt_n" in timings:
        cached = int(timings.get("cache_n", 0))
        return Usage(int(timings["prompt_n"]) + cached, cached, int(timings.get("predicted_n", 0)))
    return None


def _sent_back(content: Any, tool_calls: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


# ---- Responses --------------------------------------------------------------------------------------------


def _responses(body: bytes, whole: bool) -> _Read:
    response: Any = json.loads(body) if whole else None
    if not whole:
        for event in _events(body):
            if isinstance(event, dict) and event.get("type") == "response.completed":
                response = event["response"]
    if not isinstance(response, dict):
        return _Read(None, None)  # cut off before its last event
    usage = response.get("usage") or {}
    cached = int((usage.get("input_tokens_details") or {}).get("cached_tokens", 0))
    counts = Usage(int(usage["input_tokens"]), cached, int(usage.get("output_tokens", 0))) if usage else None
    return _Read(_one_assistant(convert.responses_to_chat({"input": response["output"]})), counts)


# ---- Anthropic Messages -----------------------------------------------------------------------------------


def _anthropic(body: bytes, whole: bool) -> _Read:  # noqa: C901 - one branch per event type
    if whole:
        data = json.loads(body)
        return _Read(_anthropic_message(data["content"]), _anthropic_usage(data.get("usage") or {}, None))
    blocks: dict[int, dict[str, Any]] = {}
    partial_json: dict[int, str] = {}
    started: dict[str, Any] = {}
    generated = None
    finished = False
    for event in _events(body):
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "message_start":
            started = event["message"].get("usage") or {}
        elif kind == "content_block_start":
            blocks[int(event["index"])] = dict(event["content_block"])
        elif kind == "content_block_delta":
            index, delta = int(event["index"]), event["delta"]
            block = blocks[index]
            match delta.get("type"):
                case "text_delta":
                    block["text"] = block.get("text", "") + delta["text"]
                case "thinking_delta":
                    block["thinking"] = block.get("thinking", "") + delta["thinking"]
                case "signature_delta":
                    block["signature"] = block.get("signature", "") + delta["signature"]
                case "input_json_delta":
                    partial_json[index] = partial_json.get(index, "") + delta["partial_json"]
        elif kind == "message_delta":
            generated = (event.get("usage") or {}).get("output_tokens")
        elif kind == "message_stop":
            finished = True
    if not finished:
        return _Read(None, None)
    for index, text in partial_json.items():
        blocks[index]["input"] = json.loads(text) if text else {}
    for block in blocks.values():
        if block.get("type") == "tool_use":
            block.setdefault("input", {})
    content = [blocks[i] for i in sorted(blocks)]
    return _Read(_anthropic_message(content), _anthropic_usage(started, generated))


def _anthropic_usage(usage: dict[str, Any], generated: Any) -> Usage | None:
    if "input_tokens" not in usage:
        return None
    cached = int(usage.get("cache_read_input_tokens", 0))
    out = generated if generated is not None else usage.get("output_tokens", 0)
    return Usage(int(usage["input_tokens"]) + cached, cached, int(out))


def _anthropic_message(content: list[Any]) -> dict[str, Any] | None:
    return _one_assistant(convert.anthropic_to_chat({"messages": [{"role": "assistant", "content": content}]}))


def _one_assistant(chat: dict[str, Any]) -> dict[str, Any] | None:
    """The one assistant message a converted reply makes (None when it makes nothing, or something else)."""
    messages = chat.get("messages") or []
    if len(messages) != 1 or not isinstance(messages[0], dict) or messages[0].get("role") != "assistant":
        return None
    message: dict[str, Any] = messages[0]
    return message


_PARSERS = {Api.CHAT: _chat, Api.RESPONSES: _responses, Api.MESSAGES: _anthropic}
