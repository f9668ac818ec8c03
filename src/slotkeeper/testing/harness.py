"""Drives slotkeeper as llama-swap does: a real process in a new process group, signalled as a group."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state: str = f.read().rsplit(")", 1)[1].split()[0]
            return state != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str]
    elapsed: float


def http_call(
    port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 60.0
) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    payload = json.dumps(body).encode() if body is not None else None
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    started = time.monotonic()
    try:
        conn.request(method, path, body=payload, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        parsed: Any = json.loads(raw) if raw else None
    except ValueError:
        parsed = raw.decode("utf-8", "replace")
    return Reply(resp.status, parsed, dict(resp.getheaders()), time.monotonic() - started)


def health_status(port: int) -> int:
    """GET /health's status on a local port; 0 while nothing answers there."""
    try:
        return http_call(port, "GET", "/health", timeout=2).status
    except OSError:
        return 0


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Slotkeeper:
    """One slotkeeper process started the way llama-swap starts a `cmd:` (its own new process group)."""

    args: list[str]
    env: dict[str, str]
    cwd: Path
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def start(self) -> Slotkeeper:
        self.log_file = open(self.log_path, "ab")  # noqa: SIM115 - slotkeeper's output, open until stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slotkeeper.cli", *self.args],
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def accepting(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def health(self) -> int:
        return health_status(self.port)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until this slotkeeper says it is ready (its own log line: a 200 alone could come from a process that
        took the port first) or exits."""
        proc = self.proc
        assert proc is not None, "start() first"

        def ready() -> bool:
            return proc.poll() is not None or (self.health() == 200 and "after starting llama-server" in self.logs())

        if not wait_until(ready, timeout):
            raise AssertionError(f"slotkeeper not ready after {timeout}s:\n{self.logs()}")
        if proc.poll() is not None:
            raise AssertionError(f"slotkeeper exited with {proc.returncode}:\n{self.logs()}")

    def call(self, method: str, path: str, body: Any = None, **kw: Any) -> Reply:
        return http_call(self.port, method, path, body, **kw)

    def killpg(self, sig: int = signal.SIGTERM) -> None:
        """What llama-swap does: signal slotkeeper's whole process group."""
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"slotkeeper still running after {timeout}s:\n{self.logs()}") from None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.killpg(signal.SIGKILL)
            self.proc.wait(10)
        self.log_file.close()


class PlainServer:
    """Plain llama-server, started and stopped the way llama-swap does (own process group, SIGTERM to it)."""

    def __init__(self, binary: str, args: list[str], port: int, log_path: Path, env: dict[str, str]) -> None:
        self.port = port
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - the server's output, open for its whole life (stop() closes it)
        self.proc = subprocess.Popen(
            [binary, *args, "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 120.0) -> None:
        def healthy() -> bool:
            try:
                return http_call(self.port, "GET", "/health", timeout=2).status == 200
            except OSError:
                return self.proc.poll() is not None

        if not wait_until(healthy, timeout, interval=0.005) or self.proc.poll() is not None:
            raise RuntimeError(f"llama-server did not start; log: {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@contextlib.contextmanager
def plain_server(binary: str, args: list[str], log_dir: Path) -> Iterator[PlainServer]:
    """A plain llama-server (`args`, on a free port, in the clean environment), ready for the block and stopped
    after it: what a comparison with slotkeeper needs, written once."""
    port = free_port()
    server = PlainServer(binary, args, port, log_dir / f"plain-{port}.log", clean_env(binary))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def clean_env(binary: str | None = None, *, cache_home: Path | None = None) -> dict[str, str]:
    """The environment without the user's llama-server, slotkeeper or stub settings (`LLAMA_*`, `SLOTKEEPER_*`,
    `STUB_*`), so that slotkeeper and plain llama-server run alike; `binary` as LLAMA_SERVER, `cache_home` as
    XDG_CACHE_HOME (slotkeeper's default save directories and the demo's model)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "SLOTKEEPER_", "STUB_"))}
    if binary is not None:
        env["LLAMA_SERVER"] = binary
    if cache_home is not None:
        env["XDG_CACHE_HOME"] = str(cache_home)
    return env


def stream_lines(port: int, path: str, body: Any, timeout: float = 30.0) -> Generator[tuple[float, bytes], None, None]:
    """(arrival time, line) for each line of a streamed response, as it arrives."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    try:
        while True:
            line = resp.readline()
            if not line:
                return
            yield time.monotonic(), line
    finally:
        conn.close()


@dataclass
class Stream:
    """A streamed answer as a user feels it: the time to its first event that brings text, and its events."""

    first_s: float  # the whole answer's time when no event brought text
    total_s: float
    events: list[dict[str, Any]]


def stream_events(
    port: int,
    path: str,
    body: dict[str, Any],
    *,
    first: Callable[[dict[str, Any]], bool],
    headers: dict[str, str] | None = None,
    timeout: float = 600.0,
) -> Stream:
    """POST a streamed completion and read its SSE events as they come; `first` says which event is the first
    token's (its text, reasoning, ...). Stops at an event with `"stop": true` (llama-server's /completion)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    started = time.monotonic()
    first_s: float | None = None
    events: list[dict[str, Any]] = []
    try:
        conn.request(
            "POST",
            path,
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise AssertionError(f"{path} answered {resp.status}: {resp.read()[:300]!r}")
        while line := resp.readline():
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            events.append(event)
            if first_s is None and first(event):
                first_s = time.monotonic() - started
            if event.get("stop") is True:
                break
    finally:
        conn.close()
    total = time.monotonic() - started
    return Stream(first_s if first_s is not None else total, total, events)


@dataclass
class StreamTiming:
    """One streamed completion as a user feels it: time to the first token, and llama-server's own timings."""

    first_token_s: float
    total_s: float
    content: str
    timings: dict[str, Any]


def stream_completion(
    port: int, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 600.0
) -> StreamTiming:
    """POST /completion with stream: the time to the first content, the content, and llama-server's timings."""
    stream = stream_events(
        port,
        "/completion",
        {**body, "stream": True},
        first=lambda e: bool(e.get("content")),
        headers=headers,
        timeout=timeout,
    )
    timings: dict[str, Any] = {}
    for event in stream.events:
        timings = event.get("timings", timings)
    content = "".join(event.get("content", "") for event in stream.events)
    return StreamTiming(stream.first_s, stream.total_s, content, timings)
