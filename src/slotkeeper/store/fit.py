"""What an entry saved by another configuration is good for here: loaded as it is, recomputed, or kept aside.

Users change things between two starts: they upgrade llama-server (its slot-file format changed twice in six
weeks), raise `-c`, change `-np` or the KV cache type, or download a re-quantized copy of their model. Which of
these a saved state survives is llama-server's to say, not flags': its loader compares the file's layout with
its own and answers 400 for any mismatch, while it never checks the weights (a file of other weights loads,
then answers wrongly). So an entry is loaded as it is only when it was computed by these tensors and the
running llama-server loaded a file of its group (`Group`: the same configuration and format) at start; any
other entry whose tokens mean the same to this model (the same vocabulary, from the GGUF header) is
recomputed from its tokens in idle time (placement/recompute.py). Pure: the store asks, and does the I/O.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from .entries import Entry
from .fingerprint import shareable

# The fingerprint fields that say which tensors computed a state (the model file, its projector, adapters):
# a state of other tensors is another model's, whatever the loader accepts.
TENSOR_FIELDS = ("model", "model_size", "model_sha256", "mmproj", "lora")


class Fit(enum.StrEnum):
    """What an entry of another configuration is good for here (the values label metrics and `ls --json`)."""

    LOADS = "loads"  # the running llama-server loads it as it is (e.g. -c raised)
    RECOMPUTE = "recompute"  # its tokens are recomputed by the running llama-server, then saved anew
    KEPT = "kept"  # neither: kept as it is (a downgrade may use it), not used


class Unfit(enum.StrEnum):
    """Why an entry cannot be recomputed (the values label slotkeeper_recompute_skipped)."""

    PICTURES = "pictures"  # its pictures' bytes are not kept: tokens alone cannot rebuild it
    VOCABULARY = "vocabulary"  # another vocabulary or shape: another model, not another file of this one
    NO_VOCABULARY = "no_vocabulary"  # saved by other tensors before slotkeeper recorded vocabularies
    CONTEXT = "context"  # longer than a slot of the running llama-server holds


UNFIT_WORDS = {
    Unfit.PICTURES: "it holds pictures, whose bytes are not kept",
    Unfit.VOCABULARY: "its model has another vocabulary or shape",
    Unfit.NO_VOCABULARY: "its model's vocabulary was not recorded",
    Unfit.CONTEXT: "it is longer than a slot's context",
}


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """Whether an entry fits the running configuration, and if it is kept but unfit, why."""

    fit: Fit
    unfit: Unfit | None = None  # KEPT: why


@dataclass(frozen=True, kw_only=True)
class Running:
    """The running configuration, as far as fitting entries goes."""

    fingerprint: dict[str, Any]
    vocabulary: str  # the model's vocabulary key ("" when its header could not be read)
    n_ctx_slot: int | None  # tokens a slot holds (None: unknown)


def group_of(entry: Entry) -> str:
    """Entries that llama-server loads alike: the same configuration, server and state format. One file of
    each is tried at start (the smallest), and its answer stands for them all."""
    return json.dumps(
        [shareable(entry.fingerprint), entry.server, entry.seq_version, entry.layout],
        sort_keys=True,
        separators=(",", ":"),
    )


def same_tensors(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Computed by the same model file (by content, wherever it lies), projector and adapters."""
    saved, current = shareable(saved), shareable(current)
    return all(saved.get(field) == current.get(field) for field in TENSOR_FIELDS)


def fit(entry: Entry, running: Running, *, loads: bool | None) -> Verdict:
    """What `entry` is good for here; `loads`: whether the running llama-server loaded a file of its group
    (None: not tried, e.g. other tensors)."""
    tensors = same_tensors(entry.fingerprint, running.fingerprint)
    fits_context = running.n_ctx_slot is None or entry.n_tokens <= running.n_ctx_slot
    if tensors and loads and fits_context:
        return Verdict(fit=Fit.LOADS)
    if entry.images:
        return Verdict(fit=Fit.KEPT, unfit=Unfit.PICTURES)
    if not tensors:
        if not entry.vocabulary or not running.vocabulary:
            return Verdict(fit=Fit.KEPT, unfit=Unfit.NO_VOCABULARY)
        if entry.vocabulary != running.vocabulary:
            return Verdict(fit=Fit.KEPT, unfit=Unfit.VOCABULARY)
    if not fits_context:
        return Verdict(fit=Fit.KEPT, unfit=Unfit.CONTEXT)
    return Verdict(fit=Fit.RECOMPUTE)
