"""Framing fuzz (issue 11): every request on a connection gets the same rules, however its bytes arrive.

hypothesis writes a connection's worth of requests (Content-Length, chunked with extensions and trailers,
Expect: 100-continue, bodies up to past BODY_BUFFER_HIGH, targets that spell a completion path with escapes,
answers that stream while the next requests arrive) and cuts the bytes into writes at random places, maybe
half-closing after them. The proxy serves them in front of the scripted child, with a completion hook that
records what it is given and tags the body, so the child shows which bodies went through it:

* the child receives exactly the requests the client sent, in order, each body intact;
* every completion request (by llama-server's reading of its target) goes through the hook exactly once, and
  no other request does; its end is reported once;
* with the gate closed, nothing reaches the child or the hook until it opens (but /health's 503); draining,
  every request gets the same 503;
* ambiguous or malformed bytes anywhere (both Content-Length and Transfer-Encoding, two lengths, bad chunk
  sizes, obs-fold, bare LF, a fragment, a %u escape, a body with Upgrade...) get a 400 (431 for a huge head)
  after the answers to the requests before them, then the connection closes: they, and what follows them,
  never reach the child whole.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from pathlib import Path

import httptools
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from proxy_helpers import FakeChild, RawRequest, RawResponse, raw_response, read_body, read_response
from target_model import Target, read_target

from slotkeeper.llama.supervisor import ChildEndpoint
from slotkeeper.proxy.connection import BODY_BUFFER_HIGH, MAX_REQUEST_HEAD, SMALL_BODY
from slotkeeper.proxy.hook import Placed
from slotkeeper.proxy.server import Gate, Proxy

# What llama-server b11434 routes as a completion (tools/server/server.cpp); the hook must see exactly these.
COMPLETION_PATHS = frozenset(
    {
        "/completion",
        "/completions",
        "/v1/completions",
        "/chat/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/infill",
    }
)
HOOK_TAG = b"hooked:"
STREAM_MARK = b"stream=1"  # in a target: the child answers in several chunks, a few ms apart
FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class RecordingHook:
    """A CompletionHook that records what it was given and tags the body it hands back."""

    def __init__(self) -> None:
        self.placed: list[tuple[str, bytes]] = []
        self.ended: list[int] = []

    def wants(self, method: bytes, path: str) -> bool:
        return method == b"POST" and path in COMPLETION_PATHS

    async def place(self, path: str, body: bytes) -> Placed:
        self.placed.append((path, body))
        await asyncio.sleep(0)
        return Placed(HOOK_TAG + body, self.ended.append)


class Sent:
    """One request as the client writes it, and what the child must get for it."""

    __slots__ = ("body", "data", "method", "target")

    def __init__(self, method: bytes, target: bytes, body: bytes, data: bytes) -> None:
        self.method, self.target, self.body, self.data = method, target, body, data

    @property
    def hooked(self) -> bool:
        target = read_target(self.target)
        return self.method == b"POST" and isinstance(target, Target) and target.path in COMPLETION_PATHS

    @property
    def forwarded_body(self) -> bytes:
        return HOOK_TAG + self.body if self.hooked else self.body

    @property
    def health(self) -> bool:
        target = read_target(self.target)
        return isinstance(target, Target) and target.path in ("/health", "/v1/health")

    def answer(self) -> bytes:
        return echo(self.method, self.target, self.forwarded_body)

    def __repr__(self) -> str:
        head, _, body = self.data.partition(b"\r\n\r\n")
        return f"Sent({head + b'<CRLF CRLF>'!r} + {len(body)} bytes: {body[:60]!r}...)"


def echo(method: bytes, target: bytes, body: bytes) -> bytes:
    return b"%s %s %d %s" % (method, target, len(body), hashlib.sha1(body).hexdigest().encode())


# ---- the connection's bytes -----------------------------------------------------------------------------------

TARGETS = [  # (method, target): completions spelled several ways, other routes, and methods the hook ignores
    (b"POST", b"/completion"),
    (b"POST", b"/v1/chat/completions"),
    (b"POST", b"/v1/chat%2Fcompletions"),
    (b"POST", b"/%76%31/messages?x=1"),
    (b"POST", b"/v1/responses?" + STREAM_MARK),
    (b"POST", b"/infill"),
    (b"POST", b"/completions?" + STREAM_MARK),
    (b"POST", b"/v1/completions?a=1&a=2"),
    (b"POST", b"/chat/completions"),
    (b"POST", b"/tokenize"),
    (b"POST", b"/v1/embeddings?" + STREAM_MARK),
    (b"POST", b"/v1/chat/completions/"),
    (b"POST", b"/Completion"),
    (b"POST", b"/slots/0?action=save"),
    (b"PUT", b"/completion"),
    (b"GET", b"/completion"),
    (b"GET", b"/props?x=%2F"),
    (b"GET", b"/health"),
    (b"GET", b"/he%61lth?" + STREAM_MARK),
    (b"OPTIONS", b"/v1/chat/completions"),
]
EXTENSIONS = [b"", b"", b";a=b", b";x", b';q="v;w"', b";a=b;c"]


@st.composite
def requests(draw: st.DrawFn, expect: bool = True) -> Sent:
    method, target = draw(st.sampled_from(TARGETS))
    size = draw(st.sampled_from([0, 1, 2, 17, 300, 300, SMALL_BODY + 1, 2 * BODY_BUFFER_HIGH + 1000]))
    body = draw(st.binary(min_size=size, max_size=size)) if size <= 300 else bytes(range(256)) * (size // 256)
    framing = draw(st.sampled_from(["length", "length", "chunked"] + (["none"] if not body else [])))
    head = [b"%s %s HTTP/1.1" % (method, target), b"Host: fuzz"]
    if expect and body and draw(st.integers(0, 4)) == 0:
        head.append(b"Expect: 100-continue")
    if framing == "length":
        head.append(b"Content-Length: %s" % draw(st.sampled_from([b"%d", b"%d", b"00%d"])) % len(body))
        data = b"\r\n".join(head) + b"\r\n\r\n" + body
    elif framing == "chunked":
        head.append(b"Transfer-Encoding: " + draw(st.sampled_from([b"chunked", b"Chunked", b"chunked "])))
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(body) - 1)), max_size=4))) if len(body) > 1 else []
        parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)]) if body[a:b]]
        chunks = b"".join(b"%x%s\r\n%s\r\n" % (len(p), draw(st.sampled_from(EXTENSIONS)), p) for p in parts)
        trailer = draw(st.sampled_from([b"", b"", b"X-Trailer: 1\r\n", b"Expect: 100-continue\r\nHost: t\r\n"]))
        data = (
            b"\r\n".join(head)
            + b"\r\n\r\n"
            + chunks
            + b"0"
            + draw(st.sampled_from(EXTENSIONS))
            + b"\r\n"
            + trailer
            + b"\r\n"
        )
    else:
        data = b"\r\n".join(head) + b"\r\n\r\n"
    return Sent(method, target, body, data)


def cut(data: bytes, draw: st.DrawFn) -> list[bytes]:
    """The bytes in writes, cut anywhere (a write may hold the end of one request and the start of the next)."""
    points = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=6)))
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)]) if data[a:b]]


# ---- the proxy in front of a recording child --------------------------------------------------------------------

_sockets = itertools.count()


class Harness:
    """A fresh proxy (gate open, the recording hook) in front of a FakeChild that records whole requests."""

    def __init__(self, tmp_path: Path) -> None:
        self.child = FakeChild(tmp_path / f"c{next(_sockets)}.sock")
        self.child.respond = self._respond
        self.complete: list[tuple[bytes, bytes, bytes]] = []  # (method, target, body), once the body is all in
        self.hook = RecordingHook()
        self.gate = Gate()
        self.gate.open()
        endpoint = ChildEndpoint(runtime_dir=tmp_path, socket_path=self.child.path)
        self.proxy = Proxy(endpoint, self.gate, lambda: "restoring", time.monotonic() + 30)
        self.proxy.hook = self.hook
        self.writing: asyncio.Future[None] | None = None
        # a unix socket, not a TCP port: a test elsewhere that polls a free_port() it was given could land here
        self.address = str(tmp_path / f"p{next(_sockets)}.sock")

    async def __aenter__(self) -> Harness:
        await self.child.start()
        await self.proxy.listen(self.address, 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.writing is not None:
            self.writing.cancel()
        await self.proxy.stop_listening()
        self.proxy.close()
        await self.child.stop()

    async def _respond(self, request: RawRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_body(request, reader)  # raises if the proxy cut the request off: it is not recorded
        self.complete.append((request.method, request.target, request.body))
        answer = echo(request.method, request.target, request.body)
        if STREAM_MARK not in request.target:
            writer.write(raw_response(body=answer))
            return
        writer.write(raw_response(headers=[("Transfer-Encoding", "chunked")], length=False))
        for piece in (answer[:5], answer[5:20], answer[20:]):  # still streaming when the next requests arrive
            await writer.drain()
            await asyncio.sleep(0.002)
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        writer.write(b"0\r\n\r\n")

    async def send(self, writes: list[bytes], half_close: bool) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect and write in the background (the proxy may hold a body back while the answers are read)."""
        reader, writer = await asyncio.open_unix_connection(self.address)

        async def write() -> None:
            for piece in writes:
                try:
                    writer.write(piece)
                    await writer.drain()
                except ConnectionError:  # refused and closed: what was written is answered
                    return
                await asyncio.sleep(0.001)  # its own read at the proxy, most of the time
            if half_close:
                try:
                    writer.write_eof()
                except OSError:  # the proxy closed first (it refused what it got)
                    pass

        self.writing = asyncio.ensure_future(write())
        return reader, writer


