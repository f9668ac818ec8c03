"""The assistant message a front end will send back, read from llama-server's chat completion response.

Why: on hybrid and sliding-window models a saved state is reused only when the next request extends all of
its tokens, so a chat must be saved at its *turn boundary*: the history with the last reply as the front end
re-sends it, rendered by the model's template. Front ends send back the reply's `content` and `tool_calls`,
never its `reasoning_content`; the template decides the rest. This reads just those fields from the
response, plain JSON or a server-sent event stream, without touching the bytes the client receives.

The body is kept as it arrives (a list append per piece, off the parsing path) and parsed once, only when
the chat is about to be saved.
"""

from __future__ import annotations

import json
from typing import Any

MAX_REPLY_BYTES = 8 * 1024 * 1024  # a longer response is not kept: its chat is saved without a boundary


class ReplyReader:
    """Collects one response body; `message()` parses it into the assistant message, or None."""

    __slots__ = ("_parts", "_size")

    def __init__(self) -> None:
        self._parts: list[bytes] | None = []
        self._size = 0

    def feed(self, data: bytes) -> None:
        parts = self._parts
        if parts is None:
            return
        self._size += len(data)
        if self._size > MAX_REPLY_BYTES:
            self._parts = None
            return
        parts.append(data)

    def message(self) -> dict[str, Any] | None:
        """The assistant message as a front end re-sends it (`role`, `content`, and `tool_calls` if any)."""
        if self._parts is None:
            return None
        body = b"".join(self._parts)
        stripped = body.lstrip()
        try:
            if stripped.startswith(b"{"):
                return _from_json(json.loads(body))
            return _from_events(body)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return None


def _from_json(data: Any) -> dict[str, Any] | None:
    message = data["choices"][0]["message"]
    if not isinstance(message, dict):
        return None
    return _sent_back(message.get("content"), message.get("tool_calls"))


def _from_events(body: bytes) -> dict[str, Any] | None:
    """A stream of `data: {chunk}` events: the content deltas joined, tool call deltas merged by index."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finished = False
    for line in body.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            finished = True
            break
        choices = json.loads(payload).get("choices") or []
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
        return None  # cut off: the client did not see a whole reply either
    tool_calls = [calls[i] for i in sorted(calls)]
    return _sent_back("".join(content) if content or not tool_calls else None, tool_calls)


def _sent_back(content: Any, tool_calls: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message
