"""slotkeeper's own HTTP calls to its llama-server child, over the private endpoint.

These few calls use an aiohttp session; the proxy has its own lean keep-alive pool to the same child
(proxy.ChildPool).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from .supervisor import ChildEndpoint

# Bound only what is safe to bound: reaching the child. Slot saves of large caches and long generations
# legitimately take minutes, so no total or read timeout is set here.
CONNECT_TIMEOUT_S = 10.0


def make_session(endpoint: ChildEndpoint) -> aiohttp.ClientSession:
    """A pooled session to the child, with no automatic decompression (the proxy passes bodies byte-exact)."""
    if endpoint.socket_path is not None:
        connector: aiohttp.BaseConnector = aiohttp.UnixConnector(path=str(endpoint.socket_path), limit=0)
    else:
        connector = aiohttp.TCPConnector(limit=0, use_dns_cache=False)
    return aiohttp.ClientSession(
        base_url=endpoint.base_url,
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )


@dataclass(frozen=True)
class ChildReply:
    """A parsed JSON reply and its status; `error` is llama-server's error message when there is one."""

    status: int
    body: Any

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def error(self) -> str:
        if isinstance(self.body, dict) and isinstance(self.body.get("error"), dict):
            return str(self.body["error"].get("message", ""))
        return str(self.body)[:200]


class LlamaClient:
    """The few llama-server endpoints slotkeeper calls itself, with the API key llama-server requires."""

    def __init__(self, session: aiohttp.ClientSession, api_key: str | None) -> None:
        self.session = session
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def _call(
        self, method: str, path: str, payload: Any = None, params: dict[str, str] | None = None
    ) -> ChildReply:
        async with self.session.request(method, path, json=payload, params=params, headers=self.headers) as resp:
            raw = await resp.read()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode("utf-8", "replace")
            return ChildReply(resp.status, body)

    async def health(self) -> ChildReply:
        return await self._call("GET", "/health")

    async def props(self) -> ChildReply:
        return await self._call("GET", "/props")

    async def slots(self) -> ChildReply:
        return await self._call("GET", "/slots")

    async def slot_action(self, slot_id: int, action: str, filename: str | None = None) -> ChildReply:
        body = {"filename": filename} if filename is not None else {}
        return await self._call("POST", f"/slots/{slot_id}", payload=body, params={"action": action})