async def answers(reader: asyncio.StreamReader, n: int) -> list[RawResponse]:
    """Up to n answers, fewer if the connection closes."""
    out = []
    for _ in range(n):
        try:
            out.append(await asyncio.wait_for(read_response(reader), 10))
        except asyncio.IncompleteReadError:
            break
    return out


async def closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 5) == b""
    except ConnectionError:
        return True


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


# ---- one path for every request -------------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_every_request_reaches_the_child_once_through_the_same_rules(tmp_path, data):
    sent = data.draw(st.lists(requests(), min_size=1, max_size=5), "requests")
    writes = cut(b"".join(s.data for s in sent), data.draw)
    half_close = data.draw(st.booleans(), "half-close")

    async def case() -> None:
        async with Harness(tmp_path) as h:
            reader, writer = await h.send(writes, half_close)
            got = await answers(reader, len(sent))
            note(f"answers {[r.status for r in got]}; child {[(m, t, len(b)) for m, t, b in h.complete]}")
            assert [(r.status, r.body) for r in got] == [(200, s.answer()) for s in sent]
            assert h.complete == [(s.method, s.target, s.forwarded_body) for s in sent]
            expected_hooked = [(read_target(s.target).path, s.body) for s in sent if s.hooked]  # type: ignore
            assert h.hook.placed == expected_hooked
            assert h.hook.ended == [200] * len(expected_hooked)
            if half_close:
                assert await closed(reader), "a half-closed client's connection is closed once answered"
            writer.close()

    run(case())


