"""The store's index: which entries share which prefix, as a tree of runs of keys (a radix tree).

Chained keys (prefix.py) make every entry a path from a root: key i stands for its whole prefix. Entries
that share a prefix share the path up to where they part. The tree keeps one node per *run*: a stretch of
positions that the same entries all hold, split where one of them ends or parts from the others. So a store
of 20,000 chats that share one opening is one run for the opening and one per chat, not a set of entries
for each of their millions of keys (as a key-by-key index was, most of the daemon's memory at that size).

A run's keys are not copied: they are read from any entry holding it. Every entry ends at the end of a run
(runs are split there), so a run's `ends` are the entries whose last key it has. Nothing here does I/O or
makes a choice: the store asks, and decides (as vLLM's block pool serves its cache manager).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..chat.prefix import KeyChain, TreeKey, tree_key


@dataclass(slots=True)
class _Run:
    """A stretch of positions that the same entries all hold (the module docstring says why runs, not keys)."""

    start: int  # the position of its first key
    end: int  # ... and of its last
    holders: list[str]  # the entries holding all of its keys (those ending here and those going on)
    ends: list[str]  # the entries whose last key is its last
    children: dict[TreeKey, _Run] | None  # the runs that go on from it, by their first key


@dataclass(frozen=True, slots=True)
class Deepest:
    """How far a chain of keys goes into the tree, and the entries that go that far with it."""

    depth: int  # keys shared with the deepest entries (0: none)
    holders: Sequence[str]  # those entries
    ends: Sequence[str]  # of those, the ones with no key beyond `depth` (each smaller than any other holder)


NOWHERE = Deepest(0, (), ())


class PrefixTree:
    """Entries (by id) and their key chains, found by the prefixes they share."""

    def __init__(self) -> None:
        self._roots: dict[TreeKey, _Run] = {}
        self._chains: dict[str, Sequence[str]] = {}

    def __len__(self) -> int:
        return len(self._chains)

    def add(self, entry_id: str, keys: Sequence[str]) -> None:
        """Index an entry with at least one key (the store keeps the others apart)."""
        assert keys and entry_id not in self._chains
        self._chains[entry_id] = keys
        n = len(keys)
        table, pos = self._roots, 0
        while True:
            key = tree_key(keys, pos)
            run = table.get(key)
            if run is None:
                table[key] = _Run(pos, n - 1, [entry_id], [entry_id], None)
                return
            shown = self._chains[run.holders[0]]
            last = _last_shared(keys, shown, pos, run.end)
            if last < run.end:  # it ends or parts inside the run: split the run there
                rest = _Run(last + 1, run.end, list(run.holders), run.ends, run.children)
                run.end, run.ends, run.children = last, [], {tree_key(shown, last + 1): rest}
            run.holders.append(entry_id)
            if last == n - 1:
                run.ends.append(entry_id)
                return
            if run.children is None:
                run.children = {}
            table, pos = run.children, last + 1

    def remove(self, entry_id: str) -> None:
        """Forget an entry; runs it alone held go, and a run left with one way on is joined to it."""
        keys = self._chains.pop(entry_id)
        path: list[tuple[dict[TreeKey, _Run], TreeKey, _Run]] = []
        table: dict[TreeKey, _Run] | None = self._roots
        pos = 0
        while table is not None:
            key = tree_key(keys, pos)
            run = table[key]
            run.holders.remove(entry_id)
            path.append((table, key, run))
            if run.end == len(keys) - 1:
                run.ends.remove(entry_id)
                break
            table, pos = run.children, run.end + 1
        for table, key, run in reversed(path):
            if not run.holders:
                del table[key]
                continue
            if run.children is not None and not run.children:
                run.children = None
            if not run.ends and run.children is not None and len(run.children) == 1:
                (child,) = run.children.values()  # the same entries hold both: one run
                run.end, run.ends, run.children = child.end, child.ends, child.children

    def deepest(self, keys: Sequence[str]) -> Deepest:
        """The entries sharing the longest prefix with `keys`, and how many keys they share."""
        table: dict[TreeKey, _Run] | None = self._roots
        pos, found = 0, NOWHERE
        while table is not None and pos < len(keys):
            run = table.get(tree_key(keys, pos))
            if run is None:
                break
            last = _last_shared(keys, self._chains[run.holders[0]], pos, run.end)
            found = Deepest(last + 1, run.holders, run.ends if last == run.end else ())
            if last < run.end:
                break
            table, pos = run.children, run.end + 1
        return found

    def within(self, keys: Sequence[str]) -> list[str]:
        """The entries all of whose keys `keys` open with (each a prefix of them), shallowest first."""
        table: dict[TreeKey, _Run] | None = self._roots
        pos, found = 0, []
        while table is not None and pos < len(keys):
            run = table.get(tree_key(keys, pos))
            if run is None or _last_shared(keys, self._chains[run.holders[0]], pos, run.end) < run.end:
                break
            found += run.ends
            table, pos = run.children, run.end + 1
        return found

    def near(self, keys: Sequence[str]) -> list[str]:
        """The entries sharing at least one key with `keys` and all their keys, or all but their last (what a
        save may supersede: a chat it extends, whose last block held the end of a reply it re-templated)."""
        table: dict[TreeKey, _Run] | None = self._roots
        pos, found = 0, []
        while table is not None:
            run = table.get(tree_key(keys, pos)) if pos < len(keys) else None
            if pos:  # one key unlike `keys`'s, then nothing: all but their last
                found += [
                    i for other in table.values() if other is not run and other.start == other.end for i in other.ends
                ]
            if run is None:
                break
            last = _last_shared(keys, self._chains[run.holders[0]], pos, run.end)
            if last < run.end:
                if run.end == last + 1:
                    found += run.ends
                break
            found += run.ends
            table, pos = run.children, run.end + 1
        return found


def _last_shared(keys: Sequence[str], other: Sequence[str], start: int, end: int) -> int:
    """The last position in [start, end] where `keys` and `other` agree, given they agree at `start`.

    Chained keys agree on a prefix (equal at i means equal before i): a binary search finds it.
    """
    if isinstance(keys, KeyChain) and isinstance(other, KeyChain):
        found = keys.last_shared(other, start, end)
        if found is not None:
            return found
    lo, hi = start, min(end, len(keys) - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if keys[mid] == other[mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
