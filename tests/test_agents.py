"""Agent sessions come back warm after a swap over every API agent clients speak: chat completions, the
Responses API and Anthropic Messages (which llama-server will not let slotkeeper pin to a slot), streamed and
not, on a full-attention model and on a hybrid, and a session's swap on every tiny family (real llama-server)."""

from __future__ import annotations

import copy
import json
import re

import pytest
from family_helpers import BASE, FAMILIES, common_prefix, model_path, swap_out

from slotkeeper.chat.attribution import is_attribution_line
from slotkeeper.chat.convert import anthropic_to_chat
from slotkeeper.chat.prefix import BLOCK_TOKENS
from slotkeeper.testing.agents import (
    AGENT_SYSTEM,
    APIS,
    AgentSession,
    Turn,
    claude_code_session,
    post,
    prompt_tokens,
)
from slotkeeper.testing.harness import plain_server

AGENT_FAMILIES = ("llama", "qwen35-thinking-off")
# The session test runs on every tiny family: sliding-window (where a restored state a request does not extend
# must never serve it) and the hybrids with reasoning on and with a recurrent state of another kind.
EVERY_FAMILY = (*AGENT_FAMILIES, "qwen35-thinking-on", "lfm2", "gemma3-swa-full")
CASES = [(f, a, s) for f in EVERY_FAMILY for a in APIS for s in (False, True)]


def _id(case: tuple[str, str, bool]) -> str:
    return f"{case[0]}-{case[1]}-{'streamed' if case[2] else 'whole'}"


def _cold(sessions: list[AgentSession], turns) -> list[tuple[int, int, int]]:
    return [(s.n, t.reused, s.turns[-2].prompt) for s, t in zip(sessions, turns) if not s.reused_enough(t)]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_an_agent_session_is_warm_after_a_swap(family_start, case):
    """Three turns of an agent session (a long system prompt, six tools), a swap, and its next turn reuses all
    of its previous prompt; the turns before the swap went on in their slot too."""
    family_name, api, stream = case
    family = FAMILIES[family_name]
    sk = family_start(family)
    session = AgentSession(1, api, stream, dict(family.request))
    for _ in range(3):
        session.turn(sk.port)
    assert session.reused_enough(session.turns[-1]), (session.turns[-1], sk.logs()[-3000:])
    swap_out(sk)
    logs = sk.logs()
    assert "held nothing to save" not in logs, logs[-3000:]
    sk = family_start(family)
    turn = session.turn(sk.port)
    assert session.reused_enough(turn), (turn.reused, session.turns[-2].prompt, logs[-3000:], sk.logs()[-3000:])
    # All of the previous prompt, and the reply: on the hybrid, the latest turn boundary was saved (read from
    # the API's own reply), not only the one before the last request's new message.
    assert turn.reused > session.turns[-2].prompt, (turn.reused, session.turns[-2].prompt, logs[-3000:])


@pytest.mark.parametrize("family_name", AGENT_FAMILIES)
@pytest.mark.parametrize("api", APIS)
def test_more_agent_sessions_than_slots_come_back_on_demand(family_start, family_name, api):
    """Three sessions (every other one streamed) take turns on two slots: each turn, and each session's turn
    after a swap, reuses at least 90% of its previous prompt (restored on demand where it is not in a slot)."""
    family = FAMILIES[family_name]
    sk = family_start(family, "-np", "2")
    sessions = [AgentSession(n, api, n % 2 == 1, dict(family.request)) for n in range(3)]
    for _ in range(2):
        for session in sessions:
            session.turn(sk.port)
    assert not _cold(sessions, [s.turns[-1] for s in sessions]), sk.logs()[-4000:]
    swap_out(sk)
    sk = family_start(family, "-np", "2")
    turns = [s.turn(sk.port) for s in sessions]
    assert not _cold(sessions, turns), sk.logs()[-4000:]


