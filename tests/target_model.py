"""llama-server's reading of a request's query and of ``POST /slots/:id_slot``, as a reference model.

slotkeeper routes on the path alone (``slotkeeper.proxy.target.read_path``); these readings of the rest are what the
tests check the proxy's rules and llama-server itself against (cpp-httplib's ``parse_query_text`` and
``decode_query_component``, ``server-http.cpp``'s ``get_params``: the last value of a name wins, and the
``id_slot`` path parameter overrides a query parameter of that name after a second ``%XX`` decoding).
"""

from __future__ import annotations

import re

from slotkeeper.proxy.target import _ESCAPE, RefusedTarget, _byte, read_path

SLOTS_ROUTE = "/slots/"  # llama-server's POST /slots/:id_slot
INT_MIN, INT_MAX = -(2**31), 2**31 - 1  # std::stoi's range (a 32-bit int)
_ESCAPE_STR = re.compile(r"%([0-9A-Fa-f]{2})")
# std::stoi -> strtol(base 10): C-locale white space, a sign, digits; whatever follows is ignored
_STOI = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


def _char(match: re.Match[str]) -> str:
    return chr(int(match.group(1), 16))


class Target:
    """A request target as llama-server reads it: the decoded path it routes on, and the raw query."""

    __slots__ = ("path", "query")

    def __init__(self, path: str, query: bytes) -> None:
        self.path = path  # percent-decoded, one character per byte (Latin-1)
        self.query = query  # after the first '?', undecoded

    @property
    def params(self) -> dict[str, str]:
        """What llama-server's ``req.get_param(name)`` returns for each query parameter (the last one given)."""
        return read_params(self.query)

    def __repr__(self) -> str:
        return f"Target({self.path!r}, {self.query!r})"


def read_target(raw: bytes) -> Target | str:
    """The target of a request line, as llama-server reads it; or why slotkeeper refuses it (a str)."""
    try:
        path = read_path(raw)
    except RefusedTarget as exc:
        return exc.reason
    return Target(path, raw.partition(b"?")[2])


def _query_component(raw: bytes) -> str:
    """cpp-httplib's decode_query_component: '+' is a space, %XX a byte (raw '+' first: %2B stays '+')."""
    return _ESCAPE.sub(_byte, raw.replace(b"+", b" ")).decode("latin-1")


def read_params(query: bytes) -> dict[str, str]:
    """A query's parameters as llama-server's handlers see them: decoded, the last value of a name winning; a piece
    that repeats an earlier one byte for byte is dropped (cpp-httplib's parse_query_text keeps a set of them), so
    in `action=a=b&action=x&action=a=b` the last value is `x`."""
    params: dict[str, str] = {}
    seen: set[bytes] = set()
    for piece in query.split(b"&"):
        piece = piece.strip(b" \t")  # cpp-httplib's split() trims each piece
        if piece in seen:
            continue
        seen.add(piece)
        name, _, value = piece.partition(b"=")
        if name:
            params[_query_component(name)] = _query_component(value)
    return params


class SlotRequest:
    """What llama-server reads from ``POST /slots/:id_slot?action=...``."""

    __slots__ = ("action", "slot")

    def __init__(self, slot: int | None, action: str) -> None:
        self.slot = slot  # None: llama-server answers "Invalid slot ID"
        self.action = action  # "save", "restore" and "erase" are actions; anything else is "Invalid action"

    def index(self, n_slots: int) -> int | None:
        """The slot llama-server acts on: it wraps the id as an unsigned number (-1 is the last of 2^64)."""
        return None if self.slot is None else (self.slot % 2**64) % n_slots

    def __repr__(self) -> str:
        return f"SlotRequest({self.slot!r}, {self.action!r})"


def c_stoi(text: str) -> int | None:
    """std::stoi of a C string: None where it throws (no digits, or outside a 32-bit int)."""
    match = _STOI.match(text.partition("\0")[0])
    if match is None:
        return None
    value = int(match.group(1))
    return value if INT_MIN <= value <= INT_MAX else None


def slot_request(target: Target) -> SlotRequest | None:
    """The slot and action llama-server reads from a POST to this target; None when it is not /slots/:id_slot."""
    path = target.path
    if not path.startswith(SLOTS_ROUTE):
        return None
    segment, _, rest = path[len(SLOTS_ROUTE) :].partition("/")
    if rest:  # the route's one segment, then at most a trailing '/'
        return None
    params = target.params
    params["id_slot"] = _ESCAPE_STR.sub(_char, segment)  # the path parameter wins, decoded once more
    return SlotRequest(c_stoi(params["id_slot"]), params.get("action", ""))
