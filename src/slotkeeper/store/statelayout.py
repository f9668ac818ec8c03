"""What a slot file asks of the llama-server that restores it: its `Signature`, read from the file's headers.

Why: whether a saved chat can be restored by the running llama-server depends on more than its command line
(the llama.cpp version, -np with or without --kv-unified, -fa, -ctk/-ctv, the model's memory kind). Rather
than compare flags, slotkeeper reads what llama.cpp's loader itself compares, from a file the running server
saved (a probe: a slot holding one decoded token, saved and erased) and from each saved file: when the two
Signatures are equal, and the file's cells fit in a slot, the file loads as it is.

The format (llama.cpp's `llama_state_seq_save_file`): magic, version, token count and tokens (statefile.py
reads those), then what `llama_memory_i::state_write` writes for one sequence, one section per memory:

* a KV cache (llama-kv-cache.cpp): u32 n_stream; per stream u32 cell_count and, when not 0, the cells'
  metadata (i32 pos, u32 n_seq_id, a 12-byte llama_kv_cell_ext for M-RoPE or PLE models, the seq ids), then
  u32 v_trans, u32 n_layer, (version 4 on) u32 n_rot_k and n_rot_v, per layer i32 K type, u64 K row size and
  the rows; then per layer the V type and row size (or, transposed, u32 element size and u32 n_embd_v_gqa)
  and the rows; MLA caches have no V.
* a recurrent memory (llama-memory-recurrent.cpp): u32 cell_count, the cells' metadata (i32 pos, u32
  n_seq_id, seq ids), u32 s_trans, u32 n_layer, per recurrent layer i32 R type, u64 R row size and the rows,
  then the same for S.
* iswa: the full-attention KV cache, then the sliding-window one; hybrid: the KV cache, then the recurrent
  memory; hybrid-iswa: both KV caches, then the recurrent memory.

The file does not say which memory wrote it, nor whether cells carry the ext, nor how many layers are
recurrent: the reader tries each reading in turn and keeps the one that validates and ends exactly at the
end of the file. It reads only headers: each layer's rows are seeked over, so a file of hundreds of MB costs
a few hundred small reads.

Not read (the loader compares them too, but they are no part of what a server is): the cell count (it must
fit in the slot's context) and the tokens.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

from .statefile import HEADER, SEQ_MAGIC, StateFileError

__all__ = ["CellData", "KvSection", "RecurrentSection", "RowRun", "Rows", "Signature", "read_layout", "read_signature"]

#: Versions of the seq-state format this reader knows: 3 (b11349 and before), 4 (n_rot_k, n_rot_v added).
KNOWN_VERSIONS = (3, 4)
ROTATION_VERSION = 4  # the first version with the KV sections' n_rot_k and n_rot_v
CELL_EXT_SIZE = 12  # llama_kv_cell_ext: i32 x, i32 y, i32 tok
MAX_LAYERS = 512  # LLAMA_MAX_LAYERS
MAX_STREAMS = 256  # LLAMA_MAX_SEQ
MAX_GGML_TYPE = 64  # GGML_TYPE_COUNT is 43 in b11434; room for a few more
MAX_RECURRENT_CELLS = 4096  # one per sequence: a slot file holds one


@dataclass(frozen=True, kw_only=True)
class Rows:
    """One layer's tensor in a section, as the loader checks it: its ggml type and row size."""

    type: int  # ggml_type
    size: int  # bytes per cell; for a transposed V, bytes per element
    width: int | None = None  # a transposed V's n_embd_v_gqa (elements per cell); None otherwise


@dataclass(frozen=True, kw_only=True)
class KvSection:
    """An attention KV cache's part of a file. The per-stream fields are those of the streams that hold cells
    (a slot's own); None when no stream does (an empty slot's file says nothing of its layers)."""

    n_stream: int  # 1 with --kv-unified, else -np
    cell_ext: bool | None  # cells carry a llama_kv_cell_ext (M-RoPE or PLE models): inferred, not written
    v_trans: bool | None  # V stored transposed (no flash attention)
    n_layer: int | None
    n_rot_k: int | None  # version 4 on: the K rotation of a quantized K cache; None in version 3
    n_rot_v: int | None
    k: tuple[Rows, ...]
    v: tuple[Rows, ...]  # empty for MLA caches (no V)


