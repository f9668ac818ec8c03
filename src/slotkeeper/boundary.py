"""Turn boundaries: the exact tokens a chat's next request will open with.

Why: on hybrid models (attention plus a recurrent state) and on sliding-window models, llama-server reuses a
restored state only when the next prompt extends *all* of its tokens (a recurrent state cannot be rolled
back; a sliding-window file lacks the positions before its window). A slot at the end of a turn holds the
reply as it was generated, reasoning included; the next request carries it as the template re-renders it
from what the front end sends back. So a chat is saved at its boundary instead: the history, with the last
reply as the front end re-sends it, rendered by the template up to where the next message's content starts.

The template decides that point, never the reply text: the history is rendered twice, followed by two
different placeholder messages, and the boundary is the longest common prefix of the two token lists. A
pinned `n_predict: 0` request with those tokens then brings the live slot there (llama-server rolls back to
its in-memory checkpoint and prefills the tail), and the slot is saved.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from .llama_client import LlamaClient

PLACEHOLDERS = ("A", "7")  # two next messages that differ in their first token
NEXT_ROLES = frozenset({"user", "tool"})


@dataclass(frozen=True)
class Turn:
    """One boundary of a chat: the history before it, and the role of the message that comes next."""

    history: list[dict[str, Any]]
    next_role: str


@dataclass(frozen=True)
class Reached:
    tokens: int  # the slot now holds this many tokens
    prefilled: int  # of which llama-server had to process this many
    seconds: float


def turns_of(messages: list[dict[str, Any]], reply: dict[str, Any] | None) -> tuple[Turn | None, Turn | None]:
    """The chat's boundary after its last reply, and the one before its last request's new messages (the
    fallback a regenerate or an edit of the last message extends). Either may be None."""
    trailing = 0
    while trailing < len(messages) and messages[len(messages) - 1 - trailing].get("role") in NEXT_ROLES:
        trailing += 1
    previous = None
    if trailing and len(messages) > trailing:
        previous = Turn(messages[: len(messages) - trailing], str(messages[len(messages) - trailing]["role"]))
    current = None
    if reply is not None and trailing:
        current = Turn([*messages, reply], "tool" if reply.get("tool_calls") else "user")
    return current, previous


def _placeholder(role: str, text: str, history: list[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": role, "content": text}
    if role == "tool":
        calls = history[-1].get("tool_calls") if history else None
        if calls and isinstance(calls[0], dict) and calls[0].get("id"):
            message["tool_call_id"] = calls[0]["id"]
    return message


class Boundaries:
    """Renders boundaries through llama-server's own template and tokenizer, and brings slots to them."""

    def __init__(self, client: LlamaClient) -> None:
        self.client = client

    async def tokens(self, chat: dict[str, Any], turn: Turn) -> list[int] | None:
        """The boundary's tokens, or None when llama-server cannot render the chat."""
        first, second = await asyncio.gather(*(self._render(chat, turn, text) for text in PLACEHOLDERS))
        if first is None or second is None:
            return None
        n = 0
        for a, b in zip(first, second):
            if a != b:
                break
            n += 1
        return first[:n]

    async def _render(self, chat: dict[str, Any], turn: Turn, placeholder: str) -> list[int] | None:
        """The tokens of the chat's history followed by one placeholder message (both renders run at once)."""
        body = {**chat, "messages": [*turn.history, _placeholder(turn.next_role, placeholder, turn.history)]}
        body.pop("id_slot", None)
        return await self.client.chat_tokens(json.dumps(body, separators=(",", ":")).encode())

    async def reach(self, slot_id: int, tokens: list[int]) -> Reached | None:
        """Make the (idle, reserved) slot hold exactly `tokens`: prefill without generating anything."""
        started = time.monotonic()
        reply = await self.client.call_json(
            "POST", "/completion", {"prompt": tokens, "n_predict": 0, "cache_prompt": True, "id_slot": slot_id}
        )
        if not reply.ok or not isinstance(reply.body, dict):
            return None
        timings = reply.body.get("timings") or {}
        return Reached(len(tokens), int(timings.get("prompt_n", 0)), time.monotonic() - started)
