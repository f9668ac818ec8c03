"""Tiny random-weight GGUF models that a real llama.cpp ``llama-server`` loads and runs.

Why: slotkeeper's tests and its ``demo`` command need a real llama-server with a real
model so that slot save/restore, ``cache_n`` and output equality are exercised end to end,
but no model can be downloaded. These models are a few hundred KB to a few tens of MB,
are written in well under a second, and are built so that the checks slotkeeper cares
about are meaningful:

* The output depends on the whole context, not just the last token: the query/key
  projections are scaled up so attention is sharp, and the attention output is as large
  as the token embedding. A wrong, stale or foreign KV cache therefore changes the
  completion (with plain ``N(0, 1/fan_in)`` weights different prompts gave the same text).
* A completion always runs ``n_predict`` tokens: the output head carries a large negative
  bias for BOS/EOS (the only control tokens) and for every byte token that is not printable
  ASCII, so greedy sampling never stops early and ``content`` is plain ASCII. The llama
  architecture has no output bias tensor, so the bias is built from one constant hidden
  dimension (dimension 0): every token embedding holds ``1.0`` there, no layer writes to
  it (row 0 of ``attn_output``/``ffn_down`` is zero) and no layer reads it (the attention
  and FFN norm weights are zero there), so after the final RMS norm it is a positive
  constant-sign input that column 0 of ``output`` turns into a per-token bias.
* The same spec gives byte-identical files (seeded :class:`numpy.random.Generator`, no
  timestamps, fixed key and tensor order), so a model path plus a spec is a stable cache
  identity across runs. (NumPy does not promise identical random streams across NumPy
  versions; within one environment the output is identical.)

Format (known to load in llama.cpp b11434): architecture ``llama``, tokenizer
``gpt2``/``gpt-2`` with the 256 byte tokens spelled through GPT-2's byte-to-unicode table,
BOS and EOS as CONTROL tokens and a few hundred merged-letter tokens with their ``merges``
(llama.cpp refuses a ``gpt2`` vocabulary without merges). Norms are f32; matrices f32 or f16.

Other architectures (``TinyModelSpec.arch``), each with the same constant-dimension bias
(none of them has an output bias tensor either) and the same byte/merge vocabulary:

* ``qwen35`` -- the dense Qwen3.5 hybrid: gated delta-net (linear attention, recurrent
  state) layers with a gated full-attention layer every ``4`` layers (the last layer if
  there are fewer), interleaved M-RoPE on a quarter of each head, Q/K norms. The delta-net
  uses ``n_heads`` value heads and ``n_kv_heads`` key heads of ``head_dim`` each.
* ``lfm2`` -- LFM2: gated short-convolution layers (a 3-token causal conv, recurrent
  state) with a GQA attention layer every third layer (layers 2, 5, ...; the last layer if
  there are fewer than 3).
* ``gemma3`` -- Gemma 3: sliding-window attention (``sliding_window`` tokens) with the
  Gemma 3 5:1 local:global pattern (layer ``i`` is global when ``i % 6 == 5``; the last
  layer is always global), pre- and post-norms, GELU FFN, embeddings scaled by
  ``sqrt(width)`` inside llama.cpp (so the stored embeddings are ``1/sqrt(width)`` smaller).
  GGUF norm weights are used as plain multipliers by llama.cpp (the converter already
  folded Gemma's ``1 + w``), so the same zero-at-dimension-0 trick applies.

These models carry a chat template (``tokenizer.chat_template``) and the special tokens it
uses as single CONTROL/USER_DEFINED tokens, appended after the llama vocabulary:
``qwen35`` (the real Qwen3.5 template; ``<think>`` reasoning, ``enable_thinking``),
``qwen3`` (the real Qwen3 template) -- both with ``<|im_start|>``/``<|im_end|>`` and EOS/EOT
``<|im_end|>``, no BOS added -- or ``gemma`` (the Gemma 3 template) with
``<start_of_turn>``/``<end_of_turn>``, BOS ``<bos>``, EOS ``<eos>`` and EOT ``<end_of_turn>``.
``qwen35`` and ``lfm2`` default to ``qwen35``, ``gemma3`` to ``gemma``; ``llama`` has no
template unless one is asked for (so its file is unchanged). Every special token carries
the large negative output bias, so generated text stays printable ASCII and the model never
ends a turn or opens/closes a think block by itself.

The vocabulary and chat templates are ``tinyvocab``'s, the spec and its presets
``tinyspec``'s; this module writes the file (its weights and keys). Only imported by tests
and by the ``demo`` command (needs ``numpy`` and ``gguf``), never by the daemon.

Command line::

    python -m slotkeeper.testing.tinymodel OUT.gguf [--layers N --width N --heads N
        --kv-heads N --ff N --f16 --seed N --ctx N --name NAME --preset e
        --arch {llama,qwen35,lfm2,gemma3} --sliding-window N --template {qwen35,qwen3,gemma}]

``--arch A`` without ``--preset`` starts from the preset named ``A`` (if there is one).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .ggufwrite import write_gguf
from .tinymmproj import image_part, solid_png, write_tiny_mmproj
from .tinyspec import ARCHS, BENCH_MODEL_E, PRESETS, TinyModelSpec
from .tinyvocab import BOS_ID, EOS_ID, TEMPLATES, add_tokenizer, chat_template_text, vocab_tokens

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

__all__ = [
    "ARCHS",
    "BENCH_MODEL_E",
    "BOS_ID",
    "EOS_ID",
    "PRESETS",
    "TEMPLATES",
    "TinyModelSpec",
    "chat_template_text",
    "image_part",
    "main",
    "solid_png",
    "vocab_tokens",
    "write_tiny_mmproj",
    "write_tiny_model",
]

ARCH = "llama"
_DEFAULT_SPEC = TinyModelSpec()  # frozen: one instance is every call's default


# Weight scales (see the module docstring for why they are not plain 1/sqrt(fan_in)).
_QK_SCALE = 2.5  # q and k per-component std ~2.5 -> attention logits std ~6: sharp attention
_ATTN_OUT_SCALE = 1.5  # attention writes about as much into the residual as the embedding holds
_FFN_DOWN_SCALE = 0.5
_BAD_TOKEN_BIAS = -1000.0  # column-0 weight of tokens that must never be sampled
_CONST_DIM_VALUE = 1.0

# Architecture constants of the other families (the real models' values where they matter).
_QWEN35_FULL_ATTN_INTERVAL = 4
_QWEN35_CONV_KERNEL = 4
_LFM2_CONV_L_CACHE = 3
_LFM2_ATTN_EVERY = 3
_GEMMA3_SWA_PERIOD = 6


def _weights(spec: TinyModelSpec) -> list[tuple[str, np.ndarray[Any, Any]]]:
    """All tensors, in file order, as numpy arrays shaped (rows=out, cols=in).

    gguf stores numpy shape reversed, so a ``(n_out, n_in)`` array becomes the
    ``{n_in, n_out}`` ggml tensor llama.cpp expects.
    """
    if spec.arch != "llama":
        return _ARCH_WEIGHTS[spec.arch](spec)
    import numpy as np

    rng = np.random.default_rng(spec.seed)
    mat_dtype = np.float16 if spec.f16 else np.float32
    d, ff = spec.width, spec.ff_length
    kv = spec.n_kv_heads * spec.head_dim
    _, _, _, allowed = spec.vocab
    n_vocab = len(allowed)

    def normal(shape: tuple[int, int], std: float) -> np.ndarray[Any, Any]:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def mat(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return np.ascontiguousarray(a.astype(mat_dtype, copy=False))

    # Layer norms read every dimension but the constant one (see module docstring).
    in_norm = np.ones(d, dtype=np.float32)
    in_norm[0] = 0.0

    out: list[tuple[str, np.ndarray[Any, Any]]] = []
    embd = normal((n_vocab, d), 1.0)
    embd[:, 0] = _CONST_DIM_VALUE
    out.append(("token_embd.weight", mat(embd)))

    for i in range(spec.n_layers):
        p = f"blk.{i}."
        wq = normal((d, d), _QK_SCALE / d**0.5)
        wk = normal((kv, d), _QK_SCALE / d**0.5)
        wv = normal((kv, d), 1.0 / d**0.5)
        wo = normal((d, d), _ATTN_OUT_SCALE / d**0.5)
        wo[0, :] = 0.0  # never write to the constant dimension
        gate = normal((ff, d), 1.0 / d**0.5)
        up = normal((ff, d), 1.0 / d**0.5)
        down = normal((d, ff), _FFN_DOWN_SCALE / ff**0.5)
        down[0, :] = 0.0
        out += [
            (p + "attn_norm.weight", in_norm.copy()),
            (p + "attn_q.weight", mat(wq)),
            (p + "attn_k.weight", mat(wk)),
            (p + "attn_v.weight", mat(wv)),
            (p + "attn_output.weight", mat(wo)),
            (p + "ffn_norm.weight", in_norm.copy()),
            (p + "ffn_gate.weight", mat(gate)),
            (p + "ffn_up.weight", mat(up)),
            (p + "ffn_down.weight", mat(down)),
        ]

    out.append(("output_norm.weight", np.ones(d, dtype=np.float32)))
    head = normal((n_vocab, d), 1.0 / d**0.5)
    head[:, 0] = np.where(np.asarray(allowed), 0.0, _BAD_TOKEN_BIAS).astype(np.float32)
    out.append(("output.weight", mat(head)))
    return out


class _Init:
    """Seeded weight factory shared by the non-llama architectures.

    ``proj(n_out, n_in, scale, writes=True)`` is a projection whose output is added to the
    residual stream: its row 0 is zeroed so the constant dimension stays constant.
    ``in_norm`` is a norm weight that ignores the constant dimension (zero there).
    """

    def __init__(self, spec: TinyModelSpec) -> None:
        import numpy as np

        self.np = np
        self.rng = np.random.default_rng(spec.seed)
        self.mat_dtype = np.float16 if spec.f16 else np.float32
        self.d = spec.width
        _, _, _, allowed = spec.vocab
        self.allowed = np.asarray(allowed)
        self.n_vocab = len(allowed)

    def normal(self, shape: tuple[int, ...], std: float) -> np.ndarray[Any, Any]:
        return self.rng.standard_normal(shape, dtype=self.np.float32) * self.np.float32(std)

    def mat(self, a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return self.np.ascontiguousarray(a.astype(self.mat_dtype, copy=False))

    def f32(self, a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return self.np.ascontiguousarray(a.astype(self.np.float32, copy=False))

    def proj(self, n_out: int, n_in: int, scale: float = 1.0, writes: bool = False) -> np.ndarray[Any, Any]:
        a = self.normal((n_out, n_in), scale / n_in**0.5)
        if writes:
            a[0, :] = 0.0  # never write to the constant dimension
        return self.mat(a)

    def const(self, n: int, value: float) -> np.ndarray[Any, Any]:
        return self.np.full(n, value, dtype=self.np.float32)

    def in_norm(self, value: float = 1.0) -> np.ndarray[Any, Any]:
        w = self.const(self.d, value)
        w[0] = 0.0
        return w

    def embeddings(self, std: float = 1.0) -> np.ndarray[Any, Any]:
        embd = self.normal((self.n_vocab, self.d), std)
        embd[:, 0] = _CONST_DIM_VALUE * std
        return self.mat(embd)

    def ffn(self, p: str, ff: int) -> list[tuple[str, np.ndarray[Any, Any]]]:
        return [
            (p + "ffn_gate.weight", self.proj(ff, self.d)),
            (p + "ffn_up.weight", self.proj(ff, self.d)),
            (p + "ffn_down.weight", self.proj(self.d, ff, _FFN_DOWN_SCALE, writes=True)),
        ]

    def head(self) -> np.ndarray[Any, Any]:
        head = self.normal((self.n_vocab, self.d), 1.0 / self.d**0.5)
        head[:, 0] = self.np.where(self.allowed, 0.0, _BAD_TOKEN_BIAS).astype(self.np.float32)
        return self.mat(head)


def _qwen35_layout(spec: TinyModelSpec) -> tuple[int, list[bool]]:
    """``(full_attention_interval, is_recurrent per layer)``: at least one attention layer."""
    interval = min(_QWEN35_FULL_ATTN_INTERVAL, spec.n_layers)
    return interval, [(i + 1) % interval != 0 for i in range(spec.n_layers)]


def _qwen35_rope(spec: TinyModelSpec) -> tuple[int, list[int]]:
    """``(n_rot, mrope sections)``: a quarter of each head rotates, sections split 11:11:10."""
    n_rot = max(2, spec.head_dim // 4 // 2 * 2)
    half = n_rot // 2
    a = (half + 2) // 3
    b = min(a, half - a)
    return n_rot, [a, b, half - a - b, 0]


def _weights_qwen35(spec: TinyModelSpec) -> list[tuple[str, np.ndarray[Any, Any]]]:
    import numpy as np

    g = _Init(spec)
    d, hd = spec.width, spec.head_dim
    n_v, n_k = spec.n_heads, spec.n_kv_heads  # delta-net value heads / key heads
    key_dim, value_dim = hd * n_k, hd * n_v
    conv_dim = 2 * key_dim + value_dim
    _, recurrent = _qwen35_layout(spec)

    out: list[tuple[str, np.ndarray[Any, Any]]] = [("token_embd.weight", g.embeddings())]
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", g.in_norm()), (p + "post_attention_norm.weight", g.in_norm())]
        if recurrent[i]:
            # Gated delta net. Decay per token exp(ssm_a * softplus(alpha + dt)): heads range
            # from ~0.99 (memory of a few hundred tokens) to ~0.5 (a few tokens).
            a = -np.exp(np.linspace(np.log(0.01), np.log(1.0), n_v, dtype=np.float32))
            out += [
                (p + "attn_qkv.weight", g.proj(conv_dim, d)),
                (p + "attn_gate.weight", g.proj(value_dim, d)),
                (p + "ssm_conv1d.weight", g.f32(g.normal((conv_dim, _QWEN35_CONV_KERNEL), 0.5))),
                (p + "ssm_dt.bias", g.const(n_v, 0.0)),
                (p + "ssm_a", g.f32(a)),
                (p + "ssm_beta.weight", g.proj(n_v, d)),
                (p + "ssm_alpha.weight", g.proj(n_v, d)),
                (p + "ssm_norm.weight", g.const(hd, 1.0)),
                (p + "ssm_out.weight", g.proj(d, value_dim, _ATTN_OUT_SCALE, writes=True)),
            ]
        else:
            # Gated attention: q_proj yields query and a sigmoid gate per head (~0.5 on
            # average, hence the doubled output scale); Q/K norms make attention sharp.
            out += [
                (p + "attn_q.weight", g.proj(2 * hd * spec.n_heads, d)),
                (p + "attn_k.weight", g.proj(hd * spec.n_kv_heads, d)),
                (p + "attn_v.weight", g.proj(hd * spec.n_kv_heads, d)),
                (p + "attn_output.weight", g.proj(d, hd * spec.n_heads, 2 * _ATTN_OUT_SCALE, writes=True)),
                (p + "attn_q_norm.weight", g.const(hd, _QK_SCALE)),
                (p + "attn_k_norm.weight", g.const(hd, _QK_SCALE)),
            ]
        out += g.ffn(p, spec.ff_length)
    out += [("output_norm.weight", g.const(d, 1.0)), ("output.weight", g.head())]
    return out


def _lfm2_attention_layers(spec: TinyModelSpec) -> list[bool]:
    """Which layers are attention layers (every third, at least the last one)."""
    if spec.n_layers < _LFM2_ATTN_EVERY:
        return [i == spec.n_layers - 1 for i in range(spec.n_layers)]
    return [i % _LFM2_ATTN_EVERY == _LFM2_ATTN_EVERY - 1 for i in range(spec.n_layers)]


def _weights_lfm2(spec: TinyModelSpec) -> list[tuple[str, np.ndarray[Any, Any]]]:
    g = _Init(spec)
    d, hd = spec.width, spec.head_dim
    kv = hd * spec.n_kv_heads
    attention = _lfm2_attention_layers(spec)

    out: list[tuple[str, np.ndarray[Any, Any]]] = [("token_embd.weight", g.embeddings())]
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        out.append((p + "attn_norm.weight", g.in_norm()))  # operator_norm
        if attention[i]:
            out += [
                (p + "attn_q.weight", g.proj(d, d)),
                (p + "attn_k.weight", g.proj(kv, d)),
                (p + "attn_v.weight", g.proj(kv, d)),
                (p + "attn_output.weight", g.proj(d, d, _ATTN_OUT_SCALE, writes=True)),
                (p + "attn_q_norm.weight", g.const(hd, _QK_SCALE)),
                (p + "attn_k_norm.weight", g.const(hd, _QK_SCALE)),
            ]
        else:
            # in_proj -> (b, c, x); y = c * conv(b * x) over the last l_cache tokens.
            out += [
                (p + "shortconv.conv.weight", g.f32(g.normal((d, _LFM2_CONV_L_CACHE), _LFM2_CONV_L_CACHE**-0.5))),
                (p + "shortconv.in_proj.weight", g.proj(3 * d, d)),
                (p + "shortconv.out_proj.weight", g.proj(d, d, _ATTN_OUT_SCALE, writes=True)),
            ]
        out.append((p + "ffn_norm.weight", g.in_norm()))
        out += g.ffn(p, spec.ff_length)
    # LFM2's final norm is stored as "token_embd_norm" (llama.cpp's LLM_TENSOR_OUTPUT_NORM_LFM2).
    out += [("token_embd_norm.weight", g.const(d, 1.0)), ("output.weight", g.head())]
    return out


def _gemma3_swa_layers(spec: TinyModelSpec) -> list[bool]:
    """Gemma 3's 5 local : 1 global pattern; the last layer is always global."""
    n, k = spec.n_layers, _GEMMA3_SWA_PERIOD
    return [i % k != k - 1 and i != n - 1 for i in range(n)]


