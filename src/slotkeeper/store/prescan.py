"""What run mode reads of its store while llama-server loads the model: the listing, and the index it guesses.

Why: a store of 20,000 entries took a second to open once llama-server answered healthy, all of it added to
the time until ready, while the model's load left a core idle. Listing entries/ and reading the manifest cache
need no configuration, and the index needs only the one the entries were saved for, which is the last run's
in all but the run after a change of flags: the most recently used entry's fingerprint is taken as this run's.
The store's open (ConversationStore.open) then takes that index when the guess was right, and judges only the
pairs it left; when it was wrong, it judges every pair as before: the guess costs time, never a verdict.
Nothing here removes or moves an entry, but what scan_entries removes (partial files, interrupted saves).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .entries import Entry, Status, judge
from .index import EntryIndex
from .scan import Found, scan_entries

Pair = tuple[str, dict[str, Any] | Entry, int | None]


@dataclass
class Prescan:
    """scan_entries' listing, and the usable entries indexed against the guessed configuration."""

    found: Found
    index: EntryIndex | None = None  # None: no entry says which configuration saved it
    rest: list[Pair] = field(default_factory=list)  # the pairs the index left: judged by the store's open


def prescan(root: Path, server: dict[str, Any]) -> Prescan:
    """In a thread, at the spawn: list the store, and index what the last run's configuration can use
    (`server`: this run's llama-server identity, store.server_identity). The collector is off meanwhile, as
    in the store's open: none of this makes cycles."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        found = scan_entries(root)
        guess = last_fingerprint(found.pairs)
        if guess is None:
            return Prescan(found)
        index = EntryIndex(guess, server)
        rest: list[Pair] = []
        for entry_id, data, size in found.pairs:
            verdict = judge(data, size, guess)
            if verdict.status is Status.USABLE and verdict.entry is not None:
                index.index(verdict.entry)
            else:
                rest.append((entry_id, data, size))
        return Prescan(found, index, rest)
    finally:
        if collecting:
            gc.enable()


def last_fingerprint(pairs: list[Pair]) -> dict[str, Any] | None:
    """The fingerprint of the most recently used entry (the last run's configuration), if any says one."""
    newest, found = float("-inf"), None
    used: Any
    fingerprint: Any
    for _, data, _ in pairs:
        if isinstance(data, Entry):
            used, fingerprint = data.last_used, data.fingerprint
        else:
            used, fingerprint = data.get("last_used", data.get("saved_at")), data.get("fingerprint")
        if isinstance(fingerprint, dict) and isinstance(used, (int, float)) and used > newest:
            newest, found = used, fingerprint
    return found