@FUZZ
@given(data=st.data())
def test_nothing_passes_the_closed_gate(tmp_path, data):
    """Until the restore is done: /health is slotkeeper's 503 (at its turn), everything else waits, pipelined
    or not; then all of it goes on, in order. (Without Expect: 100-continue, whose early 503 closes the
    connection, as the client may or may not send the body it announced.)"""
    sent = data.draw(st.lists(requests(expect=False), min_size=1, max_size=4), "requests")
    writes = cut(b"".join(s.data for s in sent), data.draw)

    async def case() -> None:
        async with Harness(tmp_path) as h:
            h.gate = h.proxy.gate = Gate()
            reader, writer = await h.send(writes, False)
            leading = next((i for i, s in enumerate(sent) if not s.health), len(sent))
            early = await answers(reader, leading)
            assert [(r.status, r.json()["status"]) for r in early] == [(503, "restoring")] * leading
            await asyncio.sleep(0.05)
            assert not h.complete and not h.hook.placed and not h.child.requests
            h.gate.open()
            rest = await answers(reader, len(sent) - leading)
            assert [(r.status, r.body) for r in rest] == [(200, s.answer()) for s in sent[leading:]]
            assert h.complete == [(s.method, s.target, s.forwarded_body) for s in sent[leading:]]
            writer.close()

    run(case())


