"""The completion APIs llama-server serves, by request path: the one table that placement, convert and the
reply reader all read.

Why one table: each of them asks the same question of a path (is it a completion, is its body templated chat,
can it be pinned to a slot); separate sets of paths drift apart.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType


class Api(enum.Enum):
    """A completion API of llama-server (b11434's routes in server.cpp)."""

    CHAT = "chat completions"
    RESPONSES = "responses"
    MESSAGES = "anthropic messages"
    PROMPT = "completion"  # a prompt of its own, text or tokens, not templated
    INFILL = "infill"

    @property
    def templated(self) -> bool:
        """Its body is a chat (messages) that llama-server renders through the model's chat template."""
        return self in (Api.CHAT, Api.RESPONSES, Api.MESSAGES)

    @property
    def pinnable(self) -> bool:
        """`id_slot` in its body is honoured: llama-server b11434 drops it when it converts an Anthropic request
        to chat form, so for those it chooses the slot itself."""
        return self is not Api.MESSAGES


COMPLETION_PATHS: Mapping[str, Api] = MappingProxyType(
    {
        "/chat/completions": Api.CHAT,
        "/v1/chat/completions": Api.CHAT,
        "/v1/responses": Api.RESPONSES,
        "/responses": Api.RESPONSES,
        "/v1/messages": Api.MESSAGES,
        "/completion": Api.PROMPT,
        "/completions": Api.PROMPT,
        "/v1/completions": Api.PROMPT,
        "/infill": Api.INFILL,
    }
)


def api_of(path: str) -> Api | None:
    """The completion API of a request path (decoded, without its query string), or None."""
    return COMPLETION_PATHS.get(path)
