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
import time
from dataclasses import dataclass
from typing import Any

from ..llama.client import LlamaClient
from .media import MediaBoundary, media_prompt
from .prefix import common_prefix
from .promptview import PromptViewer, Rendered

PLACEHOLDERS = ("A", "7")  # two next messages that differ in their first token
NEXT_ROLES = frozenset({"user", "tool"})


@dataclass(frozen=True)
class Turn:
    """One boundary of a chat: the history before it, and the role of the message that comes next."""

    history: list[dict[str, Any]]
    next_role: str


@dataclass(frozen=True, kw_only=True)
class Reached:
    """A slot brought to a turn's boundary (what the pinned prompt cost)."""

    n_tokens: int  # the slot now holds this many tokens
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


@dataclass(frozen=True, kw_only=True)
class Boundary:
    """A turn boundary: its tokens as slotkeeper sees them (`promptview`), and what brings a slot there.

    A chat with pictures is brought there by its text and its pictures (`media.media_prompt`), never by a
    text stand-in: the slot keeps each picture's own positions. When a picture's positions are not known yet
    (`whole` False), `tokens` ends before it, and the saved file is checked once it has shown them (`check`).
    """

    token_ids: list[int]
    prompt: Any  # the /completion prompt: the tokens, or {"prompt_string", "multimodal_data"}
    whole: bool = True
    check: list[int] | MediaBoundary | None = None  # what the saved file must hold (None: `tokens`)

    @property
    def expected(self) -> list[int] | MediaBoundary:
        return self.token_ids if self.check is None else self.check


class Boundaries:
    """Renders boundaries through llama-server's own template and tokenizer, and brings slots to them."""

    def __init__(self, viewer: PromptViewer) -> None:
        self.viewer = viewer

    async def find(self, chat: dict[str, Any], turn: Turn) -> Boundary | None:
        """The boundary, or None when llama-server cannot render the chat or its prompt cannot be written."""
        first, second = await asyncio.gather(*(self._render(chat, turn, text) for text in PLACEHOLDERS))
        if first is None or second is None:
            return None
        n = common_prefix(first.token_ids, second.token_ids)
        if not first.pictures:
            return Boundary(token_ids=first.token_ids[:n], prompt=first.token_ids[:n])
        return await self._with_pictures(first, second, n)

    async def _with_pictures(self, first: Rendered, second: Rendered, n: int) -> Boundary | None:
        """The boundary of a chat with pictures: the text both renders share, and the pictures in it. It must
        tokenize to exactly the tokens both renders share (else the slot could not be brought there)."""
        text = first.text[: common_prefix(first.text, second.text)]
        marker = self.viewer.book.marker or ""
        pictures = first.pictures[: text.count(marker)]
        if any(picture.data is None for picture in pictures):
            return None  # given by URL: slotkeeper does not have its bytes
        found = await self.viewer.text(text, pictures)
        if found is None:
            return None
        prompt = media_prompt(text, pictures)
        if first.whole and second.whole and found.whole:
            return (
                Boundary(token_ids=found.token_ids, prompt=prompt) if found.token_ids == first.token_ids[:n] else None
            )
        last, ends = found.pieces[-1], (first.pieces[len(found.pieces) - 1], second.pieces[len(found.pieces) - 1])
        if common_prefix(*ends) != len(last) or tuple(ends[0][: len(last)]) != last:
            return None
        return Boundary(
            token_ids=found.token_ids,
            prompt=prompt,
            whole=found.whole,
            check=MediaBoundary(found.pieces, tuple(pictures)),
        )

    async def _render(self, chat: dict[str, Any], turn: Turn, placeholder: str) -> Rendered | None:
        """The chat's history followed by one placeholder message (both renders run at once)."""
        body = {**chat, "messages": [*turn.history, _placeholder(turn.next_role, placeholder, turn.history)]}
        body.pop("id_slot", None)
        return await self.viewer.chat(body)

    async def reach(self, slot_id: int, boundary: Boundary) -> Reached | None:
        """Make the (idle, reserved) slot hold exactly the boundary: prefill without generating anything."""
        started = time.monotonic()
        reply = await self.client.call_json(
            "POST",
            "/completion",
            {"prompt": boundary.prompt, "n_predict": 0, "cache_prompt": True, "id_slot": slot_id},
        )
        if not reply.ok or not isinstance(reply.body, dict):
            return None
        timings = reply.body.get("timings") or {}
        return Reached(
            n_tokens=len(boundary.token_ids),
            prefilled=int(timings.get("prompt_n", 0)),
            seconds=time.monotonic() - started,
        )

    @property
    def client(self) -> LlamaClient:
        return self.viewer.client
