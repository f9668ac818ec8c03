"""A slot file's Signature says whether a llama-server restores it: equal Signatures ⇔ restored, on the real
llama-server, across the settings a user changes (-np with and without --kv-unified, -c, -fa, -ctk/-ctv,
--swa-full) on full-attention, hybrid and sliding-window models.

Each configuration's llama-server starts twice (one at a time, to keep processes few): once to save a slot
holding a short prompt, once to restore every configuration's save of the same model into its slot 0.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from slotkeeper.store.statefile import SEQ_MAGIC, StateFileError, read_header
from slotkeeper.store.statelayout import KvSection, RecurrentSection, Signature, read_signature
from slotkeeper.testing.harness import PlainServer, clean_env, free_port, http_call
from slotkeeper.testing.tinymodel import PRESETS, TinyModelSpec, write_tiny_model

# A llama with 64-wide heads: q8_0 K and V need the head size to be a multiple of their 32-element block.
WIDE_LLAMA = TinyModelSpec(seed=1, width=128, n_heads=2, n_kv_heads=1)
SPECS = {"llama": WIDE_LLAMA, "qwen35": PRESETS["qwen35"], "gemma3": PRESETS["gemma3"]}
BASE = ("-t", "2", "--no-warmup")
PROMPT = "The quick brown fox jumps over the lazy dog"


@dataclass(frozen=True)
class Config:
    name: str
    model: str  # a key of SPECS
    args: tuple[str, ...]


CONFIGS = (
    Config("llama", "llama", ("-c", "512")),
    Config("llama-c1024", "llama", ("-c", "1024")),
    Config("llama-np2", "llama", ("-c", "1024", "-np", "2")),
    Config("llama-np2-unified", "llama", ("-c", "1024", "-np", "2", "--kv-unified")),
    Config("llama-fa-off", "llama", ("-c", "512", "-fa", "off")),
    Config("llama-fa-on", "llama", ("-c", "512", "-fa", "on")),
    Config("llama-q8", "llama", ("-c", "512", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0")),
    Config("llama-q8k", "llama", ("-c", "512", "-ctk", "q8_0")),
    Config("qwen35", "qwen35", ("-c", "512")),
    Config("qwen35-c1024", "qwen35", ("-c", "1024")),
    Config("qwen35-np2", "qwen35", ("-c", "1024", "-np", "2")),
    Config("qwen35-fa-off", "qwen35", ("-c", "512", "-fa", "off")),
    Config("gemma3", "gemma3", ("-c", "512")),
    Config("gemma3-swa-full", "gemma3", ("-c", "512", "--swa-full")),
    Config("gemma3-np2", "gemma3", ("-c", "1024", "-np", "2")),
    Config("gemma3-fa-off", "gemma3", ("-c", "512", "-fa", "off")),
)


@contextmanager
def running(binary: str, model: Path, args: tuple[str, ...], saves: Path, log: Path) -> Iterator[int]:
    """A plain llama-server saving to and restoring from `saves`, stopped on leaving; yields its port."""
    port = free_port()
    server = PlainServer(
        binary, ["-m", str(model), *BASE, *args, "--slot-save-path", str(saves)], port, log, clean_env()
    )
    try:
        server.wait_ready()
        yield port
    finally:
        server.stop()


def save_slot(port: int, filename: str) -> None:
    """Slot 0 holding a short prompt and one decoded token, saved."""
    reply = http_call(port, "POST", "/completion", {"prompt": PROMPT, "n_predict": 1, "id_slot": 0})
    assert reply.status == 200, reply.body
    reply = http_call(port, "POST", "/slots/0?action=save", {"filename": filename})
    assert reply.status == 200, reply.body


@dataclass
class Matrix:
    saves: Path
    signatures: dict[str, Signature]
    restored: dict[tuple[str, str], int]  # (file's config, restoring server's config) -> status


@pytest.fixture(scope="module")
def matrix(llama_server, tmp_path_factory) -> Matrix:
    root = tmp_path_factory.mktemp("statelayout")
    models = {name: write_tiny_model(root / f"{name}.gguf", spec) for name, spec in SPECS.items()}
    saves = root / "saves"
    saves.mkdir()
    for config in CONFIGS:
        with running(llama_server, models[config.model], config.args, saves, root / f"{config.name}-save.log") as port:
            save_slot(port, f"{config.name}.bin")
    restored: dict[tuple[str, str], int] = {}
    for config in CONFIGS:
        with running(llama_server, models[config.model], config.args, saves, root / f"{config.name}.log") as port:
            for other in CONFIGS:
                if other.model == config.model:
                    reply = http_call(port, "POST", "/slots/0?action=restore", {"filename": f"{other.name}.bin"})
                    restored[other.name, config.name] = reply.status
    signatures = {config.name: read_signature(saves / f"{config.name}.bin") for config in CONFIGS}
    return Matrix(saves, signatures, restored)


@pytest.mark.parametrize("model", list(SPECS))
def test_equal_signatures_are_exactly_the_files_a_server_restores(matrix, model):
    """For every pair of configurations of one model: the server of one restores the other's file (200, not
    400) exactly when the two files' Signatures are equal."""
    wrong = []
    for (saved, restoring), status in matrix.restored.items():
        if SPECS_OF[saved] != model:
            continue
        assert status in (200, 400), (saved, restoring, status)
        equal = matrix.signatures[saved] == matrix.signatures[restoring]
        if equal != (status == 200):
            why = matrix.signatures[saved].differences(matrix.signatures[restoring]) or "equal"
            wrong.append(f"{saved} -> {restoring}: restore {status}, signatures {why}")
    assert not wrong, "\n".join(wrong)


