"""The streaming reverse proxy in front of llama-server, and the gate that holds requests until ready.

Modelled on Home Assistant's ingress proxy: hop-by-hop headers are dropped both ways, bodies stream in both
directions without buffering or size caps, an upstream failure before response headers is a 502 in
llama-server's error shape, and a failure after headers is logged and the connection closed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from .log import log
from .slots import is_reserved_filename

HOP_BY_HOP_HEADERS = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "transfer-encoding", "upgrade",
    }
)
# Set by the client library for the upstream request, or meaningless across the hop.
REQUEST_HEADERS_DROPPED = HOP_BY_HOP_HEADERS | {"host"}
HEALTH_PATHS = frozenset({"/health", "/v1/health"})
OWN_PREFIX = "/slotkeeper/"
SLOT_ACTION_PREFIX = "/slots/"
PROTECTED_SLOT_ACTIONS = frozenset({"save", "restore"})


def error_response(status: int, message: str, error_type: str, extra: dict[str, object] | None = None) -> web.Response:
    """An error in llama-server's own shape, so clients cannot tell who answered."""
    body = {"error": {"code": status, "message": message, "type": error_type}, **(extra or {})}
    return web.json_response(body, status=status)


def filter_headers(headers: CIMultiDict[str] | object, dropped: frozenset[str]) -> CIMultiDict[str]:
    """Copy headers (all values of repeated ones) except hop-by-hop ones and those named in Connection."""
    source: CIMultiDict[str] = headers  # type: ignore[assignment]
    named_in_connection = {
        token.strip().lower() for value in source.getall("Connection", []) for token in value.split(",")
    }
    return CIMultiDict(
        (name, value) for name, value in source.items()
        if name.lower() not in dropped and name.lower() not in named_in_connection
    )


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
        except asyncio.TimeoutError:
            return False


class Proxy:
    """Forwards every request to the child once the gate is open; tracks requests in flight for draining."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        gate: Gate,
        describe_state: Callable[[], str],
        startup_deadline: float,
    ) -> None:
        self.session = session
        self.gate = gate
        self.describe_state = describe_state
        self.startup_deadline = startup_deadline
        self.accepting = True
        self.in_flight: set[asyncio.Task[object]] = set()
        self.last_activity = time.monotonic()
        self.requests_total = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.own_routes: dict[str, Callable[[web.Request], object]] = {}

    # ---- lifecycle hooks used by the daemon ----------------------------------------------------------------

    async def wait_idle(self, timeout: float) -> bool:
        """True when no request is in flight within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def cancel_in_flight(self) -> int:
        for task in list(self.in_flight):
            task.cancel()
        return len(self.in_flight)

    # ---- request handling ----------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path.startswith(OWN_PREFIX):
            handler = self.own_routes.get(path)
            if handler is None:
                return error_response(404, "File Not Found", "not_found_error")
            return await handler(request)  # type: ignore[misc]
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
        body: bytes | None = None
        if path.startswith(SLOT_ACTION_PREFIX) and request.method == "POST":
            body = await request.read()
            refusal = refuse_own_files(request.query.get("action", ""), body)
            if refusal is not None:
                return refusal
        task = asyncio.current_task()
        assert task is not None
        self.in_flight.add(task)
        self._idle.clear()
        self.requests_total += 1
        try:
            return await self._forward(request, body)
        finally:
            self.in_flight.discard(task)
            self.last_activity = time.monotonic()
            if not self.in_flight:
                self._idle.set()

    async def _forward(self, request: web.Request, body: bytes | None) -> web.StreamResponse:
        data = body if body is not None else (request.content if request.body_exists else None)
        response: web.StreamResponse | None = None
        try:
            async with self.session.request(
                request.method,
                request.rel_url,
                headers=filter_headers(request.headers, REQUEST_HEADERS_DROPPED),
                data=data,
                allow_redirects=False,
                auto_decompress=False,
            ) as upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                response.headers.extend(filter_headers(upstream.headers, HOP_BY_HOP_HEADERS))
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except ConnectionResetError:
            log.debug("%s %s: client went away", request.method, request.path)
            return response or web.Response(status=499)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            if response is None or not response.prepared:
                log.warning("%s %s: llama-server unreachable: %s", request.method, request.path, exc)
                return error_response(502, f"llama-server unreachable: {exc}", "server_error")
            log.warning("%s %s: llama-server response broke off: %r", request.method, request.path, exc)
            if request.transport is not None:
                request.transport.close()
            return response


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
