"""Images in a chat, as llama-server's own cache knows them: each picture by its content and its positions.

Why: slotkeeper identifies a chat by its tokens. In the text llama-server renders (`/apply-template`) a
picture is a per-process random marker, `<__media_…__>`, which `/tokenize` makes into ~28 text tokens; the
slot holds the picture's own positions instead (64 for a small projector, 256 for Gemma 3), and llama-server
knows each by its id, the sha256 of the image's bytes (`mtmd_helper_bitmap_init_from_buf`). So slotkeeper's
view of a prompt puts the picture where llama-server puts it: the text between markers tokenized piece by
piece as mtmd does (`mtmd_tokenizer`), each picture as `image_tokens(id, n)`, wrapped in the tokens mtmd puts
around every picture (`<start_of_image>` … `<end_of_image>` on Gemma 3). A slot file's view (`statefile`) is
the same with its own ids, so a chat is found again after a restart, and two chats that differ only by their
picture never share a key.

What a picture takes is llama-server's to say, not slotkeeper's to compute (each projector resizes, tiles and
wraps its own way): `MediaBook` learns it from slot files, the positions of each image and, once, the wrap,
matching a saved file against the prompt that made it. Until a picture is known, a prompt's view ends before
it: a prefix is never wrong, only shorter. Nothing here does I/O; `promptview.py` asks llama-server.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

IMAGE_TOKEN_FLOOR = -(1 << 30)  # image tokens are below this: never a vocabulary id, never LLAMA_TOKEN_NULL
_IMAGE_TOKEN_SPAN = 1 << 29
MEDIA_PARTS = frozenset({"image_url", "input_audio", "input_video", "video_url"})  # each names its own member
PENDING = 16  # prompts with pictures kept until a slot file teaches the wrap
IDS_REMEMBERED = 4096  # pictures whose id is known from their base64 text
_IDS: dict[bytes, str] = {}  # xxh3 of a picture's base64 text -> its id (oldest first)


@dataclass(frozen=True)
class ImageSpan:
    """One media chunk in a slot: where its positions start, how many, and the image's id."""

    start: int
    n: int
    id: str


class Learnt(enum.Enum):
    """What a slot file taught the media book."""

    POSITIONS = "positions"  # its pictures' positions (or nothing new)
    WRAP = "wrap"  # and, for the first time, the wrap
    UNFIT = "unfit"  # the file fits no wrap with the prompt that made it (the first such file)


@dataclass(frozen=True)
class Wrap:
    """The tokens mtmd puts before and after every picture (per projector: `img_beg`, `img_end`)."""

    begin: tuple[int, ...]
    end: tuple[int, ...]


def image_tokens(image_id: str, n: int) -> list[int]:
    """What stands for a picture's `n` positions in a view: numbers no tokenizer makes, derived from its id."""
    try:
        base = int(image_id[:15], 16)
    except ValueError:
        base = int.from_bytes(hashlib.sha256(image_id.encode()).digest()[:8], "little")
    return [IMAGE_TOKEN_FLOOR - (base + i) % _IMAGE_TOKEN_SPAN for i in range(n)]


def shows_picture(tokens: Sequence[int], start: int, end: int) -> bool:
    """A picture's positions lie in tokens[start:end] of a prompt's view."""
    return any(t < IMAGE_TOKEN_FLOOR for t in tokens[start:end])


def view_of(tokens: array[int], spans: Sequence[ImageSpan]) -> array[int]:
    """A slot file's tokens with each media chunk's positions standing for its image."""
    out = array("i", tokens)
    for span in spans:
        out[span.start : span.start + span.n] = array("i", image_tokens(span.id, span.n))
    return out


# ---- the pictures of a request --------------------------------------------------------------------------------


