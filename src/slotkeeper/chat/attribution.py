"""Claude Code's attribution line, dropped from a request's system part so that every session shares one opening.

Claude Code opens the system part of every `/v1/messages` request with a text block of its own,
`x-anthropic-billing-header: cc_version=2.1.197.58e; cc_entrypoint=sdk-cli;` (older builds add `cch=<5 hex>;`).
Three characters of it are derived from the session's first prompt, so two sessions share only the first ~47
characters of their prompts: every new session re-prefills the whole system prompt and tools (10k-54k tokens),
and a saved opening never matches the next session's. llama-server only blanks the `cch=` stamp; vLLM drops the
whole line before the template (vllm PR 36829), as this module does.

Only a block that is exactly such a line (`x-anthropic-billing-header:` and `key=value;` pairs) and comes first
is dropped, from the first system block list of the three APIs' bodies: Anthropic's `system`, and a system or
developer message's content parts in chat completions (`messages`) or Responses (`input`). Every other byte of
the body is kept as sent: the block is cut out of the bytes, never re-serialized.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..log import log
from ..proxy.hook import CompletionHook, Placed
from .apis import Api, api_of

ATTRIBUTION_PREFIX = "x-anthropic-billing-header:"
_MARKER = ATTRIBUTION_PREFIX.encode()
_LINE = re.compile(r"x-anthropic-billing-header:(?:[ \t]*[A-Za-z0-9_.-]+=[^;\r\n]*;)+[ \t\r\n]*")
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_SYSTEM_ROLES = ("system", "developer")
_TEXT_PARTS = ("text", "input_text")


def is_attribution_line(text: object) -> bool:
    """`text` is exactly an attribution line: the prefix, one or more `key=value;` pairs, trailing space."""
    return isinstance(text, str) and _LINE.fullmatch(text) is not None


def drop_attribution_line(path: str, body: bytes) -> bytes | None:
    """The body without its leading attribution block, or None when it has none (the body goes as sent).

    Cheap for every other request: a body that does not hold the prefix's bytes is not parsed.
    """
    if _MARKER not in body:
        return None
    api = api_of(path)
    if api is None or not api.templated:
        return None
    try:
        text = body.decode()
        top = _members(text, _skip(text, 0))
        cut = _cut_span(api, text, top)
    except (ValueError, IndexError, StopIteration, RecursionError):
        return None  # not a JSON object as expected: llama-server answers it as it would
    if cut is None:
        return None
    start, end = cut
    return (text[:start] + text[end:]).encode()


@dataclass(frozen=True)
class _Span:
    """One value in the body's text: where it starts and ends, and what it is."""

    start: int
    end: int
    value: Any


def _cut_span(api: Api, text: str, top: dict[str, _Span]) -> tuple[int, int] | None:
    """Where the attribution block to drop lies in `text`, if the body has one where a client puts it."""
    if api is Api.MESSAGES:
        system = top.get("system")
        if system is None or not isinstance(system.value, list):
            return None
        return _leading_block(text, system.start)
    listed = top.get("messages" if api is Api.CHAT else "input")
    if listed is None or not isinstance(listed.value, list) or not listed.value:
        return None
    first = listed.value[0]
    if not isinstance(first, dict) or first.get("role") not in _SYSTEM_ROLES:
        return None
    elements = _elements(text, listed.start)
    if is_attribution_line(first.get("content")) and len(elements) > 1:
        return elements[0].start, elements[1].start  # a system message that is only the line, before the rest
    content = _members(text, elements[0].start).get("content")
    if content is None or not isinstance(content.value, list):
        return None
    return _leading_block(text, content.start)


def _leading_block(text: str, array_start: int) -> tuple[int, int] | None:
    """The span of a block list's first element, with the separator after it, when that is an attribution line."""
    elements = _elements(text, array_start)
    if not elements:
        return None
    block = elements[0].value
    if (
        not isinstance(block, dict)
        or block.get("type") not in _TEXT_PARTS
        or not is_attribution_line(block.get("text"))
    ):
        return None
    if len(elements) > 1:
        return elements[0].start, elements[1].start
    return elements[0].start, elements[0].end  # the only block: the list is left empty


def _skip(text: str, at: int) -> int:
    match = _WHITESPACE.match(text, at)
    assert match is not None  # (the pattern matches the empty string)
    return match.end()


def _members(text: str, at: int) -> dict[str, _Span]:
    """The members of the object that starts at `at`, by key (the last of duplicates, as llama-server keeps)."""
    members: dict[str, _Span] = {}
    for key, value in _items(text, at, "{}"):
        if key is None:
            raise ValueError("not a key")
        members[key] = value
    return members


def _elements(text: str, at: int, limit: int = 2) -> list[_Span]:
    """The first `limit` elements of the array that starts at `at` (the rest is not parsed)."""
    elements: list[_Span] = []
    for _, value in _items(text, at, "[]"):
        elements.append(value)
        if len(elements) == limit:
            break
    return elements


def _items(text: str, at: int, brackets: str) -> Iterator[tuple[str | None, _Span]]:
    """The members (key and value) of an object, or the elements (no key) of an array, that starts at `at`;
    each is parsed only when it is reached."""
    if text[at] != brackets[0]:
        raise ValueError(f"not {brackets}")
    at = _skip(text, at + 1)
    if text[at] == brackets[1]:
        return
    while True:
        key = None
        if brackets == "{}":
            key, at = _DECODER.raw_decode(text, at)
            at = _skip(text, at)
            if not isinstance(key, str) or text[at] != ":":
                raise ValueError("not a member")
            at = _skip(text, at + 1)
        value, end = _DECODER.raw_decode(text, at)
        yield key, _Span(at, end, value)
        at = _skip(text, end)
        if text[at] == brackets[1]:
            return
        if text[at] != ",":
            raise ValueError("no comma")
        at = _skip(text, at + 1)


class AttributionFilter:
    """The proxy's completion hook with the attribution line dropped first, for the hook behind it (placement, or
    the router) or for none (`--no-placement`): the line never reaches the prompt either way.

    The one writer of its count; the first drop is said in one line, the rest counted (status, metrics).
    """

    def __init__(self, inner: CompletionHook | None) -> None:
        self._inner = inner
        self._dropped = 0

    @property
    def dropped(self) -> int:
        """Requests whose attribution line was dropped."""
        return self._dropped

    def wants(self, method: bytes, path: str) -> bool:
        if self._inner is not None and self._inner.wants(method, path):
            return True
        api = api_of(path)
        return method == b"POST" and api is not None and api.templated

    async def place(self, path: str, body: bytes) -> Placed:
        dropped = drop_attribution_line(path, body)
        if dropped is not None:
            if not self._dropped:
                log.info(
                    "%s: Claude Code's attribution line is dropped from the system prompt, so that every session "
                    "shares one opening (--keep-attribution-line keeps it)",
                    path,
                )
            self._dropped += 1
            body = dropped
        if self._inner is None:
            return Placed(body)
        return await self._inner.place(path, body)
