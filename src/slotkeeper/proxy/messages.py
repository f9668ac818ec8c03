"""The proxy's HTTP messages: a client's Request as the proxy parses and answers it, and the Reply slotkeeper
gives itself.

A Request holds all that is particular to one request, from its head to the end of its answer; the connection
it came on (connection.ClientConnection) holds what outlives it.
"""

from __future__ import annotations

import enum
import http
import json
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .target import RefusedTarget, read_path

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .upstream import ChildConnection

HOP_BY_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_HOP_BY_HOP = frozenset(name.encode() for name in HOP_BY_HOP_HEADERS)
# Request headers looked at (and, but for Host, dropped): hop-by-hop, the framing (rewritten for the child's
# hop), Expect (answered here); Proxy-* are dropped too.
REQUEST_NOTED = _HOP_BY_HOP | {b"content-length", b"expect", b"host"}
# In the child's raw response head: the hop-by-hop header lines (dropped), and Content-Length (kept: it is the
# body's length on both hops). The head has been validated by llhttp; a match ends before the line's CRLF.
RESPONSE_NOTED = re.compile(
    rb"\r\n("
    + b"|".join(sorted(name for name in _HOP_BY_HOP if not name.startswith(b"proxy-")))
    + rb"|proxy-[!#$%&'*+.^_`|~0-9a-z-]*|content-length)[ \t]*:[^\r]*",
    re.IGNORECASE,
)


# ---- slotkeeper's own answers --------------------------------------------------------------------------------


class Reply:
    """A whole response slotkeeper gives itself: errors, /health while restoring, /slotkeeper/ routes."""

    __slots__ = ("body", "content_type", "status")

    def __init__(self, status: int, body: bytes, content_type: str = "application/json; charset=utf-8") -> None:
        self.status = status
        self.body = body
        self.content_type = content_type

    @classmethod
    def json(cls, value: object, status: int = 200) -> Reply:
        return cls(status, json.dumps(value, separators=(",", ":")).encode())

    def encode(self, close: bool) -> bytes:
        try:
            reason = http.HTTPStatus(self.status).phrase
        except ValueError:
            reason = "Unknown"
        return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n%s" % (
            self.status,
            reason.encode(),
            self.content_type.encode(),
            len(self.body),
            b"Connection: close\r\n" if close else b"",
            self.body,
        )


def error_reply(status: int, message: str, error_type: str, extra: dict[str, object] | None = None) -> Reply:
    """An error in llama-server's own shape, so clients cannot tell who answered."""
    return Reply.json({"error": {"code": status, "message": message, "type": error_type}, **(extra or {})}, status)


OwnRoute = Callable[[], Awaitable[Reply]]


def connection_named(value: bytes) -> set[bytes]:
    """The header names a Connection header's value lists (lower-cased), beyond keep-alive and close."""
    return {token.strip().lower() for token in value.split(b",")} - {b"keep-alive", b"close", b""}


# ---- one request, as parsed from the client ------------------------------------------------------------------


class BodyMode(enum.Enum):
    """How a request body goes to the child (Request.mode)."""

    STREAM = enum.auto()  # as it arrives
    WHOLE = enum.auto()  # read whole first, sent with the head (no body, or at most SMALL_BODY bytes)
    HOOKED = enum.auto()  # read whole (at most MAX_HOOKED_BODY), given to the completion hook, then sent
    DISCARD = enum.auto()  # answered by slotkeeper: the body is read and dropped


# The members as globals, compared with `is`, for the per-chunk path (`ClientConnection.on_body`): on Python 3.11
# `req.mode is STREAM` costs what the int comparison it replaced did, `req.mode is BodyMode.STREAM` 3.5x that.
STREAM, WHOLE, HOOKED, DISCARD = BodyMode.STREAM, BodyMode.WHOLE, BodyMode.HOOKED, BodyMode.DISCARD