@FUZZ
@given(data=st.data())
def test_draining_refuses_every_request_alike(tmp_path, data):
    sent = data.draw(st.lists(requests(expect=False), min_size=1, max_size=5), "requests")
    writes = cut(b"".join(s.data for s in sent), data.draw)

    async def case() -> None:
        async with Harness(tmp_path) as h:
            h.proxy.accepting = False
            reader, writer = await h.send(writes, False)
            got = await answers(reader, len(sent))
            assert [(r.status, r.json()["error"]["message"]) for r in got] == [
                (503, "slotkeeper is shutting down")
            ] * len(sent)
            assert not h.child.requests and not h.hook.placed
            writer.close()

    run(case())


def test_nothing_after_an_answer_that_closes_the_connection_is_read(tmp_path):
    """An early answer to a request with Expect: 100-continue closes the connection (the client may or may not
    send the body it announced): a request after it in the same read must not reach the child unanswered."""

    async def case() -> None:
        async with Harness(tmp_path) as h:
            reader, writer = await h.send([b"GET /props HTTP/1.1\r\n\r\n"], False)
            assert [r.status for r in await answers(reader, 1)] == [200]  # a kept-alive connection to the child
            writer.close()
            h.child.requests.clear()
            reader, writer = await h.send(
                [
                    b"POST /slotkeeper/nothing HTTP/1.1\r\nExpect: 100-continue\r\n"
                    b"Content-Length: 2\r\n\r\n{}POST /slots/0?action=erase HTTP/1.1\r\n"
                    b"Content-Length: 0\r\n\r\n"
                ],
                False,
            )
            got = await answers(reader, 2)
            assert [r.status for r in got] == [404]
            assert await closed(reader)
            await asyncio.sleep(0.05)
            assert not h.child.requests
            writer.close()

    run(case())


def test_a_head_too_large_from_the_first_read_is_refused(tmp_path):
    """The request head is counted from the first byte of a connection."""

    async def case() -> None:
        async with Harness(tmp_path) as h:
            head = b"GET /props HTTP/1.1\r\nX-Big: " + b"a" * (MAX_REQUEST_HEAD + 128 * 1024) + b"\r\n\r\n"
            reader, writer = await h.send([head], False)
            got = await answers(reader, 1)
            assert [r.status for r in got] == [431]
            assert not h.child.requests
            writer.close()

    run(case())


# ---- what is refused ------------------------------------------------------------------------------------------

