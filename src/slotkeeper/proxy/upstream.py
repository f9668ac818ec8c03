"""The proxy's upstream side: keep-alive connections to the llama-server child, and what each one carries.

A ChildConnection carries one exchange at a time for an `Exchange`: a client's connection (connection.py),
which relays the answer as it arrives, or one of slotkeeper's own requests (InternalExchange), which collects
it whole. Connections are kept alive in ChildPool, on the child's private socket.

Nothing is timed out here but connecting to the child (CONNECT_TIMEOUT_S).
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Protocol

import httptools

# Bound only what is safe to bound: reaching the child. Slot saves of large caches and long generations
# legitimately take minutes, so callers bound their own waits.
CONNECT_TIMEOUT_S = 10.0
POOL_IDLE_S = 2.0  # drop an idle connection before the child does (llama-server: 5 s) to avoid a reuse race
POOL_MAX_IDLE = 64
CONNECT_RETRY_S = 0.002  # first wait when the child's accept queue is full (doubling, up to 0.1 s)


class Endpoint(Protocol):
    """Where the child listens, as the pool reaches it: a unix socket, or a loopback port (the supervisor's
    endpoint is one; the proxy does not import the supervisor)."""

    @property
    def socket_path(self) -> str | None: ...

    @property
    def tcp_port(self) -> int | None: ...


class Exchange(Protocol):
    """The side a ChildConnection carries an exchange for: what it calls as the child's answer arrives.

    What these write during one read from the child goes out in one write (`batch`, then `flush`).
    """

    def batch(self) -> None:
        """A read from the child begins: collect what the calls below write."""
        ...

    def flush(self) -> None:
        """The read is processed: write what was collected."""
        ...

    def pause_body(self) -> None:
        """The child is not reading the request body we forward: stop reading more of it."""
        ...

    def resume_body(self) -> None:
        """The child reads the request body again."""
        ...

    def response_head(self, status: int, head: bytes, no_body: bool) -> bool:
        """The child's raw status line and headers (each line ending in CRLF, as validated by llhttp); True when
        its body ends only when it closes."""
        ...

    def response_body(self, data: bytes) -> None:
        """A piece of the response body, as llama-server sent it (unframed)."""
        ...

    def response_done(self) -> None:
        """The child's answer is complete (its connection is back in the pool or closed)."""
        ...

    def child_failed(self, reason: str) -> None:
        """The child broke the exchange: closed the connection, or answered malformed."""
        ...


