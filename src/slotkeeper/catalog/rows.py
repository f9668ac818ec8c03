"""What `slotkeeper ls` lists: a row per pair of files (in a save directory or in the shared tier), its status
in words, and the fields its JSON record is made of.

Local and remote rows answer the same questions (tokens, size, last use, model, status), so that one table
renderer, one record builder (render.record) and one pruning plan serve both.
"""

from __future__ import annotations

import abc
import enum
import itertools
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..chat.prefix import common_prefix
from ..store.entries import BIN_SUFFIX, Entry, Status
from .formats import count, display_path

SHORT_ID_MIN = 4

# What `ls` shows for each status: the status column, and the status in full (`ls --json`'s "reason") where
# the row has nothing more precise to say.
WORDS: dict[Status, tuple[str, str]] = {
    Status.USABLE: ("usable", ""),
    Status.OTHER_CONFIGURATION: ("other configuration", ""),
    Status.OTHER_FORMAT: ("other state format", ""),
    Status.WRONG_SIZE: ("size mismatch (quarantined at start)", ""),
    Status.NO_BIN: ("no .bin (manifest dropped at start)", "a manifest without its file: dropped at the next start"),
    Status.BAD_MANIFEST: ("bad manifest (never used)", "a manifest slotkeeper cannot read: its entry is never used"),
    Status.INTERRUPTED_SAVE: (
        "interrupted save (removed at start)",
        "a file without a manifest: an interrupted save, removed at the next start",
    ),
    Status.LINK: ("link (never followed)", "a link or not a file under an entry's name: never followed, left as it is"),
    Status.QUARANTINED: ("quarantined", "moved aside: llama-server refused it or its size was wrong"),
    Status.SLOT_FILE: (
        "slot file (taken over at next start)",
        "a slot file of the slot-file layout: taken over at the next start",
    ),
    Status.SLOT_FILE_UNVERIFIED: (
        "no manifest (--restore-unverified)",
        "a slot file without a manifest: taken over only with --restore-unverified",
    ),
    Status.SLOT_FILE_UNREADABLE: (
        "unreadable slot file (left as it is)",
        "not a slot file slotkeeper can read: left as it is",
    ),
    Status.SLOT_MANIFEST_ONLY: ("manifest without its .bin", "a slot-file manifest without its .bin: left as it is"),
    Status.SHARED: ("shared", ""),
    Status.REMOTE_BAD_MANIFEST: ("bad manifest (never used)", "a manifest slotkeeper cannot read: never fetched"),
    Status.OTHER_NAMESPACE: (
        "other namespace (never used)",
        "its fingerprint belongs to another namespace: a fetch rejects it",
    ),
}
# Rows with a fingerprint that the next start (or a fetch) would compare with its configuration.
COMPARABLE = frozenset(
    {Status.USABLE, Status.OTHER_CONFIGURATION, Status.OTHER_FORMAT, Status.SLOT_FILE, Status.SHARED}
)


class Kind(enum.StrEnum):
    """What a row is (`ls --json`'s "kind")."""

    ENTRY = "entry"
    QUARANTINED = "quarantined"
    SLOT_FILE = "slot_file"
    REMOTE = "remote"


@dataclass(frozen=True, kw_only=True)
class FileStat:
    """A listed file as the scan saw it: prune removes it only if it is still that file."""

    path: Path
    size: int
    mtime: float
    identity: tuple[int, int, int]  # (inode, mtime_ns, size): to notice a file replaced since the scan

    @classmethod
    def of(cls, path: Path) -> FileStat:
        return cls.from_stat(path, path.stat())

    @classmethod
    def from_stat(cls, path: Path, st: os.stat_result) -> FileStat:
        return cls(path=path, size=st.st_size, mtime=st.st_mtime, identity=cls.identity_of(st))

    @staticmethod
    def identity_of(st: os.stat_result) -> tuple[int, int, int]:
        return st.st_ino, st.st_mtime_ns, st.st_size

    @classmethod
    def maybe(cls, path: Path) -> FileStat | None:
        """A regular file (a link is never followed: None, as for a name that is gone), in one lstat."""
        try:
            st = os.lstat(path)
        except OSError:
            return None  # removed while we looked
        return cls.from_stat(path, st) if stat.S_ISREG(st.st_mode) else None


class Listed(abc.ABC):
    """What every row answers, local or remote; `FIELDS` orders its JSON record (render.record)."""

    FIELDS: ClassVar[tuple[str, ...]]
    kind: Kind
    entry: Entry | None
    status: Status
    reason: str  # the status in full, when it says more than the status's usual words
    note: str  # the status column, when it says more than the status's usual text
    short: str

    @property
    @abc.abstractmethod
    def id(self) -> str: ...

    @property
    @abc.abstractmethod
    def label(self) -> str:
        """How prune names it."""

    @property
    @abc.abstractmethod
    def sort_key(self) -> tuple[str, str]: ...

    @property
    @abc.abstractmethod
    def size(self) -> int | None:
        """The size column: the state's."""

    @abc.abstractmethod
    def own_fields(self) -> dict[str, Any]:
        """The record's fields that only this kind of row has."""

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.entry.fingerprint if self.entry else {}

    @property
    def model(self) -> str | None:
        value = self.fingerprint.get("model")
        return value if isinstance(value, str) and value else None

    @property
    def tokens(self) -> int | None:
        return self.entry.n_tokens if self.entry else None

    @property
    def detail(self) -> str:
        """The status column (an opening says how many chats started from it)."""
        text = self.note or WORDS[self.status][0]
        if self.entry is not None and self.entry.opening:
            text += f", opening of {count(self.entry.uses, 'chat')}"
        if self.entry is not None and self.entry.images:
            text += f", {count(len(self.entry.images), 'picture')}"
        return text

    @property
    def why(self) -> str:
        """The status in words, in full (`ls --json`'s "reason")."""
        return self.reason or WORDS[self.status][1] or self.detail

    @property
    def last_used(self) -> float:
        """As the manifest records it (for a remote entry: the uploading host's; fetches do not update it)."""
        return self.entry.last_used if self.entry else 0.0

    @property
    def disk_bytes(self) -> int:
        return self.size or 0

    @property
    def label_id(self) -> str:
        """The table's first column."""
        return self.short