def image_id(data: bytes) -> str:
    """llama-server's id of an image: the sha256 of its bytes, in hex."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Picture:
    """One media part of a chat, in the order its marker comes: its id and base64 data, or neither (given by
    URL or file: llama-server fetches those, and slotkeeper does not see their bytes)."""

    id: str | None
    data: str | None


def chat_pictures(chat: dict[str, Any]) -> list[Picture]:
    """The media parts of a chat-form body, in message and part order (llama-server's marker order)."""
    pictures: list[Picture] = []
    messages = chat.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                pictures.append(_picture(part.get(kind)))
    return pictures


def _picture(source: Any) -> Picture:
    url = source if isinstance(source, str) else None
    if isinstance(source, dict):
        url = source.get("data") or source.get("url")
    if not isinstance(url, str) or url.startswith(("http", "file://")):
        return Picture(None, None)
    data = url.partition(",")[2] if url.startswith("data:") else url
    seen = xxhash.xxh3_128_digest(data.encode())  # a chat re-sends its pictures each turn: decoded and hashed once
    ident = _IDS.get(seen)
    if ident is None:
        try:
            raw = base64.b64decode(data)
        except (binascii.Error, ValueError):
            return Picture(None, None)
        if not raw:
            return Picture(None, None)
        ident = _IDS[seen] = image_id(raw)
        while len(_IDS) > IDS_REMEMBERED:
            del _IDS[next(iter(_IDS))]
    return Picture(ident, data)


def media_prompt(text: str, pictures: Sequence[Picture]) -> dict[str, Any]:
    """A `/completion` prompt with pictures: llama-server tokenizes it exactly as the chat path does."""
    return {"prompt_string": text, "multimodal_data": [p.data for p in pictures]}


@dataclass(frozen=True)
class MediaBoundary:
    """A turn boundary with pictures whose positions no slot file has shown yet: its text pieces and pictures,
    composed into tokens once the file that holds it has taught the media book (`store._commit`)."""

    pieces: tuple[tuple[int, ...], ...]
    pictures: tuple[Picture, ...]

    def token_ids(self, book: MediaBook) -> list[int] | None:
        tokens, placed = book.compose(self.pieces, self.pictures)
        return tokens if placed == len(self.pictures) else None


# ---- what llama-server does with a picture ----------------------------------------------------------------------


class MediaBook:
    """The positions each picture takes and the wrap mtmd puts around them, as this model's slot files show.

    One writer: this object. It learns from every slot file committed or found (`learn_file`, `remember`) and
    from the prompts with pictures rendered lately (`pending`); `compose` reads it.
    """

    def __init__(self, marker: str | None = None) -> None:
        self.marker = marker  # what this llama-server writes for a picture in a rendered prompt (its /props)
        self.positions: dict[str, int] = {}  # image id -> positions (0: several chunks, a tiled picture)
        self.wrap: Wrap | None = None
        self._pending: OrderedDict[str, Sequence[Sequence[int]]] = OrderedDict()  # first image id -> text pieces
        self.unfit = False  # a file fit no wrap: until one does, pictures end a prompt's view (said once)

    def compose(self, pieces: Sequence[Sequence[int]], pictures: Sequence[Picture]) -> tuple[list[int], int]:
        """A prompt's view from its text pieces (tokenized as mtmd does: the first with BOS, the rest without)
        and its pictures; and how many pictures it holds. It ends before the first picture not known yet."""
        out = list(pieces[0])
        for i, picture in enumerate(pictures):
            n = self.positions.get(picture.id or "", 0)
            if self.wrap is None or not n or i + 1 >= len(pieces):
                return out, i
            out += [*self.wrap.begin, *image_tokens(str(picture.id), n), *self.wrap.end, *pieces[i + 1]]
        return out, len(pictures)

    def pending(self, pieces: Sequence[Sequence[int]], pictures: Sequence[Picture]) -> None:
        """Keep a prompt whose pictures are not all known, to learn the wrap from the file it makes."""
        if self.wrap is None and pictures and pictures[0].id is not None:
            self._pending[pictures[0].id] = pieces
            self._pending.move_to_end(pictures[0].id)
            while len(self._pending) > PENDING:
                self._pending.popitem(last=False)

    def remember(self, images: Sequence[tuple[str, int]], wrap: Wrap | None) -> None:
        """What an entry's manifest says (an entry found at start, or adopted from the shared tier)."""
        for ident, n in images:
            self.positions.setdefault(ident, n)
        if self.wrap is None and wrap is not None:
            self.wrap = wrap

    def learn_file(self, tokens: array[int], spans: Sequence[ImageSpan]) -> Learnt:
        """Learn from a slot file's tokens and media chunks (the positions always; the wrap once)."""
        seen: dict[str, int] = {}
        for span in spans:
            seen[span.id] = 0 if span.id in seen else span.n
        for ident, n in seen.items():
            self.positions.setdefault(ident, n)
        if self.wrap is not None or not spans:
            return Learnt.POSITIONS
        pieces = self._pending.get(spans[0].id)
        if pieces is None:
            return Learnt.POSITIONS
        wrap = _wrap_of(tokens, spans, pieces)
        if wrap is None:
            first, self.unfit = not self.unfit, True
            return Learnt.UNFIT if first else Learnt.POSITIONS
        self.wrap = wrap
        self._pending.clear()
        return Learnt.WRAP


def _wrap_of(tokens: array[int], spans: Sequence[ImageSpan], pieces: Sequence[Sequence[int]]) -> Wrap | None:
    """The wrap that makes the prompt's pieces and the file's media chunks into the file's tokens, or None."""
    first, head = spans[0], list(pieces[0])
    if len(pieces) < 2 or list(tokens[: len(head)]) != head or len(head) > first.start:
        return None
    begin = tuple(tokens[len(head) : first.start])
    after, follow = first.start + first.n, list(pieces[1])
    stop = spans[1].start - len(begin) if len(spans) > 1 else len(tokens)
    for j in range(0, min(17, stop - after + 1)):
        if not follow and after + j != stop:
            continue
        if list(tokens[after + j : after + j + len(follow)]) == follow:
            wrap = Wrap(begin, tuple(tokens[after : after + j]))
            return wrap if _fits(tokens, spans, pieces, wrap) else None
    return None


def _fits(tokens: array[int], spans: Sequence[ImageSpan], pieces: Sequence[Sequence[int]], wrap: Wrap) -> bool:
    """Whether the wrap rebuilds every picture of the file the way the file holds it."""
    out = list(pieces[0])
    for span, piece in zip(spans, pieces[1:]):
        if len(out) + len(wrap.begin) != span.start:
            return False
        out += [*wrap.begin, *[-1] * span.n, *wrap.end, *piece]
    return list(tokens[: len(out)]) == out[: len(tokens)]