def _weights_gemma3(spec: TinyModelSpec) -> list[tuple[str, np.ndarray[Any, Any]]]:
    g = _Init(spec)
    d, hd = spec.width, spec.head_dim
    q, kv = hd * spec.n_heads, hd * spec.n_kv_heads

    # llama.cpp multiplies the embeddings by sqrt(width): store them that much smaller, so
    # the residual holds ~1 per dimension and exactly 1 in the constant dimension.
    out: list[tuple[str, np.ndarray[Any, Any]]] = [("token_embd.weight", g.embeddings(1.0 / d**0.5))]
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        # Post-norms set how much each block writes: attention ~1.5 per dimension, FFN ~0.5.
        out += [
            (p + "attn_norm.weight", g.in_norm()),
            (p + "attn_q.weight", g.proj(q, d)),
            (p + "attn_k.weight", g.proj(kv, d)),
            (p + "attn_v.weight", g.proj(kv, d)),
            (p + "attn_output.weight", g.proj(d, q, writes=True)),
            (p + "attn_q_norm.weight", g.const(hd, _QK_SCALE)),
            (p + "attn_k_norm.weight", g.const(hd, _QK_SCALE)),
            (p + "post_attention_norm.weight", g.in_norm(_ATTN_OUT_SCALE)),
            (p + "ffn_norm.weight", g.in_norm()),
        ]
        out += g.ffn(p, spec.ff_length)
        out.append((p + "post_ffw_norm.weight", g.in_norm(_FFN_DOWN_SCALE)))
    out += [("output_norm.weight", g.const(d, 1.0)), ("output.weight", g.head())]
    return out


