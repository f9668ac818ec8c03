"""Blocks: a slot file cut into the parts a later save repeats, each named by a hash of its bytes.

Why: every save of a growing chat used to write its whole state again, though a full-attention KV cache only
ever appends cells, and chats that share an opening kept it once each. llama-server writes a slot file as a
header and the tokens, the cells' metadata, then each layer's K rows and V rows cell by cell (statelayout.py
says where). Cut so, a file is

* its *skeleton*: every byte that is not a cell's K or V data (header, tokens, pictures, cell metadata, the
  layers' headers, a recurrent memory's state), one block, new at nearly every save; and
* per KV stream holding cells, one *cell block* per `block_cells` cells: cells [a, b) of every layer's K and
  V, in file order (a transposed V, by element: each element's run for those cells). A save that repeats an
  earlier one's first cells repeats its cell blocks byte for byte, and a block already stored is not written
  again: each cell's data reaches the disk once, each shared opening is stored once.

A block is named by the xxh3_128 of its bytes (32 hex digits). `Parts`, kept in the entry's manifest, lists
an entry's blocks in order and where each run lies; put back together (`pieces`), they are byte for byte the
file llama-server wrote, which the entry's whole-file checksum proves at every restore.

No I/O here but reading the file being cut: what is written, and where, is blockfiles.py's and the store's.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from .statefile import StateFileError
from .statelayout import CellData, RowRun, read_layout

BLOCK_CELLS = 256  # cells per cell block: 4 MiB at 16 KiB a token; a save's unfilled last block is rewritten
HASH_HEX = 32  # xxh3_128's hex digits

Buffer = bytes | bytearray | memoryview | mmap.mmap


def block_hash(data: Buffer) -> str:
    """The name of a block: the xxh3_128 of its bytes, in hex."""
    return xxhash.xxh3_128_hexdigest(data)


def is_block_name(name: str) -> bool:
    return len(name) == HASH_HEX and all(c in "0123456789abcdef" for c in name)


RUN_GAP = 12  # bytes between two runs of a stream: the next layer's type and row size (or element size, width)
_SHAPES: dict[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]] = {}  # one object per model's layout


def _shared_shape(shape: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The one object for this layout: a store of 20,000 entries of one model holds it once, not per entry."""
    return _SHAPES.setdefault(shape, shape)


@dataclass(frozen=True, slots=True)
class CellSection:
    """One KV stream's cells and its cell blocks, in order. Where its runs lie is `start` (the first run's
    offset) and `shape` (each run's bytes per cell and groups, shared by every entry of a model): in a stream,
    run follows run with RUN_GAP bytes of the next layer's header between them (statelayout reads them so).
    Why not the runs themselves: 52 run objects per entry of a 26-layer model were most of a 20,000-entry
    store's memory."""

    cells: int
    start: int
    shape: tuple[tuple[int, int], ...]  # (size, groups) per run
    blocks: tuple[str, ...]

    @classmethod
    def of_runs(cls, cells: int, runs: tuple[RowRun, ...], blocks: tuple[str, ...]) -> CellSection:
        """The section of these runs; ValueError when they do not follow one another as a stream's do."""
        at = runs[0].offset if runs else 0
        for run in runs:
            if run.offset != at:
                raise ValueError("runs that do not follow one another")
            at = run.offset + run.groups * cells * run.size + RUN_GAP
        return cls(cells, runs[0].offset if runs else 0, _shared_shape(tuple((r.size, r.groups) for r in runs)), blocks)

    @property
    def runs(self) -> Iterator[RowRun]:
        at = self.start
        for size, groups in self.shape:
            yield RowRun(at, size, groups)
            at += groups * self.cells * size + RUN_GAP

    @property
    def cell_bytes(self) -> int:
        return sum(size * groups for size, groups in self.shape)

    @property
    def end(self) -> int:
        """Where its last run ends."""
        return self.start + self.cells * self.cell_bytes + RUN_GAP * (len(self.shape) - 1) if self.shape else 0


@dataclass(frozen=True, slots=True)
class Parts:
    """How an entry's file is made of blocks (its manifest's "parts")."""

    nbytes: int  # the whole file's size
    block_cells: int
    skeleton: str
    sections: tuple[CellSection, ...]

    @property
    def skeleton_bytes(self) -> int:
        return self.nbytes - sum(s.cells * s.cell_bytes for s in self.sections)

    def sized_blocks(self) -> Iterator[tuple[str, int]]:
        """Each block with its size, in file order (a block may come more than once)."""
        yield self.skeleton, self.skeleton_bytes
        for section in self.sections:
            cell_bytes = section.cell_bytes
            for k, name in enumerate(section.blocks):
                yield name, _cells_in(section.cells, self.block_cells, k) * cell_bytes

    def block_sizes(self) -> dict[str, int]:
        """The distinct blocks and their sizes."""
        return dict(self.sized_blocks())

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.nbytes,
            "block_cells": self.block_cells,
            "skeleton": self.skeleton,
            "sections": [
                {"cells": s.cells, "start": s.start, "shape": [list(x) for x in s.shape], "blocks": list(s.blocks)}
                for s in self.sections
            ],
        }

    @classmethod
    def from_json(cls, data: Any) -> Parts:
        """ValueError (or KeyError, TypeError) when it is not a whole, consistent description of a file."""
        sections = tuple(
            CellSection(
                cells=int(s["cells"]),
                start=int(s["start"]),
                shape=_shared_shape(tuple((int(size), int(groups)) for size, groups in s["shape"])),
                blocks=tuple(sys.intern(str(b)) for b in s["blocks"]),
            )
            for s in data["sections"]
        )
        parts = cls(
            nbytes=int(data["bytes"]),
            block_cells=int(data["block_cells"]),
            skeleton=sys.intern(str(data["skeleton"])),
            sections=sections,
        )
        parts.check()
        return parts

    def to_tuple(self) -> tuple[Any, ...]:
        """Builtins only (the manifest cache's marshal rows)."""
        return (
            self.nbytes,
            self.block_cells,
            self.skeleton,
            tuple((s.cells, s.start, s.shape, s.blocks) for s in self.sections),
        )

    @classmethod
    def from_tuple(cls, row: tuple[Any, ...]) -> Parts:
        nbytes, block_cells, skeleton, sections = row
        return cls(
            nbytes=nbytes,
            block_cells=block_cells,
            skeleton=sys.intern(skeleton),
            sections=tuple(
                CellSection(
                    cells=cells,
                    start=start,
                    shape=_shared_shape(tuple(map(tuple, shape))),
                    blocks=tuple(map(sys.intern, blocks)),
                )
                for cells, start, shape, blocks in sections
            ),
        )

    def check(self) -> None:
        """ValueError unless the runs lie in the file, one after another, and each section has its blocks."""
        if self.block_cells < 1 or not is_block_name(self.skeleton):
            raise ValueError("no skeleton block")
        end = 0
        for section in self.sections:
            if len(section.blocks) != -(-section.cells // self.block_cells) or not all(
                is_block_name(b) for b in section.blocks
            ):
                raise ValueError(f"{len(section.blocks)} blocks for {section.cells} cells")
            if section.start < end or any(size < 1 or groups < 1 for size, groups in section.shape):
                raise ValueError("runs out of order")
            end = section.end
        if end > self.nbytes or self.skeleton_bytes < 0:
            raise ValueError("runs past the end of the file")