@pytest.mark.parametrize("family_name", AGENT_FAMILIES)
@pytest.mark.parametrize("api", APIS)
def test_a_new_agent_session_after_a_swap_starts_from_the_saved_opening(family_start, family_name, api):
    """A session saves its opening (the system prompt and tools); after a swap a new session with the same
    opening reuses all of it on its first turn, on the hybrid too (where a live chat cannot go back to it)."""
    family = FAMILIES[family_name]
    sk = family_start(family, "-np", "2")
    first = AgentSession(1, api, False, dict(family.request))
    for _ in range(2):
        first.turn(sk.port)
    swap_out(sk)
    sk = family_start(family, "-np", "2")
    opening = sk.call("GET", "/slotkeeper/status").body
    newcomer = AgentSession(2, api, True, dict(family.request), first="A new task: list the files of the repo.")
    own = len(newcomer.history[0]["content"])  # its message takes at most a token per character
    turn = newcomer.turn(sk.port)
    opening_tokens = turn.prompt - own - 16  # all but its own message (and the template's tokens around it)
    assert turn.reused >= opening_tokens, (turn, opening, sk.logs()[-4000:])


def test_the_slot_an_unpinnable_request_ran_on_is_the_one_saved(family_start):
    """llama-server chooses the slot of an Anthropic request itself, by the longest common prefix in tokens;
    slotkeeper predicts it in 64-token blocks, so two slots whose chats diverge from the request inside one
    block look alike to it. Here the request runs on the second (it shares a few more tokens with its chat):
    slotkeeper reads where it ran, keeps that slot's chat, and the session is warm after a swap."""
    family = FAMILIES["llama"]
    sk = family_start(family, "-np", "2")
    shared = "Task: fix the failing test in module "
    firsts = {
        "near": shared + "seven and report back.",
        "far": "Note: the build is green today, nothing to do.",
        "new": shared + "nine and report back.",
    }
    pad = _pad_for_a_block_tie(sk.port, firsts)
    system = AGENT_SYSTEM + " " + "x" * pad
    near, far = (AgentSession(n, "messages", system=system, first=firsts[k]) for n, k in ((1, "near"), (2, "far")))
    near.turn(sk.port)
    far.turn(sk.port)  # the most recent: restored into slot 0 at the next start, `near` into slot 1
    swap_out(sk)
    sk = family_start(family, "-np", "2")
    session = AgentSession(3, "messages", system=system, first=firsts["new"])
    session.turn(sk.port)
    swap_out(sk)
    logs = sk.logs()
    sk = family_start(family, "-np", "2")
    turn = session.turn(sk.port)
    assert turn.reused > session.turns[-2].prompt, (turn, logs[-4000:], sk.logs()[-3000:])
    assert "llama-server's own choice" in logs, logs[-3000:]  # the scenario: the prediction was wrong


def _pad_for_a_block_tie(port: int, firsts: dict[str, str]) -> int:
    """How many characters added to the system prompt make the new session diverge from both earlier ones
    inside one 64-token block, sharing more tokens with `near` than with `far`."""
    for pad in range(200):
        system = AGENT_SYSTEM + " " + "x" * pad
        tokens = {
            k: prompt_tokens(port, AgentSession(0, "chat", system=system, first=v).body()) for k, v in firsts.items()
        }
        with_near, with_far = (common_prefix(tokens["new"], tokens[k]) for k in ("near", "far"))
        if with_near > with_far and with_near // BLOCK_TOKENS == with_far // BLOCK_TOKENS:
            return pad
    raise AssertionError("no padding gives the scenario")


