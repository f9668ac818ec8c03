"""A GGUF file's key/value metadata, read with the stdlib alone (no numpy, no ``gguf`` package).

Why apart from modelinfo.py: this is the file format; what its keys say of a model's memory is modelinfo's.
The daemon reads a model's header at start, before llama-server has loaded anything, and its runtime
dependencies are stdlib + pydantic etc.; the reader maps the file and reads only the header pages (a few MB
for a 262k-token vocabulary), skipping long arrays without building Python objects. It follows
ggml/src/gguf.cpp: what that refuses (a wrong magic, an unsupported version, a truncated header, invalid
types, duplicate keys) is refused here with a one-line reason.

It also says which vocabulary a model has (`vocabulary_key`, an xxhash of its tokenizer's keys: xxhash is a
runtime dependency already), so that a chat saved as token ids can be matched with the models it means the
same to.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import xxhash

__all__ = ["MAX_KEPT_ARRAY", "ModelInfoError", "SkippedArray", "read_gguf_metadata", "vocabulary_key"]


class ModelInfoError(ValueError):
    """The file is not a GGUF model this module can read; the text is a one-line reason."""


GGUF_MAGIC = b"GGUF"
# ggml/src/gguf.cpp reads versions 2 and 3 (GGUFv1, with 32-bit lengths, is "no longer supported").
SUPPORTED_VERSIONS = (2, 3)

# gguf_type: element type code -> (struct format, size). 8 = string and 9 = array are handled apart.
# fmt: off
_SCALAR_TYPES: dict[int, tuple[str, int]] = {
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
    6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
}
# fmt: on
_TYPE_STRING = 8
_TYPE_ARRAY = 9

#: Arrays up to this many elements are kept (per-layer values such as ``head_count_kv`` or
#: ``sliding_window_pattern``; llama.cpp allows at most 512 layers). Longer ones (the vocabulary, scores,
#: merges) are skipped without building Python objects.
MAX_KEPT_ARRAY = 4096


@dataclass(frozen=True)
class SkippedArray:
    """Stands in for an array the reader skipped: its GGUF element type code and length."""

    element_type: int
    count: int

    def __len__(self) -> int:
        return self.count


class _Truncated(Exception):
    pass


class _Reader:
    """Bounds-checked little-endian reads from a buffer (an mmap of the file)."""

    def __init__(self, buf: Any, size: int) -> None:
        self.buf = buf
        self.size = size
        self.pos = 0

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated

    def unpack(self, fmt: str, n: int) -> Any:
        self.need(n)
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return value[0] if len(value) == 1 else value

    def u32(self) -> int:
        return int(self.unpack("I", 4))

    def u64(self) -> int:
        return int(self.unpack("Q", 8))

    def raw_string(self) -> bytes:
        n = self.u64()
        self.need(n)
        data = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return data

    def skip_strings(self, count: int) -> None:
        # Each string needs at least its 8-byte length: a count the file cannot hold is a truncated file,
        # found before looping over billions of phantom entries.
        self.need(count * 8)
        buf, pos, size, unpack_from = self.buf, self.pos, self.size, struct.unpack_from
        for _ in range(count):
            if pos + 8 > size:
                raise _Truncated
            pos += 8 + unpack_from("<Q", buf, pos)[0]
        if pos > size:
            raise _Truncated
        self.pos = pos


def _read_value(r: _Reader, vtype: int, key: str, max_array: int) -> Any:
    if vtype in _SCALAR_TYPES:
        fmt, size = _SCALAR_TYPES[vtype]
        return r.unpack(fmt, size)
    if vtype == _TYPE_STRING:
        return r.raw_string().decode("utf-8", errors="replace")
    if vtype != _TYPE_ARRAY:
        raise ModelInfoError(f"key {key!r} has an invalid GGUF value type {vtype}")
    etype = r.u32()
    count = r.u64()
    if etype == _TYPE_STRING:
        if count <= max_array:
            return [r.raw_string().decode("utf-8", errors="replace") for _ in range(count)]
        r.skip_strings(count)
        return SkippedArray(etype, count)
    if etype not in _SCALAR_TYPES:  # gguf.cpp rejects arrays of arrays too
        raise ModelInfoError(f"key {key!r} is an array of invalid GGUF type {etype}")
    fmt, size = _SCALAR_TYPES[etype]
    r.need(count * size)
    if count > max_array:
        r.pos += count * size
        return SkippedArray(etype, count)
    values = list(struct.unpack_from(f"<{count}{fmt}", r.buf, r.pos))
    r.pos += count * size
    return values


def _map_file(path: str | os.PathLike[str]) -> tuple[Any, int, Callable[[], None]]:
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise ModelInfoError(f"{name}: empty file, not a GGUF model")
            try:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:  # not a regular file (a pipe, a device)
                raise ModelInfoError(f"{name}: cannot map the file ({exc})") from None
    except OSError as exc:
        raise ModelInfoError(f"{name}: cannot read: {exc.strerror or exc}") from None
    return mapped, size, mapped.close


def _open_header(r: _Reader, name: str) -> int:
    """Checks the magic and version, leaves `r` at the first key; the number of key/value pairs."""
    magic = bytes(r.buf[:4])
    if r.size < 4 and GGUF_MAGIC.startswith(magic):
        raise _Truncated
    if magic != GGUF_MAGIC:
        raise ModelInfoError(f"{name}: not a GGUF file (starts with {magic!r}, not b'GGUF')")
    r.pos = 4
    version = r.u32()
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and version:
            raise ModelInfoError(
                f"{name}: GGUF version {version:#x}: a big-endian file? llama.cpp reads "
                "only files of its own byte order"
            )
        raise ModelInfoError(f"{name}: unsupported GGUF version {version} (llama.cpp reads 2 and 3)")
    r.u64()  # tensor count: not needed
    n_kv = r.u64()
    # Every pair takes at least 8 (key length) + 1 (key) + 4 (type) + 1 (value) bytes.
    if n_kv * 14 > r.size - r.pos:
        raise _Truncated
    return int(n_kv)


def _pairs(path: str | os.PathLike[str], max_array: int) -> Iterator[tuple[str, Any, bytes]]:
    """Each key, its value (as read_gguf_metadata gives it) and the raw bytes of its type and value."""
    name = os.fspath(path)
    buf, size, close = _map_file(path)
    try:
        r = _Reader(buf, size)
        try:
            seen: set[str] = set()
            for i in range(_open_header(r, name)):
                try:
                    key = r.raw_string().decode("utf-8")
                except UnicodeDecodeError:
                    raise ModelInfoError(f"{name}: key #{i} is not UTF-8") from None
                if not key:
                    raise ModelInfoError(f"{name}: key #{i} is empty")
                if key in seen:
                    raise ModelInfoError(f"{name}: duplicate key {key!r}")
                seen.add(key)
                start = r.pos
                value = _read_value(r, r.u32(), key, max_array)
                yield key, value, buf[start : r.pos]
        except _Truncated:
            raise ModelInfoError(f"{name}: truncated GGUF header ({size} bytes; it ends inside the metadata)") from None
    finally:
        close()


def read_gguf_metadata(path: str | os.PathLike[str], *, max_array: int = MAX_KEPT_ARRAY) -> dict[str, Any]:
    """The key/value metadata of a GGUF file, without its tensor infos or tensor data.

    Scalars are Python ints, floats, bools and strs; arrays of at most ``max_array`` elements are lists,
    longer ones :class:`SkippedArray` (type and length only). Reads only the header pages of the file (for a
    model with a 262k-token vocabulary, a few MB). Raises :class:`ModelInfoError` for anything that is not
    a readable GGUF header: wrong magic, unsupported version, a truncated file, invalid types, duplicate keys.
    """
    return {key: value for key, value, _ in _pairs(path, max_array)}


#: Keys of the tokenizer that do not change which token an id is: the chat templates (a model's template is
#: often mended in a re-upload, or overridden on the command line; the tokens stay).
NOT_VOCABULARY = "tokenizer.chat_template"


def vocabulary_key(path: str | os.PathLike[str]) -> str:
    """A hash of a model's vocabulary: of every ``tokenizer.*`` key (but the chat templates), its type and its
    raw value bytes, in file order, read from the header alone (about 30 ms for a 262k-token vocabulary).

    Why: a saved chat is a list of token ids; it means the same to another model (a requantization, a
    fine-tune, another file of the same weights) exactly when the two vocabularies are the same, which is
    what this says without comparing weights. Equal keys: the ids are the same tokens. Raises
    :class:`ModelInfoError` for a file that is not a readable GGUF header."""
    digest = xxhash.xxh3_128()
    for key, _, raw in _pairs(path, 0):
        if key.startswith("tokenizer.") and not key.startswith(NOT_VOCABULARY):
            encoded = key.encode()
            digest.update(struct.pack("<Q", len(encoded)) + encoded)
            digest.update(raw)
    return digest.hexdigest()
