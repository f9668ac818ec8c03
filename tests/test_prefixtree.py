"""The store's prefix tree against the plainest possible index (every entry's keys compared with the chain's),
over random stores built up and torn down in random order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from slotkeeper.chat.prefix import KeyChain, block_keys, common_keys
from slotkeeper.store.prefixtree import PrefixTree

# Token lists drawn from a few shapes that share prefixes: an opening, branches of it, re-saves of a chat.
piece = st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=4)
chains = st.lists(piece, min_size=1, max_size=5).map(lambda ps: [t for p in ps for t in p for _ in range(32)])


def reference_deepest(entries: dict[str, list[str]], keys: list[str]) -> tuple[int, set[str]]:
    shared = {i: common_keys(k, keys) for i, k in entries.items()}
    depth = max(shared.values(), default=0)
    return depth, ({i for i, n in shared.items() if n == depth} if depth else set())


@settings(max_examples=300, deadline=None)
@given(st.lists(chains, min_size=1, max_size=12), st.lists(chains, min_size=1, max_size=6), st.data())
def test_the_tree_answers_as_a_scan_of_every_entry(stored, asked, data):
    tree = PrefixTree()
    entries: dict[str, list[str]] = {}
    order = list(range(len(stored)))
    removals = data.draw(st.lists(st.sampled_from(order), unique=True), "removed")
    for i, tokens in enumerate(stored):
        keys = block_keys(tokens)
        if keys:
            entries[f"e{i}"] = keys
            tree.add(f"e{i}", KeyChain(keys))
    for i in removals[: len(removals) // 2]:
        if f"e{i}" in entries:
            del entries[f"e{i}"]
            tree.remove(f"e{i}")
    for tokens in [*asked, *stored]:
        keys = block_keys(tokens)
        found = tree.deepest(KeyChain(keys) if len(tokens) % 2 else keys)  # packed, as entries' are, or not
        depth, holders = reference_deepest(entries, keys)
        assert (found.depth, set(found.holders)) == (depth, holders)
        assert set(found.ends) == {i for i in holders if len(entries[i]) == depth}
        assert sorted(tree.within(keys)) == sorted(i for i, k in entries.items() if common_keys(k, keys) == len(k))
        assert sorted(tree.near(keys)) == sorted(
            i for i, k in entries.items() if (n := common_keys(k, keys)) and n >= len(k) - 1
        )
    assert_minimal(tree, len(entries))
    for entry_id in list(entries):
        del entries[entry_id]
        tree.remove(entry_id)
    assert len(tree) == 0 and not tree._roots, "every run went with the last entry holding it"


def assert_minimal(tree: PrefixTree, n_entries: int) -> None:
    """No run is split where no entry ends or parts: at most two runs an entry, whatever came and went."""
    runs, stack = 0, list(tree._roots.values())
    while stack:
        run = stack.pop()
        runs += 1
        children = list((run.children or {}).values())
        assert run.ends or len(children) != 1, "a run that should have been joined to its one child"
        assert set(run.holders) == set(run.ends).union(*(c.holders for c in children))
        stack += children
    assert runs <= 2 * n_entries
