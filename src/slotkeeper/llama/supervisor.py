"""The llama-server child process: a private endpoint, its own process group, and death with its parent.

llama-swap sends SIGTERM to slotkeeper's whole process group, so the child gets a group of its own and
survives long enough to have its slots saved. Because llama-swap may then SIGKILL that group, the child also
asks the kernel for SIGKILL when slotkeeper dies (Linux's PR_SET_PDEATHSIG): never an orphan holding the
model's RAM. Where there is no such call (macOS, the BSDs) a watch does it (`start_watch`): a tiny shell in
the child's group that reads a pipe only slotkeeper holds open, and kills its group when the read ends, which
the kernel makes happen the moment slotkeeper dies, SIGKILL included. `SLOTKEEPER_PORTABLE=1` takes that path
on Linux too (the tests run both).
The child inherits slotkeeper's stdout and stderr, so its output passes through byte for byte and can never
be blocked by slotkeeper. What this module imports loads in a few ms, as cmdline.py's does: the child is
spawned before everything else is imported (no tempfile, which imports shutil and random; no dataclasses).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from ..portable import (
    close_exit_descriptor,
    exit_descriptor,
    portable,
    set_parent_death_signal,
    socket_path_limit,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (mypy reads the name alike)
if TYPE_CHECKING:  # asyncio is imported after the child is spawned: its import would delay the model load
    import asyncio

RUNTIME_DIR_PREFIX = "slotkeeper-"
CHILD_SOCKET_NAME = "llama-server.sock"
MAX_FD = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1 << 16
TEMP_DIR_VARIABLES = ("TMPDIR", "TEMP", "TMP")  # tempfile.gettempdir()'s, in its order
SHORT_TEMP_DIR = "/tmp"
EXIT_POLL_S, EXIT_POLL_SIGNALLED_S = 0.05, 0.002  # where no descriptor says that the child exited (_poll_exit)
# The watch: SIGTERM, SIGINT and SIGHUP ignored (llama-swap's group signals, slotkeeper's stop), so that only
# the end of its pipe (slotkeeper gone) or a SIGKILL of the group ends it; then it kills its group.
WATCH_SCRIPT = "trap '' TERM INT HUP; read -r _; kill -s KILL 0"


class ChildEndpoint:
    """Where the child listens: a unix socket in slotkeeper's 0700 runtime directory, or a loopback port."""

    __slots__ = ("runtime_dir", "socket_path", "tcp_port")

    def __init__(
        self,
        *,
        runtime_dir: str | os.PathLike[str],
        socket_path: str | os.PathLike[str] | None = None,
        tcp_port: int | None = None,
    ) -> None:
        self.runtime_dir = os.fspath(runtime_dir)
        self.socket_path = None if socket_path is None else os.fspath(socket_path)
        self.tcp_port = tcp_port

    @property
    def host_arg(self) -> list[str]:
        if self.socket_path is not None:
            return ["--host", self.socket_path]
        return ["--host", "127.0.0.1", "--port", str(self.tcp_port)]

    @property
    def base_url(self) -> str:
        return "http://llama-server" if self.socket_path is not None else f"http://127.0.0.1:{self.tcp_port}"

    def describe(self) -> str:
        return f"unix:{self.socket_path}" if self.socket_path is not None else f"127.0.0.1:{self.tcp_port}"


def temp_dir() -> str:
    """tempfile.gettempdir()'s choice where it matters: $TMPDIR (or $TEMP, $TMP) if a directory, else /tmp."""
    chosen = (os.environ.get(name) for name in TEMP_DIR_VARIABLES)
    return next((path for path in chosen if path and os.path.isdir(path)), SHORT_TEMP_DIR)


def runtime_bases() -> list[str]:
    """Where runtime directories are made: the temporary directory, then /tmp, for a socket whose path would
    not fit in the temporary directory (macOS's $TMPDIR, /var/folders/…/T/, takes half of its 104 bytes)."""
    base = temp_dir()
    return [base] if base == SHORT_TEMP_DIR or not os.path.isdir(SHORT_TEMP_DIR) else [base, SHORT_TEMP_DIR]


class SocketPathTooLongError(OSError):
    """No runtime directory gives llama-server's socket a path short enough for the platform."""

    def __init__(self, path: str, limit: int) -> None:
        super().__init__(
            f"llama-server's socket path {path} would be {len(os.fsencode(path))} bytes, over the {limit} a unix "
            "socket's path may have here: set TMPDIR to a shorter directory (or give slotkeeper --child-tcp)"
        )


