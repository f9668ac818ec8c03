"""Prefix keys: chained hashes of fixed-size token blocks (as vLLM's prefix cache keys its blocks).

Key i covers tokens [0, (i + 1) * BLOCK_TOKENS): it hashes block i together with key i - 1, so two token
sequences share key i exactly when they share that whole prefix. Finding the longest common prefix of a
request and a stored conversation is then a comparison of short strings, or one dict lookup per key, and
a manifest can carry its conversation's keys instead of its tokens.

The same chaining over request *units* (one chat message, or one fixed-size piece of prompt text) lets
placement recognise a chat continuing in its own slot without asking llama-server to tokenize it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

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
