"""The store's indexes over its usable entries: by prefix key, message keys, exact key, opening; and their sums.

Why apart from conversations.py: the store is the files, their protocol with llama-server and their lifetime; this is
how its entries are found, in memory only. Tens of thousands of entries build up after a few weeks of agent
sessions, and no request or save may scan them: every lookup here goes through a tree or a dict, kept by
`index` and `unindex` alone. `extends`, the rule by which a save supersedes an older entry, lives here with
`near`, which finds the only entries the rule can hold for.

No I/O: the store (a subclass) decides what is indexed, and when.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..chat.prefix import KeyChain, common_keys, extends_exactly
from .entries import Entry
from .prefixtree import PrefixTree

SUPERSEDE_SLACK_BLOCKS = 1  # an entry whose blocks but this many a new save repeats is superseded by it


class EntryIndex:
    """The usable entries of one configuration (`entries`), and the indexes that find them."""

    def __init__(self, fingerprint: dict[str, Any], server: dict[str, Any]) -> None:
        self.fingerprint = fingerprint  # the configuration that can use the entries
        self.server = server  # the llama-server identity (store.server_identity) of this run
        self.entries: dict[str, Entry] = {}  # usable by this configuration
        self._tree = PrefixTree()  # entries by their block keys
        # ... and by their message keys (chained too: a chat's turns are a path), built when first asked (only
        # hybrid and sliding-window models keep a chat's boundaries, and ask)
        self._by_message_keys: PrefixTree | None = None
        self._keyless: set[str] = set()  # entries without a full block
        # exact key -> the entry id, or the ids when several hold those tokens (rare: one str each, not a list)
        self._by_exact: dict[str, str | list[str]] = {}
        self._opening_ids: set[str] = set()
        self._totals = _Totals()  # running sums over self.entries

    def index(self, entry: Entry) -> None:
        """Make a usable entry findable (an entry already indexed stays as it is)."""
        if entry.id in self.entries:
            return
        # What most entries repeat is shared, not copied (this configuration's fingerprint and server), and
        # their keys are packed (prefix.KeyChain): a store of 20,000 entries is then tens of MB, not hundreds.
        if entry.fingerprint is not self.fingerprint and entry.fingerprint == self.fingerprint:
            entry.fingerprint = self.fingerprint
        if entry.server is not self.server and entry.server == self.server:
            entry.server = self.server
        if not isinstance(entry.keys, KeyChain):
            entry.keys = KeyChain(entry.keys)
        if not isinstance(entry.message_keys, KeyChain):
            entry.message_keys = KeyChain(entry.message_keys)
        self.entries[entry.id] = entry
        if entry.keys:
            self._tree.add(entry.id, entry.keys)
        else:
            self._keyless.add(entry.id)
        if entry.message_keys and self._by_message_keys is not None:
            self._by_message_keys.add(entry.id, entry.message_keys)
        if entry.exact:
            held = self._by_exact.get(entry.exact)
            if held is None:
                self._by_exact[entry.exact] = entry.id
            elif isinstance(held, str):
                self._by_exact[entry.exact] = [held, entry.id]
            else:
                held.append(entry.id)
        if entry.opening:
            self._opening_ids.add(entry.id)
        self._totals.add(entry, 1)

    def unindex(self, entry: Entry) -> None:
        """Forget an entry (its files are the caller's)."""
        if self.entries.pop(entry.id, None) is None:
            return
        if entry.keys:
            self._tree.remove(entry.id)
        else:
            self._keyless.discard(entry.id)
        if entry.message_keys and self._by_message_keys is not None:
            self._by_message_keys.remove(entry.id)
        if entry.exact:
            _drop(self._by_exact, entry.exact, entry.id)
        self._opening_ids.discard(entry.id)
        self._totals.add(entry, -1)

    def take_index(self, other: EntryIndex) -> bool:
        """Take over the indexes `other` built (store.prescan, in a thread, before this configuration was known),
        when nothing is indexed here yet and `other` was built for this configuration and llama-server; whether
        it was taken. Its entries then share this index's fingerprint and server, as index() makes them."""
        if self.entries or other.fingerprint != self.fingerprint or other.server != self.server:
            return False
        for entry in other.entries.values():
            if entry.fingerprint is other.fingerprint:
                entry.fingerprint = self.fingerprint
            if entry.server is other.server:
                entry.server = self.server
        self.entries, self._tree, self._by_message_keys = other.entries, other._tree, other._by_message_keys
        self._keyless, self._by_exact, self._opening_ids = other._keyless, other._by_exact, other._opening_ids
        self._totals = other._totals
        return True

    # ---- finding ------------------------------------------------------------------------------------------

    def lookup(self, keys: list[str]) -> tuple[Entry | None, int]:
        """The usable entry sharing the longest prefix with `keys`, and how many keys it shares.

        Of the entries that share that many, the smallest: it gives llama-server the same prefix for the fewest
        bytes read (a new chat gets its opening, not a long chat that happens to start with it). Those that end
        there are smaller than any that goes on, so only they are compared when there are any.
        """
        found = self._tree.deepest(keys)
        if not found.depth:
            return None, 0
        best = min((self.entries[i] for i in found.ends or found.holders), key=lambda e: (e.n_tokens, -e.last_used))
        return best, found.depth

    def lookup_extended(self, tokens: list[int], keys: list[str]) -> Entry | None:
        """The deepest boundary entry that `tokens` extend exactly (all of its tokens, and more): the only kind
        of entry llama-server reuses on a hybrid or sliding-window model."""
        best: Entry | None = None
        for entry_id in (*self._keyless, *self._tree.within(keys)):  # the entries whose blocks the request's open
            entry = self.entries[entry_id]
            if (
                entry.boundary
                and entry.exact
                and (best is None or entry.n_tokens > best.n_tokens)
                and extends_exactly(tokens, entry.n_tokens, entry.exact)
            ):
                best = entry
        return best

    def near(self, keys: Sequence[str]) -> set[str]:
        """The entries a save of `keys` may supersede: those that share all their blocks with it, or all but
        their last (the slack of `extends`), and those without a full block; not every chat that shares a
        system prompt."""
        return {*self._keyless, *self._tree.near(keys)}

    def _message_keys_tree(self) -> PrefixTree:
        if self._by_message_keys is None:
            self._by_message_keys = PrefixTree()
            for entry in self.entries.values():
                if entry.message_keys:
                    self._by_message_keys.add(entry.id, entry.message_keys)
        return self._by_message_keys

    def saved_within(self, message_keys: Sequence[str]) -> list[Entry]:
        """The entries whose message keys `messages` open with (a chat's earlier saves, its opening)."""
        return [self.entries[i] for i in self._message_keys_tree().within(message_keys)]

    def saved_beyond(self, message_keys: Sequence[str]) -> bool:
        """Whether some entry's message keys go on past all of `messages` (a later save of the same chat)."""
        found = self._message_keys_tree().deepest(message_keys)
        return found.depth == len(message_keys) > 0 and len(found.holders) > len(found.ends)

    def find_exact(self, key: str) -> Entry | None:
        """The entry holding exactly these tokens (by `prefix.exact_key`), if one is saved."""
        held = self._by_exact.get(key)
        if held is None:
            return None
        return self.entries[held if isinstance(held, str) else held[0]]

    def openings(self) -> list[Entry]:
        return [self.entries[i] for i in self._opening_ids]

    def mark_opening(self, entry: Entry) -> None:
        """Mark an entry an opening (chats start from it), and find it among them if it is indexed."""
        entry.opening = True
        if entry.id in self.entries:
            self._opening_ids.add(entry.id)

    # ---- sums ---------------------------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return self._totals.nbytes

    def bytes_per_token(self) -> float | None:
        """What a token of cache costs on disk here, from the entries (None before the first one)."""
        totals = self._totals
        return totals.nbytes / totals.n_tokens if totals.n_tokens else None

    def timed_save_rate(self) -> float | None:
        """Bytes per second of the saves llama-server timed, from the manifests (None: none was timed)."""
        totals = self._totals
        seconds = totals.save_ms / 1000
        return totals.timed_bytes / seconds if seconds > 0 else None


@dataclass
class _Totals:
    """Running sums over the usable entries (kept by index/unindex): a save asks for them, and summing
    20,000 entries each time cost more than the save's own bookkeeping."""

    nbytes: int = 0
    n_tokens: int = 0
    timed_bytes: int = 0  # of the entries with llama-server's save time ...
    save_ms: float = 0.0  # ... and those times

    def add(self, entry: Entry, sign: int) -> None:
        self.nbytes += sign * entry.nbytes
        self.n_tokens += sign * entry.n_tokens
        if entry.save_ms:
            self.timed_bytes += sign * entry.nbytes
            self.save_ms += sign * entry.save_ms


def _drop(index: dict[str, str | list[str]], key: str, entry_id: str) -> None:
    held = index.get(key)
    if held == entry_id:
        del index[key]
    elif isinstance(held, list):
        with contextlib.suppress(ValueError):
            held.remove(entry_id)
        if len(held) == 1:
            index[key] = held[0]


def extends(new: Entry, old: Entry) -> bool:
    """`new` holds `old`'s conversation and more (a chat that grew): `old` is superseded.

    All of it but at most the last SUPERSEDE_SLACK_BLOCKS: the end of the answer `old` generated, which the
    next prompt carries re-templated (a longer answer's blocks differ further back, and the older entry stays
    until the cap evicts it: the slack is kept small because a chat sharing only a system prompt must never
    supersede another).
    An opening is never superseded: the chats that start from it all extend it. Nor is another chat: when both
    were saved from chat requests, `old`'s message keys (its settings and messages) must open `new`'s, or a new
    chat whose opening is all but the last block of a short chat (an agent session after its tools) would
    supersede it.
    """
    if old.id == new.id or old.opening or not old.keys or old.n_tokens > new.n_tokens:
        return False
    if old.message_keys and new.message_keys and new.message_keys[: len(old.message_keys)] != old.message_keys:
        return False
    shared = common_keys(old.keys, new.keys)
    return shared >= len(old.keys) - SUPERSEDE_SLACK_BLOCKS and shared * 2 >= len(old.keys)