def make_endpoint(tcp: bool) -> ChildEndpoint:
    """A fresh runtime directory (0700, named after our pid so stale ones can be recognised, with a random
    part as tempfile.mkdtemp's) and an address in it: in the first base (runtime_bases) where the socket's
    path fits. OSError (its filename: the base) when the directory cannot be made."""
    name = f"{RUNTIME_DIR_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"  # (48 random bits: never taken twice)
    bases = runtime_bases()
    if not tcp:
        limit = socket_path_limit()
        fitting = [b for b in bases if len(os.fsencode(os.path.join(b, name, CHILD_SOCKET_NAME))) <= limit]
        if not fitting:
            raise SocketPathTooLongError(os.path.join(bases[0], name, CHILD_SOCKET_NAME), limit)
        bases = fitting
    runtime_dir = os.path.join(bases[0], name)
    try:
        os.mkdir(runtime_dir, 0o700)
    except OSError as exc:
        exc.filename = bases[0]
        raise
    if not tcp:
        return ChildEndpoint(runtime_dir=runtime_dir, socket_path=os.path.join(runtime_dir, CHILD_SOCKET_NAME))
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return ChildEndpoint(runtime_dir=runtime_dir, tcp_port=port)


def remove_runtime_dir(path: str) -> None:
    """A runtime directory and the socket in it, at exit or stale (shutil is imported only then)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def remove_stale_runtime_dirs() -> None:
    """Runtime directories left by a slotkeeper that was SIGKILLed (its pid no longer exists); run after the
    spawn, which need not wait for it. Housekeeping only: a directory it cannot list (made unreadable since
    our own was made in it) is left as it is, not a reason to stop the start."""
    candidates = []
    for base in runtime_bases():
        try:
            with os.scandir(base) as found:
                candidates += [entry for entry in found if entry.name.startswith(RUNTIME_DIR_PREFIX)]
        except OSError:
            continue
    for entry in candidates:
        pid_text, dash, _ = entry.name[len(RUNTIME_DIR_PREFIX) :].partition("-")
        if not dash or not pid_text.isdigit() or not entry.is_dir():  # (ours is alive: kept)
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            remove_runtime_dir(entry.path)
        except PermissionError:
            pass


def _die_with_parent(parent_pid: int) -> None:
    """Runs in the child between fork and exec: SIGKILL when slotkeeper dies, even by SIGKILL (Linux's
    parent-death signal; elsewhere the watch does it)."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the parent-death signal took effect
        os._exit(1)


