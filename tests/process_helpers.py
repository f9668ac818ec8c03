"""The processes a slotkeeper leaves running, read from /proc (the tests run on Linux, in both modes)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from slotkeeper.portable import VARIABLE as PORTABLE_VARIABLE

# The two modes the lifecycle tests run in: Linux's own calls (prctl's parent-death signal, a pidfd), and the
# paths of a platform without them (macOS, the BSDs), taken on Linux: the watch in llama-server's group.
MODES = {"linux": {PORTABLE_VARIABLE: "0"}, "portable": {PORTABLE_VARIABLE: "1"}}
PORTABLE = MODES["portable"]


def llama_servers_of(slotkeeper_pid: int) -> list[int]:
    """The llama-server processes a slotkeeper started (their command line names its runtime directory)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if f"/slotkeeper-{slotkeeper_pid}-".encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def group_members(group: int) -> list[int]:
    """The live processes of a process group (zombies are gone already: they hold no memory)."""
    members = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                members.append(int(proc.name))
    return members


def no_runtime_dir(slotkeeper_pid: int) -> bool:
    """No runtime directory of that slotkeeper in $TMPDIR, nor in /tmp (where a socket goes when $TMPDIR is long)."""
    pattern = f"slotkeeper-{slotkeeper_pid}-*"
    return not any(any(Path(base).glob(pattern)) for base in {tempfile.gettempdir(), "/tmp"})


def watched(group: int) -> bool:
    """llama-server's group holds the watch too."""
    return len(group_members(group)) >= 2


def gone(group: int) -> bool:
    return not group_members(group)
