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

Only imported by tests and by the ``demo`` command (needs ``numpy`` and ``gguf``), never by
the daemon.

Command line::

    python -m slotkeeper.testing.tinymodel OUT.gguf [--layers N --width N --heads N
        --kv-heads N --ff N --f16 --seed N --ctx N --name NAME --preset e]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Sequence

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

__all__ = [
    "TinyModelSpec",
    "BENCH_MODEL_E",
    "PRESETS",
    "write_tiny_model",
    "vocab_tokens",
    "BOS_ID",
    "EOS_ID",
    "main",
]

ARCH = "llama"

#: Token ids. Bytes first (id == byte value) so a byte's token id is obvious in tests.
N_BYTE_TOKENS = 256
BOS_ID = 256
EOS_ID = 257
BOS_TEXT = "<|startoftext|>"
EOS_TEXT = "<|endoftext|>"  # a spelling llama.cpp recognizes as end-of-generation (else it warns)

# gguf TokenType values (gguf.TokenType), kept here so the vocabulary needs no gguf import.
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3

#: Letters whose pairs get merged tokens (the most frequent English letters).
_PAIR_LETTERS = "etaoinshrdlcumwf"

# Weight scales (see the module docstring for why they are not plain 1/sqrt(fan_in)).
_QK_SCALE = 2.5  # q and k per-component std ~2.5 -> attention logits std ~6: sharp attention
_ATTN_OUT_SCALE = 1.5  # attention writes about as much into the residual as the embedding holds
_FFN_DOWN_SCALE = 0.5
_BAD_TOKEN_BIAS = -1000.0  # column-0 weight of tokens that must never be sampled
_CONST_DIM_VALUE = 1.0


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and identity of a tiny model; equal specs give byte-identical files.

    ``context_length`` is the trained context written into the file: llama-server caps
    each slot's context at it, so it defaults to 32768 to let tests use long prompts.
    """

    n_layers: int = 2
    width: int = 64
    """Embedding length (``llama.embedding_length``)."""
    n_heads: int = 4
    n_kv_heads: int = 4
    """Fewer KV heads than heads (GQA) shrinks the KV cache and the slot files."""
    ff: int | None = None
    """Feed-forward length; ``None`` means llama-style 8/3 * width rounded up to 32."""
    f16: bool = False
    """Matrices (embeddings, projections, output head) in f16 instead of f32; norms stay f32."""
    seed: int = 0
    context_length: int = 32768
    name: str = "slotkeeper-tiny"

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.n_layers < 1:
            problems.append(f"n_layers must be >= 1, got {self.n_layers}")
        if self.width < 8:
            problems.append(f"width must be >= 8, got {self.width}")
        if self.n_heads < 1 or self.width % self.n_heads:
            problems.append(f"width {self.width} must be a positive multiple of n_heads {self.n_heads}")
        elif (self.width // self.n_heads) % 2:
            problems.append(f"head size width/n_heads = {self.width // self.n_heads} must be even (RoPE)")
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}")
        if self.ff is not None and self.ff < 1:
            problems.append(f"ff must be >= 1, got {self.ff}")
        if self.context_length < 1:
            problems.append(f"context_length must be >= 1, got {self.context_length}")
        if not (0 <= self.seed < 2**63):
            problems.append(f"seed must be in [0, 2**63), got {self.seed}")
        if not self.name:
            problems.append("name must not be empty")
        if problems:
            raise ValueError("invalid TinyModelSpec: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.width // self.n_heads

    @property
    def ff_length(self) -> int:
        """The feed-forward length actually written (``ff`` or its default)."""
        if self.ff is not None:
            return self.ff
        return -(-8 * self.width // (3 * 32)) * 32

    @property
    def n_vocab(self) -> int:
        return len(vocab_tokens()[0])


#: Benchmark model "E": ~44 MB f16, 8 layers x 512 wide, GQA with one KV head (small KV
#: cache and slot files). A ~7,500-token prompt takes several seconds to prefill on 2 CPU
#: cores, which makes a restored slot cache clearly visible in timings.
BENCH_MODEL_E = TinyModelSpec(
    n_layers=8, width=512, n_heads=8, n_kv_heads=1, f16=True, name="slotkeeper-bench-e"
)

#: Named specs for the ``--preset`` option.
PRESETS: dict[str, TinyModelSpec] = {"tiny": TinyModelSpec(), "e": BENCH_MODEL_E}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table.

    llama.cpp's ``gpt2`` tokenizer looks byte tokens up by this spelling, so the 256 byte
    tokens must use it for every input byte to be representable.
    """
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_Vocab = tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...], tuple[bool, ...]]
_VOCAB_CACHE: _Vocab | None = None