SPECS_OF = {config.name: config.model for config in CONFIGS}


def test_what_the_signatures_tell_apart(matrix):
    """The settings that change a file's layout, and those that do not (so the matrix above tests both)."""
    sig = matrix.signatures
    assert sig["llama"] == sig["llama-c1024"] == sig["llama-np2-unified"], "-c and a unified -np 2 keep the layout"
    assert sig["llama"] == sig["llama-fa-on"], "flash attention is on by default on this CPU"
    assert sig["llama"] != sig["llama-np2"], "-np 2 without --kv-unified: two streams"
    assert sig["llama"] != sig["llama-fa-off"], "without flash attention V is stored transposed"
    assert sig["llama"] != sig["llama-q8"] != sig["llama-q8k"]
    assert sig["gemma3"] == sig["gemma3-swa-full"], "--swa-full changes the window cache's size, not its rows"
    assert [s.kind for s in (sig["llama"], sig["qwen35"], sig["gemma3"])] == ["kv", "hybrid", "iswa"]
    assert all(s.version == 4 for s in sig.values())


def test_a_signature_holds_what_the_loader_compares(matrix):
    """Field by field, for one full-attention file with quantized K and V and one hybrid file."""
    (kv,) = matrix.signatures["llama-q8"].sections
    assert isinstance(kv, KvSection)
    assert (kv.n_stream, kv.v_trans, kv.n_layer, kv.cell_ext) == (1, False, 2, False)
    assert kv.n_rot_k and kv.n_rot_v, "a quantized cache is rotated (version 4 writes by how much)"
    assert {(r.type, r.size) for r in kv.k + kv.v} == {(8, 68)}, "q8_0 (ggml type 8): 64 values in 68 bytes"
    (vt,) = matrix.signatures["llama-fa-off"].sections
    assert isinstance(vt, KvSection) and vt.v_trans and {(r.type, r.size, r.width) for r in vt.v} == {(1, 2, 64)}
    attention, recurrent = matrix.signatures["qwen35"].sections
    assert isinstance(attention, KvSection) and isinstance(recurrent, RecurrentSection)
    assert attention.cell_ext, "qwen35's M-RoPE cells carry their 2D position"
    assert recurrent.n_layer == 4 and len(recurrent.r) == len(recurrent.s) == 4 - (attention.n_layer or 0)


