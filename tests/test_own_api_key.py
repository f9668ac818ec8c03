"""slotkeeper's own endpoints require llama-server's API key (issue 21).

With --api-key, --api-key-file or LLAMA_API_KEY, llama-server answers 401 to a request without a valid key, but
for /health, /v1/health and its web UI's files. /slotkeeper/status and /slotkeeper/metrics tell what the slots
and the store hold, so they are guarded the same way: same headers, same verdict, same 401 answer.
"""

from __future__ import annotations

import http.client
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from proxy_helpers import Proxied, proxied_child, raw_call, request_bytes

from slotkeeper.proxy.messages import Reply

KEY = "tok-123"
OWN_PATHS = ("/slotkeeper/status", "/slotkeeper/metrics")
# Header sets, each judged by llama-server on a proxied path and by slotkeeper on its own: the verdicts must agree.
HEADER_CASES: list[list[tuple[str, str]]] = [
    [],
    [("Authorization", f"Bearer {KEY}")],
    [("X-Api-Key", KEY)],
    [("Authorization", "Bearer wrong")],
    [("X-Api-Key", "wrong")],
    [("Authorization", KEY)],  # no "Bearer ": the value itself is compared
    [("X-Api-Key", f"Bearer {KEY}")],
    [("Authorization", f"bearer {KEY}")],
    [("Authorization", f"Bearer  {KEY}")],
    [("Authorization", f"Bearer {KEY}x")],
    [("Authorization", f"Bearer {KEY[:-1]}")],
    [("Authorization", "Bearer wrong"), ("X-Api-Key", KEY)],  # Authorization, when present, is the one read
    [("Authorization", ""), ("X-Api-Key", KEY)],  # an empty one is absent
    [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer wrong")],  # the first of repeats
    [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")],
]


def ask(port: int, path: str, headers: list[tuple[str, str]]) -> tuple[int, str, bytes]:
    """(status, Content-Type, raw body), with exactly these headers (repeats kept)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("GET", path)
        for name, value in headers:
            conn.putheader(name, value)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read()
    finally:
        conn.close()


# ---- a real llama-server ------------------------------------------------------------------------------------------


@pytest.fixture(params=["--api-key", "--api-key-file", "LLAMA_API_KEY"])
def keyed(request: pytest.FixtureRequest, starter, llama_server: str, models: dict[str, Path], tmp_path: Path) -> int:
    """The port of slotkeeper around the real llama-server, given the key one of llama-server's three ways."""
    start = starter(llama_server, ["-m", str(models["A"]), "-c", "2048", "-np", "1", "-t", "2", "--no-warmup"])
    if request.param == "--api-key":
        return int(start("--api-key", KEY).port)
    if request.param == "--api-key-file":
        keys = tmp_path / "keys"
        keys.write_text(f"# the one key\n{KEY}\n")
        return int(start("--api-key-file", str(keys)).port)
    return int(start(env={"LLAMA_API_KEY": KEY}).port)


def test_own_paths_require_the_key_as_llama_server_paths_do(keyed: int) -> None:
    port = keyed
    refused = ask(port, "/props", [])  # answered by llama-server itself
    assert refused[0] == 401, refused
    for path in (*OWN_PATHS, "/slotkeeper/nothing"):  # an unknown one too: llama-server checks before routing
        for headers in ([], [("Authorization", "Bearer wrong")], [("X-Api-Key", "wrong")]):
            assert ask(port, path, headers) == refused, (path, headers)
        for headers in ([("Authorization", f"Bearer {KEY}")], [("X-Api-Key", KEY)]):
            status = ask(port, path, headers)[0]
            assert status == (404 if path == "/slotkeeper/nothing" else 200), (path, headers, status)
    assert ask(port, "/health", [])[0] == 200  # public, as in llama-server


def test_own_paths_judge_every_header_form_as_llama_server_does(
    starter, llama_server: str, models: dict[str, Path]
) -> None:
    port = starter(llama_server, ["-m", str(models["A"]), "-c", "2048", "-np", "1", "-t", "2", "--no-warmup"])(
        "--api-key", KEY
    ).port
    for headers in HEADER_CASES:
        theirs = ask(port, "/props", headers)[0]
        assert theirs in (200, 401), (headers, theirs)
        for path in OWN_PATHS:
            assert ask(port, path, headers)[0] == theirs, (path, headers)


# ---- the proxy alone ----------------------------------------------------------------------------------------------


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[Proxied]:
    """The proxy with two keys, an own route, in front of a FakeChild."""

    async def status() -> Reply:
        return Reply.json({"state": "ready"})

    async with proxied_child(tmp_path, api_keys=["k1", "k2"]) as served:
        served.proxy.own_routes["/slotkeeper/status"] = status
        yield served


async def test_any_of_the_keys_opens_own_paths_and_nothing_reaches_the_child(guarded: Proxied) -> None:
    for key in ("k1", "k2"):
        reply = await raw_call(guarded.port, request_bytes("GET", "/slotkeeper/status", [("X-Api-Key", key)]))
        assert (reply.status, reply.json()) == (200, {"state": "ready"})
    refused = await raw_call(guarded.port, request_bytes("GET", "/slotkeeper/status", [("X-Api-Key", "k3")]))
    assert refused.status == 401
    assert refused.body == b'{"error":{"message":"Invalid API Key","type":"authentication_error","code":401}}'
    assert not guarded.child.requests
    proxied = await raw_call(guarded.port, request_bytes("GET", "/props"))  # the child judges its own paths
    assert proxied.status == 200 and len(guarded.child.requests) == 1


def test_every_key_llama_server_accepts_opens_own_paths(
    starter, llama_server: str, models: dict[str, Path], tmp_path: Path
) -> None:
    """Several keys (`--api-key a,b` and an --api-key-file beside it): llama-server accepts each, and so do
    slotkeeper's own paths, not only the first."""
    keys = tmp_path / "keys"
    keys.write_text("k-file\n")
    start = starter(llama_server, ["-m", str(models["A"]), "-c", "2048", "-np", "1", "-t", "2", "--no-warmup"])
    port = int(start("--api-key", "k-one,k-two", "--api-key-file", str(keys)).port)
    for key in ("k-one", "k-two", "k-file"):
        headers = [("Authorization", f"Bearer {key}")]
        assert ask(port, "/props", headers)[0] == 200, key  # llama-server's own verdict
        assert ask(port, "/slotkeeper/status", headers)[0] == 200, key
    assert ask(port, "/slotkeeper/status", [("Authorization", "Bearer k-three")])[0] == 401