@dataclass
class Row(Listed):
    """One listed thing of a save directory: an entry, a quarantined entry, or a slot file of the old layout;
    its two files are `<folder>/<name>.json` and `<folder>/<name>.bin`."""

    FIELDS: ClassVar[tuple[str, ...]] = (
        "kind",
        "dir",
        "id",
        "short",
        "status",
        "detail",
        "reason",
        "tokens",
        "bytes",
        "bin_size",
        "disk_bytes",
        "saved_at",
        "last_used",
        "age_s",
        "save_ms",
        "boundary",
        "opening",
        "uses",
        "images",
        "model",
        "model_name",
        "fingerprint",
        "format",
        "llama_server",
        "bin",
        "manifest",
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
        """The size column: the .bin's (the state's) size."""
        return self.bin.size if self.bin else (self.entry.nbytes if self.entry else None)

    @property
    def files(self) -> list[FileStat]:
        return [f for f in (self.manifest_file, self.bin) if f is not None]

    @property
    def disk_bytes(self) -> int:
        return sum(f.size for f in self.files)

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
            "disk_bytes": self.disk_bytes,
            "save_ms": entry.save_ms if entry else None,
            "boundary": entry.boundary if entry else None,  # saved at a turn boundary (hybrid, sliding-window)
            "opening": entry.opening if entry else None,  # a shared opening (system prompt, tools), not a chat
            "uses": entry.uses if entry and entry.opening else None,  # the chats that started from it
            "images": len(entry.images) if entry else None,  # the pictures it holds
            "llama_server": (entry.server or None) if entry else None,
            "bin": str(self.bin.path) if self.bin else None,
            "manifest": str(self.manifest_file.path) if self.manifest_file else None,
        }


@dataclass
class RemoteRow(Listed):
    """One entry of the shared tier: `<prefix>/<namespace>/<id>.json` (and its .bin)."""

    FIELDS: ClassVar[tuple[str, ...]] = (
        "kind",
        "url",
        "namespace",
        "id",
        "short",
        "status",
        "detail",
        "reason",
        "tokens",
        "bytes",
        "sha256",
        "saved_at",
        "last_used",
        "age_s",
        "model",
        "model_name",
        "fingerprint",
        "format",
    )
    url: str
    namespace: str
    entry_id: str
    manifest: dict[str, Any]
    entry: Entry | None
    status: Status
    reason: str = ""
    note: str = ""
    short: str = ""
    kind: Kind = Kind.REMOTE

    @property
    def id(self) -> str:
        return self.entry_id

    @property
    def label(self) -> str:
        return f"remote entry {self.short} in {self.url}/{self.namespace}"

    @property
    def sort_key(self) -> tuple[str, str]:
        return self.namespace, self.id

    @property
    def size(self) -> int | None:
        value = self.manifest.get("bytes")
        return value if isinstance(value, int) else None

    def own_fields(self) -> dict[str, Any]:
        return {"url": self.url, "namespace": self.namespace, "bytes": self.size, "sha256": self.manifest.get("sha256")}


def assign_short_ids(rows: Sequence[Row | RemoteRow]) -> None:
    """The shortest prefix of at least 4 hex digits (as the daemon's log lines name entries) that tells the
    rows apart; 8 suffice in practice.

    A row's prefix must be one character longer than the longest prefix its id shares with any other id (all of
    it, when that is the whole id). In sorted order, the id sharing the longest prefix with an id is one of its
    two neighbours, so one pass over the sorted distinct ids finds every row's length: O(n log n), where comparing
    every id with every other took minutes at tens of thousands of entries. Rows with the same id (an entry and
    its quarantined copy) do not tell each other apart, as before.
    """
    ids = sorted({r.id for r in rows if r.kind is not Kind.SLOT_FILE})
    shared = dict.fromkeys(ids, 0)  # id -> the longest prefix it shares with another id
    for left, right in itertools.pairwise(ids):
        n = common_prefix(left, right)
        if n > shared[left]:
            shared[left] = n
        if n > shared[right]:
            shared[right] = n
    for row in rows:
        if isinstance(row, Row) and row.kind is Kind.SLOT_FILE:
            row.short = row.name
            continue
        entry_id = row.id
        row.short = entry_id[: max(SHORT_ID_MIN, min(len(entry_id), shared[entry_id] + 1))]
