"""The conversation store: saved KV states of conversations, found by prefix, never lost to a crash.

An *entry* is one conversation's saved state: its manifest (`entries/<id>.json`) and its bytes, kept as blocks
(`blocks/`, each written once and shared by the entries that repeat it: blocks.py) or, as before blocks, as
one file (`entries/<id>.bin`, llama-server's slot file). The manifest holds the fingerprint of the
configuration that can use it, token count, bytes, last use, llama-server's identity and the file's format
version, and the prefix keys of its tokens (`prefix.block_keys`). Entries are keyed by content, not by slot:
the placement policy restores one into whichever slot it chooses. The manifest and the rule for what an entry
found on disk is good for are entries.py's (`slotkeeper ls` reads them there too).

The mechanism lives here; what to save, restore or evict, and when, is the caller's (placement, daemon). The
store is built in layers, one module each, imports running one way: the entries on disk and their lifetime
(entryfiles.py, on the prefix indexes of index.py), restores (restores.py), saves (saves.py), and what the
entries of other configurations are good for (fitcheck.py). Their outcomes are outcomes.py's.

Nothing lost, by construction:
* llama-server never sees the store. Its `--slot-save-path` is `snapshots/` (clients' own save and restore
  names land there); slotkeeper saves into it under a random transient name (staged in RAM when there is
  room) and restores through one. No request can name an entry.
* A save never overwrites: every save is a new entry, committed by its manifest (fsync, rename, fsync the
  directory) after its new blocks, and only then are the entries it extends removed. A crash at any step
  leaves the previous entries whole; what an interrupted save wrote is removed at the next start.
* A save that fails, whatever the error (a full disk, a read-only remount), removes everything it made before
  it returns: a file left behind would hold the space the next save needs.
* Every entry carries a checksum of llama-server's file, known good before any request may use the slot: a
  state that changed on disk is quarantined (with every entry sharing its changed blocks), so the model
  never answers from a state it never had.
"""

from __future__ import annotations

from .entryfiles import default_cap, format_entry
from .fitcheck import FitChecks
from .outcomes import RestoreOutcome, RestoreResult, SaveFailure, SaveResult
from .saves import Saves

__all__ = [
    "ConversationStore",
    "RestoreOutcome",
    "RestoreResult",
    "SaveFailure",
    "SaveResult",
    "default_cap",
    "format_entry",
]


class ConversationStore(FitChecks, Saves):
    """The entries of one save directory, indexed by prefix key (EntryIndex), and the save/restore protocol
    around them."""