def test_debug_logs_one_line_per_placement(family_start):
    """With --log-level debug each request's placement is one line: its slot, outcome and the tokens
    llama-server is expected to reuse there (and none of those lines without it)."""
    family = FAMILIES["llama"]
    sk = family_start(family, own=("--log-level", "debug"))
    sessions = [AgentSession(1, "messages"), AgentSession(2, "chat", stream=True)]
    for session in sessions * 2:
        session.turn(sk.port)
    lines = [line for line in sk.logs().splitlines() if "request placed on slot" in line]
    assert len(lines) == 4, lines
    assert all(
        re.fullmatch(
            r"slotkeeper: debug: /v1/(messages|chat/completions) request placed on slot \d "
            r"\((new|resident|restored|opening|branch)\): .*(reused|tokenized).*",
            line,
        )
        for line in lines
    ), lines
    assert "of 3," in lines[0] and "prompt tokens expected reused" in lines[0], lines
    swap_out(sk)
    quiet = family_start(family)
    AgentSession(3, "messages").turn(quiet.port)
    assert "request placed on slot" not in quiet.logs()


# ---- every new Claude Code session starts warm ---------------------------------------------------------------

FIRSTS = ("What does calc.py do?", "Hello there", "Fix the failing test in parser.py.")


def _without_line(body: dict) -> dict:
    """The request as a plain llama-server should see it: the attribution block gone, nothing else changed."""
    assert is_attribution_line(body["system"][0]["text"]), body["system"][0]
    return {**body, "system": body["system"][1:]}


def _opening_tokens(port: int, body: dict) -> int:
    """The system prompt and tools of a Messages request, in tokens: what two first user messages share."""
    chat = anthropic_to_chat(_without_line(body))
    a, b = ({**chat, "messages": [*chat["messages"][:-1], {"role": "user", "content": c}]} for c in ("A", "7"))
    return common_prefix(prompt_tokens(port, a), prompt_tokens(port, b))


def _openings(sk) -> dict:
    return sk.call("GET", "/slotkeeper/status").body["openings"]


def _first_turn(sk, session: AgentSession) -> tuple[dict, Turn]:
    """A new session's first request: its body as sent, and its turn."""
    body = copy.deepcopy(session.body())  # (the session's history grows on)
    return body, session.turn(sk.port)


def _own_prefill(sk) -> int:
    """The tokens slotkeeper has had llama-server prefill of its own so far: openings, and slots brought to a
    turn boundary (before a save, or settled while idle)."""
    status = sk.call("GET", "/slotkeeper/status").body
    extend_only = status["extend_only"]
    return (
        status["openings"]["prefill_tokens"]
        + extend_only["boundary_prefill_tokens"]
        + extend_only["settle_prefill_tokens"]
    )


def _first_turn_prefilling(sk, session: AgentSession) -> tuple[dict, Turn, int]:
    """_first_turn, and every token prefilled on its way: the request's own (its prompt less what it reused)
    and what slotkeeper prefilled meanwhile (an opening, a boundary before it parked another chat)."""
    before = _own_prefill(sk)
    body, turn = _first_turn(sk, session)
    return body, turn, turn.prompt - turn.reused + _own_prefill(sk) - before


