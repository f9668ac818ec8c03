"""The rows of a save directory: an entry, a quarantined entry, or a slot file of the old layout, each a pair
of files that prune may delete (an entry kept as blocks has no .bin: its manifest, and its claim on blocks).

A row keeps each file as the scan saw it (FileStat), so that prune removes a file only if it is still that one.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..store.blocks import Parts
from ..store.entries import BIN_SUFFIX, Entry, Status
from .formats import display_path
from .listed import Kind, Listed, record_fields


@dataclass(frozen=True, kw_only=True, slots=True)
class FileStat:
    """A listed file as the scan saw it: prune removes it only if it is still that file.

    Its folder and name, not a Path of its own: at 20,000 entries, making 40,000 Paths was a tenth of `ls`."""

    folder: Path
    name: str
    size: int
    mtime: float
    identity: tuple[int, int, int]  # (inode, mtime_ns, size): to notice a file replaced since the scan

    @property
    def path(self) -> Path:
        return self.folder / self.name

    @property
    def path_text(self) -> str:
        """str(self.path), without making the Path (ls --json's two per row)."""
        return f"{self.folder}/{self.name}"

    @classmethod
    def of(cls, path: Path) -> FileStat:
        return cls.from_stat(path, path.stat())

    @classmethod
    def from_stat(cls, path: Path, st: os.stat_result) -> FileStat:
        return cls.listed(path.parent, path.name, st)

    @classmethod
    def listed(cls, folder: Path, name: str, st: os.stat_result) -> FileStat:
        return cls(folder=folder, name=name, size=st.st_size, mtime=st.st_mtime, identity=cls.identity_of(st))

    @staticmethod
    def identity_of(st: os.stat_result) -> tuple[int, int, int]:
        return st.st_ino, st.st_mtime_ns, st.st_size

    @classmethod
    def maybe(cls, path: Path) -> FileStat | None:
        """A regular file (a link is never followed: None, as for a name that is gone), in one lstat."""
        return cls.maybe_in(path.parent, path.name)

    @classmethod
    def maybe_in(cls, folder: Path, name: str) -> FileStat | None:
        """`maybe` of a name listed in `folder`."""
        try:
            st = os.lstat(f"{folder}/{name}")
        except OSError:
            return None  # removed while we looked
        return cls.listed(folder, name, st) if stat.S_ISREG(st.st_mode) else None


@dataclass
class Row(Listed):
    """One listed thing of a save directory: an entry, a quarantined entry, or a slot file of the old layout;
    its two files are `<folder>/<name>.json` and `<folder>/<name>.bin`."""

    FIELDS: ClassVar[tuple[str, ...]] = record_fields(
        where=("dir",),
        sizes=("bin_size", "blocks", "own_bytes", "disk_bytes"),
        saving=("save_ms", "boundary", "opening", "uses", "images"),
        files=("llama_server", "bin", "manifest"),
    )
    kind: Kind
    directory: Path  # the save directory
    folder: Path  # entries/, quarantine/, or the save directory itself (slot files)
    name: str  # the entry id, `<stamp>-<id>` in quarantine/, or the slot number
    bin: FileStat | None
    manifest_file: FileStat | None
    entry: Entry | None  # what the manifest says (for a slot file: what taking it over would record)
    status: Status
    reason: str = ""
    note: str = ""
    short: str = ""
    next_start: str = ""  # another configuration's entry: what the next start does with it (scan._next_start)
    block_bytes: int = 0  # an entry kept as blocks: the bytes of those no other entry of its directory uses

    @property
    def id(self) -> str:
        return self.name.rsplit("-", 1)[-1] if self.kind is Kind.QUARANTINED else self.name

    @property
    def label_id(self) -> str:
        return f"{self.name}{BIN_SUFFIX}" if self.kind is Kind.SLOT_FILE else self.short

    @property
    def label(self) -> str:
        """How prune names it: `entry 1a2b in DIR`, `slot file DIR/0.bin`."""
        where = display_path(self.directory)
        if self.kind is Kind.SLOT_FILE:
            return f"slot file {where}/{self.name}{BIN_SUFFIX}"
        return f"{'quarantined entry' if self.kind is Kind.QUARANTINED else 'entry'} {self.short} in {where}"

    @property
    def sort_key(self) -> tuple[str, str]:
        return str(self.directory), self.name

    @property
    def size(self) -> int | None:
        """The size column: the .bin's (the state's) size; kept as blocks, the state's as its manifest says."""
        return self.bin.size if self.bin else (self.entry.nbytes if self.entry else None)

    @property
    def files(self) -> list[FileStat]:
        return [f for f in (self.manifest_file, self.bin) if f is not None]

    @property
    def file_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def own_bytes(self) -> int:
        """The state's bytes only it holds: its .bin, or the blocks no other entry of its directory uses (none
        for a quarantined entry: the store dropped its claim on them when it quarantined it)."""
        return (self.bin.size if self.bin else 0) + self.block_bytes

    @property
    def disk_bytes(self) -> int:
        """What removing it frees: its files and its own blocks."""
        return self.file_bytes + self.block_bytes

    @property
    def block_parts(self) -> Parts | None:
        """An entry in entries/ kept as blocks (whatever its status: the store keeps every such entry on disk)."""
        return self.entry.parts if self.kind is Kind.ENTRY and self.entry is not None else None

    @property
    def block_claim(self) -> tuple[object, Parts] | None:
        parts = self.block_parts
        return None if parts is None else (self.directory, parts)

    @property
    def last_used(self) -> float:
        """The manifest's last use, else the newest file's mtime."""
        if self.entry and self.entry.last_used:
            return self.entry.last_used
        return max((f.mtime for f in self.files), default=0.0)

    def own_fields(self) -> dict[str, Any]:
        entry = self.entry
        return {
            "dir": str(self.directory),
            "bytes": entry.nbytes if entry else None,
            "bin_size": self.bin.size if self.bin else None,
            "blocks": len(entry.parts.block_sizes()) if entry and entry.parts else None,  # kept as blocks: how many
            "own_bytes": self.own_bytes,  # what only it holds (its .bin, or the blocks no other entry uses)
            "disk_bytes": self.disk_bytes,  # what removing it frees: that and its manifest
            "save_ms": entry.save_ms if entry else None,
            "boundary": entry.boundary if entry else None,  # saved at a turn boundary (hybrid, sliding-window)
            "opening": entry.opening if entry else None,  # a shared opening (system prompt, tools), not a chat
            "uses": entry.uses if entry and entry.opening else None,  # the chats that started from it
            "images": len(entry.images) if entry else None,  # the pictures it holds
            "llama_server": (entry.server or None) if entry else None,
            "bin": self.bin.path_text if self.bin else None,
            "manifest": self.manifest_file.path_text if self.manifest_file else None,
        }
