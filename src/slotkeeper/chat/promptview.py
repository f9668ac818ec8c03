"""A prompt's tokens as llama-server's cache will hold them, pictures included (see `media.py` for why).

A prompt without pictures is `/apply-template` then `/tokenize`, as it always was. With pictures, the rendered
text is cut at llama-server's media marker and each piece tokenized as mtmd tokenizes it (the first with
BOS, the others on their own), and the media book composes the pieces and the pictures into the view.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..llama.client import LlamaClient
from .media import MediaBook, Picture, chat_pictures


@dataclass(frozen=True)
class Rendered:
    """A chat prompt: its view (`tokens`), its text, its pictures, and how many of them the view holds (it ends
    before the first one not known yet)."""

    token_ids: list[int]
    text: str
    pictures: tuple[Picture, ...] = ()
    placed: int = 0
    pieces: tuple[tuple[int, ...], ...] = ()  # with pictures: the text pieces between them, tokenized

    @property
    def whole(self) -> bool:
        return self.placed == len(self.pictures)


class PromptViewer:
    """Renders and tokenizes prompts through llama-server, and views their pictures through the media book."""

    def __init__(self, client: LlamaClient, book: MediaBook) -> None:
        self.client = client
        self.book = book

    async def chat(self, chat: dict[str, Any], body: bytes | None = None) -> Rendered | None:
        """A chat-form body's prompt (`body`: its bytes, when the caller has them); None when llama-server
        cannot render it."""
        text = await self.client.apply_template(body or json.dumps(chat, separators=(",", ":")).encode())
        if text is None:
            return None
        marker = self.book.marker
        if not marker or marker not in text:
            tokens = await self.client.tokenize(text)
            return None if tokens is None else Rendered(tokens, text)
        return await self.text(text, chat_pictures(chat))

    async def text(self, text: str, pictures: Sequence[Picture]) -> Rendered | None:
        """A rendered prompt with media markers, and its pictures in marker order."""
        marker = self.book.marker or ""
        parts = text.split(marker)
        if len(parts) - 1 != len(pictures):  # (a template that drops or repeats a picture: none is placed)
            pictures = [Picture(None, None)] * (len(parts) - 1)
        found = await asyncio.gather(
            self.client.tokenize(parts[0]), *(self.client.tokenize(part, add_special=False) for part in parts[1:])
        )
        if any(piece is None for piece in found):
            return None
        pieces = tuple(tuple(piece or ()) for piece in found)
        tokens, placed = self.book.compose(pieces, pictures)
        if placed < len(pictures):
            self.book.pending(pieces, pictures)
        return Rendered(tokens, text, tuple(pictures), placed, pieces)
