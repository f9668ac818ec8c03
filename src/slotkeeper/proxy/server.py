"""The proxy's server half: the Proxy that listens, counts and drains, and the Gate requests wait at.

(The rules a client sees, and why protocol callbacks: the package's docstring, `slotkeeper.proxy`.)

The Proxy is what the daemon holds: it listens on the public sockets, creates a ClientConnection
(connection.py) for each client, counts the requests those forward (in flight, by status) and waits for them to
drain at exit. It also holds what every connection shares: the ChildPool, the Gate, slotkeeper's own routes and
the API keys that guard them, and the completion hook. The connections read it as a `front.Front`.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..log import log
from .connection import ClientConnection
from .messages import OwnRoute, Request
from .upstream import ChildPool, Endpoint

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .hook import CompletionHook

# GET requests llama-server answers without a task that moves its idle clock (b11434: /slots and /metrics post a
# METRICS task, which does not): a monitor polling them does not keep slotkeeper from being idle, as it does not
# keep llama-server from sleeping.
STATUS_PATHS = frozenset({"/health", "/v1/health", "/props", "/models", "/v1/models", "/metrics", "/slots"})
CLIENT_IDLE_S = 75.0  # a client's idle keep-alive connection is closed after this long (aiohttp's default)
CLIENT_SWEEP_S = 15.0
CLOSE_GRACE_S = 1.0  # at exit, how long requests still running get to end (the child is gone: they fail fast)


# ---- the gate, and the proxy as a whole -----------------------------------------------------------------------


class Gate:
    """Requests wait here until the restore is done; resolved once, to open (True) or closed (False)."""

    def __init__(self) -> None:
        self._outcome: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.is_open = False

    def open(self) -> None:
        if not self._outcome.done():
            self._outcome.set_result(True)
            self.is_open = True

    def close(self) -> None:
        if not self._outcome.done():
            self._outcome.set_result(False)

    async def wait(self, timeout: float | None) -> bool:
        try:
            return await asyncio.wait_for(asyncio.shield(self._outcome), timeout)
        except TimeoutError:
            return False


class Proxy:
    """The public server: forwards every request to the child once the gate is open; counts and drains them.

    Its connections see it as a front.Front[ClientConnection]: what they read and call of it is declared there.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        gate: Gate,
        describe_state: Callable[[], str],
        startup_deadline: float,
        api_keys: Sequence[str] = (),
    ) -> None:
        self.pool = ChildPool.for_endpoint(endpoint)
        # llama-server's keys: slotkeeper's own routes require one as llama-server's routes do (surrogateescape:
        # a key from argv compares as the bytes llama-server got)
        self._api_keys = tuple(key.encode("utf-8", "surrogateescape") for key in api_keys)
        self.gate = gate
        self.describe_state = describe_state
        self.startup_deadline = startup_deadline
        self.accepting = True
        self.in_flight: set[ClientConnection] = set()  # connections with a forwarded request under way
        self.connections: set[ClientConnection] = set()
        self.last_activity = time.monotonic()  # when the last request that made llama-server work ended
        self.requests_total = 0
        self.working = 0  # requests in flight that make llama-server work (not a status poll)
        self.work_total = 0  # such requests so far
        self.status_counts: collections.Counter[int] = collections.Counter()  # 499: the client went away
        self.own_routes: dict[str, OwnRoute] = {}  # path -> handler
        self.hook: CompletionHook | None = None  # completion requests go through it (the conversation cache)
        self._idle = asyncio.Event()
        self._idle.set()
        self._servers: list[asyncio.AbstractServer] = []
        self._sweeper: asyncio.Future[None] | None = None

    # ---- serving ----

    async def listen(self, host: str, port: int) -> str:
        """Listen on a TCP host and port, or on a unix socket when `host` ends in .sock; returns its name."""
        loop = asyncio.get_running_loop()
        if host.endswith(".sock"):
            server = await loop.create_unix_server(lambda: ClientConnection(self), host)
            name = f"unix:{host}"
        else:
            server = await loop.create_server(lambda: ClientConnection(self), host, port, reuse_address=True)
            if port == 0 and server.sockets:  # (--port 0: the kernel's choice, which the log must name)
                port = server.sockets[0].getsockname()[1]
            name = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        self._servers.append(server)
        if self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._close_idle_clients())
        return name

    async def stop_listening(self) -> None:
        """Close the public sockets and every client connection: idle ones now, and those with a request under
        way once it has ended (a 502 if the child is gone), or after CLOSE_GRACE_S."""
        for server in self._servers:
            server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.connections):
            if conn.active is None:
                conn.close()
        if not await self.wait_idle(CLOSE_GRACE_S):
            log.warning("%d request(s) still running at exit after %.1f s; cut off", len(self.in_flight), CLOSE_GRACE_S)
        for conn in list(self.connections):
            if conn.active is None:
                conn.close()
            else:
                conn.abort()
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()

    async def _close_idle_clients(self) -> None:
        while True:
            await asyncio.sleep(CLIENT_SWEEP_S)
            limit = time.monotonic() - CLIENT_IDLE_S
            for conn in list(self.connections):
                if conn.active is None and conn.idle_since < limit:
                    conn.close()

    def authorized(self, req: Request) -> bool:
        """llama-server's API key check (server-http.cpp, middleware_validate_api_key), for slotkeeper's own
        paths: the first Authorization header, else X-Api-Key, less a "Bearer " prefix, must be a key. Every key
        is compared in constant time, so the time taken tells nothing about any of them."""
        keys = self._api_keys
        if not keys:
            return True
        given = (req.first_header(b"authorization") or req.first_header(b"x-api-key")).removeprefix(b"Bearer ")
        return any([hmac.compare_digest(given, key) for key in keys])  # a list: no early exit

    # ---- accounting, for the daemon ----

    def enter(self, conn: ClientConnection) -> None:
        self.in_flight.add(conn)
        self.requests_total += 1
        self._idle.clear()
        req = conn.active
        if req is not None and (req.method != b"GET" or req.path not in STATUS_PATHS):
            req.works = True
            self.working += 1
            self.work_total += 1

    def leave(self, conn: ClientConnection, status: int) -> None:
        self.status_counts[status] += 1
        self.in_flight.discard(conn)
        req = conn.active
        if req is not None and req.works:
            req.works = False
            self.working -= 1
            self.last_activity = time.monotonic()
        if not self.in_flight:
            self._idle.set()

    def upstream_in_flight(self) -> bool:
        """Some request in flight goes to llama-server (slotkeeper's own status and metrics routes do not): what
        work done while idle (a recompute) gives way to."""
        return any(conn.active is None or conn.active.own_route is None for conn in self.in_flight)

    async def wait_idle(self, timeout: float) -> bool:
        """True when no request is in flight within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def cancel_in_flight(self) -> int:
        """Cut off the requests still running (their clients' connections close)."""
        running = list(self.in_flight)
        for conn in running:
            conn.abort()
        return len(running)

    def close(self) -> None:
        """Close the idle connections to the child (requests in flight close theirs when they end)."""
        self.pool.close()
