"""The tiny models' tokenizer: a byte-level GPT-2 vocabulary with merges, special tokens, chat templates.

Why apart from tinymodel.py: the vocabulary is the same for every tiny model, whatever its shape or weights,
and needs neither numpy nor ``gguf``; tests that reason about token ids (a byte's id is its value, BOS and EOS
follow) read it here. A model with a chat template appends the special tokens of the template's family
(``<|im_start|>``... for Qwen, ``<start_of_turn>``... for Gemma) after it; the templates themselves are the
Jinja files in ``templates/``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "N_BYTE_TOKENS",
    "TEMPLATES",
    "Vocab",
    "add_tokenizer",
    "chat_template_text",
    "family_vocab",
    "template_family",
    "vocab_tokens",
]

#: Chat templates that can be embedded (``TinyModelSpec.template``).
TEMPLATES: tuple[str, ...] = ("qwen35", "qwen3", "gemma")
_TEMPLATE_FILES = {"qwen35": "qwen35.jinja", "qwen3": "qwen3.jinja", "gemma": "gemma3.jinja"}
_TEMPLATE_FAMILY = {"qwen35": "qwen", "qwen3": "qwen", "gemma": "gemma"}

#: Token ids. Bytes first (id == byte value) so a byte's token id is obvious in tests.
N_BYTE_TOKENS = 256
BOS_ID = 256
EOS_ID = 257
BOS_TEXT = "<|startoftext|>"
EOS_TEXT = "<|endoftext|>"  # a spelling llama.cpp recognizes as end-of-generation (else it warns)

# gguf TokenType values (gguf.TokenType), kept here so the vocabulary needs no gguf import.
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

#: Special tokens appended after the llama vocabulary, per template family (spelling, type).
#: Qwen marks ``<think>``/``<tool_call>``... as non-special added tokens (USER_DEFINED in GGUF).
_FAMILY_SPECIALS: dict[str, tuple[tuple[str, int], ...]] = {
    "qwen": (
        ("<|im_start|>", _TOKEN_CONTROL),
        ("<|im_end|>", _TOKEN_CONTROL),
        ("<|vision_start|>", _TOKEN_CONTROL),
        ("<|vision_end|>", _TOKEN_CONTROL),
        ("<|vision_pad|>", _TOKEN_CONTROL),
        ("<|image_pad|>", _TOKEN_CONTROL),
        ("<|video_pad|>", _TOKEN_CONTROL),
        ("<tool_call>", _TOKEN_USER_DEFINED),
        ("</tool_call>", _TOKEN_USER_DEFINED),
        ("<tool_response>", _TOKEN_USER_DEFINED),
        ("</tool_response>", _TOKEN_USER_DEFINED),
        ("<think>", _TOKEN_USER_DEFINED),
        ("</think>", _TOKEN_USER_DEFINED),
    ),
    "gemma": (
        ("<pad>", _TOKEN_CONTROL),
        ("<eos>", _TOKEN_CONTROL),
        ("<bos>", _TOKEN_CONTROL),
        ("<start_of_turn>", _TOKEN_CONTROL),
        ("<end_of_turn>", _TOKEN_CONTROL),
        ("<start_of_image>", _TOKEN_CONTROL),
        ("<end_of_image>", _TOKEN_CONTROL),
    ),
}
#: (bos, eos, eot, pad, add_bos) spellings per template family.
_FAMILY_IDS: dict[str, tuple[str, str, str, str, bool]] = {
    "qwen": (EOS_TEXT, "<|im_end|>", "<|im_end|>", EOS_TEXT, False),
    "gemma": ("<bos>", "<eos>", "<end_of_turn>", "<pad>", True),
}

#: Letters whose pairs get merged tokens (the most frequent English letters).
_PAIR_LETTERS = "etaoinshrdlcumwf"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table.

    llama.cpp's ``gpt2`` tokenizer looks byte tokens up by this spelling, so the 256 byte
    tokens must use it for every input byte to be representable.
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


Vocab = tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...], tuple[bool, ...]]
_VOCAB_CACHE: Vocab | None = None


def vocab_tokens() -> Vocab:
    """Return ``(tokens, token_types, merges, allowed)`` of the fixed tiny vocabulary.

    ``allowed[i]`` says whether the output head lets token ``i`` be generated: printable
    ASCII bytes and merged-letter tokens yes, control tokens and other bytes no. The
    vocabulary does not depend on the spec, so every tiny model tokenizes alike.
    (Models with a chat template append their special tokens, see ``TinyModelSpec.template``.)
    """
    global _VOCAB_CACHE
    if _VOCAB_CACHE is not None:
        return _VOCAB_CACHE
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(N_BYTE_TOKENS)]
    types = [_TOKEN_NORMAL] * N_BYTE_TOKENS
    allowed = [0x20 <= b <= 0x7E for b in range(N_BYTE_TOKENS)]
    tokens += [BOS_TEXT, EOS_TEXT]
    types += [_TOKEN_CONTROL, _TOKEN_CONTROL]
    allowed += [False, False]

    space = b2u[ord(" ")]  # "Ġ"
    pairs: list[tuple[str, str]] = []
    pairs += [(space, c) for c in "abcdefghijklmnopqrstuvwxyz"]
    pairs += [(a, b) for a in _PAIR_LETTERS for b in _PAIR_LETTERS]
    pairs += [(space, c) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    pairs += [(space, c) for c in "0123456789"]
    merges = [f"{a} {b}" for a, b in pairs]
    tokens += [a + b for a, b in pairs]
    types += [_TOKEN_NORMAL] * len(pairs)
    allowed += [True] * len(pairs)
    assert len(set(tokens)) == len(tokens), "duplicate token spelling"
    _VOCAB_CACHE = (tuple(tokens), tuple(types), tuple(merges), tuple(allowed))
    return _VOCAB_CACHE


def template_family(template: str | None) -> str | None:
    """The tokenizer family of a chat template (``None``: no template, the plain llama vocabulary)."""
    return None if template is None else _TEMPLATE_FAMILY[template]


def family_vocab(family: str | None) -> Vocab:
    """The llama vocabulary plus the family's special tokens (never allowed as output)."""
    tokens, types, merges, allowed = vocab_tokens()
    if family is None:
        return tokens, types, merges, allowed
    specials = _FAMILY_SPECIALS[family]
    out = (
        tokens + tuple(t for t, _ in specials),
        types + tuple(k for _, k in specials),
        merges,
        allowed + (False,) * len(specials),
    )
    assert len(set(out[0])) == len(out[0]), "duplicate token spelling"
    return out


