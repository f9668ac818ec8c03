"""slotkeeper on a platform without Linux's own calls (macOS, the BSDs), by its code path on Linux:
`SLOTKEEPER_PORTABLE=1` takes that path (llama/supervisor.py). There, no parent-death signal makes llama-server
die with slotkeeper: a watch in llama-server's process group kills it the moment slotkeeper dies.

On the real llama-server, SIGKILL of slotkeeper (alone, or of its group as llama-swap sends it after its
timeout) at random moments of a start, a turn, a save and idle: llama-server and the watch are gone within a
second every time, the next start leaves no runtime directory of the killed run and restores the chat.
"""

from __future__ import annotations

import ast
import os
import random
import signal
import tempfile
import time
from functools import partial
from pathlib import Path

from family_helpers import FAMILIES, Chat

from slotkeeper.portable import VARIABLE as PORTABLE_VARIABLE
from slotkeeper.testing.harness import wait_until

PORTABLE = {PORTABLE_VARIABLE: "1"}


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
    return not list(Path(tempfile.gettempdir()).glob(f"slotkeeper-{slotkeeper_pid}-*"))


def watched(group: int) -> bool:
    """llama-server's group holds the watch too."""
    return len(group_members(group)) >= 2


def gone(group: int) -> bool:
    return not group_members(group)


def test_in_the_portable_mode_llama_server_never_outlives_a_sigkilled_slotkeeper(family_start, tmp_path):
    """12 SIGKILLs at random moments (starting, in a turn, saving at stop, idle; of slotkeeper alone, or of its
    group after a SIGTERM, as llama-swap sends them): llama-server's group, the watch with it, is empty within a
    second each time; the next start removes the killed run's runtime directory, and the store goes on: the chat
    saved at a stop comes back warm."""
    rng = random.Random(47)
    family = FAMILIES["llama"]
    save_dir = tmp_path / "cache"
    chat = Chat(0, family.request)
    killed = 0
    moments = ["starting", "in a turn", "saving", "idle"] * 3
    for trial, moment in enumerate(moments):
        sk = family_start(family, "-np", "1", env=PORTABLE, save_dir=save_dir, wait=moment != "starting")
        assert wait_until(partial(llama_servers_of, sk.pid), 10), sk.logs()
        assert wait_until(partial(no_runtime_dir, killed), 2), f"trial {trial}: the killed run's runtime directory"
        (group,) = llama_servers_of(sk.pid)
        assert wait_until(partial(watched, group), 2), f"trial {trial}: no watch beside llama-server"
        if moment == "starting":
            time.sleep(rng.uniform(0.0, 0.3))
        elif moment == "in a turn":
            chat.turn(sk.port)
            time.sleep(rng.uniform(0.0, 0.1))
        elif moment == "saving":
            sk.killpg(signal.SIGTERM)
            time.sleep(rng.uniform(0.0, 0.05))
        else:
            time.sleep(rng.uniform(0.0, 0.2))
        if moment == "saving" or trial % 2:
            sk.killpg(signal.SIGKILL)  # llama-swap's group kill after its timeout
        else:
            os.kill(sk.pid, signal.SIGKILL)
        sk.wait()
        killed = sk.pid
        assert wait_until(partial(gone, group), 1.0, interval=0.01), f"trial {trial} ({moment}): {group_members(group)}"
    sk = family_start(family, "-np", "1", env=PORTABLE, save_dir=save_dir)
    assert no_runtime_dir(killed), "a runtime directory was left"
    chat.turn(sk.port)  # (from what the kills left saved: a turn killed before its save is not kept)
    sk.killpg(signal.SIGTERM)
    assert sk.wait(30) == 0, sk.logs()
    sk = family_start(family, "-np", "1", env=PORTABLE, save_dir=save_dir)
    assert chat.reused_enough(chat.turn(sk.port)), sk.logs()[-3000:]


def test_in_the_portable_mode_a_stop_leaves_no_watch_and_exits_0(family_start):
    """A stop as llama-swap sends it (SIGTERM to the group): slotkeeper saves, exits 0, and llama-server's
    group, the watch included, is empty."""
    family = FAMILIES["llama"]
    sk = family_start(family, "-np", "1", env=PORTABLE)
    Chat(1, family.request).turn(sk.port)
    (group,) = llama_servers_of(sk.pid)
    sk.killpg(signal.SIGTERM)
    assert sk.wait(30) == 0, sk.logs()
    assert " saved from slot 0 (at stop)" in sk.logs(), sk.logs()
    assert wait_until(partial(gone, group), 1.0, interval=0.01), group_members(group)


# Linux's own calls: names of functions and constants, and paths a string starts with.
LINUX_NAMES = {"prctl", "posix_fadvise", "POSIX_FADV_WILLNEED", "pidfd_open", "sched_setaffinity", "O_DIRECT"}
LINUX_PATHS = ("/proc/", "/dev/shm", "/sys/")
SRC = Path(__file__).resolve().parent.parent / "src" / "slotkeeper"


def linux_calls(tree: ast.AST) -> list[str]:
    """What a module uses of Linux's own calls: the names, and string constants that are such paths."""
    found = []
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name in LINUX_NAMES:
            found.append(f"line {node.lineno}: {name}")  # type: ignore[attr-defined]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(LINUX_PATHS):
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_no_linux_only_call_outside_the_portable_module():
    """Every call that exists on Linux alone goes through slotkeeper/portable.py, which says what to do
    elsewhere; none appears in another module of the product (the testing helpers, which the tests alone run
    on Linux, aside)."""
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC)
        if relative.parts[0] == "testing" or relative.name == "portable.py":
            continue
        if found := linux_calls(ast.parse(path.read_text(), str(path))):
            offenders[str(relative)] = found
    assert not offenders, offenders
    assert linux_calls(ast.parse((SRC / "portable.py").read_text())), "the check finds nothing: it sees nothing"
