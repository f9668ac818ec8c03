"""Durable files: written whole or not at all, fsynced when asked, removed without raising on cleanup.

Why apart: the store's entries, the fingerprint's identity cache, the blocks and the shared tier's journal all
write small files the same way, and entries.py reads fingerprints: this module, stdlib only, is what they
share, so that none of them imports another for it.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

PARTIAL_SUFFIX = ".partial"  # a file being written (manifest, download): finished or removed, never read


def discard(path: Path) -> bool:
    """Remove a file slotkeeper made, if it is there; False when it is there and cannot be removed.

    For cleanup after a failure: on a read-only filesystem even `unlink(missing_ok=True)` of a missing name
    raises EROFS, and a cleanup that raises would hide the failure it cleans up after. What is left is a
    transient or partial name, removed at the next start.
    """
    try:
        path.unlink(missing_ok=True)
        return True
    except OSError:
        return not os.path.lexists(path)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by name (a directory after a rename in it, so the rename survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: Path | str) -> dict[str, Any] | None:
    """A JSON object from a file, or None when it is missing or unreadable (a start reads thousands: plain
    bytes, no pathlib on the way)."""
    with contextlib.suppress(OSError, ValueError), open(path, "rb") as f:
        data = json.loads(f.read())
        if isinstance(data, dict):
            return data
    return None


def write_json_atomic(path: Path, data: dict[str, Any], fsync: bool) -> None:
    """Write to `<name>.partial`, fsync, rename over `path`, fsync the directory: a reader sees all or nothing.

    A write that fails (a full disk) removes its partial file: left behind, it would hold the space that the
    next save needs.
    """
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    try:
        with open(partial, "w", encoding="utf-8") as f:
            json.dump(data, f, separators=(",", ":"))
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        discard(partial)
        raise
    if fsync:
        fsync_path(path.parent)
