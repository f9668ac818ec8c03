"""The streaming reverse proxy in front of llama-server, and the gate that holds requests until ready.

A client must not be able to tell slotkeeper from llama-server, except that it is barely slower:

* Method, request target (path and query, byte for byte: ``%2F`` stays ``%2F``), header names, values and
  order, repeated headers, and bodies (compressed ones included) reach the child unchanged; status, reason,
  headers and body bytes come back unchanged. Only hop-by-hop headers are dropped both ways (``Connection``,
  the headers it names, ``Keep-Alive``, ``TE``, ``Trailer``, ``Transfer-Encoding``, ``Upgrade``,
  ``Proxy-*``), and ``Expect: 100-continue``, which slotkeeper answers itself.
* Bodies stream both ways without size cap, at the pace of the slower side; every chunk of the child's answer
  (an SSE event) is written to the client as soon as it arrives. Only a request body of at most SMALL_BODY
  bytes is read whole first, to go out with the head in one write.
* A client that goes away closes the request to the child at once, so llama-server cancels a streamed
  generation and frees the slot.
* Nothing is timed out but connecting to the child. A failure before the child's response headers is a 502
  in llama-server's error shape; after them, the client's connection is closed, so it sees a truncated body.

The public side is aiohttp's low-level server (``make_runner``). The child side is a small HTTP/1.1 client
of its own (``ChildConnection``, ``ChildPool``) over keep-alive connections to the child's private socket:
aiohttp's ClientSession, built for the open internet (URL joining, cookies, redirects, tracing, timers),
cost about half of the CPU time of every proxied request. The child is our own llama-server, reached only
by us, so the client needs no more than HTTP/1.1 framing: Content-Length, chunked, or until close.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import aiohttp
from aiohttp import web

from .llama_client import CONNECT_TIMEOUT_S
from .log import log
from .slots import is_reserved_filename

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .supervisor import ChildEndpoint

HOP_BY_HOP_HEADERS = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "transfer-encoding", "upgrade",
    }
)
_HOP_BY_HOP = frozenset(name.encode() for name in HOP_BY_HOP_HEADERS)
# Not forwarded to the child: hop-by-hop, the framing (rewritten for the child's hop) and Expect (answered here).
_REQUEST_DROPPED = _HOP_BY_HOP | {b"content-length", b"expect"}
# Not passed back: hop-by-hop. Content-Length stays: it is the body's length on both hops.
_RESPONSE_DROPPED = _HOP_BY_HOP

HEALTH_PATHS = frozenset({"/health", "/v1/health"})
OWN_PREFIX = "/slotkeeper/"
SLOT_ACTION_PREFIX = "/slots/"
PROTECTED_SLOT_ACTIONS = frozenset({"save", "restore"})

SMALL_BODY = 64 * 1024  # request bodies up to this size are read whole and sent with the head, in one write
MAX_SLOT_ACTION_BODY = 1024 * 1024  # a slot save/restore body is a small JSON object, checked before it is sent
MAX_RESPONSE_HEAD = 256 * 1024  # the child's status line and headers
READ_HIGH_WATER = 256 * 1024  # stop reading from the child while this much of its answer waits for the client
READ_LOW_WATER = 64 * 1024
POOL_IDLE_S = 2.0  # drop an idle connection before the child does (llama-server: 5 s) to avoid a reuse race
POOL_MAX_IDLE = 64


def error_response(status: int, message: str, error_type: str, extra: dict[str, object] | None = None) -> web.Response:
    """An error in llama-server's own shape, so clients cannot tell who answered."""
    body = {"error": {"code": status, "message": message, "type": error_type}, **(extra or {})}
    return web.json_response(body, status=status)


def connection_tokens(headers: Any) -> frozenset[bytes]:
    """Lower-cased header names listed in the Connection headers of raw (bytes, bytes) pairs."""
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(token.strip().lower() for token in value.split(b","))
    return frozenset(tokens)


def is_forwarded(lname: bytes, dropped: frozenset[bytes], named: frozenset[bytes]) -> bool:
    """Whether a header (lower-cased name) crosses the proxy: not hop-by-hop, not named in Connection."""
    return lname not in dropped and not lname.startswith(b"proxy-") and lname not in named


