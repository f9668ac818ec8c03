"""Linux's own calls, and what slotkeeper does where there are none (macOS, the BSDs): the one place that asks.

Why one module: every call that exists on Linux alone (prctl, /proc, posix_fadvise, pidfd, a RAM filesystem at
/dev/shm) is reached through a function here that says what to do elsewhere, so that a platform without them
takes a path of its own that is written down, and tested: `SLOTKEEPER_PORTABLE=1` makes slotkeeper take every
such path on Linux too (tests/test_portable.py; a test greps the tree for the calls outside this module).
Standard library only, and cheap to import: the supervisor imports it before llama-server is spawned.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (mypy reads the name alike)
if TYPE_CHECKING:
    from typing import Any


VARIABLE = "SLOTKEEPER_PORTABLE"  # "1": the paths of a platform without Linux's own calls, on Linux too


def portable() -> bool:
    """Whether to take the paths of a platform without Linux's own calls."""
    return not sys.platform.startswith("linux") or os.environ.get(VARIABLE) == "1"


def set_parent_death_signal(signum: int) -> bool:
    """In a child between fork and exec: ask Linux for `signum` when the parent dies (PR_SET_PDEATHSIG); False
    where there is no such call (the supervisor's watch does it then)."""
    if portable():
        return False
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signum, 0, 0, 0)
    return True


def available_memory() -> int | None:
    """Bytes the kernel could give to new data without swapping: Linux's MemAvailable (/proc/meminfo), else
    the free pages sysconf reports (SC_AVPHYS_PAGES, where there is one); None when nothing says."""
    if not portable():
        try:
            with open("/proc/meminfo", "rb") as meminfo:
                for line in meminfo:
                    if line.startswith(b"MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def read_ahead(fd: int, offset: int, length: int) -> bool:
    """Ask the kernel to start reading a file range into the page cache (POSIX_FADV_WILLNEED); False where there
    is no posix_fadvise (macOS): nothing is read ahead, the restore reads the file as it would anyway."""
    if portable() or not hasattr(os, "posix_fadvise"):
        return False
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    return True


_exit_queues: dict[int, Any] = {}  # kqueues by descriptor, held open until close_exit_descriptor


def exit_descriptor(pid: int) -> int | None:
    """A descriptor that becomes readable when the child `pid` exits: Linux's pidfd; on macOS and the BSDs a
    kqueue with the process's NOTE_EXIT (it is readable while an event is pending); None where there is neither,
    or the process is gone already (the supervisor then polls its child every 50 ms). The portable mode on Linux
    has no kqueue: it polls."""
    if not portable() and hasattr(os, "pidfd_open"):
        try:
            return os.pidfd_open(pid)
        except OSError:
            return None
    import select

    kq: Any = select  # (typed as Linux's select, which has no kqueue: the portable mode on Linux polls)
    if not hasattr(kq, "kqueue"):
        return None
    queue = kq.kqueue()
    try:
        exit_event = kq.kevent(
            pid, filter=kq.KQ_FILTER_PROC, flags=kq.KQ_EV_ADD | kq.KQ_EV_ONESHOT, fflags=kq.KQ_NOTE_EXIT
        )
        queue.control([exit_event], 0, 0)
    except OSError:  # (ESRCH: it exited before it was watched; the poll sees that at once)
        queue.close()
        return None
    fd = int(queue.fileno())
    _exit_queues[fd] = queue
    return fd


def close_exit_descriptor(fd: int) -> None:
    """Close what exit_descriptor returned."""
    queue = _exit_queues.pop(fd, None)
    if queue is not None:
        queue.close()
    else:
        os.close(fd)


def socket_path_limit() -> int:
    """The bytes a unix socket's path may have: sun_path is 108 bytes on Linux, 104 on macOS and the BSDs, the
    last one the path's terminating NUL."""
    return 103 if portable() else 107


def ram_filesystems() -> list[str]:
    """Where a file may be staged in RAM: Linux's /dev/shm, and $XDG_RUNTIME_DIR; none elsewhere (macOS has
    no RAM filesystem at hand: files are staged on disk)."""
    if portable():
        return []
    return [base for base in ("/dev/shm", os.environ.get("XDG_RUNTIME_DIR") or "") if base]