class Request:
    """A client's request: what the child will get (`head`, without framing), its body so far, and where its
    answer stands.

    Attributes that most requests never change are class-level defaults, not set per request.
    """

    target = b""
    method = b""
    path = ""
    head = b""
    http11 = True
    keep_alive = True
    length: int | None = None
    chunked = False
    expect_continue = False
    has_host = False
    named: set[bytes] | None = None  # header names listed in Connection (beyond keep-alive and close)
    codings: bytes | None = None  # a Transfer-Encoding other than just "chunked" (refused)
    upgrade = False  # has an Upgrade header
    mode: BodyMode = STREAM
    buffered = 0
    complete = False  # the whole body has been read from the client
    child: ChildConnection | None = None  # where further body pieces go, once the head is sent
    payload: bytes | None = None  # the whole request as sent, kept to send it again once
    retried = False
    counted = False  # forwarded (or refused on the way): in the proxy's counts and drain
    works = False  # counted as work for llama-server (not a status poll): for the idle saves
    reply: Reply | None = None  # slotkeeper's own answer, sent once the body is read
    own_route: OwnRoute | None = None
    deferred = False  # to be sent once its body is read
    done: Callable[[int], None] | None = None  # the completion hook's callback for the request's end
    observe: Callable[[bytes], None] | None = None  # the completion hook's reader of the response body
    # its answer from the child
    status = 0  # set when the answer's head goes to the client
    chunked_out = False  # the answer's body goes to the client chunked

    def __init__(self) -> None:
        self.forwarded: list[bytes] = []  # end-to-end header lines for the child: name, ": ", value, CRLF
        self.parts: list[bytes] = []  # body pieces not sent yet

    def header(self, lname: bytes, name: bytes, value: bytes) -> None:
        """A header that is not simply forwarded: noted (framing, Expect, Connection) and dropped, or Host."""
        if lname in REQUEST_NOTED:
            if lname == b"content-length":
                self.length = int(value)
            elif lname == b"transfer-encoding":
                self.chunked = True  # llhttp accepts a request body in no other final transfer coding
                if value.strip(b" \t").lower() != b"chunked":  # "gzip, chunked": more than the framing
                    self.codings = value
            elif lname == b"expect":
                self.expect_continue = value.lower() == b"100-continue"
            elif lname == b"host":
                self.has_host = True
                self.forwarded += (name, b": ", value, b"\r\n")
            elif lname == b"connection":
                named = connection_named(value)
                if named:
                    self.named = (self.named or set()) | named
            elif lname == b"upgrade":
                self.upgrade = True

    def first_header(self, lname: bytes) -> bytes:
        """The first value of the end-to-end header `lname` (lower case), b"" if absent: as cpp-httplib's
        get_header_value reads it (the first of repeats, spaces and tabs trimmed). Off the hot path: a scan."""
        forwarded = self.forwarded
        for i in range(0, len(forwarded), 4):
            if forwarded[i].lower() == lname:
                return forwarded[i + 2].strip(b" \t")
        return b""

    def prepare(self, method: bytes) -> str | None:
        """The child's request head (without framing), and the path slotkeeper routes on, read from the target
        as llama-server reads it (target.py); or why the request is refused. The child gets the target byte for
        byte (an absolute-form one too: llama-server reads it as a path, which no route matches)."""
        self.method = method
        try:
            self.path = read_path(self.target)
        except RefusedTarget as exc:
            return exc.reason
        if self.codings is not None:
            return f"Transfer-Encoding {self.codings.decode('latin-1')!r}: only chunked is supported"
        forwarded = self.forwarded
        if self.named:  # drop the headers Connection named (rare): every header is 4 items
            forwarded = [
                item
                for i in range(0, len(forwarded), 4)
                if forwarded[i].lower() not in self.named
                for item in forwarded[i : i + 4]
            ]
        if not self.has_host:
            forwarded += (b"Host: localhost\r\n",)
        if self.chunked:
            self.length = None
        self.expect_continue = self.expect_continue and self.http11
        self.head = b"".join((method, b" ", self.target, b" HTTP/1.1\r\n", *forwarded))
        return None

    @property
    def has_body(self) -> bool:
        return self.chunked or self.length is not None

    @property
    def head_sent(self) -> bool:
        """The answer's head went to the client: a failure now can only cut its body off."""
        return self.status != 0