AMBIGUOUS = {  # each is refused with a 400 (431) and the connection closes; llhttp or slotkeeper refuses it
    "CL and TE": b"POST /completion HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "TE and CL": b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
    "TE and CL 0": b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n0\r\n\r\n",
    "two equal CLs": b"POST /completion HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
    "two CLs": b"POST /completion HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 30\r\n\r\n{}",
    "CL list": b"POST /completion HTTP/1.1\r\nContent-Length: 2, 2\r\n\r\n{}",
    "CL sign": b"POST /completion HTTP/1.1\r\nContent-Length: +2\r\n\r\n{}",
    "CL empty": b"POST /completion HTTP/1.1\r\nContent-Length: \r\n\r\n",
    "CL hex": b"POST /completion HTTP/1.1\r\nContent-Length: 0x2\r\n\r\n{}",
    "TE gzip, chunked": b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "TE gzip then chunked": b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked"
    b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "TE chunked twice": b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked"
    b"\r\n\r\n0\r\n\r\n",
    "TE identity": b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: identity\r\n\r\n{}",
    "chunk size hex prefix": b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\n{}\r\n0\r\n\r\n",
    "chunk size sign": b"POST /completion HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n-2\r\n{}\r\n0\r\n\r\n",
    "chunk size space": b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2 \r\n{}\r\n0\r\n\r\n",
    "chunk size overflow": b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1000000000000000000"
    b"\r\n{}\r\n0\r\n\r\n",
    "chunk without CRLF": b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}X0\r\n\r\n",
    "chunk bare LF": b"POST /completion HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\n{}\n0\n\n",
    "chunk extension after a space": b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2; a=b\r\n{}"
    b"\r\n0\r\n\r\n",
    "chunk extension ctl": b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2;\x01\r\n{}\r\n0\r\n\r\n",
    "bad trailer": b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nBad Trailer\r\n\r\n",
    "CL trailer": b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
    b"Content-Length: 9\r\n\r\n",
    "obs-fold": b"GET /props HTTP/1.1\r\nX-A: 1\r\n  folded\r\n\r\n",
    "bare LF": b"GET /props HTTP/1.1\nHost: x\n\n",
    "bare CR": b"GET /props HTTP/1.1\rHost: x\r\n\r\n",
    "space before colon": b"POST /tokenize HTTP/1.1\r\nContent-Length : 2\r\n\r\n{}",
    "NUL in a header": b"GET /props HTTP/1.1\r\nX-A: a\x00b\r\n\r\n",
    "no method": b"NOT HTTP AT ALL\r\n\r\n",
    "lower-case method": b"get /props HTTP/1.1\r\n\r\n",
    "HTTP/2.0": b"GET /props HTTP/2.0\r\n\r\n",
    "HTTP/1.2": b"GET /props HTTP/1.2\r\n\r\n",
    "raw UTF-8 target": b"GET /caf\xc3\xa9 HTTP/1.1\r\n\r\n",
    "fragment": b"POST /slots/0?action=save#x HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
    "fragment before ?": b"POST /completion#?x=1 HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
    "%u escape": b"POST /v1/chat%u002Fcompletions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
    "lone surrogate": b"POST /completion%uD800 HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
    "stray %": b"GET /props% HTTP/1.1\r\n\r\n",
    "%00": b"GET /health%00 HTTP/1.1\r\n\r\n",
    "target without /": b"GET %2Fhealth HTTP/1.1\r\n\r\n",
    "Upgrade with a body": b"POST /completion HTTP/1.1\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n"
    b"Content-Length: 2\r\n\r\n{}",
    "huge head": b"GET /props HTTP/1.1\r\nX-Big: "
    + b"a" * (2 * MAX_REQUEST_HEAD + 1024)
    + b"\r\n\r\n",  # (see proxy.py)
}