def chat_template_text(name: str) -> str:
    """The Jinja source of the named chat template (one of :data:`TEMPLATES`)."""
    from importlib.resources import files

    if name not in _TEMPLATE_FILES:
        raise ValueError(f"unknown chat template {name!r}; expected one of {', '.join(TEMPLATES)}")
    return (
        files(__package__ or "slotkeeper.testing")
        .joinpath("templates", _TEMPLATE_FILES[name])
        .read_text(encoding="utf-8")
    )


def add_tokenizer(w: Any, template: str | None) -> None:
    """Write the tokenizer keys (and the chat template, if any) of the vocabulary for `template`."""
    family = template_family(template)
    tokens, types, merges, _ = family_vocab(family)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt-2")
    w.add_array("tokenizer.ggml.tokens", list(tokens))
    w.add_array("tokenizer.ggml.token_type", list(types))  # int32 array, as llama.cpp reads it
    w.add_array("tokenizer.ggml.merges", list(merges))
    if family is None:
        w.add_uint32("tokenizer.ggml.bos_token_id", BOS_ID)
        w.add_uint32("tokenizer.ggml.eos_token_id", EOS_ID)
        w.add_bool("tokenizer.ggml.add_bos_token", True)
        w.add_bool("tokenizer.ggml.add_eos_token", False)
    else:
        bos, eos, eot, pad, add_bos = _FAMILY_IDS[family]
        w.add_uint32("tokenizer.ggml.bos_token_id", tokens.index(bos))
        w.add_uint32("tokenizer.ggml.eos_token_id", tokens.index(eos))
        w.add_uint32("tokenizer.ggml.eot_token_id", tokens.index(eot))
        w.add_uint32("tokenizer.ggml.padding_token_id", tokens.index(pad))
        w.add_bool("tokenizer.ggml.add_bos_token", add_bos)
        w.add_bool("tokenizer.ggml.add_eos_token", False)
    if template is not None:
        w.add_string("tokenizer.chat_template", chat_template_text(template))