@dataclass(frozen=True, kw_only=True)
class RecurrentSection:
    """A recurrent memory's part of a file (Mamba, RWKV, the linear-attention layers of hybrids)."""

    s_trans: bool  # always False as b11434 writes it; compared by the loader all the same
    n_layer: int  # every layer of the model, recurrent or not
    r: tuple[Rows, ...]  # one per recurrent layer
    s: tuple[Rows, ...]


Section = KvSection | RecurrentSection


@dataclass(frozen=True, kw_only=True)
class Signature:
    """Everything of a slot file that llama.cpp's loader compares with its own memory, but the cell count and
    the tokens: the format version and each memory section's headers.

    Equality is the test: two files with equal Signatures are restored by the same servers, and a server
    restores a file whose Signature equals one of its own saves' (its probe's) when the file's cells fit in a
    slot. Unequal Signatures mean the loader refuses the file ("no space in KV cache or invalid file")."""

    version: int  # LLAMA_STATE_SEQ_VERSION of the writer
    sections: tuple[Section, ...]

    @property
    def kind(self) -> str:
        """The memory that wrote the file: "kv", "iswa", "recurrent", "hybrid" or "hybrid-iswa"."""
        kv = sum(isinstance(s, KvSection) for s in self.sections)
        recurrent = any(isinstance(s, RecurrentSection) for s in self.sections)
        if recurrent:
            return {0: "recurrent", 1: "hybrid"}.get(kv, "hybrid-iswa")
        return "kv" if kv == 1 else "iswa"

    def differences(self, other: Signature) -> tuple[str, ...]:
        """What differs, one short phrase each (for a log line saying why a file needs converting)."""
        if self.version != other.version:
            return (f"format version {self.version} vs {other.version}",)
        if self.kind != other.kind:
            return (f"memory {self.kind} vs {other.kind}",)
        found: list[str] = []
        for i, (mine, theirs) in enumerate(zip(self.sections, other.sections)):
            for f in fields(mine):
                a, b = getattr(mine, f.name), getattr(theirs, f.name)
                if a != b:
                    shown = f"{a} vs {b}" if not isinstance(a, tuple) else _rows_difference(a, b)
                    found.append(f"section {i} {f.name}: {shown}")
        return tuple(found)


@dataclass(frozen=True, slots=True)
class RowRun:
    """Where one layer's per-cell data lies in a file: `groups` runs, one after the other from `offset`, each of
    `size` bytes per cell (a K or V tensor's rows: one group of whole rows; a transposed V: one group per
    element, each holding that element of every cell)."""

    offset: int
    size: int
    groups: int = 1


@dataclass(frozen=True, slots=True)
class CellData:
    """The per-cell data of one KV cache stream that holds cells: every layer's K and V, cell by cell.

    Why: a full-attention KV cache grows by appending cells, so a later save of a growing chat repeats the
    earlier save's cells byte for byte, and cells [a, b) of every run together are what the block store keeps
    once (store/blocks.py)."""

    cells: int
    runs: tuple[RowRun, ...]


def _rows_difference(a: tuple[Rows, ...], b: tuple[Rows, ...]) -> str:
    if len(a) != len(b):
        return f"{len(a)} layers vs {len(b)}"
    il = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return f"layer {il} {a[il]} vs {b[il]}"


def read_signature(path: Path) -> Signature:
    """The Signature of a slot file; StateFileError when it is not one, is cut short, or no reading of its
    sections ends where the file does."""
    return read_layout(path)[0]


def read_layout(path: Path | str) -> tuple[Signature, tuple[CellData, ...]]:
    """A slot file's Signature and where its KV caches' per-cell data lies (one CellData per stream holding
    cells, in file order); StateFileError as read_signature. A recurrent memory's state is not per cell."""
    with open(path, "rb") as f:
        reader = _Reader(f.fileno(), os.fstat(f.fileno()).st_size)
        try:
            magic, version, count = reader.unpack(HEADER, 0)
        except _Mismatch:
            raise StateFileError("shorter than a slot file header") from None
        if magic != SEQ_MAGIC:
            raise StateFileError(f"not a llama.cpp sequence state file (magic {magic:08x})")
        if version not in KNOWN_VERSIONS:
            raise StateFileError(f"seq-state format version {version}: this reader knows {KNOWN_VERSIONS}")
        start = HEADER.size + 4 * count
        if start > reader.size:
            raise StateFileError(f"truncated: {count} token words announced in {reader.size} bytes")
        for sections, data in _readings(reader, version, start, (), ()):
            return Signature(version=version, sections=sections), data
    raise StateFileError(f"no reading of its memory sections fits its {reader.size} bytes (truncated?)")