class ChildConnection(asyncio.Protocol):
    """One keep-alive connection to the child, carrying one exchange at a time for an Exchange."""

    def __init__(self, pool: ChildPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.client: Exchange | None = None  # whom the current answer goes to
        self.closed = False
        self.reused = False  # taken from the pool: it carried an exchange before this one
        self.idle_since = 0.0
        self.request_sent = False  # the whole request, body included, was written
        self.got_bytes = False  # any byte of the current response arrived
        self.half_closed = False  # we sent EOF (the client did): never reused
        self._head_request = False
        self._head: bytes | None = None  # the response so far, until its head is complete
        self._interim = False
        self._until_close = False
        self._keep_alive = False
        self._reading_paused = False
        self._head_answered = False  # a HEAD answer's headers are in: the exchange ends after this read

    def start(self, client: Exchange, payload: bytes, head_request: bool, complete: bool) -> None:
        self.client = client
        self.request_sent = complete
        self.got_bytes = False
        self._head_request = head_request
        self._head = b""
        self._until_close = False
        if self.closed:  # the child closed it while it was idle, and we heard just now
            self.client = None
            client.child_failed("llama-server closed the connection")
            return
        self.transport.write(payload)  # type: ignore[union-attr]

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def pause_reading(self) -> None:
        if not self._reading_paused and not self.closed and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and not self.closed and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()

    def half_close(self) -> None:
        """Send EOF after the request, as the client did: llama-server polls its socket during a non-streamed
        generation and cancels it when it reads EOF, so it decides as it would for a direct client (which it
        cannot tell from one that only half-closed either). The answer, if any, is still read."""
        self.half_closed = True
        transport = self.transport
        if transport is not None and not self.closed and transport.can_write_eof():
            transport.write_eof()

    def abort(self) -> None:
        """Drop the connection now (the child sees it closed and cancels what it was doing for us)."""
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.closed = True

    @property
    def reusable(self) -> bool:
        return self._keep_alive and self.request_sent and not self.closed and not self.half_closed

    # ---- asyncio.Protocol ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None:  # bytes nobody asked for: the connection cannot be trusted any more
            self.abort()
            return
        self.got_bytes = True
        if self._head is not None:
            self._head += data
        client.batch()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.abort()
            if self.client is not None:
                self.client = None
                cause = exc.__context__
                client.child_failed(f"malformed response from llama-server: {cause or exc}")
        if self._head_answered:
            # llhttp waits for the Content-Length bytes a HEAD answer announces but never sends: a new parser
            self._head_answered = False
            self.parser = httptools.HttpResponseParser(self)
            if self.client is not None:
                self._finish()
        client.flush()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost decides whether the response was complete

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        client = self.client
        if client is None:
            return
        self.client = None
        client.batch()
        if self._until_close:
            client.response_done()
        else:
            client.child_failed(f"llama-server closed the connection ({exc or 'EOF'})")
        client.flush()

    def pause_writing(self) -> None:  # the child is not reading the body we forward
        if self.client is not None:
            self.client.pause_body()

    def resume_writing(self) -> None:
        if self.client is not None:
            self.client.resume_body()

    # ---- httptools callbacks ----

    def on_headers_complete(self) -> None:
        # The head is the start of what arrived (a response begins a read: we send no request before the
        # previous answer is complete), up to the first blank line.
        head = self._head or b""
        end = head.find(b"\r\n\r\n")
        status = self.parser.get_status_code()
        if status < 200:  # interim (100 Continue, 103 Early Hints): the real answer follows
            self._interim = True
            self._head = head[end + 4 :]
            return
        self._head = None
        client = self.client
        if client is None:
            return
        self._keep_alive = self.parser.should_keep_alive()
        no_body = self._head_request or status in (204, 304)
        self._until_close = client.response_head(status, head[: end + 2], no_body)
        self._head_answered = self._head_request

    def on_body(self, data: bytes) -> None:
        client = self.client
        if client is not None and not self._head_answered:
            client.response_body(data)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
        elif self.client is not None and not self._head_answered:
            self._finish()

    def _finish(self) -> None:
        client = self.client
        assert client is not None
        self.client = None
        if self._reading_paused:
            self.resume_reading()
        self.pool.release(self)
        client.response_done()


class ChildPool:
    """Keep-alive connections to the child, most recently used first; connecting is the only thing timed."""

    def __init__(self, socket_path: str | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.socket_path = socket_path
        self.host = host
        self.port = port
        self._idle: list[ChildConnection] = []

    @classmethod
    def for_endpoint(cls, endpoint: Endpoint) -> ChildPool:
        if endpoint.socket_path is not None:
            return cls(socket_path=str(endpoint.socket_path))
        assert endpoint.tcp_port is not None
        return cls(port=endpoint.tcp_port)

    def take(self) -> ChildConnection | None:
        """An idle connection, or None (then `connect`)."""
        idle = self._idle
        now = 0.0
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            now = now or time.monotonic()
            if now - conn.idle_since >= POOL_IDLE_S:
                conn.abort()
                continue
            conn.reused = True
            return conn
        return None

    async def connect(self) -> ChildConnection:
        """A new connection, within CONNECT_TIMEOUT_S; a full accept queue (EAGAIN on a unix socket, when many
        requests arrive at once) is waited out, not reported."""
        # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that arrives as the
        # connect fails (no socket yet), and a health poll cancelled that way would loop on forever.
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            return await self._connect()

    async def _connect(self) -> ChildConnection:
        loop = asyncio.get_running_loop()
        if self.socket_path is None:
            _, conn = await loop.create_connection(lambda: ChildConnection(self), self.host, self.port)
            return conn
        # A unix socket connects at once or fails with EAGAIN (never "in progress"), which the event loops
        # do not all tell apart: connect here, and hand the loop a connected socket.
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            backoff = CONNECT_RETRY_S
            while True:
                try:
                    sock.connect(self.socket_path)
                    break
                except BlockingIOError:
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 0.1)
            _, conn = await loop.create_unix_connection(lambda: ChildConnection(self), sock=sock)
        except BaseException:
            sock.close()
            raise
        return conn

    def release(self, conn: ChildConnection) -> None:
        """Back to the pool when its exchange ended cleanly; closed otherwise."""
        if not conn.reusable:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        idle = self._idle
        while idle and (idle[0].closed or conn.idle_since - idle[0].idle_since >= POOL_IDLE_S):
            idle.pop(0).abort()
        if len(idle) >= POOL_MAX_IDLE:
            idle.pop(0).abort()
        idle.append(conn)

    async def request(self, payload: bytes) -> ChildReplyBytes:
        """One whole request of slotkeeper's own (head and body in `payload`), answered whole."""
        return await InternalExchange(self, payload).run()

    def close(self) -> None:
        for conn in self._idle:
            conn.abort()
        self._idle.clear()


class ChildReplyBytes:
    """A whole answer from the child to one of slotkeeper's own requests."""

    __slots__ = ("body", "head", "status")

    def __init__(self, status: int, head: bytes, body: bytes) -> None:
        self.status = status
        self.head = head
        self.body = body


class InternalExchange:
    """An Exchange in a client connection's place, for one of slotkeeper's own requests: collects the answer whole.

    slotkeeper's calls to the child (health, props, tokenize, slot save and restore) share the proxy's pool,
    so they cost what a proxied request costs and need no second HTTP client.
    """

    def __init__(self, pool: ChildPool, payload: bytes) -> None:
        self.pool = pool
        self.payload = payload
        self.result: asyncio.Future[ChildReplyBytes] = asyncio.get_running_loop().create_future()
        self._status = 0
        self._head = b""
        self._parts: list[bytes] = []
        self._retried = False
        self._conn: ChildConnection | None = None

    async def run(self) -> ChildReplyBytes:
        try:
            self._send(self.pool.take() or await self.pool.connect())
            return await self.result
        except BaseException:
            if self._conn is not None and not self.result.done():  # cancelled: the child stops what it did for us
                self._conn.client = None
                self._conn.abort()
            raise

    def _send(self, conn: ChildConnection) -> None:
        self._conn = conn
        conn.start(self, self.payload, False, True)

    # the Exchange, as ChildConnection calls it
    def batch(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def pause_body(self) -> None:  # (the whole request went in one write)
        pass

    def resume_body(self) -> None:
        pass

    def response_head(self, status: int, head: bytes, no_body: bool) -> bool:
        self._status, self._head = status, head
        lower = head.lower()
        return not (no_body or b"\r\ncontent-length:" in lower or b"\r\ntransfer-encoding:" in lower)

    def response_body(self, data: bytes) -> None:
        self._parts.append(data)

    def response_done(self) -> None:
        if not self.result.done():
            self.result.set_result(ChildReplyBytes(self._status, self._head, b"".join(self._parts)))

    def child_failed(self, reason: str) -> None:
        conn, self._conn = self._conn, None
        if self.result.done():
            return
        if conn is not None and conn.reused and not conn.got_bytes and not self._retried:
            self._retried = True  # a kept-alive connection the child closed as we used it: once more, fresh
            task = asyncio.ensure_future(self.pool.connect())
            task.add_done_callback(self._on_fresh)
            return
        self.result.set_exception(ConnectionError(reason))

    def _on_fresh(self, task: asyncio.Future[ChildConnection]) -> None:
        if self.result.done():
            if not task.cancelled() and task.exception() is None:
                task.result().abort()
            return
        if task.cancelled() or task.exception() is not None:
            self.result.set_exception(ConnectionError(f"llama-server unreachable: {task.exception()!r}"))
            return
        self._send(task.result())