_ARCH_WEIGHTS = {"qwen35": _weights_qwen35, "lfm2": _weights_lfm2, "gemma3": _weights_gemma3}


def _add_metadata(w: Any, spec: TinyModelSpec) -> None:
    """Write the hyperparameters and tokenizer keys (explicit key names and types)."""
    if spec.arch != "llama":
        _add_arch_metadata(w, spec)
        add_tokenizer(w, spec.chat_template)
        return
    a = ARCH
    _add_shape(w, spec, a, len(spec.vocab[0]))
    w.add_uint32(f"{a}.attention.head_count_kv", spec.n_kv_heads)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{a}.rope.dimension_count", spec.head_dim)
    w.add_float32(f"{a}.rope.freq_base", 10000.0)
    add_tokenizer(w, spec.chat_template)


def _add_shape(w: Any, spec: TinyModelSpec, a: str, n_vocab: int) -> None:
    """The keys every architecture's loader reads first, in the order all tiny models write them."""
    w.add_string("general.name", spec.name)
    w.add_uint32("general.file_type", 1 if spec.f16 else 0)  # MOSTLY_F16 / ALL_F32
    w.add_uint32(f"{a}.vocab_size", n_vocab)
    w.add_uint32(f"{a}.context_length", spec.context_length)
    w.add_uint32(f"{a}.embedding_length", spec.width)
    w.add_uint32(f"{a}.block_count", spec.n_layers)
    w.add_uint32(f"{a}.feed_forward_length", spec.ff_length)
    w.add_uint32(f"{a}.attention.head_count", spec.n_heads)


