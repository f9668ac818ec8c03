"""What an entry of another configuration is good for (store/fit.py): the decision alone, no llama-server."""

from __future__ import annotations

from typing import Any

import pytest

from slotkeeper.store.entries import Entry
from slotkeeper.store.fit import Fit, Running, Unfit, fit, group_of, same_tensors

MODEL = {"model": "/m/a.gguf", "model_size": 10, "model_sha256": "aa"}
RUNNING = Running(fingerprint={**MODEL, "total_slots": 2, "n_ctx_slot": 4096}, vocabulary="v1", n_ctx_slot=4096)


def entry(**fields: Any) -> Entry:
    base: dict[str, Any] = {
        "id": "e1",
        "n_tokens": 1000,
        "nbytes": 100,
        "keys": [],
        "saved_at": 0.0,
        "last_used": 0.0,
        "fingerprint": {**MODEL, "total_slots": 4, "n_ctx_slot": 4096},
        "seq_version": 3,
        "layout": "packed-1",
        "vocabulary": "v1",
    }
    return Entry(**{**base, **fields})


def test_same_tensors_under_another_path_or_flags_are_the_same_tensors() -> None:
    moved = {**MODEL, "model": "/elsewhere/a.gguf", "cache_type_k": "q8_0", "total_slots": 1}
    assert same_tensors(moved, RUNNING.fingerprint)
    assert not same_tensors({**MODEL, "model_sha256": "bb"}, RUNNING.fingerprint)
    assert not same_tensors({**MODEL, "mmproj": "/m/p.gguf"}, RUNNING.fingerprint)


def test_an_entry_whose_group_loads_is_used_as_saved() -> None:
    assert fit(entry(), RUNNING, loads=True).fit is Fit.LOADS


def test_an_entry_whose_group_is_refused_is_recomputed() -> None:
    assert fit(entry(), RUNNING, loads=False).fit is Fit.RECOMPUTE


def test_a_group_that_loads_does_not_make_a_longer_entry_fit_a_smaller_context() -> None:
    verdict = fit(entry(n_tokens=5000), RUNNING, loads=True)
    assert (verdict.fit, verdict.unfit) == (Fit.KEPT, Unfit.CONTEXT)


def test_other_weights_are_recomputed_even_when_their_file_would_load() -> None:
    """llama-server loads a state of other weights of the same shape, then answers wrongly: never loaded."""
    other = entry(fingerprint={**MODEL, "model_sha256": "bb"})
    assert fit(other, RUNNING, loads=True).fit is Fit.RECOMPUTE


@pytest.mark.parametrize(
    ("fields", "unfit"),
    [
        ({"vocabulary": "v2"}, Unfit.VOCABULARY),
        ({"vocabulary": ""}, Unfit.NO_VOCABULARY),
        ({"images": (("img", 64),)}, Unfit.PICTURES),
    ],
)
def test_what_cannot_be_recomputed_says_why(fields: dict[str, Any], unfit: Unfit) -> None:
    other = entry(fingerprint={**MODEL, "model_sha256": "bb"}, **fields)
    verdict = fit(other, RUNNING, loads=None)
    assert (verdict.fit, verdict.unfit) == (Fit.KEPT, unfit)


def test_the_same_model_needs_no_recorded_vocabulary() -> None:
    assert fit(entry(vocabulary=""), RUNNING, loads=False).fit is Fit.RECOMPUTE


def test_groups_are_configurations_and_formats() -> None:
    a, b = entry(), entry(id="e2", n_tokens=5)
    assert group_of(a) == group_of(b)
    assert group_of(a) != group_of(entry(seq_version=4))
    assert group_of(a) != group_of(entry(fingerprint={**MODEL, "total_slots": 1}))
