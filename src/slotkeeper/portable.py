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


def exit_descriptor(pid: int) -> int | None:
    """A descriptor that becomes readable when the process exits (Linux's pidfd); None elsewhere (the
    supervisor then polls its child every 50 ms)."""
    if portable() or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def ram_filesystems() -> list[str]:
    """Where a file may be staged in RAM: Linux's /dev/shm, and $XDG_RUNTIME_DIR; none elsewhere (macOS has
    no RAM filesystem at hand: files are staged on disk)."""
    if portable():
        return []
    return [base for base in ("/dev/shm", os.environ.get("XDG_RUNTIME_DIR") or "") if base]
