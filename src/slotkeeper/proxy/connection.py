"""The proxy's public side: one client's connection, its requests answered one at a time.

(The rules a client sees, and why protocol callbacks: the package's docstring, `slotkeeper.proxy`.)

One request is answered at a time per client connection (pipelined ones wait their turn, as HTTP/1.1
requires), over a keep-alive connection to the child's private socket taken from ChildPool (upstream.py).
A ClientConnection is the connection (parsing, routing, writing, flow control); a Request is one request's
state, from its head to the end of its answer (messages.py). The Proxy that creates the connections and counts
their requests (server.py) is, to them, a `Front` (front.py): this module does not import server.py.

Every request goes through the same rules (`begin`), however its bytes arrived: first on its connection or
pipelined, in the read that ended the previous one, while an answer still streams. They are decided on the
target as llama-server reads it (target.py), so a spelling cannot get a completion past the hook or a route
past the gate. What llama-server and slotkeeper could read two ways is refused with a 400 and the connection
closes, after the answers to the requests before it: a fragment or a non-%XX escape in the path (target.py),
a framing llhttp finds ambiguous (its strict defaults: no lenient flag is set), a Transfer-Encoding other than
chunked alone, a body on an Upgrade request (llhttp skips it), an HTTP version other than 1.0 and 1.1.
"""

from __future__ import annotations

import asyncio
import collections
import re
import time

import httptools

from ..log import log
from .front import HOLD_BUFFERED, HOLD_CHILD_BUSY, FlowControl, Front
from .messages import (
    DISCARD,
    HOOKED,
    REQUEST_NOTED,
    RESPONSE_NOTED,
    STREAM,
    WHOLE,
    OwnRoute,
    Reply,
    Request,
    connection_named,
    error_reply,
)
from .upstream import ChildConnection

HEALTH_PATHS = frozenset({"/health", "/v1/health"})
OWN_PREFIX = "/slotkeeper/"

