"""A tiny random-weight vision projector (mmproj GGUF) that llama.cpp's ``llama-server`` loads, and test images.

Why: image chats change what llama-server puts in a slot (image chunks whose positions are not text tokens),
and slotkeeper's tests must exercise them on a real server, but no real projector can be downloaded. This one is
a Gemma 3 style SigLIP (``clip.projector_type`` ``gemma3``): 128-pixel images, 8-pixel patches, a 2-block ViT 64
wide, a 2x2 average pool, then an RMS norm and a projection to the text model's width. Every image is therefore
exactly ``(128 / 8)**2 / 2**2 = 64`` positions, whatever its size (llama-server resizes it to 128x128 first).
The file is about 0.4 MB (0.5 MB for a 640-wide text model) and is written in a few milliseconds.

Any text model of the right width takes it (llama-server only checks that ``projection_dim`` equals the text
model's embedding width); the ``gemma3`` projector wraps the image in the text ``<start_of_image>`` /
``<end_of_image>``, which a vocabulary without those tokens spells as several ordinary tokens.

The patch embedding is strong (std 1 per weight, position embeddings 0.1): a solid image's patches are all
alike, so its colour decides the ViT's input direction and a red and a blue picture give clearly different
embeddings; the soft-embedding norm weight (4) makes the image embeddings large enough that the text model's
greedy answer follows the colour, also for the real Gemma 3 270M (at 1 it answered red and blue alike). Same
``n_embd`` and ``seed``, byte-identical file.

Format known to load in llama.cpp b11434 (``tools/mtmd/clip.cpp``): all tensors f32; ``ffn_down`` is stored
``{n_ff, n_embd}`` so the loader does not swap up and down; the keys' types are those its ``get_u32`` /
``get_f32`` / ``get_arr_f32`` / ``get_bool`` read. Only imported by tests (needs ``numpy`` and ``gguf``).
"""

from __future__ import annotations

import base64
import os
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .ggufwrite import write_gguf

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

__all__ = ["IMAGE_POSITIONS", "IMAGE_SIZE", "image_part", "solid_png", "write_tiny_mmproj"]

IMAGE_SIZE = 128
PATCH_SIZE = 8
MERGE = 2  # clip.vision.projector.scale_factor: the 2x2 average pool after the ViT
IMAGE_POSITIONS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // MERGE**2  # 64 positions per image
_WIDTH = 64
_FF = 128
_BLOCKS = 2
_HEADS = 4
_PATCH_STD = 1.0  # strong: the colour, not the position, sets each patch's embedding
_POS_STD = 0.1
_GAIN = 4.0  # mm.soft_emb_norm: image embeddings of rms ~4 (at 1 the real Gemma 3 270M ignored the colour)


def _tensors(n_embd: int, seed: int) -> list[tuple[str, np.ndarray[Any, Any]]]:
    """All tensors in file order, numpy shapes (out, in): gguf reverses them into ggml's ``{in, out}``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    d, ff = _WIDTH, _FF

    def normal(*shape: int, std: float) -> np.ndarray[Any, Any]:
        return np.ascontiguousarray(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    def ones(n: int) -> np.ndarray[Any, Any]:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> np.ndarray[Any, Any]:
        return np.zeros(n, dtype=np.float32)

    n_patches = (IMAGE_SIZE // PATCH_SIZE) ** 2
    out = [
        ("v.patch_embd.weight", normal(d, 3, PATCH_SIZE, PATCH_SIZE, std=_PATCH_STD)),  # ggml {P, P, 3, d}
        ("v.patch_embd.bias", zeros(d)),
        ("v.position_embd.weight", normal(n_patches, d, std=_POS_STD)),
    ]
    for i in range(_BLOCKS):
        p = f"v.blk.{i}."
        out += [
            (p + f"{ln}.{part}", ones(d) if part == "weight" else zeros(d))
            for ln in ("ln1", "ln2")
            for part in ("weight", "bias")
        ]
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            out += [(p + f"{name}.weight", normal(d, d, std=d**-0.5)), (p + f"{name}.bias", zeros(d))]
        out += [
            (p + "ffn_up.weight", normal(ff, d, std=d**-0.5)),
            (p + "ffn_up.bias", zeros(ff)),
            (p + "ffn_down.weight", normal(d, ff, std=ff**-0.5)),  # ggml {ff, d}: ne[0] != d, so not swapped
            (p + "ffn_down.bias", zeros(d)),
        ]
    out += [
        ("v.post_ln.weight", ones(d)),
        ("v.post_ln.bias", zeros(d)),
        ("mm.input_projection.weight", normal(d, n_embd, std=d**-0.5)),  # ggml {n_embd, d}: ne[0] is the text width
        ("mm.soft_emb_norm.weight", ones(d) * np.float32(_GAIN)),
    ]
    return out


def _add_keys(w: Any, n_embd: int) -> None:
    """The keys clip.cpp reads for a gemma3 vision projector, with the types it reads them as."""
    w.add_string("general.name", "slotkeeper-tiny-mmproj")
    w.add_uint32("general.file_type", 0)  # ALL_F32
    w.add_string("clip.projector_type", "gemma3")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    w.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    w.add_uint32("clip.vision.embedding_length", _WIDTH)
    w.add_uint32("clip.vision.feed_forward_length", _FF)
    w.add_uint32("clip.vision.projection_dim", n_embd)
    w.add_uint32("clip.vision.block_count", _BLOCKS)
    w.add_uint32("clip.vision.attention.head_count", _HEADS)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])  # Python floats: a FLOAT32 array
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_uint32("clip.vision.projector.scale_factor", MERGE)


def write_tiny_mmproj(path: str | os.PathLike[str], n_embd: int, *, seed: int = 0) -> Path:
    """Write the projector for a text model ``n_embd`` wide to ``path`` and return the path.

    Written under a temporary name and renamed into place (as :func:`tinymodel.write_tiny_model` does), so a
    llama-server started concurrently never reads half a file. Missing parent directories are created.
    """
    if n_embd < 1:
        raise ValueError(f"n_embd must be >= 1, got {n_embd}")
    return write_gguf(path, "clip", lambda writer: _add_keys(writer, n_embd), _tensors(n_embd, seed))


def solid_png(rgb: tuple[int, int, int], size: int = IMAGE_SIZE) -> bytes:
    """A ``size`` x ``size`` PNG of one colour (8-bit RGB), from zlib and struct alone: tests need no PIL."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" + bytes(rgb) * size  # filter type 0 (None), then the pixels
    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)  # 8-bit, colour type 2 (RGB), no interlace
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(row * size)) + chunk(b"IEND", b"")
    )


def image_part(png: bytes) -> dict[str, Any]:
    """The OpenAI chat content part carrying ``png`` inline, as llama-server's ``/v1/chat/completions`` takes it."""
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
