"""The store's index of exact keys (store.index.EntryIndex.find_exact), called directly: most exact keys belong to
one entry (held as its id alone, to spare a list per entry at 20,000 entries), a few to several."""

from __future__ import annotations

from slotkeeper.store.entries import Entry
from slotkeeper.store.index import EntryIndex

FINGERPRINT = {"model": "/m/a.gguf"}


def entry(entry_id: str, exact: str) -> Entry:
    return Entry(
        id=entry_id,
        n_tokens=100,
        nbytes=10,
        keys=[],
        saved_at=0.0,
        last_used=0.0,
        fingerprint=FINGERPRINT,
        seq_version=4,
        layout="",
        exact=exact,
    )


def test_an_exact_key_finds_its_entry_until_it_is_unindexed() -> None:
    index = EntryIndex(FINGERPRINT, {})
    one = entry("a1", "x")
    index.index(one)
    assert index.find_exact("x") is one
    assert index.find_exact("y") is None
    index.unindex(one)
    assert index.find_exact("x") is None


def test_entries_sharing_an_exact_key_are_found_until_the_last_goes() -> None:
    index = EntryIndex(FINGERPRINT, {})
    first, second, third = entry("a1", "x"), entry("a2", "x"), entry("a3", "x")
    for each in (first, second, third):
        index.index(each)
    assert index.find_exact("x") is first
    index.unindex(first)
    assert index.find_exact("x") is second
    index.unindex(third)
    assert index.find_exact("x") is second
    index.unindex(second)
    assert index.find_exact("x") is None
    index.index(third)
    assert index.find_exact("x") is third
