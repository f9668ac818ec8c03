"""Pictures as slotkeeper sees them: read from slot files, learnt, and composed into a prompt's view (no server)."""

from __future__ import annotations

import base64
import struct
from array import array

from slotkeeper.chat.media import Learnt, MediaBook, Picture, Wrap, chat_pictures, image_id, image_tokens
from slotkeeper.store.statefile import SEQ_MAGIC, read_header

BOS, BEGIN, END = 2, 255999, 256000


def chunk(ident: str, n_text: int = 0) -> bytes:
    """An mtmd image chunk as `mtmd_input_chunk_save` writes it (serialization v2)."""
    body = struct.pack("<QIQ", 2, 1, n_text) + b"\0" * 4 * n_text + b"\1"
    body += struct.pack("<5I", 8, 8, 0, 0, 1) + struct.pack("<Q", len(ident)) + ident.encode() + b"batch"
    return struct.pack("<I", len(body)) + body


def packed_file(tmp_path, tokens: list[int], images: list[tuple[int, str]]):
    """A slot file of b11434's packed layout: tokens (-1 at picture positions), then each chunk's start and data."""
    payload = array("i", [-1, 1, len(tokens), *tokens, len(images), *(start for start, _ in images)]).tobytes()
    payload += b"".join(chunk(ident) for _, ident in images)
    payload += b"\0" * (-len(payload) % 4)
    path = tmp_path / "slot.bin"
    path.write_bytes(struct.pack("<III", SEQ_MAGIC, 9, len(payload) // 4) + payload + b"kv state")
    return path


RED, BLUE = image_id(b"red"), image_id(b"blue")


def file_of(tmp_path, first: str, second: str):
    # BOS, "hi", <begin>, 4 positions, <end>, "and", <begin>, 3 positions, <end>, "?", reply
    tokens = [BOS, 10, 11, BEGIN, *[-1] * 4, END, 12, BEGIN, *[-1] * 3, END, 13, 14, 15]
    return read_header(packed_file(tmp_path, tokens, [(4, first), (11, second)]))


def test_a_slot_file_says_where_each_picture_sits_and_whose_it_is(tmp_path):
    header = file_of(tmp_path, RED, BLUE)
    assert [(s.start, s.n, s.id) for s in header.images] == [(4, 4, RED), (11, 3, BLUE)]
    assert list(header.view[4:8]) == image_tokens(RED, 4) and list(header.view[11:14]) == image_tokens(BLUE, 3)
    assert header.n_tokens == len(header.view) == 18
    other = file_of(tmp_path, BLUE, RED)
    assert list(other.token_ids) == list(header.token_ids), "llama-server's token list is the same for both"
    assert list(other.view) != list(header.view), "the views differ by their pictures"


def test_the_book_learns_the_wrap_from_a_file_and_composes_the_same_view(tmp_path):
    header = file_of(tmp_path, RED, BLUE)
    pieces = ((BOS, 10, 11), (12,), (13,))
    pictures = [Picture(RED, "r"), Picture(BLUE, "b")]
    book = MediaBook("<m>")
    assert book.compose(pieces, pictures) == ([BOS, 10, 11], 0), "nothing known: the view ends before it"
    book.pending(pieces, pictures)
    assert book.learn_file(header.token_ids, header.images) is Learnt.WRAP
    assert book.wrap == Wrap((BEGIN,), (END,))
    view, placed = book.compose(pieces, pictures)
    assert placed == 2 and view == list(header.view[:16])
    swapped, _ = book.compose(pieces, pictures[::-1])
    assert swapped != view
    unknown, placed = book.compose(pieces, [Picture(RED, "r"), Picture(image_id(b"green"), "g")])
    assert placed == 1 and unknown == list(header.view[:10])


def test_a_file_that_fits_no_wrap_teaches_none(tmp_path):
    header = file_of(tmp_path, RED, BLUE)
    book = MediaBook("<m>")
    book.pending(((BOS, 10, 99), (12,), (13,)), [Picture(RED, "r"), Picture(BLUE, "b")])
    assert book.learn_file(header.token_ids, header.images) is Learnt.UNFIT and book.wrap is None
    assert book.learn_file(header.token_ids, header.images) is Learnt.POSITIONS, "said once"
    assert book.positions == {RED: 4, BLUE: 3}, "the positions are learnt all the same"


def test_the_pictures_of_a_chat_in_marker_order():
    red, blue = base64.b64encode(b"red").decode(), base64.b64encode(b"blue").decode()
    chat = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{red}"}},
                ],
            },
            {"role": "assistant", "content": "ok"},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": blue}},
                    {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                ],
            },
        ]
    }
    assert chat_pictures(chat) == [Picture(RED, red), Picture(BLUE, blue), Picture(None, None)]
