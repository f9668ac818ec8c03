"""Shared openings: what chats share before their first user message (the system prompt, the tools).

Why: every new chat and agent session re-sends its opening, often thousands of tokens of tool definitions.
Saved once as an entry of its own, it starts every later chat that shares it warm, on every model family: the
opening is a turn boundary (`boundary.py`: the history before the first user message, rendered twice with two
placeholder user messages, and cut at their common token prefix), so a hybrid or sliding-window model reuses
it in full when a request extends it.

This module finds a chat's opening and remembers it per distinct opening (two renders the first time it is
seen, none after); placement decides when to save one and when to restore one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..log import log
from .boundary import Boundaries, Turn
from .prefix import exact_key, extends_exactly

REMEMBERED = 256  # distinct openings whose tokens are kept


@dataclass(frozen=True, kw_only=True)
class Opening:
    """A chat's opening: its exact tokens, their `prefix.exact_key`, and the keys of the messages (with the
    chat's settings first) that lead to it (`placement.request.message_keys_of`)."""

    token_ids: list[int]
    key: str
    message_keys: list[str]


def opening_turn(messages: list[Any]) -> Turn | None:
    """The boundary before the first user message's content (None when the chat has no user message)."""
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return Turn(messages[:i], "user")
    return None


def is_opening(turn: Turn) -> bool:
    """A boundary with no user message before it: an opening that other chats may share."""
    return turn.next_role == "user" and not any(m.get("role") == "user" for m in turn.history)


class Openings:
    """The tokens of the openings seen lately, rendered through llama-server's own template and tokenizer."""

    def __init__(self, boundaries: Boundaries) -> None:
        self.boundaries = boundaries
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()  # the opening's last message key -> its tokens
        self._with_pictures: set[str] = set()  # openings with pictures, said once each

    async def of(self, chat: dict[str, Any], turn: Turn, message_keys: list[str], request: list[int]) -> Opening | None:
        """The opening of a chat whose request has the tokens `request`; None when it cannot be rendered or the
        request does not extend it exactly (a template that renders the system part differently once a real
        message follows: then an opening entry would not be reused, and is not made)."""
        key = message_keys[-1]
        tokens = self._tokens.get(key)
        if tokens is None:
            found = await self.boundaries.find(chat, turn)
            if found is not None and not isinstance(found.prompt, list):
                if key not in self._with_pictures:
                    if len(self._with_pictures) >= REMEMBERED:
                        self._with_pictures.clear()
                    self._with_pictures.add(key)
                    log.info("an opening with pictures is not saved as a shared opening: each chat keeps it")
                return None
            if found is None:
                return None
            tokens = found.token_ids
            self._tokens[key] = tokens
            while len(self._tokens) > REMEMBERED:
                self._tokens.popitem(last=False)
        else:
            self._tokens.move_to_end(key)
        exact = exact_key(tokens)
        if not tokens or not extends_exactly(request, len(tokens), exact):
            return None
        return Opening(token_ids=tokens, key=exact, message_keys=message_keys)
