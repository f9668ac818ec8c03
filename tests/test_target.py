"""slotkeeper reads a request target as llama-server does (issue 11), or refuses it.

* target.py's readings, case by case, as cpp-httplib (llama-server b11434's HTTP layer) reads them;
* a differential test: hypothesis writes targets (encoded, double-encoded, repeated and misspelled parameters,
  dot segments, absolute-form, fragments...) and framings, and each is sent byte for byte to a plain
  llama-server and through slotkeeper around another one. What llama-server parsed shows in its answer to
  ``POST /slots/<id>?action=<a>`` (the slot id it read, or "Invalid slot ID"; the action it ran, or "Invalid
  action"; 404 when no route matched) and in which route answered a POST elsewhere; target.py's reading must
  predict it, and through slotkeeper the answer must be the same (or slotkeeper's 400 for what it refuses).
"""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote_from_bytes

import httptools
import pytest
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st
from target_model import SlotRequest, Target, c_stoi, read_params, read_target, slot_request

from slotkeeper.proxy.target import REFUSED_ESCAPE, REFUSED_FRAGMENT, REFUSED_NUL
from slotkeeper.testing.harness import free_port, health_status, http_call, wait_until

# ---- target.py on its own --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, path",
    [
        (b"/completion", "/completion"),
        (b"/v1/chat%2Fcompletions", "/v1/chat/completions"),  # llama-server routes this as a chat completion
        (b"/v1/chat%2fcompletions?x=1", "/v1/chat/completions"),
        (b"/%76%31/messages", "/v1/messages"),
        (b"/v1/../completion", "/v1/../completion"),  # no dot-segment removal: no route matches
        (b"//completion", "//completion"),
        (b"/Completion", "/Completion"),
        (b"/completion+", "/completion+"),  # '+' is a space only in the query
        (b"/completion%2B", "/completion+"),
        (b"/a%25%32%46b", "/a%2Fb"),  # decoded once
        (b"/caf%C3%A9", "/caf\xc3\xa9"),  # bytes, one character each
        (b"http://host:8080/completion", "http://host:8080/completion"),  # absolute-form: a path no route matches
        (b"*", "*"),
    ],
)
def test_paths_read_as_llama_server_reads_them(raw, path):
    target = read_target(raw)
    assert isinstance(target, Target)
    assert target.path == path


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"/slots/0?action=save#x", REFUSED_FRAGMENT),  # slotkeeper read "save#x", llama-server reads "save"
        (b"/completion#", REFUSED_FRAGMENT),
        (b"/x#?action=erase", REFUSED_FRAGMENT),
        (b"/v1/chat%u002Fcompletions", REFUSED_ESCAPE),  # llama-server decodes %uXXXX: /v1/chat/completions
        (b"/completion%uD800", REFUSED_ESCAPE),  # a lone surrogate decodes to nothing: /completion
        (b"/completion%", REFUSED_ESCAPE),
        (b"/completion%2", REFUSED_ESCAPE),
        (b"/completion%zz", REFUSED_ESCAPE),
        (b"/completion%00", REFUSED_NUL),
    ],
)
def test_what_slotkeeper_refuses(raw, reason):
    assert read_target(raw) == reason


def test_query_parameters_as_llama_servers_get_param_returns_them():
    assert read_params(b"action=save&action=erase") == {"action": "erase"}  # the last one wins
    assert read_params(b"act%69on=save&&=x&flag&a=b=c") == {"action": "save", "flag": "", "a": "b=c"}
    assert read_params(b"q=a+b%2Bc%20d") == {"q": "a b+c d"}
    assert read_params(b"q=50%&r=%zz&s=%4") == {"q": "50%", "r": "%zz", "s": "%4"}  # kept as they are
    assert read_params(b"q=%u0041") == {"q": "%u0041"}  # no %u in the query
    assert read_params(b"Action=save") == {"Action": "save"}  # names are case-sensitive


def test_slot_requests():
    def read(raw: bytes) -> tuple[int | None, str] | None:
        target = read_target(raw)
        assert isinstance(target, Target)
        request = slot_request(target)
        return None if request is None else (request.slot, request.action)

    assert read(b"/slots/1?action=save") == (1, "save")
    assert read(b"/slots/1/?action=save") == (1, "save")  # a trailing '/' still matches /slots/:id_slot
    assert read(b"/slots/1/x?action=save") is None
    assert read(b"/slots?action=save") is None
    assert read(b"/slots%2F1?action=erase") == (1, "erase")
    assert read(b"/slots/%2531?action=erase") == (1, "erase")  # the path parameter is decoded twice
    assert read(b"/slots/0?id_slot=1&action=erase") == (0, "erase")  # the path parameter wins
    assert read(b"/slots/+7x?action=erase") == (7, "erase")  # std::stoi
    assert read(b"/slots/?action=erase") == (None, "erase")
    assert read(b"/slots/2147483648?action=erase") == (None, "erase")
    assert read(b"/slots/1") == (1, "")
    assert SlotRequest(-1, "erase").index(2) == 1 and SlotRequest(7, "erase").index(2) == 1