SMALL_BODY = 64 * 1024  # request bodies up to this size are read whole and sent with the head, in one write
MAX_HOOKED_BODY = 64 * 1024 * 1024  # a completion body larger than this is streamed through unplaced
MAX_REQUEST_HEAD = 256 * 1024  # a request line and headers; llama-server's own limits are far lower (8 KiB)
BODY_BUFFER_HIGH = 256 * 1024  # stop reading a client while this much of its body waits to be sent
# After refusing malformed input, how long what the client still sends is read and dropped before the connection
# closes: closing with unread input resets it, and a reset can destroy the 400 before the client reads it
# (RFC 9112 9.6, the TCP reset problem).
LINGER_S = 1.0

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"
# llama-server's answer to a missing or wrong API key (server-http.cpp, middleware_validate_api_key), byte for
# byte: its middleware orders the fields message, type, code (its handlers' errors, as error_reply: code first)
_UNAUTHORIZED = Reply.json({"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}, 401)


# ---- refusing what is not forwarded -----------------------------------------------------------------------------


class _Refused(Exception):
    """Raised from a parser callback to stop llhttp at once (it would go on parsing the bytes it has)."""

    def __init__(self, reply: Reply | None) -> None:
        self.reply = reply  # the answer for the client; None: none (the connection is closing anyway)


def bad_request(reason: str) -> Reply:
    """The answer to input slotkeeper does not forward (then the connection closes)."""
    return error_reply(400, f"bad request: {reason}", "invalid_request_error")


# ---- the public side: one client connection -------------------------------------------------------------------


class ClientConnection(asyncio.Protocol):
    """One client's connection: parses its requests (httptools) and relays the child's answers to it.

    The child's response arrives through `response_head`, `response_body` and `response_done`, called by the
    ChildConnection that carries the exchange (this is its upstream.Exchange); what they write during one read
    from the child goes out in one write (`batch`/`flush`).
    """

    def __init__(self, proxy: Front[ClientConnection]) -> None:
        self.proxy = proxy
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.incoming: Request | None = None  # being parsed
        self.active: Request | None = None  # being answered
        self.waiting: collections.deque[Request] = collections.deque()  # pipelined behind `active`
        self.child: ChildConnection | None = None  # carrying the active exchange
        self.task: asyncio.Future[None] | None = None  # off the hot path: gate, connect, own route
        self.lost = False
        self.idle_since = time.monotonic()
        # Reads that begin outside a body count towards the request head (MAX_REQUEST_HEAD), from the end of
        # the previous head: the first read of a connection too. (A head that starts in the read that ends the
        # previous body is counted from the next read.)
        self._in_head = True
        self._head_bytes = 0
        self.flow = FlowControl()
        self._out: list[bytes] | None = None  # collecting writes while a batch is open
        self._reading_done = False  # what follows is not parsed (malformed input, an upgrade)
        self._close_requested = False  # close once the open batch is written
        self._client_done = False  # the client half-closed: close once what it sent is answered
        self._close_in_stages = False  # refused input: `close` lingers (LINGER_S) instead of closing at once
        self._linger: asyncio.TimerHandle | None = None  # lingering: the timer that closes the connection
        self._close_after = False  # close once the active exchange's answer is written

    # ---- asyncio.Protocol ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.flow.transport = transport  # type: ignore[assignment]
        self.proxy.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._reading_done:
            return
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_REQUEST_HEAD:
                self._refuse_malformed(error_reply(431, "request header fields too large", "invalid_request_error"))
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # llama-server speaks no other protocol: the request is forwarded without Upgrade, answered, and
            # the connection closes after it (what follows is not HTTP to llhttp)
            self._reading_done = True
            if self.incoming is not None:
                self.incoming.keep_alive = False
            if self.active is None:
                self.close()
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Refused):
                if cause.reply is not None:
                    self._refuse_malformed(cause.reply)
                return
            if cause is not None and not isinstance(cause, httptools.HttpParserError):
                log.error("proxy error on a client connection: %r", cause)
                self.abort()
                return
            self._refuse_malformed(bad_request(str(exc)))

    def eof_received(self) -> bool:
        # A client that half-closes after its request may still wait for the answer; then the connection closes.
        # A closed and a half-closed client look the same here: the child gets the same EOF (`_pass_eof`).
        self._client_done = True
        req = self.incoming
        if not self._reading_done and req is not None and not req.complete:
            self._refuse_malformed(bad_request("the request ended early"))  # it can never complete
        self._pass_eof()
        return self.active is not None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.flow.transport = None
        self.proxy.connections.discard(self)
        if self._linger is not None:
            self._linger.cancel()
        if self.task is not None:
            self.task.cancel()
            self.task = None
        req = self.active
        if req is None:
            return
        child = self.child
        if child is not None:  # the child sees the connection close and cancels what it was doing for us
            child.client = None
            child.abort()
            self.child = None
        log.debug("%s %s: client went away", req.method.decode(), req.path)
        self._end(req, 499)

    def pause_writing(self) -> None:  # the client reads slower than the child answers
        if self.child is not None:
            self.child.pause_reading()

    def resume_writing(self) -> None:
        if self.child is not None:
            self.child.resume_reading()

    def pause_body(self) -> None:  # the child is not reading the body we forward (upstream.Exchange)
        self.flow.hold(HOLD_CHILD_BUSY)

    def resume_body(self) -> None:
        self.flow.unhold(HOLD_CHILD_BUSY)

    # ---- httptools callbacks ----

    def on_message_begin(self) -> None:
        if self._reading_done:  # closing (a request ended it): llhttp would go on with the bytes it has
            raise _Refused(None)
        self.incoming = Request()

    def on_url(self, url: bytes) -> None:
        req = self.incoming
        req.target = req.target + url if req.target else url  # type: ignore[union-attr]

    def on_header(self, name: bytes, value: bytes) -> None:
        lname = name.lower()
        req = self.incoming
        assert req is not None  # llhttp calls on_header only between on_message_begin and on_headers_complete
        if lname in REQUEST_NOTED or lname.startswith(b"proxy-"):
            req.header(lname, name, value)
        else:
            req.forwarded += (name, b": ", value, b"\r\n")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        req = self.incoming
        assert req is not None
        parser = self.parser
        version = parser.get_http_version()
        if version != "1.1":
            if version != "1.0":  # llhttp reads 0.9 and 2.0 too; llama-server refuses them with a 400
                raise _Refused(bad_request(f"HTTP/{version} is not supported"))
            req.http11 = False
        if not parser.should_keep_alive():
            req.keep_alive = False
        method = parser.get_method()
        refused = req.prepare(method)
        if refused is not None:
            raise _Refused(bad_request(refused))
        if (req.upgrade or method == b"CONNECT") and req.has_body and parser.should_upgrade():
            # llhttp skips the body of an upgrade: it would go to the child empty, llama-server would read it
            raise _Refused(bad_request("a body with Upgrade"))
        if self.active is None:
            self.begin(req)
        else:
            self.waiting.append(req)

    def on_body(self, data: bytes) -> None:
        req = self.incoming
        assert req is not None
        child = req.child
        if child is not None:  # streaming to the child
            child.write(b"%x\r\n%s\r\n" % (len(data), data) if req.chunked else data)
            return
        if req.mode is DISCARD:
            return
        req.parts.append(data)
        req.buffered += len(data)
        if req.buffered > BODY_BUFFER_HIGH and req.mode is STREAM:
            self.flow.hold(HOLD_BUFFERED)
        elif req.mode is HOOKED and req.buffered > MAX_HOOKED_BODY and req is self.active and req.deferred:
            req.mode = STREAM  # too large to place: it goes on as it arrives, unplaced
            req.deferred = False
            self.forward(req)

    def on_message_complete(self) -> None:
        self._in_head = True
        req = self.incoming
        assert req is not None
        req.complete = True
        child = req.child
        if child is not None:
            if req.chunked:
                child.write(_LAST_CHUNK)
            child.request_sent = True
            req.child = None
        elif req is self.active:
            self._body_read(req)

    # ---- routing ----

    def begin(self, req: Request) -> None:
        """The request's turn: answer it here, wait for the gate, or send it on."""
        self.active = req
        proxy = self.proxy
        path = req.path
        if proxy.accepting and proxy.gate.is_open and not path.startswith(OWN_PREFIX) and req.reply is None:
            self.dispatch(req)
        elif req.reply is not None:  # refused before its turn (malformed input)
            self.reply(req, req.reply)
        elif path.startswith(OWN_PREFIX):
            route = proxy.own_routes.get(path)
            if not proxy.authorized(req):  # before the route, as llama-server checks before routing (a 404 too)
                log.warning("%s %s: unauthorized: invalid API key", req.method.decode(), path)
                self.reply(req, _UNAUTHORIZED)
            elif route is None:
                self.reply(req, error_reply(404, "File Not Found", "not_found_error"))
            else:
                req.own_route = route
                self.reply(req, None)
        elif not proxy.accepting:
            self.reply(req, error_reply(503, "slotkeeper is shutting down", "unavailable_error"))
        elif not proxy.gate.is_open:
            if path in HEALTH_PATHS:
                state = proxy.describe_state()
                self.reply(req, error_reply(503, f"slotkeeper: {state}", "unavailable_error", {"status": state}))
            else:
                self.task = asyncio.ensure_future(self._after_gate(req))
        else:
            self.dispatch(req)

    async def _after_gate(self, req: Request) -> None:
        proxy = self.proxy
        opened = await proxy.gate.wait(max(0.0, proxy.startup_deadline - time.monotonic()))
        self.task = None
        if not opened:
            self.reply(req, error_reply(503, "llama-server is not ready", "unavailable_error"))
        elif not proxy.accepting:
            self.reply(req, error_reply(503, "slotkeeper is shutting down", "unavailable_error"))
        else:
            self.dispatch(req)

    def dispatch(self, req: Request) -> None:
        """Forward: now (a streamed body) or once the body is read (small, or for the completion hook).

        The one path for every request, however it arrived: the first on its connection or pipelined behind
        another, its body still coming or already complete (then `_body_read` runs at once). Every request the
        hook wants goes through it, with a body or without (one over MAX_HOOKED_BODY streams past it).
        """
        self.proxy.enter(self)
        req.counted = True
        hook = self.proxy.hook
        if (
            hook is not None
            and (req.length is None or req.length <= MAX_HOOKED_BODY)
            and hook.wants(req.method, req.path)
        ):
            req.mode = HOOKED
        elif not req.has_body or (req.length is not None and req.length <= SMALL_BODY):
            req.mode = WHOLE
        if req.expect_continue and req.has_body and not req.complete:
            self.send(_CONTINUE)  # we are about to read the body
        if req.mode is STREAM:
            self.forward(req)
            return
        req.deferred = True
        if self.flow.holds:  # the body is read whole now (it was held while it waited its turn or for the gate)
            self.flow.unhold(HOLD_BUFFERED)
        if req.complete:
            self._body_read(req)

    def _body_read(self, req: Request) -> None:
        """The active request's body is all here: send it (placed first), or the answer slotkeeper had for it."""
        if req.mode is DISCARD:
            if req.own_route is not None and req.reply is None:
                self.task = asyncio.ensure_future(self._own_route(req, req.own_route))
            elif req.reply is not None:
                self._send_reply(req)
        elif req.deferred:
            req.deferred = False
            if req.mode is HOOKED:
                self.task = asyncio.ensure_future(self._place(req))
            else:
                self.forward(req)

    async def _place(self, req: Request) -> None:
        """Off the hot path: the hook may tokenize, save a victim slot or restore one before the request goes."""
        hook = self.proxy.hook
        assert hook is not None
        body = b"".join(req.parts)
        placed = await hook.place(req.path, body)
        self.task = None
        req.done = placed.done
        req.observe = placed.observe
        req.parts = [placed.body]
        req.buffered = len(placed.body)
        self.forward(req)

    async def _own_route(self, req: Request, route: OwnRoute) -> None:
        try:
            reply = await route()
        except Exception as exc:  # noqa: BLE001 - one line in the log, a 500 to the client
            log.error("GET %s failed: %r", req.path, exc)
            reply = error_reply(500, f"slotkeeper: {exc}", "server_error")
        self.task = None
        req.reply = reply
        self._send_reply(req)

    def reply(self, req: Request, reply: Reply | None) -> None:
        """Answer `req` here (own route when reply is None): once its body is read, or now if the client waits."""
        req.mode = DISCARD
        req.parts.clear()
        self.flow.unhold(HOLD_BUFFERED)
        req.reply = reply
        if req.complete:
            self._body_read(req)
        elif req.expect_continue and reply is not None:  # the client waits for us before sending its body
            self._close_after = True
            self._send_reply(req)

    def _send_reply(self, req: Request) -> None:
        reply = req.reply
        assert reply is not None
        close = self._close_after or not req.keep_alive or not req.http11
        self.send(reply.encode(close))
        self._close_after = close
        self._end(req, reply.status)

    def _refuse_malformed(self, reply: Reply) -> None:
        """Bytes that are no request we forward: after the answers to the requests before them, a 400 (or 431),
        then the connection closes; nothing after them is read. A request whose body they cut never reaches the
        child whole."""
        self._reading_done = True
        self._close_in_stages = True
        req = self.incoming
        if req is not None and req.complete:
            if not req.keep_alive:  # after the client's last request (Connection: close): nothing to answer
                if self.active is None:
                    self.close()
                return
        elif req is not None and req is self.active:
            self._cut(req, reply)
            return
        elif req is not None and req in self.waiting:
            self.waiting.remove(req)
        refusal = Request()
        refusal.complete = True
        refusal.keep_alive = False
        refusal.reply = reply
        if self.active is None:
            self.begin(refusal)
        else:
            self.waiting.append(refusal)

    def _cut(self, req: Request, reply: Reply) -> None:
        """The active request's body turned out malformed: what the child got of it is cut off (llama-server
        drops a request whose body ends early); the client gets `reply`, or a cut answer if one is under way."""
        if self.task is not None:  # waiting for the gate or a connection to the child
            self.task.cancel()
            self.task = None
        child, self.child = self.child, None
        req.child = None
        if child is not None:
            child.client = None
            child.abort()
        req.complete = True
        req.keep_alive = False
        if req.head_sent:
            self._close_after = True
            self._end(req, req.status)
            self.abort()
        else:
            self.reply(req, reply)

    # ---- the exchange with the child ----

    def forward(self, req: Request, fresh: bool = False) -> None:
        conn = None if fresh else self.proxy.pool.take()
        if conn is None:
            self.task = asyncio.ensure_future(self._connect_and_send(req))
        else:
            self._send_request(req, conn)

    async def _connect_and_send(self, req: Request) -> None:
        try:
            conn = await self.proxy.pool.connect()
        except (OSError, TimeoutError) as exc:
            self.task = None
            reason = exc if str(exc) else type(exc).__name__
            log.warning("%s %s: llama-server unreachable: %s", req.method.decode(), req.path, reason)
            self.reply(req, error_reply(502, f"llama-server unreachable: {reason}", "server_error"))
            return
        self.task = None
        self._send_request(req, conn)

    def _send_request(self, req: Request, conn: ChildConnection) -> None:
        """The head and all the body read so far, in one write; the rest follows as it arrives."""
        parts, req.parts = req.parts, []
        req.buffered = 0
        if req.payload is not None:  # sent before, on a kept-alive connection that turned out closed
            payload = req.payload
        elif req.mode is STREAM:
            if req.chunked:
                framing = b"Transfer-Encoding: chunked\r\n\r\n"
                body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + (_LAST_CHUNK if req.complete else b"")
            else:
                framing = b"Content-Length: %d\r\n\r\n" % req.length  # type: ignore[str-format]
                body = b"".join(parts)
            payload = req.head + framing + body
            req.child = None if req.complete else conn
        elif req.has_body or req.mode is HOOKED:  # (a hooked one keeps what the hook gave it)
            body = b"".join(parts)
            payload = b"%sContent-Length: %d\r\n\r\n%s" % (req.head, len(body), body)
            req.payload = payload  # all of it: it can be sent again if a kept-alive connection was stale
        else:
            payload = req.head + b"\r\n"
            req.payload = payload
        self.child = conn
        if self.flow.holds:
            self.flow.unhold(HOLD_BUFFERED)
        conn.start(self, payload, req.method == b"HEAD", req.child is None)
        if self._client_done:  # the client's EOF came while this request waited (gate, placement, a connection)
            self._pass_eof()

    def _pass_eof(self) -> None:
        """Once the client has sent EOF, the child's connection gets it too, after the whole request, and
        llama-server decides as for a direct client: it cancels a generation it polls the socket for (a
        non-streamed one) and answers what it has (an empty 200 for a cancelled one), which the client gets if it
        still reads. A close and a half-close look the same to both. Every request answered after the client's
        EOF is sent that way."""
        child = self.child
        if self._client_done and child is not None and child.request_sent and not child.half_closed:
            child.half_close()

    def response_head(self, status: int, head: bytes, no_body: bool) -> bool:
        """The child's raw status line and headers (each line ending in CRLF, as validated by llhttp), passed on
        byte for byte but for the hop-by-hop lines; True when its body ends only when it closes."""
        req = self.active
        assert req is not None
        req.payload = None
        req.status = status
        if not head.startswith(b"HTTP/1.1 "):
            head = b"HTTP/1.1" + head[8:]
        length = chunked = False
        kept: list[bytes] = []
        pos = 0
        named: set[bytes] | None = None
        for match in RESPONSE_NOTED.finditer(head):
            lname = match.group(1).lower()
            if lname == b"content-length":
                length = True
                continue
            kept.append(head[pos : match.start()])
            pos = match.end()
            if lname == b"transfer-encoding":
                chunked = True
            elif lname == b"connection":
                named = (named or set()) | connection_named(match.group(0).partition(b":")[2])
        if pos:
            kept.append(head[pos:])
            head = b"".join(kept)
        if named:  # the headers Connection named are hop-by-hop too (rare)
            names = b"|".join(re.escape(name) for name in named)
            head = re.sub(rb"\r\n(?:" + names + rb")[ \t]*:[^\r]*", b"", head, flags=re.IGNORECASE)
        until_close = not (no_body or length or chunked)
        chunked_out = False
        if (chunked or until_close) and not no_body:
            if req.http11:
                chunked_out = True
                head += b"Transfer-Encoding: chunked\r\n"
            else:
                self._close_after = True  # an HTTP/1.0 client reads the body until we close
        # set either way: read for every piece of the body, and on Python 3.11 an attribute of the instance reads
        # in half the time of a class-level default
        req.chunked_out = chunked_out
        if not req.keep_alive or not req.http11:
            self._close_after = True
        self.send(head + b"Connection: close\r\n\r\n" if self._close_after else head + b"\r\n")
        return until_close

    def response_body(self, data: bytes) -> None:
        req = self.active
        if req is not None:
            if req.observe is not None:
                req.observe(data)
            if req.chunked_out:
                data = b"%x\r\n%s\r\n" % (len(data), data)
        self.send(data)

    def response_done(self) -> None:
        """The child's answer is complete (its connection is back in the pool or closed)."""
        req = self.active
        assert req is not None
        if req.chunked_out:
            self.send(_LAST_CHUNK)
        self.child = None
        self._end(req, req.status)

    def child_failed(self, reason: str) -> None:
        """The child broke the exchange: retry once, answer 502, or (after the headers) cut the client off."""
        req = self.active
        conn = self.child
        self.child = None
        if req is None:
            return
        req.child = None
        method = req.method.decode()
        if req.head_sent:
            log.warning("%s %s: llama-server response broke off: %s", method, req.path, reason)
            self._end(req, req.status)
            self.abort()  # the client sees the body end early, never a complete one
            return
        # A kept-alive connection the child closed just as we used it: nothing was processed, so the request
        # is sent again once, on a new connection, when we still have all of it.
        if conn is not None and conn.reused and not conn.got_bytes and req.payload is not None and not req.retried:
            req.retried = True
            self.forward(req, fresh=True)
            return
        log.warning("%s %s: llama-server unreachable: %s", method, req.path, reason)
        self.reply(req, error_reply(502, f"llama-server unreachable: {reason}", "server_error"))

    def _end(self, req: Request, status: int) -> None:
        """The active exchange is over: count it, then the next pipelined request, or close."""
        if req.done is not None:
            done, req.done = req.done, None
            done(status)
        if req.counted:
            self.proxy.leave(self, status)
        self.active = None
        if self.flow.holds:
            self.flow.unhold(HOLD_CHILD_BUSY)
        self.idle_since = time.monotonic()
        if self.lost:
            return
        if self._close_after or not req.complete or (self._client_done and not self.waiting):
            self.close()  # (a body the child did not wait for is not read on)
        elif self.waiting:
            next_request = self.waiting.popleft()
            self.begin(next_request)
            if not self.waiting and self.active is None:
                self.flow.unhold(HOLD_BUFFERED)

    # ---- writing ----

    def send(self, data: bytes) -> None:
        out = self._out
        if out is not None:
            out.append(data)
        elif self.transport is not None and not self.lost:
            self.transport.write(data)

    def batch(self) -> None:
        if self._out is None:
            self._out = []

    def flush(self) -> None:
        out, self._out = self._out, None
        if out and self.transport is not None and not self.lost:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
        if self._close_requested:
            self._close_requested = False
            self.close()

    def close(self) -> None:
        """Close after what is written (and what the open batch will write); nothing more is read. After refused
        input, in stages: our side first, then the client's once it closes it or after LINGER_S (what it sends
        meanwhile is dropped); closing it again (at exit) ends that at once."""
        self._reading_done = True
        transport = self.transport
        if self._out is not None:
            self._close_requested = True
        elif transport is None:
            pass
        elif (
            self._close_in_stages
            and self._linger is None
            and not self._client_done
            and not self.lost
            and transport.can_write_eof()
        ):
            transport.write_eof()
            self.flow.release_all()  # read on, to drop what still comes
            self._linger = asyncio.get_running_loop().call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def abort(self) -> None:
        self._reading_done = True
        if self.transport is not None:
            self.transport.abort()
