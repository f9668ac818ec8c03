"""slotkeeper on a platform without Linux's own calls (macOS, the BSDs), by its code path on Linux:
`SLOTKEEPER_PORTABLE=1` takes that path. Here: no call that exists on Linux alone appears outside
slotkeeper/portable.py, and each of its fallbacks gives what its callers need. The lifecycle and its faults in
both modes, on the real llama-server: tests/test_lifecycle_real.py.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from slotkeeper import portable
from slotkeeper.portable import VARIABLE as PORTABLE_VARIABLE


@pytest.mark.parametrize("mode", ["0", "1"])
def test_the_memory_figure_comes_from_sysconf_where_there_is_no_proc(monkeypatch, tmp_path, mode):
    """The read-ahead budget's memory figure: Linux's MemAvailable, else sysconf's free pages (macOS has both
    names): in both modes a number between 1 MiB and the machine's memory, and the portable one is sysconf's."""
    monkeypatch.setenv(PORTABLE_VARIABLE, mode)
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    available = portable.available_memory()
    assert available is not None and 1 << 20 < available <= total, (available, total)
    if mode == "1":
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        assert abs(available - free) < total // 10, (available, free)  # (pages come and go between the two reads)
    (tmp_path / "f").write_bytes(b"x" * 4096)
    with (tmp_path / "f").open("rb") as file:
        assert portable.read_ahead(file.fileno(), 0, 4096) is (mode == "0")
    assert (portable.ram_filesystems() == []) is (mode == "1")
    assert portable.socket_path_limit() == (107 if mode == "0" else 103)


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