def test_c_stoi():
    assert [
        c_stoi(s)
        for s in (
            "0",
            "+1",
            "-1",
            " \t\n\v\f\r5",
            "12abc",
            "0x1f",
            "",
            "x1",
            "- 1",
            "2147483647",
            "-2147483648",
            "2147483648",
            "9" * 30,
            "1\x002",
        )
    ] == [0, 1, -1, 5, 12, 0, None, None, None, 2147483647, -2147483648, None, None, 1]


# ---- the differential test against the real llama-server ---------------------------------------------------------

N_SLOTS = 2
SERVER_ARGS = ["-np", str(N_SLOTS), "-c", "2048", "-t", "2", "--no-warmup"]
PROBE_BODY = b'{"filename":"probe.bin"}'  # a slot action's file; every other route refuses it at once
INNOCENT = b"GET /health HTTP/1.1\r\nHost: probe\r\n\r\n"
SLOT_ANSWER_KEYS = {
    "save": ["filename", "id_slot", "n_saved", "n_written", "timings"],
    "restore": ["filename", "id_slot", "n_read", "n_restored", "timings"],
    "erase": ["id_slot", "n_erased"],
}


@pytest.fixture
def servers(starter, llama_server, models, tmp_path) -> Iterator[tuple[int, int]]:
    """(plain llama-server's port, slotkeeper's port): each around its own llama-server, same model and args."""
    slots = tmp_path / "direct-slots"
    slots.mkdir()
    direct_port = free_port()
    args = ["-m", str(models["A"]), *SERVER_ARGS]
    direct = subprocess.Popen(
        [llama_server, *args, "--host", "127.0.0.1", "--port", str(direct_port), "--slot-save-path", str(slots)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        sk = starter(llama_server, args)()
        assert wait_until(lambda: health_status(direct_port) == 200, 60), "plain llama-server never became ready"
        for port in (direct_port, sk.port):  # a file for restore to read
            assert http_call(port, "POST", "/slots/0?action=save", {"filename": "probe.bin"}).status == 200
        yield direct_port, sk.port
    finally:
        direct.terminate()
        direct.wait(10)


Observed = tuple[Any, ...]


def observed(status: int, body: bytes) -> Observed:
    """What an answer shows of how the request was read: the error message, or the slot action's keys and id."""
    try:
        data = json.loads(body)
    except ValueError:
        return (status, body)
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return (status, data["error"].get("message"))
    if isinstance(data, dict) and "id_slot" in data:
        return (status, sorted(data), data["id_slot"])
    return (status, sorted(data) if isinstance(data, dict) else data)


def read_answer(stream: Any) -> tuple[int, bytes, bool] | None:
    """One answer from a buffered stream: status, body (by Content-Length or chunked), whether the server closes
    after it; None if the connection closed first."""
    status_line = stream.readline()
    if not status_line:
        return None
    headers = {}
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip().lower()
    if headers.get(b"transfer-encoding") == b"chunked":
        parts = []
        while size := int(stream.readline().split(b";")[0], 16):
            parts.append(stream.read(size))
            stream.readline()
        while stream.readline() not in (b"\r\n", b""):
            pass
        body = b"".join(parts)
    else:
        body = stream.read(int(headers.get(b"content-length", b"0")))
    return int(status_line.split()[1]), body, headers.get(b"connection") == b"close"


def exchange(port: int, data: bytes, n: int) -> list[Observed]:
    """Send raw bytes, read up to n answers (fewer when the server closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock, sock.makefile("rb") as stream:
        sock.sendall(data)
        answers = []
        for _ in range(n):
            try:
                answer = read_answer(stream)
            except ConnectionError:
                break
            if answer is None:
                break
            answers.append(observed(answer[0], answer[1]))
            if answer[2]:
                break
        return answers


def expected_slot_answer(request: SlotRequest) -> Observed:
    if request.slot is None:
        return (400, "Invalid slot ID")
    if request.action not in SLOT_ANSWER_KEYS:
        return (400, "Invalid action")
    return (200, SLOT_ANSWER_KEYS[request.action], request.slot)


def is_slot_answer(answer: Observed) -> bool:
    """Whether POST /slots/:id_slot answered (its errors, or a slot action's keys)."""
    return answer[1] in ("Invalid slot ID", "Invalid action") or (
        answer[0] == 200 and answer[1] in SLOT_ANSWER_KEYS.values()
    )


def canonical(target: Target) -> bytes:
    """A target llama-server can read only one way (every byte but unreserved ones and '/' as %XX) for the same
    path and query."""
    path = quote_from_bytes(target.path.encode("latin-1"), safe="/").encode()
    return path + (b"?" + target.query if target.query else b"")


# Targets: a route, each character possibly escaped (either case, twice, %uXXXX) or its case changed, pieces
# spliced in, absolute-form, a query of repeated and look-alike parameters, a fragment.
ROUTES = ["/slots/{id}"] * 6 + [
    "/completion",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/responses",
    "/infill",
    "/tokenize",
    "/health",
    "/slotkeeper/status",
]
SLOT_IDS = ["0", "1"] * 4 + [
    "-1",
    "+1",
    "%2B1",
    "%201",
    "%0A1",
    "1x",
    "",
    "2",
    "2147483647",
    "2147483648",
    "-2147483649",
    "9" * 20,
    "0x1",
    "%31",
    "%2531",
    "%25",
    "%2F",
    "1%00",
    "%u0031",
    "1/",
    "1/x",
    "1%2F",
]
SPLICES = ["/", "//", "/./", "/../", "%2F", "%2f", "%00", "%", "%u002F", "%uD800", "+", "%2B", "%20", ".", "%2E", "x"]
NAMES = ["action"] * 8 + ["act%69on", "%61ction", "Action", "action+", "action%", "id_slot", "x", ""]
VALUES = ["save", "restore", "erase"] * 4 + [
    "bogus",
    "sav%65",
    "%73ave",
    "Save",
    "erase+",
    "+erase",
    "erase%",
    "erase%2",
    "er%2Base",
    "era+se",
    "",
    "5",
    "%31",
    "-1",
]
FORMS = ["{n}={v}"] * 6 + ["{n}", "={v}", "", "{n}={v}={v}", "{n}=={v}"]
ESCAPES = ["upper"] * 4 + ["lower"] * 3 + ["twice"] * 2 + ["u", "case"]


def _escape(ch: str, how: str) -> str:
    code = ord(ch)
    return {
        "keep": ch,
        "upper": f"%{code:02X}",
        "lower": f"%{code:02x}",
        "twice": f"%25{code:02X}",
        "u": f"%u{code:04X}",
        "case": ch.swapcase(),
    }[how]


@st.composite
def targets(draw: st.DrawFn) -> bytes:
    path = draw(st.sampled_from(ROUTES)).replace("{id}", draw(st.sampled_from(SLOT_IDS)))
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):  # a few characters escaped or recased
        at = draw(st.integers(0, len(path) - 1))
        if path[at] != "%":
            path = path[:at] + _escape(path[at], draw(st.sampled_from(ESCAPES))) + path[at + 1 :]
    for _ in range(draw(st.sampled_from([0, 0, 0, 0, 1, 2]))):
        at = draw(st.integers(0, len(path)))
        path = path[:at] + draw(st.sampled_from(SPLICES)) + path[at:]
    if draw(st.integers(0, 14)) == 0:
        path = draw(st.sampled_from(["http://h", "HTTP://h:1", "h://x"])) + path
    pieces: list[str] = [
        draw(st.sampled_from(FORMS)).format(n=draw(st.sampled_from(NAMES)), v=draw(st.sampled_from(VALUES)))
        for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 2, 3, 4])))
    ]
    with_query = bool(pieces) or draw(st.booleans())
    target = path + ("?" + "&".join(pieces) if with_query else "")
    if draw(st.integers(0, 14)) == 0:
        target += draw(st.sampled_from(["#", "#x", "#?action=save", "#&action=bogus"]))
    return target.encode()


