"""The llama-server child process: a private endpoint, its own process group, and death with its parent.

llama-swap sends SIGTERM to slotkeeper's whole process group, so the child gets a group of its own and
survives long enough to have its slots saved. Because llama-swap may then SIGKILL that group, the child also
asks the kernel for SIGKILL when slotkeeper dies (PR_SET_PDEATHSIG): never an orphan holding the model's RAM.
The child inherits slotkeeper's stdout and stderr, so its output passes through byte for byte and can never
be blocked by slotkeeper. Stdlib only: the child is spawned before slotkeeper's heavy imports.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # asyncio is imported after the child is spawned: its import would delay the model load
    import asyncio

RUNTIME_DIR_PREFIX = "slotkeeper-"
CHILD_SOCKET_NAME = "llama-server.sock"
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildEndpoint:
    """Where the child listens: a unix socket in slotkeeper's 0700 runtime directory, or a loopback port."""

    runtime_dir: Path
    socket_path: Path | None = None
    tcp_port: int | None = None

    @property
    def host_arg(self) -> list[str]:
        if self.socket_path is not None:
            return ["--host", str(self.socket_path)]
        return ["--host", "127.0.0.1", "--port", str(self.tcp_port)]

    @property
    def base_url(self) -> str:
        return "http://llama-server" if self.socket_path is not None else f"http://127.0.0.1:{self.tcp_port}"

    def describe(self) -> str:
        return f"unix:{self.socket_path}" if self.socket_path is not None else f"127.0.0.1:{self.tcp_port}"


def make_endpoint(tcp: bool) -> ChildEndpoint:
    """A fresh runtime directory (0700, named after our pid so stale ones can be recognised) and an address in it."""
    remove_stale_runtime_dirs()
    runtime_dir = Path(tempfile.mkdtemp(prefix=f"{RUNTIME_DIR_PREFIX}{os.getpid()}-"))
    if not tcp:
        return ChildEndpoint(runtime_dir, socket_path=runtime_dir / CHILD_SOCKET_NAME)
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return ChildEndpoint(runtime_dir, tcp_port=port)


def remove_stale_runtime_dirs() -> None:
    """Runtime directories left by a slotkeeper that was SIGKILLed (its pid no longer exists)."""
    for entry in Path(tempfile.gettempdir()).glob(f"{RUNTIME_DIR_PREFIX}*-*"):
        pid_text = entry.name[len(RUNTIME_DIR_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or not entry.is_dir():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)
        except PermissionError:
            pass


def _die_with_parent(parent_pid: int) -> None:
    """Runs in the child between fork and exec: SIGKILL when slotkeeper dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def exit_code_of(returncode: int) -> int:
    """Shell convention: a child killed by signal N exits 128+N."""
    return 128 - returncode if returncode < 0 else returncode


class ChildProcess:
    """One llama-server; stop() is idempotent and escalates from SIGTERM to SIGKILL."""

    def __init__(self, command: list[str], endpoint: ChildEndpoint, env: dict[str, str] | None = None) -> None:
        """`env`: the child's environment (the caller's choice of what it inherits; default: ours)."""
        parent_pid = os.getpid()
        self.command = command
        self.endpoint = endpoint
        self.started_at = time.monotonic()
        self.popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            env=env,
            process_group=0,
            preexec_fn=lambda: _die_with_parent(parent_pid),
        )
        self.pid = self.popen.pid
        self._exited: asyncio.Future[int] | None = None

    def watch(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[int]:
        """A future that resolves with the exit code (128+signal if killed) the moment the child exits."""
        if self._exited is not None:
            return self._exited
        self._exited = loop.create_future()
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            loop.create_task(self._poll_exit())
            return self._exited

        def on_exit() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            self._resolve(self.popen.wait())

        loop.add_reader(pidfd, on_exit)
        return self._exited

    async def _poll_exit(self) -> None:
        import asyncio

        while (code := self.popen.poll()) is None:
            await asyncio.sleep(0.05)
        self._resolve(code)

    def _resolve(self, returncode: int) -> None:
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(exit_code_of(returncode))

    @property
    def returncode(self) -> int | None:
        code = self.popen.poll()
        return None if code is None else exit_code_of(code)

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    async def stop(self, timeout: float) -> int:
        """SIGTERM the child's group, wait up to `timeout`, then SIGKILL. Safe to call at any time, repeatedly."""
        import asyncio

        exited = self._exited
        assert exited is not None, "watch() first"
        if not exited.done():
            self._signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(exited), timeout)
            except TimeoutError:
                from ..log import log

                log.warning("llama-server did not exit %.1f s after SIGTERM; sending SIGKILL", timeout)
                self._signal_group(signal.SIGKILL)
                await exited
        else:
            self._signal_group(signal.SIGKILL)  # anything the child left behind in its group
        return exited.result()

    def kill_now(self) -> None:
        """Last resort on the way out (second signal, unexpected error): no waiting."""
        self._signal_group(signal.SIGKILL)
