"""Reading the tokens out of llama-server's slot save files (llama.cpp's seq-state format).

A slot file is `llama_state_seq_save_file`'s output: magic (`ggsq`), format version, a count, that many
32-bit words, then the KV state. The words are the slot's tokens: a plain list, or (b11434 and later,
`server_tokens::serialize`) a packed payload that starts with LLAMA_TOKEN_NULL: payload version, the token
list, then media chunk keys. slotkeeper reads the tokens to know, without asking llama-server, which
conversation a file holds; and the format version, because llama-server refuses a file of another version
with a misleading "no space in KV cache or invalid file".
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass
from pathlib import Path

SEQ_MAGIC = 0x67677371  # 'ggsq' (LLAMA_FILE_MAGIC_GGSQ)
TOKEN_NULL = -1  # LLAMA_TOKEN_NULL: starts a packed payload; stands for media positions in it
HEADER = struct.Struct("<III")  # magic, version, word count


class StateFileError(ValueError):
    """Not a slot file slotkeeper can read (the message says why)."""


@dataclass(frozen=True)
class StateHeader:
    version: int  # LLAMA_STATE_SEQ_VERSION of the llama.cpp that wrote it
    layout: str  # "plain", or "packed-<n>" for server_tokens' packed payload version n
    tokens: array[int]  # array('i'); media positions are TOKEN_NULL
    media_chunks: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def read_header(path: Path) -> StateHeader:
    """The format version and the tokens of a slot file; StateFileError when it is not one."""
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
        if len(head) < HEADER.size:
            raise StateFileError("shorter than a slot file header")
        magic, version, count = HEADER.unpack(head)
        if magic != SEQ_MAGIC:
            raise StateFileError(f"not a llama.cpp sequence state file (magic {magic:08x})")
        raw = f.read(count * 4)
    if len(raw) != count * 4:
        raise StateFileError(f"truncated: {count} token words announced, {len(raw) // 4} there")
    words = array("i", raw)
    if not count or words[0] != TOKEN_NULL:
        return StateHeader(version, "plain", words)
    return _unpack(version, words)


def _unpack(version: int, words: array[int]) -> StateHeader:
    """server_tokens::serialize: NULL marker, u32 payload version, u32 n, n tokens, u32 m, m media keys, chunks."""
    if len(words) < 3:
        raise StateFileError("packed token payload too short")
    payload_version = words[1] & 0xFFFFFFFF
    n = words[2] & 0xFFFFFFFF
    if 3 + n + 1 > len(words):
        raise StateFileError(f"packed token payload announces {n} tokens in {len(words)} words")
    tokens = words[3 : 3 + n]
    media = words[3 + n] & 0xFFFFFFFF
    return StateHeader(version, f"packed-{payload_version}", tokens, media)
