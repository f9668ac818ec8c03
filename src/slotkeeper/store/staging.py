"""Where llama-server writes a save and reads a restore: a RAM filesystem when it has room, else the disk.

Why: llama-server writes and reads whole slot files only, by a name under its --slot-save-path (snapshots/),
and neither file needs to outlive a second: a save's is cut into blocks and removed (blocks.py), a restore's
is put together from blocks, read and removed. Staged in RAM (Linux's `/dev/shm`, else `$XDG_RUNTIME_DIR`),
llama-server's save runs at memory speed, its loop paused for less, and none of the file reaches the disk;
its name in snapshots/ is then a symbolic link to the file in RAM, which llama-server's fopen follows.
Without room for the file (checked against its expected size with a margin, and against the memory free), or
without a RAM filesystem (macOS), it is staged in snapshots/ itself: never fsynced, and removed before the
kernel would write it back, so that it costs the disk little or nothing.

The RAM folder is the run's own (`slotkeeper-<uid>-<pid>-<hash of the store's path>`, mode 0700, owned by this
user, never a link), made when first needed and removed at stop. A run killed before its stop leaves it: a
start removes those of this user's runs that are gone (their pid no longer alive), and what is in them.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ..log import fmt_bytes, log
from ..portable import ram_filesystems
from .entries import discard
from .prescan import prefetch_budget
from .slotfiles import transient_path

RAM_HEADROOM = 1.25  # a file is staged in RAM when the RAM filesystem has its expected size plus 25% free


@dataclass(frozen=True)
class Staged:
    """One staged file: the name llama-server is given (in snapshots/), and the file itself."""

    name: Path
    real: Path

    @property
    def in_ram(self) -> bool:
        return self.real != self.name

    def remove(self) -> None:
        discard(self.name)
        if self.in_ram:
            discard(self.real)


class Staging:
    """Stages files for one store: in its RAM folder when there is room, else in snapshots/."""

    def __init__(self, snapshots_dir: Path, store_root: Path, *, ram: bool = True) -> None:
        self._snapshots_dir = snapshots_dir
        self._ram_dir = _ram_dir(store_root) if ram else None
        self._ready = False  # the RAM folder made (and checked) in this run
        self._warned = False

    def clean(self) -> None:
        """At open: the RAM folders of this user's runs that were killed go, with what they staged (snapshots/
        is swept by scan.remove_transients)."""
        if self._ram_dir is None:
            return
        prefix = f"slotkeeper-{os.getuid()}-"
        with contextlib.suppress(OSError):
            for folder in self._ram_dir.parent.iterdir():
                pid = folder.name.removeprefix(prefix).partition("-")[0]
                if folder.name.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
                    _remove_folder(folder)

    def stage(self, expected: int) -> Staged:
        """A new staged file for about `expected` bytes (0: unknown, or on disk in any case); nothing is created
        yet but the link: llama-server, or the assembly, creates the file."""
        name = transient_path(self._snapshots_dir)
        if expected and self._ram_dir is not None and self._has_room(expected):  # (0: size unknown, disk)
            real = self._ram_dir / name.name
            try:
                os.symlink(real, name)
                return Staged(name, real)
            except OSError as exc:  # snapshots/ read-only or full: the save that follows says so, on disk
                log.debug("not staged in RAM: its link in %s could not be made (%s)", self._snapshots_dir, exc)
        return Staged(name, name)

    def fell_back(self, why: str) -> None:
        """A file staged in RAM could not be written there: said once, the caller stages it on disk."""
        if not self._warned:
            self._warned = True
            log.warning("could not stage in %s (%s): staged on disk when that happens", self._ram_dir, why)

    def close(self) -> None:
        """At stop, nothing staged any more: the RAM folder goes."""
        if self._ram_dir is not None and self._ready:
            with contextlib.suppress(OSError):
                self._ram_dir.rmdir()
            self._ready = False

    def _has_room(self, expected: int) -> bool:
        if not self._usable():
            return False
        assert self._ram_dir is not None
        try:
            st = os.statvfs(self._ram_dir)
        except OSError:
            return False
        needed = int(expected * RAM_HEADROOM)
        if st.f_bavail * st.f_frsize >= needed and needed <= prefetch_budget():
            return True
        log.debug("%s staged on disk: %s has %s free", fmt_bytes(expected), self._ram_dir, fmt_bytes(st.f_bavail))
        return False

    def _usable(self) -> bool:
        """The RAM folder made if it is not there, and checked: a folder of this user's, not a link."""
        if self._ready:
            return True
        assert self._ram_dir is not None
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(self._ram_dir, 0o700)
            st = os.lstat(self._ram_dir)
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            if not self._warned:
                self._warned = True
                log.warning(
                    "%s is not a private folder of this user's: saves and restores staged on disk", self._ram_dir
                )
            self._ram_dir = None
            return False
        self._ready = True
        return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        pass
    return True


def _remove_folder(folder: Path) -> None:
    """A killed run's RAM folder: its files, then itself (a link or another user's is left alone)."""
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return
    for leftover in folder.iterdir():
        discard(leftover)
    folder.rmdir()


def _ram_dir(store_root: Path) -> Path | None:
    """The store's folder on the machine's RAM filesystem; None when it has none (macOS, most BSDs)."""
    for base in ram_filesystems():
        if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            key = xxhash.xxh3_64_hexdigest(os.path.realpath(store_root).encode())
            return Path(base) / f"slotkeeper-{os.getuid()}-{os.getpid()}-{key}"
    return None
