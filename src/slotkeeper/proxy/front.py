"""What a client connection works with besides its requests and the child: when it reads (FlowControl), and
the proxy and gate it belongs to, as protocols (Front, GateView).

The protocols let connection.py call the Proxy and wait at the Gate without importing server.py, which imports
connection.py to create the connections: imports go one way, as upstream.Exchange lets a ChildConnection call
a ClientConnection. Front is generic in the connection's type for the same reason (the Proxy's sets hold
ClientConnections). They only type what a connection reads on the Proxy: nothing stands between the two.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .hook import CompletionHook
    from .messages import OwnRoute, Request
    from .upstream import ChildPool

# Why a client connection stops reading (bits of FlowControl.holds)
HOLD_CHILD_BUSY = 1  # the child is not reading the body we forward
HOLD_BUFFERED = 2  # BODY_BUFFER_HIGH bytes of body wait for the gate, a connection or a pipelined turn


class FlowControl:
    """Whether a client connection reads: not while any reason holds it (`holds`: HOLD_* bits).

    Each reason is held and released on its own: by the child's connection (it is not reading the body we
    forward) and by the client's (too much body waits to be sent), so one cannot resume what the other paused.
    """

    __slots__ = ("holds", "transport")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None  # set once connected; None again once the connection is lost
        self.holds = 0

    def hold(self, reason: int) -> None:
        if not self.holds and self.transport is not None:
            self.transport.pause_reading()
        self.holds |= reason

    def unhold(self, reason: int) -> None:
        if self.holds & reason:
            self.holds &= ~reason
            if not self.holds and self.transport is not None:
                self.transport.resume_reading()

    def release_all(self) -> None:
        """Read again, whatever held the connection."""
        self.holds = 0
        if self.transport is not None:
            self.transport.resume_reading()


# ---- the proxy, as its connections see it ------------------------------------------------------------------


Connection = TypeVar("Connection")


class GateView(Protocol):
    """The gate requests wait at until the restore is done (server.Gate)."""

    @property
    def is_open(self) -> bool: ...

    async def wait(self, timeout: float | None) -> bool:
        """True once the gate is open, False once it is closed or after `timeout` seconds."""
        ...


class Front(Protocol[Connection]):
    """What a client connection reads and calls of the proxy it belongs to (server.Proxy, which creates it)."""

    pool: ChildPool
    accepting: bool  # False once draining: what comes in gets a 503
    startup_deadline: float  # time.monotonic() by which the gate should be open
    describe_state: Callable[[], str]  # for /health while the gate is shut
    connections: set[Connection]
    own_routes: dict[str, OwnRoute]  # slotkeeper's own routes, by path
    hook: CompletionHook | None  # completion requests go through it

    @property
    def gate(self) -> GateView: ...

    def authorized(self, req: Request) -> bool:
        """The request may use slotkeeper's own routes: it carries an API key llama-server accepts, if any is set."""
        ...

    def enter(self, conn: Connection) -> None:
        """A request of `conn` is forwarded: counted, and in flight until it leaves."""
        ...

    def leave(self, conn: Connection, status: int) -> None:
        """That request has ended with `status` (499: the client went away)."""
        ...