def exit_code_of(returncode: int) -> int:
    """Shell convention: a child killed by signal N exits 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def _spawn(command: list[str], env: dict[str, str] | None) -> tuple[int, int]:
    """fork and exec `command` in a process group of its own, stdin from /dev/null, dying with us; returns its
    pid and the read end of a pipe that says whether the exec failed (ChildProcess.confirm_started).

    Why not subprocess.Popen: with the prctl to run in the child, Popen forks and waits until the child has
    exec'd, ~5 ms in which the child imports ctypes, and importing subprocess takes ~8 ms more: both before
    llama-server starts loading the model. Here nothing waits for the exec; its outcome is read once the
    daemon is imported. What Popen does besides is done too: the signals Python ignores (SIGPIPE, SIGXFSZ)
    are reset to their defaults, every descriptor but 0-2 closed."""
    parent_pid = os.getpid()
    exec_errors, exec_error = os.pipe()  # both close on exec: a successful exec says nothing
    stdin = os.open(os.devnull, os.O_RDONLY)
    pid = os.fork()
    if pid == 0:  # the child: never returns, and nothing here may raise past the except
        try:
            os.dup2(stdin, 0)
            os.closerange(3, exec_error)
            os.closerange(exec_error + 1, MAX_FD)
            for ignored in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(ignored, signal.SIG_DFL)
            os.setpgid(0, 0)
            _die_with_parent(parent_pid)
            os.execve(command[0], command, os.environ if env is None else env)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which says why in one line
            os.write(exec_error, str(getattr(exc, "errno", None) or 0).encode())
        finally:
            os._exit(127)
    os.close(exec_error)
    os.close(stdin)
    with contextlib.suppress(OSError):  # (the child makes its group too; whichever comes first, it exists now)
        os.setpgid(pid, pid)
    return pid, exec_errors


def start_watch(group: int) -> int | None:
    """Where the kernel has no parent-death signal: a watch in the child's process group (WATCH_SCRIPT) that
    kills the group when slotkeeper dies. Returns the write end of its pipe, which slotkeeper holds open for
    its life (never written; not inherited by anything it starts), or None when the watch could not start (one
    line then says the child may outlive a SIGKILL of slotkeeper)."""
    read_end, write_end = os.pipe()
    try:
        os.posix_spawn(
            "/bin/sh",
            ["sh", "-c", WATCH_SCRIPT],
            os.environ,
            file_actions=[(os.POSIX_SPAWN_DUP2, read_end, 0)],
            setpgroup=group,
        )
    except OSError as exc:
        os.close(write_end)
        print(f"slotkeeper: warning: llama-server is not watched ({exc}): it may outlive a SIGKILL", file=sys.stderr)
        return None
    finally:
        os.close(read_end)
    return write_end


class ChildProcess:
    """One llama-server; stop() is idempotent and escalates from SIGTERM to SIGKILL."""

    def __init__(self, command: list[str], endpoint: ChildEndpoint, env: dict[str, str] | None = None) -> None:
        """`env`: the child's environment (the caller's choice of what it inherits; default: ours). The exec's
        outcome is known only once confirm_started() has read it."""
        self.command = command
        self.endpoint = endpoint
        self.started_at = time.monotonic()
        self.pid, self._exec_errors = _spawn(command, env)
        self._watch = start_watch(self.pid) if portable() else None  # held open until we exit
        self._returncode: int | None = None  # once reaped: the raw status as Popen gives it (-N: signal N)
        self._exited: asyncio.Future[int] | None = None
        self._signalled: asyncio.Event | None = None  # (polled exits only: set once it was signalled)

    def confirm_started(self) -> None:
        """Raise the OSError that kept llama-server from starting (the exec's), if one did; waits for the exec,
        long done by the time the daemon is imported."""
        with os.fdopen(self._exec_errors, "rb") as errors:
            report = errors.read()
        if report:
            self._reap(0)
            code = int(report) if report.isdigit() else 0
            raise OSError(code, os.strerror(code) if code else "exec failed")

    def watch(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[int]:
        """A future that resolves with the exit code (128+signal if killed) the moment the child exits."""
        if self._exited is not None:
            return self._exited
        self._exited = loop.create_future()
        pidfd = exit_descriptor(self.pid)
        if pidfd is None:
            loop.create_task(self._poll_exit())
            return self._exited

        def on_exit() -> None:
            loop.remove_reader(pidfd)
            close_exit_descriptor(pidfd)
            code = self._reap(0)
            assert code is not None  # waited for
            self._resolve(code)

        loop.add_reader(pidfd, on_exit)
        return self._exited

    async def _poll_exit(self) -> None:
        """Where nothing says at once that the child exited: look every 50 ms while it runs, every 2 ms once it
        was signalled (a stop's wait for its exit was 15-22 ms longer at 50 ms: benchmarks/swap.py)."""
        import asyncio

        self._signalled = asyncio.Event()
        while (code := self._reap(os.WNOHANG)) is None:
            if self._signalled.is_set():
                await asyncio.sleep(EXIT_POLL_SIGNALLED_S)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._signalled.wait(), EXIT_POLL_S)
        self._resolve(code)

    def _resolve(self, returncode: int) -> None:
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(exit_code_of(returncode))

    def _reap(self, flags: int) -> int | None:
        """The child's status as Popen gives it (-N: killed by signal N), once it has exited; it is reaped once,
        and remembered. None: still running (flags=os.WNOHANG)."""
        if self._returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped elsewhere: nothing more to learn
                pid, status = self.pid, 255 << 8
            if pid == 0:
                return None
            self._returncode = os.waitstatus_to_exitcode(status)
        return self._returncode

    @property
    def returncode(self) -> int | None:
        code = self._reap(os.WNOHANG)
        return None if code is None else exit_code_of(code)

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
        if self._signalled is not None:
            self._signalled.set()

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
        """Last resort on the way out (second signal, unexpected error, a bad option): no waiting. The child
        itself too: just forked (not waited for), it may not have made its group yet."""
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGKILL)
