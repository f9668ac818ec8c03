"""The proxy's one hook into slotkeeper: what a completion request's placement returns to the proxy.

A module of its own so that what implements the hook (placement/hook.py) depends on these two types only, not on
the proxy that calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Placed:
    """What the completion hook decided for one request: the body to send, and who to tell when it ended."""

    __slots__ = ("body", "done", "observe")

    def __init__(
        self, body: bytes, done: Callable[[int], None] | None = None, observe: Callable[[bytes], None] | None = None
    ) -> None:
        self.body = body
        self.done = done  # called once with the final status (499: the client went away)
        self.observe = observe  # given each piece of the response body, as llama-server sent it (unframed)


class CompletionHook(Protocol):
    """The proxy's one hook: completion requests are read whole and handed here before they are sent.

    The proxy stays a transport; what to do with a completion (which slot, restore first) lives behind this.
    """

    def wants(self, method: bytes, path: str) -> bool:
        """Cheap and synchronous: is this a request the hook places?"""
        ...

    async def place(self, path: str, body: bytes) -> Placed:
        """The body to forward (changed or not); may wait (a slot restore). Must not raise."""
        ...
