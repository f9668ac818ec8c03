"""How a save or a restore ended: closed enums (their values label the metrics) and the results around them.

Why apart: every part of the store reports them (its files, its restores, its saves) and its callers read
them (placement, the daemon); none of those need import another for them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..log import fmt_bytes
from .entries import (
    Entry,
)


class SaveFailure(enum.StrEnum):
    """Why a save made no entry (the values label slotkeeper_save_failures; EMPTY counts as an outcome)."""

    EMPTY = "empty"  # the slot held no tokens: nothing to keep
    DISK_SPACE = "disk_space"
    LLAMA_SERVER_ERROR = "llama_server_error"
    SIZE_MISMATCH = "size_mismatch"
    COMMIT_FAILED = "commit_failed"
    REQUEST_FAILED = "request_failed"
    BUDGET = "budget"  # the caller's time ran out


@dataclass(frozen=True, kw_only=True)
class SaveResult:
    """How a save ended: the entry it wrote, or why none."""

    entry: Entry | None = None
    failure: SaveFailure | None = None  # when entry is None
    reason: str = ""  # the failure in words
    seconds: float = 0.0
    superseded: int = 0
    written: int = 0  # the bytes it wrote to the store: its new blocks (kept as blocks) or its file

    @property
    def size_text(self) -> str:
        """The entry's size for a log line, with what reached the store when that is less (blocks it shares)."""
        if self.entry is None:
            return ""
        if self.written >= self.entry.nbytes:
            return fmt_bytes(self.entry.nbytes)
        return f"{fmt_bytes(self.entry.nbytes)} ({fmt_bytes(self.written)} new)"


class RestoreOutcome(enum.StrEnum):
    """How a restore ended (the values label slotkeeper_restores)."""

    RESTORED = "restored"
    FAILED = "failed"  # not restored, the entry kept: llama-server unreachable, or its file unreadable now
    QUARANTINED = "quarantined"  # the entry was bad and is gone (the store said so in its own line)


@dataclass(frozen=True, kw_only=True)
class RestoreResult:
    """How a restore ended, and what it read."""

    outcome: RestoreOutcome
    reason: str = ""  # why it was not restored, in words
    n_tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome is RestoreOutcome.RESTORED