def _header_str(raw: bytes) -> str:
    """A header name or value as aiohttp wants it (it writes them back as UTF-8, so UTF-8 round-trips)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


# ---- the child side: a keep-alive HTTP/1.1 client --------------------------------------------------------


class UpstreamError(Exception):
    """The child closed or broke the connection before its response was complete."""


class ResponseHead:
    """The child's status line and end-to-end headers."""

    __slots__ = ("status", "reason", "headers", "chunked")

    def __init__(self, status: int, reason: str, headers: list[tuple[str, str]], chunked: bool) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.chunked = chunked  # the client gets chunked framing too (not a length), as it would directly


# Response parser states
_IDLE, _HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _UNTIL_CLOSE, _DONE = range(9)


class ChildConnection(asyncio.Protocol):
    """One keep-alive connection to the child, carrying one request/response exchange at a time.

    ``data_received`` parses the response as it arrives: the head wakes ``read_head``, body pieces (chunked
    framing removed) queue for ``read``. Reading from the child pauses while more than READ_HIGH_WATER
    bytes wait for a slow client; writing waits (``drain``) while the child is not reading.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False  # carried an exchange before the current one
        self.idle_since = 0.0
        self.request_sent = False  # the whole request, body included, was written
        self.got_bytes = False  # any byte of the current response arrived
        self._loop = asyncio.get_running_loop()
        self._state = _IDLE
        self._expect_body = True
        self._keep_alive = False
        self._leftover = b""
        self._remaining = 0
        self._head: ResponseHead | None = None
        self._head_waiter: asyncio.Future[None] | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._data_waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._reading_paused = False
        self._writing_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None

    # ---- the exchange, for the proxy ----

    def send(self, data: bytes, *, expect_body: bool, complete: bool) -> None:
        """Start an exchange with the request head (and its whole body when `complete`)."""
        self._state = _HEAD
        self._expect_body = expect_body
        self._head = None
        self._chunks.clear()
        self._buffered = 0
        self.got_bytes = False
        self.request_sent = complete
        if not self.is_open:  # the child closed it while it was idle, and we have not heard yet
            self._error = UpstreamError("llama-server closed the connection")
            raise self._error
        self.transport.write(data)  # type: ignore[union-attr]

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    async def drain(self) -> None:
        """Wait while the child is not reading; returns at once if the connection is gone or it answered."""
        if self._writing_paused and not self.closed and self._state == _HEAD:
            self._drain_waiter = self._loop.create_future()
            await self._drain_waiter

    async def read_head(self) -> ResponseHead:
        while self._head is None:
            if self._error is not None:
                raise self._error
            self._head_waiter = self._loop.create_future()
            await self._head_waiter
        return self._head

    @property
    def body_complete(self) -> bool:
        return self._state == _DONE

    def take_body(self) -> bytes:
        """The whole body, once it has all arrived (body_complete)."""
        body = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return body

    async def read(self) -> bytes:
        """The body as it arrived since the last read, b"" at its end; UpstreamError if it broke off."""
        chunks = self._chunks
        while not chunks:
            if self._state == _DONE:
                return b""
            if self._error is not None:
                raise self._error
            self._data_waiter = self._loop.create_future()
            await self._data_waiter
        if len(chunks) == 1:  # the usual case: each piece is read as soon as it arrives
            chunk = chunks.popleft()
        else:  # the client is slower than the child: one write for all that is waiting
            chunk = b"".join(chunks)
            chunks.clear()
        self._buffered -= len(chunk)
        if self._reading_paused and self._buffered <= READ_LOW_WATER and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        return chunk

    @property
    def is_open(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    @property
    def reusable(self) -> bool:
        return self._state == _DONE and self._keep_alive and self.request_sent and not self.closed

    def abort(self) -> None:
        """Drop the connection now (the child sees it closed and cancels what it was doing for us)."""
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.closed = True

    # ---- asyncio.Protocol ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
        elif self._state not in (_IDLE, _DONE):
            self._error = UpstreamError(f"llama-server closed the connection ({exc or 'EOF'})")
        self._wake()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._leftover:
            data = self._leftover + data
            self._leftover = b""
        try:
            self._parse(data)
        except (ValueError, IndexError) as exc:
            self._fail(f"malformed response from llama-server: {exc}")
        self._wake()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost decides whether the response was complete

    # ---- parsing ----

    def _fail(self, message: str) -> None:
        self._error = UpstreamError(message)
        self._state = _IDLE if self._head is None else self._state
        self.abort()

    def _wake(self) -> None:
        for waiter in (self._head_waiter, self._data_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _emit(self, piece: bytes) -> None:
        self._chunks.append(piece)
        self._buffered += len(piece)
        if self._buffered > READ_HIGH_WATER and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _parse(self, data: bytes) -> None:
        pos, end = 0, len(data)
        self.got_bytes = True
        pieces: list[bytes] = []
        while pos < end:
            state = self._state
            if state == _LENGTH or state == _CHUNK_DATA:
                take = min(self._remaining, end - pos)
                pieces.append(data[pos:pos + take] if pos or take < end else data)
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self._state = _DONE if state == _LENGTH else _CHUNK_END
            elif state == _UNTIL_CLOSE:
                pieces.append(data[pos:] if pos else data)
                pos = end
            elif state == _HEAD:
                i = data.find(b"\r\n\r\n", pos)
                if i < 0:
                    if end - pos > MAX_RESPONSE_HEAD:
                        raise ValueError("response head too large")
                    break
                self._parse_head(data[pos:i])
                pos = i + 4
            elif state == _CHUNK_SIZE or state == _TRAILERS:
                i = data.find(b"\r\n", pos)
                if i < 0:
                    if end - pos > 4096:
                        raise ValueError("chunk line too long")
                    break
                line = data[pos:i]
                pos = i + 2
                if state == _TRAILERS:
                    if not line:
                        self._state = _DONE
                    continue
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size < 0:
                    raise ValueError("negative chunk size")
                self._remaining = size
                self._state = _CHUNK_DATA if size else _TRAILERS
            elif state == _CHUNK_END:
                if end - pos < 2:
                    break
                if data[pos:pos + 2] != b"\r\n":
                    raise ValueError("chunk not followed by CRLF")
                pos += 2
                self._state = _CHUNK_SIZE
            else:  # _IDLE or _DONE: bytes nobody asked for; the connection cannot be trusted any more
                self._keep_alive = False
                self.abort()
                break
        if pos < end and self._state not in (_IDLE, _DONE):
            self._leftover = data[pos:]
        if pieces:
            self._emit(pieces[0] if len(pieces) == 1 else b"".join(pieces))

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        code, _, reason = rest.partition(b" ")
        status = int(code)
        if not version.startswith(b"HTTP/1.") or not 100 <= status <= 999:
            raise ValueError(f"bad status line {lines[0][:100]!r}")
        raw = []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise ValueError(f"bad header line {line[:100]!r}")
            raw.append((name, value.strip(b" \t")))
        if 100 <= status < 200:
            return  # interim response (100 Continue, 103 Early Hints): the real one follows
        named = connection_tokens(raw)
        self._keep_alive = b"close" not in named and (version == b"HTTP/1.1" or b"keep-alive" in named)
        chunked = False
        length: int | None = None
        headers = []
        for name, value in raw:
            lname = name.lower()
            if lname == b"transfer-encoding":
                chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
            elif lname == b"content-length":
                length = int(value)
            if is_forwarded(lname, _RESPONSE_DROPPED, named):
                headers.append((_header_str(name), _header_str(value)))
        if chunked and length is not None:  # Transfer-Encoding wins (RFC 9112 6.3); the length is wrong
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        self._head = ResponseHead(status, reason.decode("latin-1"), headers, chunked and self._expect_body)
        if not self._expect_body or status in (204, 304):
            self._state = _DONE
        elif chunked:
            self._state = _CHUNK_SIZE
        elif length is not None:
            self._remaining = length
            self._state = _LENGTH if length else _DONE
        else:
            self._state = _UNTIL_CLOSE
            self._keep_alive = False


class ChildPool:
    """Keep-alive connections to the child, most recently used first; connecting is the only thing timed."""

    def __init__(self, socket_path: str | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.socket_path = socket_path
        self.host = host
        self.port = port
        self._idle: list[ChildConnection] = []

    @classmethod
    def for_endpoint(cls, endpoint: ChildEndpoint) -> ChildPool:
        if endpoint.socket_path is not None:
            return cls(socket_path=str(endpoint.socket_path))
        assert endpoint.tcp_port is not None
        return cls(port=endpoint.tcp_port)

    async def acquire(self, fresh: bool = False) -> ChildConnection:
        idle, now = self._idle, time.monotonic()
        while idle and not fresh:
            conn = idle.pop()
            if conn.is_open and now - conn.idle_since < POOL_IDLE_S:
                conn.reused = True
                return conn
            conn.abort()
        loop = asyncio.get_running_loop()
        if self.socket_path is not None:
            connecting = loop.create_unix_connection(ChildConnection, self.socket_path)
        else:
            connecting = loop.create_connection(ChildConnection, self.host, self.port)
        _, conn = await asyncio.wait_for(connecting, CONNECT_TIMEOUT_S)
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

    def close(self) -> None:
        for conn in self._idle:
            conn.abort()
        self._idle.clear()


# ---- the public side -------------------------------------------------------------------------------------


class Gate:
    """Requests wait here until the restore is done; resolved once, to open (True) or closed (False)."""

    def __init__(self) -> None:
        self._outcome: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def open(self) -> None:
        if not self._outcome.done():
            self._outcome.set_result(True)

    def close(self) -> None:
        if not self._outcome.done():
            self._outcome.set_result(False)

    @property
    def is_open(self) -> bool:
        return self._outcome.done() and self._outcome.result()

    async def wait(self, timeout: float | None) -> bool:
        try:
            return await asyncio.wait_for(asyncio.shield(self._outcome), timeout)
        except TimeoutError:
            return False


class RequestRefused(Exception):
    """A request answered by slotkeeper itself instead of being forwarded."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