def vocab_tokens() -> _Vocab:
    """Return ``(tokens, token_types, merges, allowed)`` of the fixed tiny vocabulary.

    ``allowed[i]`` says whether the output head lets token ``i`` be generated: printable
    ASCII bytes and merged-letter tokens yes, control tokens and other bytes no. The
    vocabulary does not depend on the spec, so every tiny model tokenizes alike.
    """
    global _VOCAB_CACHE
    if _VOCAB_CACHE is not None:
        return _VOCAB_CACHE
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(N_BYTE_TOKENS)]
    types = [_TOKEN_NORMAL] * N_BYTE_TOKENS
    allowed = [0x20 <= b <= 0x7E for b in range(N_BYTE_TOKENS)]
    tokens += [BOS_TEXT, EOS_TEXT]
    types += [_TOKEN_CONTROL, _TOKEN_CONTROL]
    allowed += [False, False]

    space = b2u[ord(" ")]  # "Ġ"
    pairs: list[tuple[str, str]] = []
    pairs += [(space, c) for c in "abcdefghijklmnopqrstuvwxyz"]
    pairs += [(a, b) for a in _PAIR_LETTERS for b in _PAIR_LETTERS]
    pairs += [(space, c) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    pairs += [(space, c) for c in "0123456789"]
    merges = [f"{a} {b}" for a, b in pairs]
    tokens += [a + b for a, b in pairs]
    types += [_TOKEN_NORMAL] * len(pairs)
    allowed += [True] * len(pairs)
    assert len(set(tokens)) == len(tokens), "duplicate token spelling"
    _VOCAB_CACHE = (tuple(tokens), tuple(types), tuple(merges), tuple(allowed))
    return _VOCAB_CACHE


def _weights(spec: TinyModelSpec) -> list[tuple[str, np.ndarray[Any, Any]]]:
    """All tensors, in file order, as numpy arrays shaped (rows=out, cols=in).

    gguf stores numpy shape reversed, so a ``(n_out, n_in)`` array becomes the
    ``{n_in, n_out}`` ggml tensor llama.cpp expects.
    """
    import numpy as np

    rng = np.random.default_rng(spec.seed)
    mat_dtype = np.float16 if spec.f16 else np.float32
    d, ff = spec.width, spec.ff_length
    kv = spec.n_kv_heads * spec.head_dim
    _, _, _, allowed = vocab_tokens()
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


def _add_metadata(w: Any, spec: TinyModelSpec) -> None:
    """Write the hyperparameters and tokenizer keys (explicit key names and types)."""
    tokens, types, merges, _ = vocab_tokens()
    a = ARCH
    w.add_string("general.name", spec.name)
    w.add_uint32("general.file_type", 1 if spec.f16 else 0)  # MOSTLY_F16 / ALL_F32
    w.add_uint32(f"{a}.vocab_size", len(tokens))
    w.add_uint32(f"{a}.context_length", spec.context_length)
    w.add_uint32(f"{a}.embedding_length", spec.width)
    w.add_uint32(f"{a}.block_count", spec.n_layers)
    w.add_uint32(f"{a}.feed_forward_length", spec.ff_length)
    w.add_uint32(f"{a}.attention.head_count", spec.n_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", spec.n_kv_heads)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{a}.rope.dimension_count", spec.head_dim)
    w.add_float32(f"{a}.rope.freq_base", 10000.0)

    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt-2")
    w.add_array("tokenizer.ggml.tokens", list(tokens))
    w.add_array("tokenizer.ggml.token_type", list(types))  # int32 array, as llama.cpp reads it
    w.add_array("tokenizer.ggml.merges", list(merges))
    w.add_uint32("tokenizer.ggml.bos_token_id", BOS_ID)
    w.add_uint32("tokenizer.ggml.eos_token_id", EOS_ID)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", False)


def write_tiny_model(path: str | os.PathLike[str], spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the model described by ``spec`` to ``path`` and return the path.

    The file is written to a temporary file in the same directory and moved into place
    with :func:`os.replace`, so a concurrent reader (e.g. a llama-server being started by
    another test) sees either the old file or the complete new one, never half a file.
    Missing parent directories are created.
    """
    import gguf

    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = gguf.GGUFWriter(tmp, ARCH)
        try:
            _add_metadata(writer, spec)
            for name, arr in _weights(spec):
                writer.add_tensor(name, arr)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a model file is not a secret
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def _parse_args(argv: Sequence[str] | None) -> tuple[Path, TinyModelSpec]:
    p = argparse.ArgumentParser(
        prog="python -m slotkeeper.testing.tinymodel",
        description="Write a tiny random-weight GGUF model that llama-server can load.",
    )
    p.add_argument("out", type=Path, help="output .gguf path")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="start from a named spec (other options override its fields)")
    p.add_argument("--layers", type=int, dest="n_layers")
    p.add_argument("--width", type=int)
    p.add_argument("--heads", type=int, dest="n_heads")
    p.add_argument("--kv-heads", type=int, dest="n_kv_heads")
    p.add_argument("--ff", type=int)
    p.add_argument("--f16", action="store_true", default=None, help="f16 matrices")
    p.add_argument("--seed", type=int)
    p.add_argument("--ctx", type=int, dest="context_length", help="context_length written to the file")
    p.add_argument("--name", type=str)
    ns = p.parse_args(argv)
    overrides = {
        f.name: getattr(ns, f.name)
        for f in dataclasses.fields(TinyModelSpec)
        if getattr(ns, f.name, None) is not None
    }
    try:
        spec = dataclasses.replace(PRESETS[ns.preset], **overrides)
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
