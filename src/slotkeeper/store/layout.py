"""The save directory's layout and its lock, needed before llama-server starts: os.path, not pathlib, whose
import (with re and urllib.parse, ~5 ms, ~15 ms from a cold disk) would delay the spawn (cmdline.py says why).

```
<save dir>/
  .lock        held (flock) by the one slotkeeper using this directory
  entries/     the conversation store: <id>.json (an entry's manifest) and, for an entry kept as one file,
               <id>.bin (llama-server's slot file)
  blocks/      the blocks entries are made of (blocks.py): <2 hex>/<32 hex>, each named by its bytes' hash
  snapshots/   llama-server's --slot-save-path: clients' own save/restore names, and slotkeeper's transient ones
  quarantine/  entries llama-server refused
  models/      router mode: a store per model (<name>/ with its own entries/), sharing snapshots/ above
```
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

StrPath = str | os.PathLike[str]

ENTRIES_DIR = "entries"
BLOCKS_DIR = "blocks"
SNAPSHOTS_DIR = "snapshots"
QUARANTINE_DIR = "quarantine"
LOCK_NAME = ".lock"
MODELS_DIR = "models"


def cache_root(env: Mapping[str, str]) -> str:
    """$XDG_CACHE_HOME/slotkeeper or ~/.cache/slotkeeper: where the per-model default save directories live."""
    return os.path.join(env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "slotkeeper")


class StoreLockedError(Exception):
    """Another slotkeeper uses this save directory; the text is its pid."""


def prepare_layout(root: StrPath) -> str:
    """Create entries/ and snapshots/ and check that they, blocks/ (when there) and the directory itself are
    directories this user may list, write and enter; returns llama-server's --slot-save-path (snapshots/).

    An OSError names the folder and the reason in its strerror (`/x/c/blocks is not writable (Permission
    denied): ...`): a folder a `sudo slotkeeper` run left (root's, mode 700 under umask 077) would otherwise fail
    later, deep in the store's first scan, as a bare PermissionError naming nothing."""
    _check_folder(os.fspath(root))  # (its listing finds the slot files of the old layout)
    for name in (ENTRIES_DIR, SNAPSHOTS_DIR):
        path = os.path.join(root, name)
        try:
            os.mkdir(path)
        except FileExistsError:  # as Path.mkdir(exist_ok=True): only a directory may be there already
            pass
    for name in (ENTRIES_DIR, BLOCKS_DIR, SNAPSHOTS_DIR):
        _check_folder(os.path.join(root, name))
    return os.path.join(root, SNAPSHOTS_DIR)


def _check_folder(path: str) -> None:
    """One of the layout's folders must be a directory this user can read, write and enter (blocks/ may be
    missing: it is made with the first block)."""
    import errno

    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OSError(exc.errno, f"cannot access {path} ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, f"{path} is not a directory")
    missing = [what for what, mode in _ACCESS if not os.access(path, mode)]
    if missing:
        which = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} or {missing[-1]}"
        if st.st_uid == os.geteuid():
            hint = "chmod u+rwx it"
        else:  # typically root's, after a `sudo slotkeeper` run
            hint = f"it belongs to {_owner(st.st_uid)}: chown -R it to this user"
        raise OSError(
            errno.EACCES, f"{path} is not {which} (Permission denied, mode {stat.S_IMODE(st.st_mode):o}): {hint}"
        )


_ACCESS = (("readable", os.R_OK), ("writable", os.W_OK), ("enterable", os.X_OK))


def _owner(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def lock_store(root: StrPath) -> int:
    """An exclusive lock on the directory for this process's lifetime (flock; the kernel drops it at exit).

    Two slotkeepers on one directory would remove each other's transient files and supersede each other's
    entries: the second one is refused before it starts anything. The descriptor is not inherited by
    llama-server (O_CLOEXEC), so a lingering child cannot hold the lock.
    """
    import fcntl

    fd = os.open(os.path.join(root, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StoreLockedError(holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
