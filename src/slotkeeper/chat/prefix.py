"""Prefix keys: chained hashes of fixed-size token blocks (as vLLM's prefix cache keys its blocks).

Key i covers tokens [0, (i + 1) * BLOCK_TOKENS): it hashes block i together with key i - 1, so two token
sequences share key i exactly when they share that whole prefix. Finding the longest common prefix of a
request and a stored conversation is then a comparison of short strings, or one dict lookup per key, and
a manifest can carry its conversation's keys instead of its tokens.

The same chaining over request *units* (one chat message, or one fixed-size piece of prompt text) lets
placement recognise a chat continuing in its own slot without asking llama-server to tokenize it.
"""

from __future__ import annotations

import contextlib
import hashlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

BLOCK_TOKENS = 64
KEY_BYTES = 8


def _chain(pieces: Iterable[bytes]) -> list[str]:
    keys: list[str] = []
    previous = b""
    for piece in pieces:
        digest = hashlib.blake2b(previous + piece, digest_size=KEY_BYTES).digest()
        keys.append(digest.hex())
        previous = digest
    return keys


def block_keys(tokens: Sequence[int] | array[int], block: int = BLOCK_TOKENS) -> list[str]:
    """One key per *full* block of `tokens` (a partial last block has none)."""
    words = tokens if isinstance(tokens, array) and tokens.typecode == "i" else array("i", tokens)
    raw = memoryview(words.tobytes())
    step = block * 4
    return _chain(raw[i : i + step].tobytes() for i in range(0, (len(words) // block) * step, step))


def exact_key(tokens: Sequence[int] | array[int], n: int | None = None) -> str:
    """A key of exactly the first `n` tokens (all of them by default), partial last block included: what a
    state that llama-server reuses only when a request extends *all* of it is matched by."""
    words = tokens if isinstance(tokens, array) and tokens.typecode == "i" else array("i", tokens)
    view = memoryview(words.tobytes())
    return hashlib.blake2b(view[: (len(words) if n is None else n) * 4], digest_size=2 * KEY_BYTES).hexdigest()


def extends_exactly(tokens: Sequence[int] | array[int], n: int, key: str) -> bool:
    """`tokens` open with the `n` tokens keyed by `key`, and go on past them (llama-server needs one new token)."""
    return len(tokens) > n and exact_key(tokens, n) == key


def unit_keys(units: Iterable[bytes]) -> list[str]:
    """Chained keys of request units (canonical bytes of each message, or of each piece of prompt text)."""
    return _chain(units)


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The length of the longest common prefix of two sequences (tokens, characters): compared one by one."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def common_keys(a: Sequence[str], b: Sequence[str]) -> int:
    """How many leading keys two chains share. Chained keys agree on a prefix, so a binary search finds it."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


TreeKey = bytes | str  # a key as an index holds it: a digest's 8 bytes, or a made-up key as it is


def as_tree_key(key: str) -> TreeKey:
    """A hex digest as its bytes (no hex string kept or made per look-up); any other key as it is."""
    if len(key) == 2 * KEY_BYTES:
        with contextlib.suppress(ValueError):
            return bytes.fromhex(key)
    return key


def tree_key(keys: Sequence[str], i: int) -> TreeKey:
    """Key i of a chain as an index holds it (a packed chain's without decoding it)."""
    if isinstance(keys, KeyChain):
        return keys.tree_key(i)
    return as_tree_key(keys[i])


class KeyChain(Sequence[str]):
    """A chain of keys as an entry keeps it: 8 bytes a key in one bytes object, not a list of hex strings.

    A store of 20,000 entries holds millions of keys; as strings they were most of the daemon's memory (a
    16-digit hex string costs 65 bytes, a list slot 8 more). It reads as a sequence of the same hex strings,
    and compares equal to any sequence of them. Keys that are not KEY_BYTES-byte hex digests (made-up ones in
    tests) are kept as they are.
    """

    __slots__ = ("_packed", "_plain")

    def __init__(self, keys: Iterable[str] = ()) -> None:
        plain = tuple(keys)
        self._packed: bytes | None = None
        self._plain: tuple[str, ...] = plain
        if set(map(len, plain)) <= {2 * KEY_BYTES}:
            with contextlib.suppress(ValueError):
                self._packed, self._plain = bytes.fromhex("".join(plain)), ()

    @classmethod
    def from_packed(cls, packed: bytes) -> KeyChain:
        """The chain packed() gave."""
        if len(packed) % KEY_BYTES:
            raise ValueError("a packed key chain is whole keys")
        chain = cls.__new__(cls)
        chain._packed, chain._plain = packed, ()
        return chain

    def packed(self) -> bytes | None:
        """All keys, KEY_BYTES bytes each (None for a chain of made-up keys)."""
        return self._packed

    def tree_key(self, i: int) -> TreeKey:
        """Key i as prefix.tree_key gives it: the raw 8 bytes of a packed chain's."""
        if self._packed is None:
            return as_tree_key(self._plain[i])
        if i < 0:
            i += len(self._packed) // KEY_BYTES
        return self._packed[i * KEY_BYTES : (i + 1) * KEY_BYTES]

    def __len__(self) -> int:
        return len(self._packed) // KEY_BYTES if self._packed is not None else len(self._plain)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> KeyChain: ...

    def __getitem__(self, index: int | slice) -> str | KeyChain:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("a key chain is sliced in order")
            part = KeyChain()
            if self._packed is not None:
                part._packed = self._packed[start * KEY_BYTES : max(start, stop) * KEY_BYTES]
            else:
                part._packed, part._plain = None, self._plain[start:stop]
            return part
        if self._packed is None:
            return self._plain[index]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("key chain index out of range")
        return self._packed[index * KEY_BYTES : (index + 1) * KEY_BYTES].hex()

    def __iter__(self) -> Iterator[str]:
        if self._packed is None:
            return iter(self._plain)
        raw = self._packed
        return (raw[i : i + KEY_BYTES].hex() for i in range(0, len(raw), KEY_BYTES))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KeyChain) and self._packed is not None and other._packed is not None:
            return self._packed == other._packed
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def last_shared(self, other: KeyChain, start: int, end: int) -> int | None:
        """The last position in [start, end] where two chains agree (they agree at `start`), comparing bytes;
        None when either is not packed."""
        a, b = self._packed, other._packed
        if a is None or b is None:
            return None
        lo, hi = start, min(end, len(a) // KEY_BYTES - 1, len(b) // KEY_BYTES - 1)
        if a[hi * KEY_BYTES : (hi + 1) * KEY_BYTES] == b[hi * KEY_BYTES : (hi + 1) * KEY_BYTES]:
            return hi  # the common case, one chat added below a run it shares whole (an opening): one comparison
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if a[mid * KEY_BYTES : (mid + 1) * KEY_BYTES] == b[mid * KEY_BYTES : (mid + 1) * KEY_BYTES]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def __hash__(self) -> int:
        return hash(self._packed) if self._packed is not None else hash(self._plain)

    def __repr__(self) -> str:
        return f"KeyChain({list(self)!r})"