class Proxy:
    """Forwards every request to the child once the gate is open; tracks requests in flight for draining."""

    def __init__(
        self, endpoint: ChildEndpoint, gate: Gate, describe_state: Callable[[], str], startup_deadline: float
    ) -> None:
        self.pool = ChildPool.for_endpoint(endpoint)
        self.gate = gate
        self.describe_state = describe_state
        self.startup_deadline = startup_deadline
        self.accepting = True
        self.in_flight: set[asyncio.Task[object]] = set()
        self.last_activity = time.monotonic()
        self.requests_total = 0
        self.status_counts: collections.Counter[int] = collections.Counter()  # 499: the client went away
        self._idle = asyncio.Event()
        self._idle.set()
        self.own_routes: dict[str, Callable[[Any], Awaitable[web.StreamResponse]]] = {}  # path -> handler(request)

    # ---- lifecycle hooks used by the daemon ----------------------------------------------------------------

    async def wait_idle(self, timeout: float) -> bool:
        """True when no request is in flight within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def cancel_in_flight(self) -> int:
        for task in list(self.in_flight):
            task.cancel()
        return len(self.in_flight)

    def close(self) -> None:
        """Close the idle connections to the child (requests in flight close theirs when they end)."""
        self.pool.close()

    # ---- request handling ----------------------------------------------------------------------------------

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if path.startswith(OWN_PREFIX):
            handler = self.own_routes.get(path)
            if handler is None:
                return error_response(404, "File Not Found", "not_found_error")
            return await handler(request)
        if not self.accepting:
            return error_response(503, "slotkeeper is shutting down", "unavailable_error")
        if not self.gate.is_open:
            if path in HEALTH_PATHS:
                state = self.describe_state()
                return error_response(503, f"slotkeeper: {state}", "unavailable_error", {"status": state})
            if not await self.gate.wait(max(0.0, self.startup_deadline - time.monotonic())):
                return error_response(503, "llama-server is not ready", "unavailable_error")
            if not self.accepting:
                return error_response(503, "slotkeeper is shutting down", "unavailable_error")
        task = asyncio.current_task()
        assert task is not None
        self.in_flight.add(task)
        self._idle.clear()
        self.requests_total += 1
        response: web.StreamResponse | None = None
        try:
            response = await self._forward(request)
            return response
        except RequestRefused as refused:
            response = refused.response
            return response
        finally:
            self.status_counts[response.status if response is not None else 499] += 1
            self.in_flight.discard(task)
            self.last_activity = time.monotonic()
            if not self.in_flight:
                self._idle.set()

    async def _forward(self, request: web.BaseRequest) -> web.StreamResponse:
        head, length, chunked = request_head(request)
        body: bytes | None = None  # the whole body, when it is read before sending
        if length is not None or chunked:
            await answer_expect_continue(request)
            if request.method == "POST" and is_slot_action(request):
                body = await read_slot_action(request, length)
            elif length is not None and length <= SMALL_BODY:
                body = await request.read()
        if body is not None:  # whole: sent with its length, in one write with the head
            chunked = False
            payload = b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body)
        elif chunked:
            payload = head + b"Transfer-Encoding: chunked\r\n\r\n"
        elif length is not None:
            payload = b"%sContent-Length: %d\r\n\r\n" % (head, length)
        else:
            payload = head + b"\r\n"
        streamed = body is None and (length is not None or chunked)
        fresh = False
        while True:
            try:
                conn = await self.pool.acquire(fresh)
            except (OSError, TimeoutError) as exc:
                reason = exc if str(exc) else type(exc).__name__
                log.warning("%s %s: llama-server unreachable: %s", request.method, request.path, reason)
                return error_response(502, f"llama-server unreachable: {reason}", "server_error")
            try:
                return await self._exchange(request, conn, payload, streamed, chunked)
            except UpstreamError as exc:
                # A kept-alive connection the child closed just as we used it: nothing was processed, so
                # the request is sent again once, on a new connection, when we still have all of it.
                if conn.reused and not conn.got_bytes and not streamed and not fresh:
                    fresh = True
                    continue
                log.warning("%s %s: llama-server unreachable: %s", request.method, request.path, exc)
                return error_response(502, f"llama-server unreachable: {exc}", "server_error")

    async def _exchange(
        self, request: web.BaseRequest, conn: ChildConnection, payload: bytes, streamed: bool, chunked: bool
    ) -> web.StreamResponse:
        """One request/response with the child on `conn`; UpstreamError only before the response started."""
        finished = False
        pump: asyncio.Task[None] | None = None
        try:
            conn.send(payload, expect_body=request.method != "HEAD", complete=not streamed)
            if streamed:
                pump = asyncio.ensure_future(pump_body(request, conn, chunked))
            head = await conn.read_head()
            if conn.body_complete and not head.chunked:  # the whole answer is here already (most non-streamed)
                finished = True
                return web.Response(status=head.status, reason=head.reason, headers=head.headers,
                                    body=conn.take_body())
            response = web.StreamResponse(status=head.status, reason=head.reason, headers=head.headers)
            await response.prepare(request)
            if conn.body_complete:  # a short stream that ended before we got to it: one write, still chunked
                finished = True
                await response.write_eof(conn.take_body())
                return response
            try:
                while chunk := await conn.read():
                    await response.write(chunk)
            except UpstreamError as exc:
                log.warning("%s %s: llama-server response broke off: %s", request.method, request.path, exc)
                if request.transport is not None:
                    request.transport.close()  # the client sees the body end early, never a complete one
                return response
            finished = True
            await response.write_eof()
            return response
        except ConnectionResetError:
            log.debug("%s %s: client went away", request.method, request.path)
            return web.Response(status=499)  # never delivered
        finally:
            if pump is not None and not pump.done():
                pump.cancel()
            if finished:
                self.pool.release(conn)
            else:
                conn.abort()


def request_head(request: web.BaseRequest) -> tuple[bytes, int | None, bool]:
    """The request line and end-to-end headers for the child (the framing header and the blank line that ends
    the head are added by the caller), and the body's framing: (head, content length, chunked)."""
    target = request.raw_path
    if not target.startswith("/") and target != "*":  # absolute-form: the child wants origin-form
        target = request.rel_url.raw_path_qs
    parts = [request.method.encode(), b" ", target.encode("utf-8", "surrogateescape"), b" HTTP/1.1\r\n"]
    raw = request.raw_headers
    named = connection_tokens(raw)
    length: int | None = None
    chunked = has_host = False
    for name, value in raw:
        lname = name.lower()
        if lname == b"content-length":
            length = int(value)
        elif lname == b"transfer-encoding":
            chunked = True  # aiohttp accepts a request body in no other transfer coding
        elif lname == b"host":
            has_host = True
        if is_forwarded(lname, _REQUEST_DROPPED, named):
            parts += (name, b": ", value, b"\r\n")
    if not has_host:
        parts.append(b"Host: localhost\r\n")
    return b"".join(parts), None if chunked else length, chunked