def _cells_in(cells: int, block_cells: int, k: int) -> int:
    return min(block_cells, cells - k * block_cells)


def _runs_in_order(parts_sections: tuple[CellSection, ...]) -> list[tuple[RowRun, int, int]]:
    """Every run with its section's index and its byte offset within a cell (across the section's runs)."""
    found = []
    for index, section in enumerate(parts_sections):
        within = 0
        for run in section.runs:
            found.append((run, index, within))
            within += run.size * run.groups
    return found


def cut(path: Path | str, keep: Callable[[str, Buffer], None], *, block_cells: int = BLOCK_CELLS) -> Parts:
    """Cut a slot file into blocks: `keep(name, data)` is called once per block, in file order (the caller
    writes what its store lacks; `data` is valid only during the call). Reads the file through a memory map:
    one pass, no copy of what is kept.

    A file whose memory sections statelayout cannot read (a format newer than it knows) is kept whole, as its
    skeleton: saved all the same, only not shared."""
    try:
        _, streams = read_layout(path)
        for stream in streams:
            CellSection.of_runs(stream.cells, stream.runs, ())  # (ValueError: not a stream's runs as it knows them)
    except (StateFileError, ValueError):
        streams = ()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else _Empty() as mapped:
            view = memoryview(mapped)
            try:
                return _cut(view, size, streams, keep, block_cells)
            finally:
                view.release()


def _cut(
    view: memoryview, size: int, streams: tuple[CellData, ...], keep: Callable[[str, Buffer], None], block_cells: int
) -> Parts:
    spans = sorted(
        (run.offset, run.offset + run.groups * stream.cells * run.size) for stream in streams for run in stream.runs
    )
    skeleton = bytearray()
    at = 0
    for start, end in spans:
        skeleton += view[at:start]
        at = end
    skeleton += view[at:size]
    skeleton_name = block_hash(skeleton)
    keep(skeleton_name, skeleton)
    sections = []
    for stream in streams:
        names = []
        for k in range(-(-stream.cells // block_cells)):
            a = k * block_cells
            b = a + _cells_in(stream.cells, block_cells, k)
            data = b"".join(
                view[
                    run.offset + g * stream.cells * run.size + a * run.size : run.offset
                    + g * stream.cells * run.size
                    + b * run.size
                ]
                for run in stream.runs
                for g in range(run.groups)
            )
            name = block_hash(data)
            keep(name, data)
            names.append(name)
        sections.append(CellSection.of_runs(stream.cells, stream.runs, tuple(names)))
    return Parts(nbytes=size, block_cells=block_cells, skeleton=skeleton_name, sections=tuple(sections))


def pieces(parts: Parts, blocks: Mapping[str, Buffer]) -> Iterator[memoryview]:
    """The file `parts` describes, as slices of its blocks in file order (`blocks`: each block's bytes by
    name). KeyError for a block missing, ValueError for one of the wrong size."""
    for name, nbytes in parts.sized_blocks():
        if len(blocks[name]) != nbytes:
            raise ValueError(f"block {name} has {len(blocks[name])} bytes, not {nbytes}")
    skeleton = memoryview(blocks[parts.skeleton])
    views = {name: memoryview(blocks[name]) for s in parts.sections for name in s.blocks}
    at = taken = 0  # in the file; in the skeleton
    for run, index, within in _runs_in_order(parts.sections):
        section = parts.sections[index]
        if run.offset > at:
            yield skeleton[taken : taken + run.offset - at]
            taken += run.offset - at
        for g in range(run.groups):
            for k, name in enumerate(section.blocks):
                n = _cells_in(section.cells, parts.block_cells, k)
                start = n * (within + g * run.size)
                yield views[name][start : start + n * run.size]
        at = run.offset + run.groups * section.cells * run.size
    yield skeleton[taken:]


class _Empty:
    """An empty file's map (mmap refuses a length of 0)."""

    def __enter__(self) -> bytes:
        return b""

    def __exit__(self, *exc: object) -> None:
        return None