@pytest.mark.parametrize("name", list(AMBIGUOUS))
def test_each_ambiguous_input_is_refused(tmp_path, name):
    """Each entry gets a 400 (431) and the connection closes, and nothing of it reaches the child whole. Who
    refuses it: llhttp's strict defaults (no lenient flag is set; httptools can only turn them on), or for those
    llhttp alone accepts, slotkeeper's own checks."""
    slotkeepers = {
        "TE gzip, chunked",
        "TE gzip then chunked",
        "HTTP/2.0",
        "fragment",
        "fragment before ?",
        "%u escape",
        "lone surrogate",
        "stray %",
        "%00",
        "Upgrade with a body",
        "huge head",
    }
    parser = httptools.HttpRequestParser(object())
    try:
        parser.feed_data(AMBIGUOUS[name])
        accepted = True
    except httptools.HttpParserUpgrade:
        accepted = True
    except httptools.HttpParserError:
        accepted = False
    assert accepted == (name in slotkeepers)

    async def case() -> None:
        async with Harness(tmp_path) as h:
            reader, writer = await h.send([AMBIGUOUS[name]], False)
            got = await answers(reader, 1)
            assert [r.status for r in got] == [431 if name == "huge head" else 400]
            assert got[0].header(b"connection") == [b"close"]
            assert await closed(reader)
            await asyncio.sleep(0.01)
            assert not h.complete and not h.hook.placed
            writer.close()

    run(case())


def test_a_refused_client_still_sending_gets_its_400(tmp_path):
    """Closing with unread input would reset the connection, which can destroy the 400 before the client reads
    it: the proxy shuts its side and drops what still comes (for LINGER_S) instead."""

    async def case() -> None:
        async with Harness(tmp_path) as h:
            reader, writer = await h.send([b"NOT HTTP\r\n\r\n" + b"x" * (4 << 20)], False)
            await asyncio.sleep(0.2)  # the proxy has refused, and unread bytes wait in its socket
            got = await answers(reader, 1)
            assert [r.status for r in got] == [400]
            writer.close()

    run(case())


@FUZZ
@given(data=st.data())
def test_ambiguous_bytes_get_a_400_after_the_answers_before_them(tmp_path, data):
    before = data.draw(st.lists(requests(), max_size=3), "before")
    name = data.draw(st.sampled_from(list(AMBIGUOUS)), "ambiguous")
    after = data.draw(st.lists(requests(), max_size=2), "after")
    stream = b"".join(s.data for s in before) + AMBIGUOUS[name] + b"".join(s.data for s in after)
    writes = cut(stream, data.draw)

    async def case() -> None:
        async with Harness(tmp_path) as h:
            reader, writer = await h.send(writes, False)
            got = await answers(reader, len(before) + 1)
            note(f"answers {[(r.status, r.body[:80]) for r in got]}")
            assert [(r.status, r.body) for r in got[:-1]] == [(200, s.answer()) for s in before]
            refusal = got[-1]
            assert refusal.status == (431 if name == "huge head" else 400)
            assert refusal.json()["error"]["type"] == "invalid_request_error"
            assert refusal.header(b"connection") == [b"close"]
            assert await closed(reader)
            assert h.complete == [(s.method, s.target, s.forwarded_body) for s in before]
            assert h.hook.placed == [(read_target(s.target).path, s.body) for s in before if s.hooked]  # type: ignore
            writer.close()

    run(case())


@FUZZ
@given(data=st.data())
def test_a_request_cut_short_by_a_half_close_never_reaches_the_child_whole(tmp_path, data):
    before = data.draw(st.lists(requests(), max_size=3), "before")
    last = data.draw(requests(), "cut short")
    stream = b"".join(s.data for s in before) + last.data[: data.draw(st.integers(1, len(last.data) - 1), "kept")]
    writes = cut(stream, data.draw)

    async def case() -> None:
        async with Harness(tmp_path) as h:
            reader, writer = await h.send(writes, True)
            got = await answers(reader, len(before) + 1)
            assert [(r.status, r.body) for r in got[:-1]] == [(200, s.answer()) for s in before]
            assert (
                got[-1].status == 400 and got[-1].json()["error"]["message"] == "bad request: the request ended early"
            )
            assert await closed(reader)
            await asyncio.sleep(0.02)  # the child sees its connection cut
            assert h.complete == [(s.method, s.target, s.forwarded_body) for s in before]
            assert h.hook.placed == [(read_target(s.target).path, s.body) for s in before if s.hooked]  # type: ignore
            writer.close()

    run(case())
