"""An abandoned request must not keep the model busy (issue 21; llama.cpp's own test_cancel_request).

llama-server polls a client's socket while it generates a non-streamed answer (cpp-httplib's
is_connection_closed: readable with nothing to peek is closed, so a half-close counts too) and cancels the task
once the client is gone. Through slotkeeper the same must happen: the client's EOF goes on to the child's
connection, after the request, and llama-server decides as it would for a direct client.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from proxy_helpers import RawRequest, RawResponse, proxied_child, raw_response, read_body, read_response, request_bytes

from slotkeeper.testing.harness import free_port, health_status, http_call, wait_until

ARGS = ["-c", "32768", "-np", "1", "-t", "2", "--no-warmup", "--no-cache-idle-slots"]
N_PREDICT = 30000  # fits the 32,768-token context with the prompt: without a cancel, it runs for many seconds
# llama-server looks at the socket after a second without any result for any task (HTTP_POLLING_SECONDS: its
# wait restarts on every result it hands out, a GET /slots included): so /slots is asked once, after this long
# and the time of STEPS_AFTER_CANCEL tokens (the step under way when the cancel comes, the /slots answer that
# waits for the next one, and the threads' own wait): on a loaded machine a step can take half a second.
FREED_WITHIN_S = 2.0
STEPS_AFTER_CANCEL = 10
READ_TIMEOUT_S = 300.0  # a reply that waits for steps of a loaded machine: only a hang takes this long


# ---- the proxy in front of the scripted child --------------------------------------------------------------------


async def test_the_clients_eof_reaches_the_child_after_its_request(tmp_path: Path) -> None:
    """EOF while the request waits for the gate: once the request is sent, the child reads all of it, then EOF;
    the client, half-closed, still gets the answer; that connection to the child is never reused."""
    seen_eof: list[bool] = []
    hold = asyncio.Event()

    async def respond(request: RawRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_body(request, reader)
        seen_eof.append(await asyncio.wait_for(reader.read(), 5) == b"")
        writer.write(raw_response(body=b'{"ok":true}'))
        await writer.drain()
        await hold.wait()  # the child keeps this connection open: only the proxy must not reuse it

    async with proxied_child(tmp_path, opened=False, state="restoring") as served:
        port, child, gate = served.port, served.child, served.gate
        child.respond = respond
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes("POST", "/completion", body=b'{"prompt":"x"}'))
            writer.write_eof()
            await asyncio.sleep(0.05)
            assert not child.requests, "the gate is closed"
            gate.open()
            reply = await asyncio.wait_for(read_response(reader), 5)
            assert (reply.status, reply.body) == (200, b'{"ok":true}')
            assert seen_eof == [True]
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            child.respond = _answer
            again = await asyncio.wait_for(_call(port), 5)
            assert again.status == 200
            assert child.connections == 2, "the half-closed connection went back to the pool"
        finally:
            hold.set()


async def _answer(request: RawRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_body(request, reader)
    writer.write(raw_response(body=b"{}"))


async def _call(port: int) -> RawResponse:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request_bytes("GET", "/props"))
        return await read_response(reader)
    finally:
        writer.close()


# ---- a real llama-server ------------------------------------------------------------------------------------------


@pytest.fixture(params=["slotkeeper", "llama-server"])
def server_port(request: pytest.FixtureRequest, starter, llama_server: str, slow_model: Path) -> Iterator[int]:
    """The public port of slotkeeper around the real llama-server, or of a plain llama-server (the reference)."""
    args = ["-m", str(slow_model), *ARGS]
    if request.param == "slotkeeper":
        yield starter(llama_server, args)().port
        return
    port = free_port()
    direct = subprocess.Popen(
        [llama_server, *args, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_until(lambda: health_status(port) == 200, 60), "plain llama-server never became ready"
        yield port
    finally:
        direct.terminate()
        direct.wait(10)


def _slot_busy(port: int) -> bool:
    return any(slot["is_processing"] for slot in http_call(port, "GET", "/slots", timeout=READ_TIMEOUT_S).body)


@pytest.mark.parametrize("how", ["close", "shutdown"])
def test_a_client_gone_from_a_non_streamed_completion_frees_the_slot(server_port: int, how: str) -> None:
    """The client times out and closes (or half-closes): 2 s later (and a few of the model's steps, which a
    loaded machine makes long) no slot is processing, as with a plain llama-server; a half-closed client gets
    what llama-server answers a cancelled request (an empty 200), then the end of the connection."""
    port = server_port
    probe_body = {"prompt": "Speed probe", "n_predict": 64, "temperature": 0}
    probe = http_call(port, "POST", "/completion", probe_body, timeout=READ_TIMEOUT_S).body
    speed = probe["timings"]["predicted_per_second"]
    full_run_s, freed_within_s = N_PREDICT / speed, FREED_WITHIN_S + STEPS_AFTER_CANCEL / speed
    assert full_run_s > 3 * freed_within_s, f"the model generates too fast for this test: {full_run_s:.1f} s"
    body = json.dumps({"prompt": "Tell me everything.", "n_predict": N_PREDICT, "temperature": 0}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        sock.sendall(
            b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert wait_until(lambda: _slot_busy(port), 30, interval=0.1), "the generation never started"
        if how == "close":
            sock.close()
        else:
            sock.shutdown(socket.SHUT_WR)
        time.sleep(freed_within_s)  # not polled: a /slots answer at least once a second would hold the check off
        assert not _slot_busy(port), f"the slot still generates {freed_within_s:.1f} s after the client left"
        if how == "shutdown":
            sock.settimeout(READ_TIMEOUT_S)
            answer = b""
            while data := sock.recv(65536):
                answer += data
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ") and body == b"", answer
    finally:
        sock.close()
    after = {"prompt": "after", "n_predict": 4, "temperature": 0}
    reply = http_call(port, "POST", "/completion", after, timeout=READ_TIMEOUT_S)
    assert reply.status == 200
