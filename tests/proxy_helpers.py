"""The proxy's test harness, shared by test_proxy.py, test_framing.py, test_client_gone.py and
test_own_api_key.py: a scripted child that records the raw bytes it receives, the proxy served in front of it,
and a raw client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slotkeeper.llama.supervisor import ChildEndpoint
from slotkeeper.proxy.server import Gate, Proxy
from slotkeeper.testing.harness import free_port

# ---- a scripted child ----------------------------------------------------------------------------------------


@dataclass
class RawRequest:
    """A request as the child received it: exact request line and header bytes, de-chunked body."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    chunked: bool = False

    def header(self, name: bytes) -> list[bytes]:
        return [v for k, v in self.headers if k.lower() == name.lower()]


Responder = Callable[[RawRequest, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool | None]]


async def read_head(reader: asyncio.StreamReader) -> RawRequest | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head[:-4].split(b"\r\n")
    method, target, _ = lines[0].split(b" ", 2)
    headers = [(n, v.strip()) for n, _, v in (line.partition(b":") for line in lines[1:])]
    request = RawRequest(method, target, headers)
    request.chunked = any(v.lower() == b"chunked" for v in request.header(b"transfer-encoding"))
    return request


async def read_body(request: RawRequest, reader: asyncio.StreamReader) -> None:
    if request.chunked:
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass
                break
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        request.body = b"".join(parts)
    elif length := request.header(b"content-length"):
        request.body = await reader.readexactly(int(length[0]))


def raw_response(
    status: str = "200 OK", headers: list[tuple[str, str]] | None = None, body: bytes = b"", length: bool = True
) -> bytes:
    lines = [f"HTTP/1.1 {status}"] + [f"{k}: {v}" for k, v in headers or []]
    if length:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def answer_ok(request: RawRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_body(request, reader)
    writer.write(raw_response(headers=[("Content-Type", "application/json")], body=b'{"ok":true}'))


class FakeChild:
    """An HTTP/1.1 server on a unix socket that records every request and answers with `self.respond`.

    A responder returns False to close the connection after its answer.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.requests: list[RawRequest] = []
        self.connections = 0
        self.closed_at: list[float] = []  # when each connection ended, seen from the child
        self.respond: Responder = answer_ok
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, str(self.path))

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while request := await read_head(reader):
                self.requests.append(request)
                if await self.respond(request, reader, writer) is False:
                    break
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the proxy hung up, or the test ended
        finally:
            self.closed_at.append(time.monotonic())
            writer.close()


@dataclass
class Proxied:
    port: int
    child: FakeChild
    proxy: Proxy
    gate: Gate


# ---- the proxy in front of it -----------------------------------------------------------------------------------


@asynccontextmanager
async def listening_proxy(
    tmp_path: Path, socket_path: Path, opened: bool = True, state: str = "ready", api_keys: Sequence[str] = ()
) -> AsyncIterator[tuple[int, Proxy, Gate]]:
    """(port, proxy, gate): the proxy served exactly as slotkeeper serves it (Proxy.listen, on a free TCP port),
    in front of the child at `socket_path`; its gate open unless not `opened`, `state` the daemon's state it
    reports while the gate is shut. Stopped after, as the daemon stops it."""
    gate = Gate()
    if opened:
        gate.open()
    endpoint = ChildEndpoint(runtime_dir=tmp_path, socket_path=socket_path)
    proxy = Proxy(endpoint, gate, lambda: state, time.monotonic() + 30, api_keys)
    port = free_port()
    await proxy.listen("127.0.0.1", port)
    try:
        yield port, proxy, gate
    finally:
        await proxy.stop_listening()
        proxy.close()


@asynccontextmanager
async def proxied_child(
    tmp_path: Path, opened: bool = True, state: str = "ready", api_keys: Sequence[str] = ()
) -> AsyncIterator[Proxied]:
    """The proxy (`listening_proxy`) in front of a FakeChild, which answers `answer_ok` until a test sets its
    `respond`; both stopped after."""
    child = FakeChild(tmp_path / "child.sock")
    await child.start()
    try:
        async with listening_proxy(tmp_path, child.path, opened, state, api_keys) as (port, proxy, gate):
            yield Proxied(port, child, proxy, gate)
    finally:
        await child.stop()


# ---- a raw client --------------------------------------------------------------------------------------------


@dataclass
class RawResponse:
    status_line: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    chunks: list[tuple[float, bytes]] = field(default_factory=list)  # (arrival time, data) as de-chunked

    @property
    def status(self) -> int:
        return int(self.status_line.split(b" ")[1])

    def header(self, name: bytes) -> list[bytes]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    def json(self) -> Any:
        return json.loads(self.body)


async def read_response(reader: asyncio.StreamReader, head_request: bool = False) -> RawResponse:
    """One response, skipping interim (1xx) ones; the body by Content-Length, chunked, or until close."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head[:-4].split(b"\r\n")
        headers = [(n, v.strip()) for n, _, v in (line.partition(b":") for line in lines[1:])]
        response = RawResponse(lines[0], headers, b"")
        if not 100 <= response.status < 200:
            break
    if head_request or response.status in (204, 304):
        return response
    if any(v.lower() == b"chunked" for v in response.header(b"transfer-encoding")):
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            response.chunks.append((time.monotonic(), data))
        response.body = b"".join(d for _, d in response.chunks)
    elif length := response.header(b"content-length"):
        response.body = await reader.readexactly(int(length[0]))
    else:
        response.body = await reader.read()
    return response


async def raw_call(port: int, request: bytes, head_request: bool = False) -> RawResponse:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await asyncio.wait_for(read_response(reader, head_request), 10)
    finally:
        writer.close()


def request_bytes(method: str, target: str, headers: list[tuple[str, str]] | None = None, body: bytes = b"") -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: slotkeeper.test"] + [f"{k}: {v}" for k, v in headers or []]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
