"""What every row of `slotkeeper ls` answers, local or remote: its kind, its status in words, and the order of
its JSON record.

Local and remote rows answer the same questions (tokens, size, last use, model, status), so that one table
renderer (listing), one record builder (records.record) and one pruning plan serve both; this is the interface
they read, with nothing of either kind's files.
"""

from __future__ import annotations

import abc
import enum
from typing import Any, ClassVar

from ..store.blocks import Parts
from ..store.entries import Entry, Status
from .formats import count
from .statuses import WORDS


class Kind(enum.StrEnum):
    """What a row is (`ls --json`'s "kind")."""

    ENTRY = "entry"
    QUARANTINED = "quarantined"
    SLOT_FILE = "slot_file"
    REMOTE = "remote"


def record_fields(
    *,
    where: tuple[str, ...],
    sizes: tuple[str, ...],
    saving: tuple[str, ...] = (),
    files: tuple[str, ...] = (),
) -> tuple[str, ...]:
    """A kind of row's record fields, in order: those every row has (records.record builds them) with the kind's
    own (its own_fields) in their places. One function for every kind, so that a field they share stands at the
    same place in every record and is named once.

    `where`: where the row is (after "kind"); `sizes`: after "bytes"; `saving`: how it was saved (after
    "age_s"); `files`: after "format".
    """
    return (
        "kind",
        *where,
        "id",
        "short",
        "status",
        "detail",
        "reason",
        "tokens",
        "bytes",
        *sizes,
        "saved_at",
        "last_used",
        "age_s",
        *saving,
        "model",
        "model_name",
        "fingerprint",
        "format",
        *files,
    )


class Listed(abc.ABC):
    """What every row answers, local or remote; `FIELDS` orders its JSON record (records.record)."""

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
        """What removing it frees on disk."""
        return self.size or 0

    @property
    def file_bytes(self) -> int:
        """The bytes of its own files (not its blocks)."""
        return self.disk_bytes

    @property
    def own_bytes(self) -> int | None:
        """The state's bytes that only it holds on disk (an entry kept as blocks shares some of them)."""
        return self.size

    @property
    def block_parts(self) -> Parts | None:
        """The blocks it holds a claim on (an entry of a save directory kept as blocks); None: it holds none."""
        return None

    @property
    def block_claim(self) -> tuple[object, Parts] | None:
        """Where its blocks are counted, each once (a save directory, a bucket's namespace), and which: for
        --max-total and what each removal frees. None: it holds none."""
        return None

    @property
    def in_blocks(self) -> bool:
        """Its state is kept as blocks (the table then shows what each row holds on its own)."""
        return self.entry is not None and self.entry.parts is not None

    @property
    def label_id(self) -> str:
        """The table's first column."""
        return self.short
