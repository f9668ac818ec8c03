"""What kind of memory a model has, read from its GGUF header alone.

Why: what a slot's state is, and what saving, restoring or reusing it means, depends on the model's memory.
A full-attention model keeps every token's K/V, so any prefix of a conversation can be reused. A
sliding-window (SWA) model keeps only the last ``n_swa`` tokens in most layers (unless llama-server runs with
``--swa-full``), so a cached prefix is reusable only up to where the window has moved on. A recurrent or
hybrid model keeps a fixed-size state that cannot be rolled back to an arbitrary earlier token at all. The
daemon learns which at start, before llama-server has loaded anything, and without numpy or the ``gguf``
package (runtime dependencies are stdlib + pydantic etc.): the GGUF header's key/value section says it all.

The classification follows llama.cpp b11434, not guesses from key names: which architectures are recurrent,
hybrid, memoryless or use a sliding window is arch.py's tables, copied from llama.cpp's source; which
layers carry a KV cache, and how big llama-server's cache is, follow ``create_memory``, ``llama_kv_cache``,
``llama_kv_cache_iswa``, ``llama_memory_hybrid`` and ``llama_context``'s context padding. The header itself is
read by ggufheader.py.

Architectures those tables do not know (a GGUF from a newer llama.cpp) fall back on the keys:
``<arch>.ssm.*`` / ``shortconv.*`` / ``wkv.*`` / ``kda.*`` mean recurrent, ``<arch>.attention.sliding_window``
means SWA.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..log import log
from .arch import (
    HYBRID_ARCHITECTURES,
    INTERVAL_HYBRIDS,
    KNOWN_ARCHITECTURES,
    MAX_LAYERS,
    MEMORYLESS_ARCHITECTURES,
    RECURRENT_ARCHITECTURES,
    RECURRENT_KEY_GROUPS,
    SPECIAL_CACHE_ARCHITECTURES,
    SWA_RULES,
    SwaRule,
)
from .ggufheader import ModelInfoError, SkippedArray, read_gguf_metadata

__all__ = [
    "KvLayer",
    "MemoryKind",
    "ModelInfoError",
    "ModelMemory",
    "SkippedArray",
    "kv_cache_bytes",
    "llama_server_slots",
    "model_memory",
    "model_memory_from_metadata",
    "read_gguf_metadata",
    "read_model_memory",
]


# --------------------------------------------------------------------------------------------------------------
# The model's memory
# --------------------------------------------------------------------------------------------------------------


class MemoryKind(enum.Enum):
    FULL = "full"
    SLIDING_WINDOW = "sliding-window"
    RECURRENT = "recurrent"  # recurrent or hybrid


@dataclass(frozen=True)
class KvLayer:
    """One layer with a KV cache: K and V row widths in elements per cell (``n_embd_k_gqa``/``n_embd_v_gqa``;
    ``v`` is 0 for MLA, which caches no V) and whether it is in the sliding-window cache."""

    index: int
    k: int
    v: int
    swa: bool


@dataclass(frozen=True)
class ModelMemory:
    """What the model keeps per sequence, from its GGUF header: which cache policy its restores need (a
    recurrent or sliding-window state is reused only when extended) and how many bytes a token costs."""

    architecture: str
    kind: MemoryKind
    sliding_window: int | None  # n_swa, for SLIDING_WINDOW (and for a hybrid whose attention uses a window)
    n_layers: int  # the trunk's layers: block_count less any MTP (nextn) layers
    hybrid: bool  # attention + recurrent (False for pure recurrent)
    #: The layers with a KV cache in llama-server's main context (empty for pure recurrent and memoryless).
    kv_layers: tuple[KvLayer, ...] = ()
    #: The per-layer SWA pattern could not be known (an unknown architecture without the pattern key): every
    #: KV layer is counted in the full cache, an upper bound.
    swa_pattern_unknown: bool = False
    chunked: bool = False  # llama4's chunked attention rather than a sliding window
    n_ctx_train: int = 0  # <arch>.context_length: llama-server's context for -c 0
    memoryless: bool = False  # no memory at all (encoder, embedding or diffusion model)
    recurrent_layers: int = 0  # layers with recurrent state
    #: kv_cache_bytes follows llama.cpp's layout exactly; False for architectures with caches of their own
    #: kind (sparse-attention indexers, ...) and for unknown architectures.
    kv_exact: bool = True

    @property
    def swa_layers(self) -> int:
        return sum(1 for layer in self.kv_layers if layer.swa)

    @property
    def attention_layers(self) -> int:
        return len(self.kv_layers)

    def describe(self) -> str:
        """One short phrase for a log line."""
        if self.memoryless:
            return "no KV cache (encoder, embedding or diffusion model)"
        if self.kind is MemoryKind.RECURRENT:
            if not self.hybrid:
                return "recurrent state only (no KV cache)"
            text = "hybrid: attention + recurrent state"
            if self.sliding_window:
                text += f" ({self.sliding_window}-token attention window)"
            return text
        if self.kind is MemoryKind.SLIDING_WINDOW:
            what = "chunked attention" if self.chunked else "sliding-window attention"
            unit = "chunks" if self.chunked else "window"
            if self.swa_pattern_unknown:
                layers = "layer pattern unknown"
            else:
                layers = f"{self.swa_layers} of {self.n_layers} layers"
            return f"{what} ({self.sliding_window}-token {unit}, {layers})"
        return "full attention"


def _per_layer(meta: dict[str, Any], key: str, n: int, default: Sequence[int] | int) -> list[int]:
    """llama_model_loader::get_key_or_arr: a scalar for every layer, or an array of exactly n values."""
    value = meta.get(key)
    if value is None:
        return list(default) if isinstance(default, Sequence) else [default] * n
    if isinstance(value, SkippedArray):
        raise ModelInfoError(f"{key} has {value.count} entries, expected {n}")
    if isinstance(value, list):
        if len(value) != n:
            raise ModelInfoError(f"{key} has {len(value)} entries, expected {n}")
        return [_as_int(v, key) for v in value]
    return [_as_int(value, key)] * n


def _as_int(value: Any, key: str) -> int:
    if isinstance(value, bool):
        return int(value)
    if not isinstance(value, int) or value < 0:
        raise ModelInfoError(f"{key} is {value!r}, not a non-negative integer")
    return value


def _get_int(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key)
    if value is None:
        if default is None:
            raise ModelInfoError(f"{key} missing (llama.cpp requires it)")
        return default
    if isinstance(value, (list, SkippedArray)):
        raise ModelInfoError(f"{key} is an array, expected a number")
    return _as_int(value, key)


def _swa_pattern(meta: dict[str, Any], p: str, n_layer: int, n_layer_all: int, rule: SwaRule) -> list[bool]:
    """llama_model_base::load_swa_pattern (or a required get_arr when the rule has no default pattern)."""
    value = meta.get(p + "attention.sliding_window_pattern")
    if isinstance(value, list):
        flags = [bool(v) for v in value[:n_layer_all]]
        return flags + [False] * (n_layer_all - len(flags))
    if isinstance(value, SkippedArray):
        raise ModelInfoError(f"{p}attention.sliding_window_pattern has {value.count} entries")
    if rule.pattern is None:
        raise ModelInfoError(f"{p}attention.sliding_window_pattern missing (llama.cpp requires the per-layer array)")
    n_pattern = _get_int(meta, p + "attention.sliding_window_pattern", rule.pattern)
    return _set_swa_pattern(n_pattern, rule.dense_first, n_layer, n_layer_all)


def _set_swa_pattern(n_pattern: int, dense_first: bool, n_layer: int, n_layer_all: int) -> list[bool]:
    """llama_hparams::set_swa_pattern: n_pattern 0 means every layer; MTP layers never slide."""
    if dense_first:
        flags = [n_pattern == 0 or il % n_pattern != 0 for il in range(n_layer)]
    else:
        flags = [n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(n_layer)]
    return flags + [False] * (n_layer_all - n_layer)


def model_memory_from_metadata(meta: dict[str, Any]) -> ModelMemory:  # noqa: C901 - llama.cpp's rules, in its order
    """Classify a model from its GGUF metadata (as :func:`read_gguf_metadata` returns it)."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelInfoError("general.architecture missing: not a llama.cpp model file")
    p = arch + "."
    known = arch in KNOWN_ARCHITECTURES
    n_layer_all = _get_int(meta, p + "block_count")
    if not 0 < n_layer_all <= MAX_LAYERS:
        raise ModelInfoError(f"{p}block_count is {n_layer_all} (llama.cpp allows 1 to {MAX_LAYERS})")
    n_nextn = min(_get_int(meta, p + "nextn_predict_layers", 0), n_layer_all)
    n_ctx_train = _get_int(meta, p + "context_length", 0)

    # llama_model_base::load_hparams: per-layer head counts, head sizes.
    n_head = _per_layer(meta, p + "attention.head_count", n_layer_all, 0)
    n_head_kv = _per_layer(meta, p + "attention.head_count_kv", n_layer_all, n_head)
    n_ff = _per_layer(meta, p + "feed_forward_length", n_layer_all, 0)
    if arch == "nanbeige":  # src/models/nanbeige.cpp: the layers run num_loops times, each pass with its KV
        loops = max(1, _get_int(meta, p + "num_loops", 1))
        if n_layer_all * loops > MAX_LAYERS:
            raise ModelInfoError(f"{p}num_loops {loops} makes more than {MAX_LAYERS} layers")
        n_head, n_head_kv, n_ff = n_head * loops, n_head_kv * loops, n_ff * loops
        n_layer_all *= loops
    n_layer = n_layer_all - n_nextn
    n_embd = _get_int(meta, p + "embedding_length", 0)
    head_k = head_v = 0
    if n_head[0] > 0:
        head_k = _get_int(meta, p + "attention.key_length", n_embd // n_head[0])
        head_v = _get_int(meta, p + "attention.value_length", n_embd // n_head[0])
    head_k_swa = _get_int(meta, p + "attention.key_length_swa", head_k)
    head_v_swa = _get_int(meta, p + "attention.value_length_swa", head_v)
    is_mla = (
        _get_int(meta, p + "attention.key_length_mla", 0) != 0
        and _get_int(meta, p + "attention.value_length_mla", 0) != 0
    )
    window_key = p + "attention.sliding_window"
    window_found = window_key in meta
    window = _get_int(meta, window_key, 0)

    kv_exact = known and arch not in SPECIAL_CACHE_ARCHITECTURES
    memoryless = arch in MEMORYLESS_ARCHITECTURES
    swa_pattern_unknown = False
    chunked = False

    # Sliding window: swa_type and is_swa per layer, as load_arch_hparams sets them.
    is_swa = [False] * n_layer_all
    n_swa = 0
    rule = SWA_RULES.get(arch)
    if rule is not None and not (rule.optional and window <= 0):
        if arch == "exaone4" and n_layer != 64:
            pass  # src/models/exaone4.cpp: only the 32B model (64 layers) uses SWA
        elif arch == "llama4" and window_found and window == 0:
            pass  # src/models/llama4.cpp: a window of 0 turns chunked attention off
        else:
            if rule.default_window is None and rule.forced_window is None and not window_found:
                raise ModelInfoError(f"{window_key} missing (llama.cpp requires it for {arch})")
            n_swa = rule.forced_window or (window if window_found else rule.default_window) or 0
            is_swa = _swa_pattern(meta, p, n_layer, n_layer_all, rule)
            chunked = rule.chunked
    elif arch == "deepseek4":
        n_swa = _get_int(meta, window_key)
        is_swa = [True] * n_layer_all  # set_swa_pattern(0) plus the MTP layers
    elif not known and window > 0:
        n_swa = window
        value = meta.get(p + "attention.sliding_window_pattern")
        if isinstance(value, list):
            is_swa = _swa_pattern(meta, p, n_layer, n_layer_all, SwaRule(None))
        elif isinstance(value, int) and not isinstance(value, bool):
            is_swa = _set_swa_pattern(value, False, n_layer, n_layer_all)
        else:
            swa_pattern_unknown = True
            kv_exact = False
    # (lfm2's window is set below, once its recurrent layers are known; phi3 disables its SWA.)

    # Recurrent layers (is_recr) and which layers the attention cache holds (create_memory's filters).
    recurrent_arch = arch in RECURRENT_ARCHITECTURES
    hybrid_arch = arch in HYBRID_ARCHITECTURES
    if not known:
        has_state = any(k.startswith(p + group) for k in meta for group in RECURRENT_KEY_GROUPS)
        if has_state:
            hybrid_arch = (
                any(n_head_kv[:n_layer])
                or p + "attention.recurrent_layers" in meta
                or p + "full_attention_interval" in meta
            )
            recurrent_arch = not hybrid_arch
    is_recr = [recurrent_arch] * n_layer_all
    if hybrid_arch:
        if arch == "falcon-h1":
            is_recr = [True] * n_layer_all
        elif arch in ("nemotron_h", "nemotron_h_moe"):
            is_recr = [il < n_layer and n_head_kv[il] == 0 and n_ff[il] == 0 for il in range(n_layer_all)]
        elif (
            arch in INTERVAL_HYBRIDS
            or p + "attention.recurrent_layers" in meta
            or (not known and p + "full_attention_interval" in meta)
        ):
            listed = meta.get(p + "attention.recurrent_layers")
            if listed is not None:
                is_recr = [bool(v) for v in _per_layer(meta, p + "attention.recurrent_layers", n_layer_all, 0)]
            else:
                interval = _get_int(meta, p + "full_attention_interval", INTERVAL_HYBRIDS.get(arch, 4)) or 1
                is_recr = [il < n_layer and (il + 1) % interval != 0 for il in range(n_layer_all)]
        elif arch == "deepseek4":
            is_recr = [False] * n_layer_all
        elif arch == "glm5-next":
            is_recr = [n_head_kv[il] == 0 for il in range(n_layer_all)]
        else:  # jamba, plamo2, granitehybrid, lfm2, lfm2moe, kimi-*, bailingmoe3: a layer without KV heads
            is_recr = [il < n_layer and n_head_kv[il] == 0 for il in range(n_layer_all)]
    if arch == "lfm2" and window_found and window > 0:
        n_swa = window
        is_swa = [il < n_layer and not is_recr[il] for il in range(n_layer_all)]

    def in_kv(il: int) -> bool:
        if memoryless or recurrent_arch:
            return False
        if hybrid_arch:
            if arch == "falcon-h1":
                return True
            if arch in ("nemotron_h", "nemotron_h_moe"):
                return not is_recr[il] and n_ff[il] == 0
            if arch in INTERVAL_HYBRIDS or arch == "glm5-next":
                return il < n_layer and not is_recr[il]
            return not is_recr[il]
        # gemma3n / gemma4: only the first n_layer_kv_from_start layers own a cache, the rest reuse one.
        if arch == "gemma3n" and il >= 20:
            return False
        if arch == "gemma4" and il >= n_layer_all - _get_int(meta, p + "attention.shared_kv_layers", 0):
            return False
        # MTP layers are not attended by the trunk (unless graniteswitch repurposes them as its router layer).
        return not (n_nextn > 0 and n_layer > 0 and arch != "graniteswitch" and il >= n_layer)

    kv_layers = []
    for il in range(n_layer_all):
        if not in_kv(il):
            continue
        swa = is_swa[il] and n_swa > 0
        k = (head_k_swa if is_swa[il] else head_k) * n_head_kv[il]
        v = 0 if is_mla else (head_v_swa if is_swa[il] else head_v) * n_head_kv[il]
        kv_layers.append(KvLayer(il, k, v, swa))

    hybrid = hybrid_arch
    if memoryless:
        kind = MemoryKind.FULL
    elif recurrent_arch or hybrid_arch:
        kind = MemoryKind.RECURRENT
    elif n_swa > 0 and (any(is_swa) or swa_pattern_unknown):
        kind = MemoryKind.SLIDING_WINDOW
    else:
        kind = MemoryKind.FULL
    if kind is MemoryKind.FULL or (kind is MemoryKind.RECURRENT and not any(is_swa)):
        n_swa = 0
    return ModelMemory(
        architecture=arch,
        kind=kind,
        sliding_window=n_swa or None,
        n_layers=n_layer,
        hybrid=hybrid,
        kv_layers=tuple(kv_layers),
        swa_pattern_unknown=swa_pattern_unknown,
        chunked=chunked and kind is MemoryKind.SLIDING_WINDOW,
        n_ctx_train=n_ctx_train,
        memoryless=memoryless,
        recurrent_layers=sum(is_recr[:n_layer_all]) if (recurrent_arch or hybrid_arch) else 0,
        kv_exact=kv_exact,
    )


def read_model_memory(path: str | os.PathLike[str]) -> ModelMemory:
    """What kind of memory the GGUF model at ``path`` has; raises :class:`ModelInfoError` with a one-line reason."""
    meta = read_gguf_metadata(path)
    try:
        return model_memory_from_metadata(meta)
    except ModelInfoError as exc:
        raise ModelInfoError(f"{os.fspath(path)}: {exc}") from None


# --------------------------------------------------------------------------------------------------------------
# KV cache size
# --------------------------------------------------------------------------------------------------------------

#: llama_context pads the context (and, without a unified cache, each sequence's share) to 256 cells, and
#: llama_kv_cache_iswa pads its SWA cache to 256 (llama.cpp issue 17037).
CTX_PAD = 256
#: llama-server's default -b: the logical batch, which caps the physical batch (-ub).
DEFAULT_N_BATCH = 2048
#: llama-server's slot count when -np is not given (b11434: "auto" = 4 slots sharing one unified cache).
AUTO_SLOTS = 4


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def llama_server_slots(parallel: int | None, kv_unified: bool | None = None) -> tuple[int, bool]:
    """(slots, unified KV cache) for llama-server b11434 given ``-np`` (None when absent, or -1 = auto) and
    ``-kvu``/``-no-kvu`` (None when absent): an automatic slot count means 4 slots and a unified cache
    (tools/server/server.cpp), an explicit one a cache split per slot unless -kvu says otherwise."""
    if parallel is None or parallel < 0:
        return AUTO_SLOTS, True if kv_unified is None else kv_unified
    return parallel, bool(kv_unified)


def kv_cache_bytes(  # noqa: PLR0913 - llama-server's KV-cache settings, one keyword each
    memory: ModelMemory,
    n_ctx: int,
    n_seq: int,
    *,
    swa_full: bool,
    n_ubatch: int = 512,
    bytes_per_element: float = 2.0,
    unified: bool = False,
    flash_attn: bool = True,
) -> int:
    """Bytes of llama-server's KV cache for this model: the sum of what it logs as ``llama_kv_cache: size = ...``
    (for an SWA model, once for the non-SWA cache and once for the SWA cache).

    ``n_ctx`` is ``-c`` (0: the model's training context), ``n_seq`` the slot count, ``unified`` whether the
    slots share one cache (``-kvu``; llama-server b11434 turns it on when -np is not given, see
    :func:`llama_server_slots`), ``n_ubatch`` the physical batch (``-ub``, capped by ``-b``), and
    ``bytes_per_element`` that of ``-ctk``/``-ctv`` (2 for f16; q8_0 is 34/32). ``flash_attn=False`` (``-fa
    off``) stores V transposed, padded to the widest layer's V on models whose layers differ.

    Counted as b11434 does (llama_context, llama_kv_cache_iswa): the context is padded to 256 cells, split
    into ``n_seq`` streams padded to 256 each unless unified; the SWA cache holds
    ``pad256(min(cells, n_swa * (n_seq if unified else 1) + n_ubatch))`` cells per stream, or as many as the
    full cache with ``--swa-full``. Recurrent state (``llama_memory_recurrent``) is not included: it is 0 for a
    pure recurrent model, the attention layers' K/V for a hybrid. For ``memory.kv_exact == False`` models the
    result leaves out caches of other kinds (sparse-attention indexers) and is a lower bound.
    """
    if not memory.kv_layers:
        return 0
    if n_seq < 1:
        raise ValueError(f"n_seq must be at least 1, got {n_seq}")
    requested = n_ctx if n_ctx > 0 else memory.n_ctx_train
    if requested <= 0:
        raise ValueError("n_ctx is 0 and the model has no context_length")
    n_ubatch = max(1, min(n_ubatch, DEFAULT_N_BATCH, requested))
    padded = _pad(requested, CTX_PAD)
    if unified:
        cells, streams = padded, 1
    else:
        cells, streams = _pad(padded // n_seq, CTX_PAD), n_seq
    swa_cells = cells
    if memory.sliding_window and not swa_full:
        swa_cells = _pad(min(cells, memory.sliding_window * (n_seq if unified else 1) + n_ubatch), CTX_PAD)
    v_max = max(layer.v for layer in memory.kv_layers)
    elements = 0
    for layer in memory.kv_layers:
        v = layer.v if flash_attn or layer.v == 0 else v_max
        elements += (layer.k + v) * (swa_cells if layer.swa else cells)
    return round(elements * streams * bytes_per_element)


def model_memory(path: str | None) -> ModelMemory | None:
    """The model's memory kind from its GGUF header, or None (one line) when it cannot be read."""
    if not path:
        return None
    try:
        return read_model_memory(path)
    except (ModelInfoError, OSError) as exc:
        log.debug("model memory of %s unknown: %s", path, exc)
        return None
