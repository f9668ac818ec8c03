"""Matching entries against llama-server arguments: what can be known of a fit without starting llama-server.

`slotkeeper ls/prune -- ARGS` reads the arguments as slotkeeper does (cmdline.parse_llama_args) and compares
the fields they decide offline (the model file, the KV flags, and the slot count and context size when -np /
-c are given) with each row's fingerprint, field by field as the store does (fingerprint.shareable).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cmdline import ConfigError, parse_llama_args
from ..store.fingerprint import KV_FLAGS, kv_flags, model_identity, shareable
from .formats import CatalogError
from .listed import Listed
from .statuses import COMPARABLE

MODEL_KEYS = ("model", "model_size", "model_sha256")
CTX_FLAGS = ("-c", "--ctx-size")
ENV_CTX_SIZE = "LLAMA_ARG_CTX_SIZE"
UNIFIED_FLAGS = {"-kvu": True, "--kv-unified": True, "-no-kvu": False, "--no-kv-unified": False}
CTX_PAD = 256  # llama.cpp rounds a slot's context up to a multiple of this


@dataclass(frozen=True, kw_only=True)
class Expectation:
    """The fingerprint fields that llama-server's arguments decide offline, and how to compare them."""

    fields: dict[str, Any]  # model identity (when -m is given) and the KV flags, as build_fingerprint has them
    model_given: bool
    total_slots: int | None  # from an explicit -np N (N >= 1)
    ctx_size: int | None  # from an explicit -c N (N >= 1)
    unified: bool

    @property
    def ctx_range(self) -> tuple[int, int] | None:
        """The per-slot context llama-server derives from -c: -c itself with a unified KV cache, else -c / -np,
        rounded up to a multiple of 256 by recent llama.cpp (older builds do not round)."""
        if self.ctx_size is None or not (self.unified or self.total_slots):
            return None  # split over an unknown number of slots: cannot tell
        per_slot = self.ctx_size if self.unified else self.ctx_size // (self.total_slots or 1)
        return per_slot, -(-per_slot // CTX_PAD) * CTX_PAD

    def checked(self) -> str:
        """What the match column compares, for the line above the tables."""
        parts = [f"model {Path(self.fields['model']).name}" if self.model_given else "model not checked (no -m)"]
        flags = ", ".join(f"{k}={v}" for k, v in sorted(self.kv_fields().items()))
        parts.append(f"KV flags ({flags or 'defaults'})")
        parts.append(
            f"total_slots (-np {self.total_slots})" if self.total_slots else "total_slots not checked (no -np)"
        )
        if self.ctx_range:
            parts.append(f"n_ctx_slot (-c {self.ctx_size})")
        else:
            parts.append("n_ctx_slot not checked (" + ("no -c" if not self.ctx_size else "-np unknown") + ")")
        return "; ".join(parts)

    def kv_fields(self) -> dict[str, Any]:
        return {k: v for k, v in self.fields.items() if k not in MODEL_KEYS}

    def differences(self, saved: Mapping[str, Any]) -> list[str]:
        """Every offline-knowable field that differs, most important first; empty when they match."""
        found: list[str] = []
        if self.model_given:
            model_diff = _model_difference(saved, self.fields)
            if model_diff:
                found.append(model_diff)
        for key in sorted(KV_FLAGS):
            if saved.get(key) != self.fields.get(key):
                found.append(f"{key} {_flag_value(saved.get(key))} -> {_flag_value(self.fields.get(key))}")
        if self.total_slots is not None and saved.get("total_slots") != self.total_slots:
            found.append(f"total_slots {saved.get('total_slots')} -> {self.total_slots} (-np)")
        ctx_range = self.ctx_range
        n_ctx = saved.get("n_ctx_slot")
        if ctx_range and isinstance(n_ctx, int) and not ctx_range[0] <= n_ctx <= ctx_range[1]:
            low, high = ctx_range
            expected = f"{low:,}" if low == high else f"{low:,}..{high:,}"
            found.append(f"n_ctx_slot {n_ctx:,} -> {expected} (-c)")
        return found


def _flag_value(value: Any) -> str:
    return "default" if value is None else str(value)


def _model_difference(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """As the store compares models (shareable: by content when its hash is known, so a moved or copied model
    file is the same model). Short on purpose: the model column names the saved model, the `match:` line the
    one in the arguments."""
    saved_model, current_model = shareable(dict(saved)), shareable(dict(current))
    if all(saved_model.get(k) == current_model.get(k) for k in MODEL_KEYS):
        return None
    if saved.get("model") == current.get("model"):
        return "model file changed"  # same path, other size or content
    return "model differs"


def _int_arg(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise CatalogError(f"llama-server argument {name} needs an integer (got {value!r})") from None


def expectation_from_args(argv: Sequence[str], env: Mapping[str, str]) -> Expectation:
    """Read llama-server's argv the way slotkeeper does (cmdline.parse_llama_args) and hash the model file."""
    try:
        llama = parse_llama_args(list(argv), env)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise CatalogError(str(exc)) from None
    fields: dict[str, Any] = {}
    if llama.model:
        if not os.path.isfile(llama.model):
            raise CatalogError(f"model file not found: {llama.model}")
        fields.update(model_identity(llama.model))
    fields.update(kv_flags(llama.passthrough))

    parallel = _int_arg("-np", llama.parallel) if llama.parallel is not None else None
    ctx_text = env.get(ENV_CTX_SIZE) or None
    unified: bool | None = None
    tokens = llama.passthrough
    for i, token in enumerate(tokens):
        name, has_inline, inline = token.partition("=")
        if name in CTX_FLAGS:
            if has_inline:
                ctx_text = inline
            elif i + 1 < len(tokens):
                ctx_text = tokens[i + 1]
            else:
                raise CatalogError(f"llama-server argument {name} needs a value")
        elif token in UNIFIED_FLAGS:
            unified = UNIFIED_FLAGS[token]
    ctx = _int_arg("-c", ctx_text) if ctx_text is not None else None
    explicit_slots = parallel if parallel is not None and parallel >= 1 else None
    if unified is None:
        unified = explicit_slots is None  # llama-server: -np auto means 4 slots sharing one unified KV cache
    return Expectation(
        fields=fields,
        model_given=bool(llama.model),
        total_slots=explicit_slots,
        ctx_size=ctx if ctx is not None and ctx >= 1 else None,  # -c 0: the model's training context
        unified=unified,
    )


def match_differences(row: Listed, expectation: Expectation) -> list[str]:
    """Why `row` would not be used under those arguments; empty when it would (or, for a slot file, would be
    after the next start takes it over)."""
    if row.status not in COMPARABLE:
        return [row.detail]
    return expectation.differences(row.fingerprint)