def _add_arch_metadata(w: Any, spec: TinyModelSpec) -> None:
    """Hyperparameters of qwen35 / lfm2 / gemma3 (the keys their llama.cpp loaders read)."""
    a = spec.arch
    _add_shape(w, spec, a, spec.n_vocab)
    if a == "qwen35":
        interval, _ = _qwen35_layout(spec)
        n_rot, sections = _qwen35_rope(spec)
        w.add_uint32(f"{a}.attention.head_count_kv", spec.n_kv_heads)
        w.add_uint32(f"{a}.attention.key_length", spec.head_dim)
        w.add_uint32(f"{a}.attention.value_length", spec.head_dim)
        w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
        w.add_uint32(f"{a}.rope.dimension_count", n_rot)
        w.add_array(f"{a}.rope.dimension_sections", sections)
        w.add_float32(f"{a}.rope.freq_base", 10_000_000.0)
        w.add_uint32(f"{a}.ssm.conv_kernel", _QWEN35_CONV_KERNEL)
        w.add_uint32(f"{a}.ssm.state_size", spec.head_dim)
        w.add_uint32(f"{a}.ssm.group_count", spec.n_kv_heads)
        w.add_uint32(f"{a}.ssm.time_step_rank", spec.n_heads)
        w.add_uint32(f"{a}.ssm.inner_size", spec.head_dim * spec.n_heads)
        w.add_uint32(f"{a}.full_attention_interval", interval)
    elif a == "lfm2":
        # LFM2 marks its conv layers by head_count_kv == 0.
        kv = [spec.n_kv_heads if att else 0 for att in _lfm2_attention_layers(spec)]
        w.add_array(f"{a}.attention.head_count_kv", kv)
        w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
        w.add_float32(f"{a}.rope.freq_base", 1_000_000.0)
        w.add_uint32(f"{a}.shortconv.l_cache", _LFM2_CONV_L_CACHE)
    elif a == "gemma3":
        swa = _gemma3_swa_layers(spec)
        w.add_uint32(f"{a}.attention.head_count_kv", spec.n_kv_heads)
        w.add_uint32(f"{a}.attention.key_length", spec.head_dim)
        w.add_uint32(f"{a}.attention.value_length", spec.head_dim)
        w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
        w.add_float32(f"{a}.rope.freq_base", 1_000_000.0)  # global layers
        w.add_float32(f"{a}.rope.freq_base_swa", 10_000.0)  # local layers
        w.add_uint32(f"{a}.attention.sliding_window", spec.sliding_window)
        # llama.cpp's default is the 6-layer period; write the pattern only when it differs
        # (fewer or a non-multiple of 6 layers, where the last layer is made global).
        k = _GEMMA3_SWA_PERIOD
        if swa != [i % k < k - 1 for i in range(spec.n_layers)]:
            w.add_array(f"{a}.attention.sliding_window_pattern", swa)
    else:  # pragma: no cover - guarded by TinyModelSpec
        raise AssertionError(a)