async def answer_expect_continue(request: web.BaseRequest) -> None:
    """Expect: 100-continue is answered here (the child never sees it): we are about to read the body."""
    if request.version != aiohttp.HttpVersion11:
        return
    if request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0


async def pump_body(request: web.BaseRequest, conn: ChildConnection, chunked: bool) -> None:
    """Stream the request body to the child as it arrives, at the child's pace; stops if the child answers."""
    content = request.content
    try:
        while data := await content.readany():
            if chunked:
                conn.write(b"%x\r\n" % len(data) + data + b"\r\n")
            else:
                conn.write(data)
            await conn.drain()
            if conn.closed or conn.got_bytes:
                return  # the child answered (or went) before taking the whole body
        if chunked:
            conn.write(b"0\r\n\r\n")
        conn.request_sent = True
    except (aiohttp.ClientError, ConnectionError, asyncio.IncompleteReadError) as exc:
        log.debug("%s %s: request body broke off: %r", request.method, request.path, exc)
        conn.abort()


def is_slot_action(request: web.BaseRequest) -> bool:
    """POST /slots/{id}, spelled as llama-server would route it (it decodes the path first)."""
    path = request.raw_path.split("?", 1)[0]
    return unquote(path).startswith(SLOT_ACTION_PREFIX)


async def read_slot_action(request: web.BaseRequest, length: int | None) -> bytes | None:
    """The body of a slot save/restore, checked before it is sent; other slot actions stream as usual."""
    action = request.query.get("action", "")
    if action not in PROTECTED_SLOT_ACTIONS:
        return await request.read() if length is not None and length <= SMALL_BODY else None
    if length is not None and length > MAX_SLOT_ACTION_BODY:
        raise RequestRefused(error_response(413, "slot action body too large", "invalid_request_error"))
    parts: list[bytes] = []
    size = 0
    while data := await request.content.readany():
        size += len(data)
        if size > MAX_SLOT_ACTION_BODY:
            raise RequestRefused(error_response(413, "slot action body too large", "invalid_request_error"))
        parts.append(data)
    body = b"".join(parts)
    refusal = refuse_own_files(action, body)
    if refusal is not None:
        raise RequestRefused(refusal)
    return body


def refuse_own_files(action: str, body: bytes) -> web.Response | None:
    """A client's slot save or restore may not touch slotkeeper's own cache files (403); others pass through."""
    if action not in PROTECTED_SLOT_ACTIONS:
        return None
    try:
        filename = json.loads(body).get("filename", "") if body else ""
    except (ValueError, AttributeError):
        return None  # llama-server answers malformed bodies itself
    if isinstance(filename, str) and is_reserved_filename(filename):
        return error_response(
            403, f"{filename!r} is managed by slotkeeper; use another filename for your own snapshots",
            "permission_error",
        )
    return None


def make_runner(proxy: Proxy) -> web.ServerRunner:
    """The public HTTP server: aiohttp's low-level server (no router: every path goes to `proxy.handle`)."""
    server = web.Server(
        proxy.handle,
        handler_cancellation=True,  # a client that goes away cancels its request, and so the child's work
        auto_decompress=False,  # request bodies pass byte-exact, Content-Encoding and all
        max_line_size=16 * 1024,  # above llama-server's own limits (8 KiB request target, 8 KiB header line),
        max_field_size=16 * 1024,  # so that it is llama-server that refuses what it refuses, as it would directly
        access_log=None,
    )
    return web.ServerRunner(server)
