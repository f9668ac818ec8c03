"""What a tiny model is: its shape, architecture, template and seed (``TinyModelSpec``), and the named presets.

Why apart from tinymodel.py: a spec is the model's identity (equal specs give byte-identical files, so a path
plus a spec is a stable cache key) and it is checked when made, before numpy or ``gguf`` is imported;
tinymodel.py turns one into a file.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tinyvocab import TEMPLATES, Vocab, family_vocab, template_family

__all__ = ["ARCHS", "BENCH_MODEL_E", "PRESETS", "TinyModelSpec"]

#: Architectures :func:`tinymodel.write_tiny_model` can write.
ARCHS: tuple[str, ...] = ("llama", "qwen35", "lfm2", "gemma3")
_DEFAULT_TEMPLATE: dict[str, str | None] = {"llama": None, "qwen35": "qwen35", "lfm2": "qwen35", "gemma3": "gemma"}


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
    arch: str = "llama"
    """One of :data:`ARCHS`: ``llama``, ``qwen35``, ``lfm2`` or ``gemma3``."""
    sliding_window: int = 128
    """Sliding-window size in tokens of gemma3's local layers (ignored by other archs)."""
    template: str | None = None
    """Embedded chat template, one of :data:`TEMPLATES`; ``None`` means the arch's default
    (``qwen35`` for qwen35 and lfm2, ``gemma`` for gemma3, no template for llama)."""

    def __post_init__(self) -> None:  # noqa: C901 - one check per constraint, all reported at once
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
        if self.arch not in ARCHS:
            problems.append(f"arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        elif self.arch in ("qwen35", "lfm2") and self.n_layers < 2:
            # llama.cpp b11434 aborts (GGML_ASSERT(buffer)) on a hybrid without recurrent layers
            problems.append(f"{self.arch} needs n_layers >= 2 (a recurrent and an attention layer)")
        if self.sliding_window < 1:
            problems.append(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.template is not None and self.template not in TEMPLATES:
            problems.append(f"template must be None or one of {', '.join(TEMPLATES)}, got {self.template!r}")
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
    def chat_template(self) -> str | None:
        """The template actually embedded (``template`` or the arch's default), or ``None``."""
        return self.template if self.template is not None else _DEFAULT_TEMPLATE[self.arch]

    @property
    def vocab(self) -> Vocab:
        """The vocabulary written: the tiny vocabulary plus the special tokens of the template's family."""
        return family_vocab(template_family(self.chat_template))

    @property
    def n_vocab(self) -> int:
        return len(self.vocab[0])


#: Benchmark model "E": ~44 MB f16, 8 layers x 512 wide, GQA with one KV head (small KV
#: cache and slot files). A ~7,500-token prompt takes several seconds to prefill on 2 CPU
#: cores, which makes a restored slot cache clearly visible in timings.
BENCH_MODEL_E = TinyModelSpec(n_layers=8, width=512, n_heads=8, n_kv_heads=1, f16=True, name="slotkeeper-bench-e")

#: Named specs for the ``--preset`` option.
PRESETS: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    "e": BENCH_MODEL_E,
    #: 3 delta-net layers + 1 full-attention layer, 64 wide, 4 value / 2 key heads (GQA).
    "qwen35": TinyModelSpec(
        arch="qwen35", n_layers=4, width=64, n_heads=4, n_kv_heads=2, name="slotkeeper-tiny-qwen35"
    ),
    #: conv, conv, attention, conv; 64 wide, GQA 4/2.
    "lfm2": TinyModelSpec(arch="lfm2", n_layers=4, width=64, n_heads=4, n_kv_heads=2, name="slotkeeper-tiny-lfm2"),
    #: 5 sliding-window layers (128 tokens) + 1 global layer, 64 wide, one KV head.
    "gemma3": TinyModelSpec(
        arch="gemma3", n_layers=6, width=64, n_heads=4, n_kv_heads=1, name="slotkeeper-tiny-gemma3"
    ),
}