Framing = tuple[str, tuple[int, ...], bool]  # Content-Length or chunked (cut where, with extensions), pipelined
framings = st.tuples(
    st.sampled_from(["length", "chunked", "chunked-ext"]),
    st.lists(st.integers(1, len(PROBE_BODY) - 1), max_size=3, unique=True).map(sorted).map(tuple),
    st.booleans(),
)


def framed(target: bytes, framing: Framing) -> tuple[bytes, int]:
    """The request in one of the framings a client may use, maybe pipelined behind an innocent one in the same
    write; returns the bytes and how many requests they hold."""
    how, cuts, pipelined = framing
    head = b"POST " + target + b" HTTP/1.1\r\nHost: probe\r\nContent-Type: application/json\r\n"
    if how == "length":
        request = head + b"Content-Length: %d\r\n\r\n%s" % (len(PROBE_BODY), PROBE_BODY)
    else:
        parts = [PROBE_BODY[a:b] for a, b in zip([0, *cuts], [*cuts, len(PROBE_BODY)])]
        ext = b";x=y" if how == "chunked-ext" else b""
        request = (
            head
            + b"Transfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in parts)
            + b"0\r\n\r\n"
        )
    return (INNOCENT + request, 2) if pipelined else (request, 1)


def llhttp_refuses(raw: bytes) -> bool:
    """llhttp's own URL grammar (origin-form, absolute-form, '*') refuses it: slotkeeper answers 400 before
    reading it (a target not starting with '/', such as "%2Fslots/0", which llama-server reads as "/slots/0")."""
    try:
        httptools.HttpRequestParser(object()).feed_data(b"POST " + raw + b" HTTP/1.1\r\n\r\n")
    except httptools.HttpParserInvalidURLError:
        return True
    return False


