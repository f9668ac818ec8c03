"""Which directories are save directories, where they are by default, and whether a slotkeeper uses one.

A save directory (layout.py) is found by what the store or an older slotkeeper leaves in it; the default ones
are the per-model directories under the cache root (layout.cache_root, as the daemon chooses them).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..store.entries import is_slot_name
from ..store.layout import ENTRIES_DIR, LOCK_NAME, MODELS_DIR, QUARANTINE_DIR, cache_root
from .formats import CatalogError

SLOT_FILE_SUFFIXES = ("bin", "json", "bin.partial", "json.partial")


@dataclass(frozen=True, kw_only=True)
class LockState:
    """Whether a slotkeeper holds the directory's .lock (an flock: the kernel drops it when its holder exits).

    Keyword-only: `exists` and `held` are two booleans side by side, easy to swap unnoticed by position."""

    exists: bool = False
    held: bool = False
    pid: int | None = None  # what the .lock says: the last process that took it

    def describe(self) -> str:
        if not self.held:
            return ""
        if self.pid is None:
            return "in use by another slotkeeper"
        if not _pid_alive(self.pid):
            return f"locked by pid {self.pid}, which is not running here (another container or host?)"
        return f"in use by slotkeeper pid {self.pid}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, not ours
    return True


def lock_pid(text: str) -> int | None:
    """The pid a .lock names (layout.lock_store writes it), if it names one."""
    text = text.strip()
    return int(text) if text.isdigit() else None


def lock_state(root: Path) -> LockState:
    """A non-blocking shared flock attempt on `.lock`, released at once (nothing is created or written)."""
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return LockState()
    try:
        pid = lock_pid(os.pread(fd, 32, 0).decode(errors="replace"))
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return LockState(exists=True, held=True, pid=pid)
        except OSError:
            return LockState(exists=True, held=False, pid=pid)  # a file system without flock: cannot tell
        return LockState(exists=True, held=False, pid=pid)
    finally:
        os.close(fd)


def list_names(path: Path) -> list[str]:
    """A folder's names, sorted; none when it does not exist."""
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CatalogError(f"cannot read {path}: {exc.strerror or exc}") from None


def holds_caches(path: Path) -> bool:
    """Whether a directory is a save directory: the store's layout or lock, slot files, or quarantined files."""
    if (path / ENTRIES_DIR).is_dir() or (path / LOCK_NAME).is_file():
        return True
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if any(is_slot_name(n.split(".", 1)[0]) and n.split(".", 1)[-1] in SLOT_FILE_SUFFIXES for n in names):
        return True
    qdir = path / QUARANTINE_DIR
    return qdir.is_dir() and any((qdir / n).is_file() for n in os.listdir(qdir))


def save_dirs_under(root: Path) -> list[Path]:
    """The directories just below `root` that are save directories (`demo`/`bench` holding only a model: skipped)."""
    try:
        children = sorted(root.iterdir())
    except OSError:
        return []
    return [p for p in children if p.is_dir() and not p.is_symlink() and holds_caches(p)]


def with_model_stores(save_dir: Path) -> list[Path]:
    """A save directory, and the stores of a router's models below it (`models/<name>/`)."""
    return [save_dir, *save_dirs_under(save_dir / MODELS_DIR)]


def find_save_dirs(env: Mapping[str, str]) -> list[Path]:
    """Every default (per-model) save directory under $XDG_CACHE_HOME/slotkeeper or ~/.cache/slotkeeper."""
    return [found for save_dir in save_dirs_under(Path(cache_root(env))) for found in with_model_stores(save_dir)]


def resolve_dirs(given: Sequence[str], env: Mapping[str, str]) -> list[Path]:
    """The directories named on the command line (each must exist), or every default one.

    A named directory that is no save directory itself but has save directories below it (the cache root,
    typically) stands for those.
    """
    if not given:
        return find_save_dirs(env)
    dirs: list[Path] = []
    seen: set[Path] = set()
    for text in given:
        path = Path(text).expanduser().absolute()
        if not path.exists():
            raise CatalogError(f"no such directory: {text}")
        if not path.is_dir():
            raise CatalogError(f"not a directory: {text}")
        below = [found for save_dir in save_dirs_under(path) for found in with_model_stores(save_dir)]
        for found in with_model_stores(path) if holds_caches(path) else below or [path]:
            if found.resolve() not in seen:
                seen.add(found.resolve())
                dirs.append(found)
    return dirs
