"""Reading the tokens out of llama-server's slot save files (llama.cpp's seq-state format).

A slot file is `llama_state_seq_save_file`'s output: magic (`ggsq`), format version, a count, that many
32-bit words, then the KV state. The words are the slot's tokens: a plain list, or (b11349 and b11434 both,
`server_tokens::serialize`) a packed payload that starts with LLAMA_TOKEN_NULL: payload version, the token
list, then the media chunks (each image's start, and its mtmd chunk with the image's id: the sha256 of its
bytes). slotkeeper reads the tokens to know, without asking llama-server, which conversation a file holds;
and the format version, because llama-server refuses a file of another version with a misleading "no space
in KV cache or invalid file". What follows the tokens, and what else a server compares, is statelayout's.

An image's positions hold LLAMA_TOKEN_NULL in the token list, the same for every picture; `StateHeader.view`
puts the image's own identity there (`media.image_tokens`), so that two chats that differ only by their
picture never share a key.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass
from pathlib import Path

from ..chat.media import ImageSpan, view_of

SEQ_MAGIC = 0x67677371  # 'ggsq' (LLAMA_FILE_MAGIC_GGSQ)
TOKEN_NULL = -1  # LLAMA_TOKEN_NULL: starts a packed payload; stands for media positions in it
HEADER = struct.Struct("<III")  # magic, version, word count


class StateFileError(ValueError):
    """Not a slot file slotkeeper can read (the message says why)."""


@dataclass(frozen=True)
class StateHeader:
    """What a slot file says before its state: the format that wrote it and the tokens (and images) it holds,
    read without loading the state."""

    version: int  # LLAMA_STATE_SEQ_VERSION of the llama.cpp that wrote it
    layout: str  # "plain", or "packed-<n>" for server_tokens' packed payload version n
    token_ids: array[int]  # array('i'); media positions are TOKEN_NULL
    media_chunks: int = 0
    images: tuple[ImageSpan, ...] = ()  # where each media chunk sits, and whose it is

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def image_positions(self) -> tuple[tuple[str, int], ...]:
        """Each picture's id and positions, in order (what an entry's manifest keeps: `Entry.images`)."""
        return tuple((image.id, image.n) for image in self.images)

    @property
    def view(self) -> array[int]:
        """The tokens with each image's positions standing for that image (what slotkeeper keys files by)."""
        return view_of(self.token_ids, self.images) if self.images else self.token_ids


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
    if 3 + n + 1 + media > len(words):
        raise StateFileError(f"packed token payload announces {media} media chunks in {len(words)} words")
    starts = [w & 0xFFFFFFFF for w in words[4 + n : 4 + n + media]]
    images = _images(words[4 + n + media :].tobytes(), starts, tokens) if media else ()
    return StateHeader(version, f"packed-{payload_version}", tokens, media, images)


def _images(chunks: bytes, starts: list[int], tokens: array[int]) -> tuple[ImageSpan, ...]:
    """Each media chunk's start, length (its run of TOKEN_NULL) and id, read from its serialized mtmd chunk:
    u32 size, then (mtmd's serialization v2) u64 version, u32 type, u64 n text tokens and those, u8 has
    image, and then the image's nx, ny, pos type, index, temporal merge (u32 each) and its id (u64 length and
    bytes). An audio chunk (u8 has audio after no image) keeps its id too: n tokens, then the id."""
    spans: list[ImageSpan] = []
    at = 0
    for start in starts:
        if at + 4 > len(chunks):
            raise StateFileError("media chunk cut off")
        (size,) = struct.unpack_from("<I", chunks, at)
        chunk, at = chunks[at + 4 : at + 4 + size], at + 4 + size
        end = start
        while end < len(tokens) and tokens[end] == TOKEN_NULL:
            end += 1
        spans.append(ImageSpan(start, end - start, _chunk_id(chunk)))
    return tuple(spans)


def _chunk_id(chunk: bytes) -> str:
    try:
        _, _, n_text = struct.unpack_from("<QIQ", chunk, 0)
        at = 20 + 4 * n_text
        if chunk[at]:  # an image: nx, ny, pos, image_idx, n_temporal_merge
            at += 1 + 20
        else:  # an audio chunk: has-audio byte, n tokens
            at += 2 + 4
        (length,) = struct.unpack_from("<Q", chunk, at)
        ident = chunk[at + 8 : at + 8 + length]
    except (struct.error, IndexError) as exc:
        raise StateFileError(f"media chunk unreadable: {exc}") from exc
    if len(ident) != length:
        raise StateFileError("media chunk id cut off")
    return ident.decode("ascii", "replace")