def write_tiny_model(path: str | os.PathLike[str], spec: TinyModelSpec = _DEFAULT_SPEC) -> Path:
    """Write the model described by ``spec`` to ``path`` and return the path.

    The file is written to a temporary file in the same directory and moved into place
    with :func:`os.replace`, so a concurrent reader (e.g. a llama-server being started by
    another test) sees either the old file or the complete new one, never half a file.
    Missing parent directories are created.
    """
    return write_gguf(path, spec.arch, lambda writer: _add_metadata(writer, spec), _weights(spec))


def _parse_args(argv: Sequence[str] | None) -> tuple[Path, TinyModelSpec]:
    p = argparse.ArgumentParser(
        prog="python -m slotkeeper.testing.tinymodel",
        description="Write a tiny random-weight GGUF model that llama-server can load.",
    )
    p.add_argument("out", type=Path, help="output .gguf path")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="start from a named spec (other options override its fields); "
        "default: the --arch preset if there is one, else 'tiny'",
    )
    p.add_argument("--arch", choices=ARCHS, help="model architecture")
    p.add_argument("--layers", type=int, dest="n_layers")
    p.add_argument("--width", type=int)
    p.add_argument("--heads", type=int, dest="n_heads")
    p.add_argument("--kv-heads", type=int, dest="n_kv_heads")
    p.add_argument("--ff", type=int)
    p.add_argument("--f16", action="store_true", default=None, help="f16 matrices")
    p.add_argument("--seed", type=int)
    p.add_argument("--ctx", type=int, dest="context_length", help="context_length written to the file")
    p.add_argument("--name", type=str)
    p.add_argument(
        "--sliding-window", type=int, dest="sliding_window", help="gemma3 sliding-window size in tokens (default 128)"
    )
    p.add_argument("--template", choices=TEMPLATES, help="embedded chat template (default: the arch's; llama has none)")
    ns = p.parse_args(argv)
    preset = ns.preset
    if preset is None:
        preset = ns.arch if ns.arch in PRESETS else "tiny"
    overrides = {
        f.name: getattr(ns, f.name) for f in dataclasses.fields(TinyModelSpec) if getattr(ns, f.name, None) is not None
    }
    try:
        spec = dataclasses.replace(PRESETS[preset], **overrides)
    except ValueError as e:
        p.error(str(e))
    return ns.out, spec


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: write one model and print ``PATH SIZE MB TIME s`` on one line."""
    out, spec = _parse_args(argv)
    import gguf  # noqa: F401  (import outside the timed part: the time is the write itself)
    import numpy  # noqa: F401

    t0 = time.perf_counter()
    path = write_tiny_model(out, spec)
    dt = time.perf_counter() - t0
    size_mb = path.stat().st_size / 1e6
    print(f"{path} {size_mb:.2f} MB {dt:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