def test_a_cut_or_padded_file_is_refused(matrix, tmp_path):
    """A file cut anywhere (in its header, its tokens, a layer's rows, the last byte) or with bytes after its
    end: StateFileError, never a Signature."""
    for name in ("llama", "qwen35", "gemma3"):
        data = (matrix.saves / f"{name}.bin").read_bytes()
        tokens_end = 12 + 4 * len(read_header(matrix.saves / f"{name}.bin").token_ids)
        for cut in (5, 12, tokens_end - 1, tokens_end + 3, len(data) // 2, len(data) - 1):
            broken = tmp_path / f"{name}-{cut}.bin"
            broken.write_bytes(data[:cut])
            with pytest.raises(StateFileError):
                read_signature(broken)
        padded = tmp_path / f"{name}-padded.bin"
        padded.write_bytes(data + b"\0" * 4)
        with pytest.raises(StateFileError):
            read_signature(padded)
    other = tmp_path / "not-a-slot-file.bin"
    other.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(StateFileError, match="sequence state file"):
        read_signature(other)


def test_reading_a_large_file_reads_only_its_headers(matrix, tmp_path):
    """A file of a million cells (about 530 MB, sparse: only its headers written) reads in milliseconds and
    has the Signature of the small file it copies the layout of."""
    small = read_signature(matrix.saves / "llama.bin")
    (kv,) = small.sections
    assert isinstance(kv, KvSection) and not kv.v_trans and kv.n_layer == 2
    cells = 1_000_000
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.write(struct.pack("<III", SEQ_MAGIC, small.version, 1) + struct.pack("<i", 1))
        f.write(struct.pack("<II", 1, cells) + struct.pack("<iIi", 0, 1, 0))  # n_stream, cell_count, first cell
        f.seek((cells - 2) * 12, os.SEEK_CUR)
        f.write(struct.pack("<iIi", cells - 1, 1, 0))  # the last cell
        f.write(struct.pack("<IIII", 0, kv.n_layer, kv.n_rot_k or 0, kv.n_rot_v or 0))
        for rows in kv.k + kv.v:
            f.write(struct.pack("<iQ", rows.type, rows.size))
            f.seek(cells * rows.size, os.SEEK_CUR)
        f.truncate()
    assert big.stat().st_size > 500_000_000
    started = time.monotonic()
    assert read_signature(big) == small
    assert time.monotonic() - started < 0.1


def test_an_older_llama_servers_file_differs_by_its_version_alone_and_is_refused(
    llama_server, llama_server_b11349, matrix, tmp_path
):
    """b11349 writes format version 3: the same sections as b11434's version 4 but for the rotation fields it
    lacks. b11434 refuses it (400), and b11349 refuses b11434's file: the Signatures say so."""
    model = write_tiny_model(tmp_path / "llama.gguf", WIDE_LLAMA)
    saves = tmp_path / "saves"
    saves.mkdir()
    args = ("-c", "512")
    with running(llama_server_b11349, model, args, saves, tmp_path / "b11349.log") as port:
        props = http_call(port, "GET", "/props")
        assert props.status == 200 and "default_generation_settings" in props.body, props.body
        save_slot(port, "old.bin")
        shutil.copy(matrix.saves / "llama.bin", saves / "new.bin")
        assert http_call(port, "POST", "/slots/0?action=restore", {"filename": "new.bin"}).status == 400
        assert http_call(port, "POST", "/slots/0?action=restore", {"filename": "old.bin"}).status == 200
    assert read_header(saves / "old.bin").version == 3
    old, new = read_signature(saves / "old.bin"), matrix.signatures["llama"]
    assert old.version == 3 and old != new
    assert old.differences(new) == ("format version 3 vs 4",)
    (old_kv,), (new_kv,) = old.sections, new.sections
    assert isinstance(old_kv, KvSection) and isinstance(new_kv, KvSection)
    assert (old_kv.n_rot_k, old_kv.n_rot_v) == (None, None), "version 3 has no rotation fields"
    assert dataclasses.replace(old_kv, n_rot_k=0, n_rot_v=0) == new_kv, "else the same layout"
    with running(llama_server, model, args, saves, tmp_path / "b11434.log") as port:
        assert http_call(port, "POST", "/slots/0?action=restore", {"filename": "old.bin"}).status == 400