class _Mismatch(Exception):
    """This reading of the file does not fit it (a bad value, or a read past the end)."""


class _Reader:
    """Reads at given offsets (os.pread), so that a reading that fails leaves nothing to undo."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    def unpack(self, fmt: struct.Struct, at: int) -> tuple[int, ...]:
        raw = os.pread(self.fd, fmt.size, at) if at + fmt.size <= self.size else b""
        if len(raw) != fmt.size:
            raise _Mismatch
        return fmt.unpack(raw)

    def skip(self, at: int, n: int) -> int:
        """The offset after n bytes of data at `at`, which must be in the file."""
        if at + n > self.size:
            raise _Mismatch
        return at + n


_U32 = struct.Struct("<I")
_CELL = struct.Struct("<iI")  # pos, n_seq_id
_SEQ = struct.Struct("<i")
_ROWS = struct.Struct("<iQ")  # type, row size
_TRANSPOSED = struct.Struct("<iII")  # type, element size, n_embd_v_gqa
_KV_DATA = struct.Struct("<II")  # v_trans, n_layer
_ROTATION = struct.Struct("<II")  # n_rot_k, n_rot_v


def _readings(
    reader: _Reader, version: int, at: int, done: tuple[Section, ...], data: tuple[CellData, ...]
) -> Iterator[tuple[tuple[Section, ...], tuple[CellData, ...]]]:
    """Each reading of the sections from `at` that ends at the end of the file, with the per-cell data of its
    KV caches: a recurrent memory is the last section; at most two KV caches come before it."""
    if at == reader.size and done:
        yield done, data
        return
    try:
        yield (*done, _recurrent(reader, at)), data
    except _Mismatch:
        pass
    if sum(isinstance(s, KvSection) for s in done) >= 2:
        return
    for cell_ext in (False, True):
        for has_v in (True, False):
            try:
                section, end, streams = _kv(reader, version, at, cell_ext=cell_ext, has_v=has_v)
            except _Mismatch:
                continue
            yield from _readings(reader, version, end, (*done, section), (*data, *streams))


def _check(condition: bool) -> None:
    if not condition:
        raise _Mismatch


def _kv(
    reader: _Reader, version: int, at: int, *, cell_ext: bool, has_v: bool
) -> tuple[KvSection, int, list[CellData]]:
    """One KV cache's section at `at` (see the module docstring), where it ends, and its streams' cell data."""
    (n_stream,) = reader.unpack(_U32, at)
    _check(1 <= n_stream <= MAX_STREAMS)
    at += 4
    shape: KvSection | None = None
    streams: list[CellData] = []
    for _ in range(n_stream):
        (cells,) = reader.unpack(_U32, at)
        at += 4
        if not cells:
            continue
        at = _kv_cells(reader, at, cells, cell_ext)
        runs: list[RowRun] = []
        stream, at = _kv_layers(reader, version, at, cells, has_v, runs)
        _check(shape is None or shape == stream)  # streams of one cache share their layers
        shape = stream
        streams.append(CellData(cells=cells, runs=tuple(runs)))
    if shape is None:  # every stream empty: whether cells carry the ext, or there is a V, is not in the file
        _check(not cell_ext and has_v)
        return (
            KvSection(
                n_stream=n_stream, cell_ext=None, v_trans=None, n_layer=None, n_rot_k=None, n_rot_v=None, k=(), v=()
            ),
            at,
            streams,
        )
    return (
        KvSection(
            n_stream=n_stream,
            cell_ext=cell_ext,
            v_trans=shape.v_trans,
            n_layer=shape.n_layer,
            n_rot_k=shape.n_rot_k,
            n_rot_v=shape.n_rot_v,
            k=shape.k,
            v=shape.v,
        ),
        at,
        streams,
    )


def _kv_cells(reader: _Reader, at: int, cells: int, cell_ext: bool) -> int:
    """Past one stream's cell metadata: a slot's cells each name one sequence (n_seq_id 1, then its id), so
    they all have one size; the first and the last are checked, the rest seeked over."""
    stride = _CELL.size + (CELL_EXT_SIZE if cell_ext else 0) + _SEQ.size
    for cell in {0, cells - 1}:
        start = at + cell * stride
        _, n_seq_id = reader.unpack(_CELL, start)
        (seq_id,) = reader.unpack(_SEQ, start + stride - _SEQ.size)
        _check(n_seq_id == 1 and 0 <= seq_id < MAX_STREAMS)
    return reader.skip(at, cells * stride)


def _kv_layers(
    reader: _Reader, version: int, at: int, cells: int, has_v: bool, runs: list[RowRun]
) -> tuple[KvSection, int]:
    """One stream's v_trans, n_layer, rotations and per-layer K and V rows, seeking over the cell data (whose
    places join `runs`)."""
    v_trans, n_layer = reader.unpack(_KV_DATA, at)
    _check(v_trans in (0, 1) and 1 <= n_layer <= MAX_LAYERS)
    at += _KV_DATA.size
    n_rot_k = n_rot_v = None
    if version >= ROTATION_VERSION:
        n_rot_k, n_rot_v = reader.unpack(_ROTATION, at)
        at += _ROTATION.size
    k, at = _rows(reader, at, cells, n_layer, runs)
    v: tuple[Rows, ...] = ()
    if has_v and not v_trans:
        v, at = _rows(reader, at, cells, n_layer, runs)
    elif has_v:
        found = []
        for _ in range(n_layer):
            type_, size, width = reader.unpack(_TRANSPOSED, at)
            _check(0 <= type_ < MAX_GGML_TYPE and size > 0 and width > 0)
            found.append(Rows(type=type_, size=size, width=width))
            runs.append(RowRun(at + _TRANSPOSED.size, size, width))
            at = reader.skip(at + _TRANSPOSED.size, width * cells * size)
        v = tuple(found)
    section = KvSection(
        n_stream=0, cell_ext=None, v_trans=bool(v_trans), n_layer=n_layer, n_rot_k=n_rot_k, n_rot_v=n_rot_v, k=k, v=v
    )
    return section, at


def _rows(
    reader: _Reader, at: int, cells: int, count: int | None, runs: list[RowRun] | None = None
) -> tuple[tuple[Rows, ...], int]:
    """`count` layers' (type, row size, rows) at `at`, each layer's rows joining `runs` when given; with count
    None, as many as there are to the end of the file (a recurrent memory's, whose S rows may be empty: LFM2's
    short convolutions have no S state)."""
    found: list[Rows] = []
    while (count is None and at < reader.size) or (count is not None and len(found) < count):
        type_, size = reader.unpack(_ROWS, at)
        _check(0 <= type_ < MAX_GGML_TYPE and (size > 0 or count is None))
        found.append(Rows(type=type_, size=size))
        if runs is not None:
            runs.append(RowRun(at + _ROWS.size, size))
        at = reader.skip(at + _ROWS.size, cells * size)
    return tuple(found), at


def _recurrent(reader: _Reader, at: int) -> RecurrentSection:
    """A recurrent memory's section at `at`, which must end at the end of the file. Its R rows come first,
    then as many S rows (llama.cpp makes a layer's R and S tensors together): all R rows have one size
    (n_embd_r), all S rows another (n_embd_s). A PLE model's extra conv rows are not read (StateFileError)."""
    (cells,) = reader.unpack(_U32, at)
    _check(cells <= MAX_RECURRENT_CELLS)
    at += 4
    for _ in range(cells):
        _, n_seq_id = reader.unpack(_CELL, at)
        _check(n_seq_id <= MAX_STREAMS)
        at = reader.skip(at + _CELL.size, n_seq_id * _SEQ.size)
    s_trans, n_layer = reader.unpack(_KV_DATA, at)
    _check(s_trans in (0, 1) and 1 <= n_layer <= MAX_LAYERS)
    rows, at = _rows(reader, at + _KV_DATA.size, cells, None)
    half = len(rows) // 2
    r, s = rows[:half], rows[half:]
    _check(bool(rows) and len(rows) % 2 == 0 and half <= n_layer and len(set(r)) == 1 and len(set(s)) == 1)
    return RecurrentSection(s_trans=bool(s_trans), n_layer=n_layer, r=r, s=s)