def example_each(raws: list[bytes]) -> Any:
    """@example for each target (Content-Length, pipelined behind an innocent request)."""

    def decorate(test: Any) -> Any:
        for raw in raws:
            test = example(raw=raw, framing=("length", (), True))(test)
        return test

    return decorate


ISSUE_CASES = [  # the issue's and this module's own: always run
    b"/slots/1?action=save#x",
    b"/slots/0?action=erase#",
    b"/v1/chat%2Fcompletions",
    b"/v1/chat%u002Fcompletions",
    b"/completion%uD800",
    b"/slots%2F1?action=erase",
    b"/slots/%2531?action=erase&id_slot=0",
    b"/slots/1?action=bogus&action=erase",
    b"/slots/1?action=erase&action=bogus",
    b"/slots/+7x/?act%69on=erase",
    b"/slots/-1?action=save",
    b"/slots/0/?action=restore",
    b"http://h/slots/0?action=erase",
    b"%2Fslots/0?action=erase",
    b"/slots/1%00?action=erase",
    b"/slotkeeper%2Fstatus",
    b"/he%61lth",
    b"/slots/%201?action=erase",
    b"/slots/%0A1/?action=erase&action=er%61se",
    b"/slots/0?action=save=save&action=save&action=save=save",
]


@settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(raw=targets(), framing=framings)
@example_each(ISSUE_CASES)
def test_slotkeeper_reads_targets_as_llama_server_does(servers, raw, framing):
    direct_port, sk_port = servers
    request, n = framed(raw, framing)
    direct = exchange(direct_port, request, n)
    through = exchange(sk_port, request, n)
    note(f"direct {direct}, through slotkeeper {through}")
    assert len(direct) == n, "llama-server itself refused the framing"
    target = read_target(raw)
    if llhttp_refuses(raw):
        event("refused by llhttp's URL grammar")
        assert through[:-1] == direct[:-1] and through[-1][0] == 400 and through[-1][1].startswith("bad request:")
        return
    if isinstance(target, str):  # refused: slotkeeper's 400 where llama-server answered, then the connection closes
        event(f"refused: {target}")
        assert through == [*direct[:-1], (400, f"bad request: {target}")]
        return
    # llama-server read the target as target.py did: it answers it as it answers an unambiguous spelling of that
    # reading, and as target.py predicts for a slot action
    unambiguous = request.replace(b" " + raw + b" HTTP/1.1", b" " + canonical(target) + b" HTTP/1.1")
    assert direct[-1] == exchange(direct_port, unambiguous, n)[-1]
    event(f"llama-server answered {direct[-1][:2]}"[:80])
    slot = slot_request(target)
    assert is_slot_answer(direct[-1]) == (slot is not None), "target.py and llama-server disagree on the route"
    if slot is not None:
        assert direct[-1] == expected_slot_answer(slot)
    if target.path.startswith("/slotkeeper/"):  # slotkeeper's own routes, read the same way
        assert through[:-1] == direct[:-1]
        assert through[-1][0] == (200 if target.path == "/slotkeeper/status" else 404)
    else:
        assert through == direct