@pytest.mark.parametrize("family_name", AGENT_FAMILIES)
def test_every_new_claude_code_session_starts_from_the_one_saved_opening(
    family_start, family_name, llama_server, family_models, request, tmp_path
):
    """Claude Code's attribution line differs per session. Dropped, two sessions with different first prompts,
    and a third after a swap, each reuse the whole system prompt and tools on their first request: the opening
    the first session saved, with none prefilled for them; all that is prefilled on the way to their first
    token (the request's own, a boundary reached to park another chat) is under a tenth of what the first
    session's first request needed (streamed, as Claude Code asks); and each answers as a plain llama-server
    answers the request without the line.

    Work, not wall time: on a loaded machine llama-server's small decodes (a 57-token boundary) took longer than
    the first session's 5,453-token prefill (1.4 s against 0.37 s, two busy loops beside it), so a comparison of
    first-token times measured the scheduler. benchmarks/agents.py times the new session's first token."""
    family = FAMILIES[family_name]
    sk = family_start(family, "-np", "2")
    first = claude_code_session(1, FIRSTS[0], family.request, stream=True)
    first_body, first_turn, first_work = _first_turn_prefilling(sk, first)
    assert first_work >= first_turn.prompt, (first_turn, first_work)  # the opening prefilled on its way
    first.turn(sk.port)
    opening_n = _opening_tokens(sk.port, first_body)
    assert opening_n > 2000, opening_n
    saved = _openings(sk)
    assert saved["saved"] == 1, (saved, sk.logs()[-3000:])
    second = claude_code_session(2, FIRSTS[1], family.request, stream=True)
    second_body, second_turn, second_work = _first_turn_prefilling(sk, second)
    after = _openings(sk)
    # No opening prefilled for it: the one saved serves it (restored, or live in the first session's slot).
    assert (after["saved"], after["prefill_tokens"]) == (1, saved["prefill_tokens"]), (after, sk.logs()[-3000:])
    assert second_turn.reused >= 0.9 * opening_n, (second_turn, opening_n, sk.logs()[-3000:])
    assert second_work * 10 < first_work, (second_turn, second_work, first_work, sk.logs()[-3000:])
    swap_out(sk)
    assert len(re.findall(r"opening \w+ saved from slot", sk.logs())) == 1, sk.logs()[-4000:]

    sk = family_start(family, "-np", "2")
    third = claude_code_session(3, FIRSTS[2], family.request, stream=True)
    third_body, third_turn, third_work = _first_turn_prefilling(sk, third)
    status = _openings(sk)  # (on full attention the opening may be live in a slot: then no restore is needed)
    assert (status["saved"], status["prefill_tokens"]) == (0, 0), (status, sk.logs()[-3000:])
    assert not re.search(r"opening \w+ saved from slot", sk.logs()), sk.logs()[-3000:]
    assert third_turn.reused >= 0.9 * opening_n, (third_turn, opening_n, sk.logs()[-3000:])
    assert third_work * 10 < first_work, (third_turn, third_work, first_work, sk.logs()[-3000:])
    assert sk.call("GET", "/slotkeeper/status").body["attribution_lines_dropped"] == 1

    model = model_path(family.model, family_models, request)
    with plain_server(llama_server, ["-m", str(model), *BASE, "-np", "2"], tmp_path) as plain:
        for body, turn in ((first_body, first_turn), (second_body, second_turn), (third_body, third_turn)):
            code, raw, _ = post(plain.port, "/v1/messages", {**_without_line(body), "stream": False})
            assert code == 200, raw[:500]
            cold = json.loads(raw)
            assert "".join(b.get("text", "") for b in cold["content"] if b["type"] == "text") == turn.text


def test_with_keep_attribution_line_a_new_claude_code_session_is_cold_as_on_plain(
    family_start, llama_server, family_models, request, tmp_path
):
    """--keep-attribution-line sends the line on: the second session shares only the line's first characters
    with the first, on slotkeeper as on a plain llama-server."""
    family = FAMILIES["llama"]
    sk = family_start(family, "-np", "2", own=("--keep-attribution-line",))
    first = claude_code_session(1, FIRSTS[0])
    first_body, _ = _first_turn(sk, first)
    opening_n = _opening_tokens(sk.port, first_body)
    before = _openings(sk)["prefill_tokens"]
    second = claude_code_session(2, FIRSTS[1])
    _, second_turn = _first_turn(sk, second)
    # What was prefilled for it: by the request, and by slotkeeper saving its own opening just before (which the
    # request then reports as cached).
    after = _openings(sk)
    prefilled = second_turn.prompt - second_turn.reused + after["prefill_tokens"] - before
    assert prefilled >= 0.9 * opening_n and after["saved"] == 2, (second_turn, after, opening_n)
    assert sk.call("GET", "/slotkeeper/status").body["attribution_lines_dropped"] == 0
    model = model_path(family.model, family_models, request)
    with plain_server(llama_server, ["-m", str(model), *BASE, "-np", "2"], tmp_path) as plain:
        claude_code_session(1, FIRSTS[0]).turn(plain.port)
        cold = claude_code_session(2, FIRSTS[1]).turn(plain.port)
    assert cold.prompt - cold.reused >= 0.9 * opening_n, (cold, opening_n)
