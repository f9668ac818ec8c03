"""A request target read the way llama-server reads it, so slotkeeper routes on what llama-server will route on.

slotkeeper decides per request whether to answer it itself (``/slotkeeper/``, ``/health`` while restoring),
make it wait, or hand its body to the completion hook. If slotkeeper and llama-server read one target two
ways, a request can get past those rules (``/v1/chat%2Fcompletions`` is a chat completion to llama-server).
So this follows llama-server b11434's HTTP layer, cpp-httplib (``vendor/cpp-httplib/httplib.cpp``), not
urllib:

* ``Server::parse_request_line``: everything from the first ``#`` on is dropped, the rest is split at its
  first ``?`` into path and query.
* ``decode_path_component``: in the path, ``%XX`` (hex of either case) is one byte, ``%uXXXX`` is that code
  point in UTF-8 (nothing at all for D800-DFFF), any other ``%`` stays; ``+`` stays. Nothing else is
  normalized: dot segments, repeated or trailing slashes and case all stay, and an absolute-form target
  (``http://host/completion``) is a path as it stands, which no route matches.
* Routes match the decoded path exactly (``PathParamsMatcher``; ``/slots/:id_slot`` takes one segment, a
  trailing ``/`` allowed).
* ``parse_query_text``: the query is split at every ``&`` (empty pieces, and pieces repeating an earlier one
  byte for byte, dropped), each piece at its first
  ``=`` (no ``=``: an empty value; an empty raw name: dropped); ``decode_query_component`` decodes names and
  values: ``%XX`` a byte (an incomplete or non-hex one stays), ``+`` a space.
* ``server-http.cpp``'s ``get_params``: ``req.get_param(name)`` is the *last* value given for a name, and a
  path parameter (``id_slot``) overrides a query parameter of that name, after a second ``%XX`` decoding.

Where matching costs more than refusing, slotkeeper refuses (the proxy answers 400 and closes):

* a fragment: no HTTP client sends one (RFC 9112 has none in a request target), so ``/slots/0?action=save#x``
  can only be someone probing how the two sides read it;
* a ``%`` in the path that is not a ``%XX`` escape: ``%uXXXX`` (an IIS-era encoding nobody else decodes) and
  stray ``%`` (invalid in RFC 3986). These are the cpp-httplib-specific parts of path decoding; refusing them
  leaves plain ``%XX``, which every version decodes alike;
* a ``%00`` in the path: a NUL byte in a path that C code will handle.

The query is matched exactly instead (it does not decide slotkeeper's routing, and sloppy escapes in query
values do occur). Bytes become ``str`` as Latin-1, one character per byte, so comparing a decoded path with
``"/v1/completions"`` is comparing bytes. (The query and ``/slots/:id_slot`` readings, which slotkeeper
does not route on, are modelled in ``tests/target_model.py``, where the tests check them against llama-server.)
"""

from __future__ import annotations

import re

# Searched for as ints: `0x23 in raw` is a memchr, `b"#" in raw` costs several times more (CPython 3.11).
HASH = ord("#")
PERCENT = ord("%")
NUL = 0

_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")
_BAD_PATH_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")

REFUSED_FRAGMENT = "a fragment ('#') in the request target"
REFUSED_ESCAPE = "a '%' in the path that is not a %XX escape"
REFUSED_NUL = "a NUL byte (%00) in the path"


def _byte(match: re.Match[bytes]) -> bytes:
    return bytes((int(match.group(1), 16),))


class RefusedTarget(ValueError):
    """A target slotkeeper does not forward; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_path(raw: bytes) -> str:
    """The path llama-server routes a request target on (the proxy's hot path: a few byte scans when there is
    nothing to decode). Raises RefusedTarget."""
    if HASH in raw:
        raise RefusedTarget(REFUSED_FRAGMENT)
    path = raw.partition(b"?")[0]
    if PERCENT not in path:  # the common case: nothing to decode
        return path.decode("latin-1")
    if _BAD_PATH_ESCAPE.search(path):
        raise RefusedTarget(REFUSED_ESCAPE)
    decoded = _ESCAPE.sub(_byte, path)
    if NUL in decoded:
        raise RefusedTarget(REFUSED_NUL)
    return decoded.decode("latin-1")
