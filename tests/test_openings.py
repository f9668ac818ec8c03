"""Shared openings: a new chat starts from its saved system prompt, on every model family (real llama-server).

A chat's opening is everything before its first user message's content. The first new chat that brings one
(at least --min-save-tokens long) has it saved as an entry of its own; later new chats get it restored, and
llama-server reuses all of it, even on hybrid and sliding-window models, where a restored state is reused only
when the request extends all of it. A restore must not change an answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from family_helpers import (
    BASE,
    FAMILIES,
    LOGPROB_TOLERANCE,
    Chat,
    Family,
    answer,
    converse,
    max_difference,
    model_path,
    same_answer,
    swap_out,
    tokens_of,
)

from slotkeeper.testing.harness import PlainServer, clean_env, free_port, http_call

# About 2,000 tokens on the test models' tokenizers, shared by the chats of these tests.
OPENING = "You are the support assistant of a small bookshop. " + " ".join(
    f"Policy {i}: a customer asking about shelf {i} gets the catalogue of section {i % 9}, politely." for i in range(38)
)
OTHER_OPENING = "You are a terse translator. " + " ".join(f"Term {i} stays as it is." for i in range(60))
MIN_SAVE_TOKENS = 400
OPENING_FAMILIES = ["llama", "qwen35-thinking-off", "qwen35-thinking-on", "gemma3-swa-full", "gemma3-270m-swa-full"]


def opening_tokens(port: int, chat: Chat) -> int:
    """How many tokens the chat's opening has: the common prefix of two different first user messages."""
    a = tokens_of(port, chat, [chat.messages[0], {"role": "user", "content": "A"}])
    b = tokens_of(port, chat, [chat.messages[0], {"role": "user", "content": "7"}])
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def openings_of(port: int) -> dict:
    return http_call(port, "GET", "/slotkeeper/status").body["openings"]


def cold_answer(llama_server: str, model: Path, family: Family, chat: Chat, tmp_path: Path) -> tuple:
    """The chat's answer from a plain llama-server with the same arguments, started cold."""
    port = free_port()
    plain = PlainServer(
        llama_server,
        ["-m", str(model), *BASE, *family.args, "-np", "2"],
        port,
        tmp_path / "plain.log",
        clean_env(llama_server),
    )
    try:
        plain.wait_ready()
        return answer(port, chat, chat.messages)
    finally:
        plain.stop()


@pytest.mark.parametrize("name", OPENING_FAMILIES)
def test_after_a_swap_a_new_chat_reuses_its_whole_saved_opening_and_answers_as_a_cold_run(
    name, family_start, llama_server, family_models, request, tmp_path
):
    """A chat with a 2k-token opening saves the opening once. After a swap, with the slots restored with other
    chats, a new chat sharing the opening reuses all of it (llama-server's cache_n), and answers exactly as a
    cold llama-server does."""
    family = FAMILIES[name]
    sk = family_start(family, "-np", "2")
    first = Chat(0, family.request, system=OPENING)
    n_opening = opening_tokens(sk.port, first)
    assert 700 <= n_opening <= 3000, n_opening  # about 2k on the tiny models' tokenizer, 800 on Gemma's
    first.turn(sk.port)
    assert openings_of(sk.port)["saved"] == 1, sk.logs()[-3000:]
    others = [Chat(i, family.request, system=OTHER_OPENING) for i in (1, 2)]
    converse(others, sk.port)  # the most recent chats: the start after the swap restores these into the slots
    swap_out(sk)

    sk2 = family_start(family, "-np", "2")
    new = Chat(3, family.request, system=OPENING)
    timings = new.send(sk2.port, new.messages)["timings"]
    assert timings["cache_n"] >= n_opening, (timings, n_opening, sk2.logs()[-4000:])
    assert openings_of(sk2.port)["hits"] == 1
    warm = answer(sk2.port, new, new.messages)  # the slot now holds this chat: its own prefix is reused

    cold = cold_answer(llama_server, model_path(family.model, family_models, request), family, new, tmp_path)
    print("max logprob difference warm vs cold:", max_difference(warm, cold))
    assert same_answer(warm, cold, LOGPROB_TOLERANCE), (warm, cold)


def test_a_new_chat_after_a_swap_answers_from_its_restored_opening_as_a_cold_run(
    family_start, llama_server, family_models, request, tmp_path
):
    """The answer of the request that itself starts from the restored opening (not a repeat of it) is a cold
    run's, on the sliding-window model where a wrong restore would show."""
    family = FAMILIES["gemma3-swa-full"]
    sk = family_start(family, "-np", "2")
    Chat(0, family.request, system=OPENING).turn(sk.port)
    converse([Chat(i, family.request, system=OTHER_OPENING) for i in (1, 2)], sk.port)
    swap_out(sk)
    sk2 = family_start(family, "-np", "2")
    new = Chat(3, family.request, system=OPENING)
    warm = answer(sk2.port, new, new.messages)
    assert openings_of(sk2.port)["hits"] == 1, sk2.logs()[-3000:]
    cold = cold_answer(llama_server, model_path(family.model, family_models, request), family, new, tmp_path)
    assert same_answer(warm, cold, LOGPROB_TOLERANCE), (warm, cold, max_difference(warm, cold))


@pytest.mark.parametrize("name", ["llama", "qwen35-thinking-off"])
def test_ten_new_chats_sharing_an_opening_leave_every_warm_chat_warm(name, family_start):
    """Two chats are warm; then ten new chats sharing one opening arrive, more than the four slots, with short
    first messages (as an agent's sessions). Every chat comes back warm (at least 90% of its previous prompt
    reused), and each new chat after the first reused the whole opening."""
    family = FAMILIES[name]
    sk = family_start(family)
    warm = [Chat(i, family.request) for i in range(2)]
    converse(warm, sk.port)
    converse(warm, sk.port)
    new = [Chat(10 + i, family.request, system=OPENING, facts=2) for i in range(10)]  # short first messages
    n_opening = opening_tokens(sk.port, new[0])
    first_turns = [chat.turn(sk.port) for chat in new]  # sessions of an agent: no title requests between
    starts = [t["cache_n"] for t in first_turns[1:]]
    assert all(n >= n_opening for n in starts), (starts, n_opening, sk.logs()[-4000:])
    back = [chat.turn(sk.port) for chat in [*warm, *new]]
    cold = [
        (c.n, t["cache_n"], c.previous_prompt_tokens) for c, t in zip([*warm, *new], back) if not c.reused_enough(t)
    ]
    assert not cold, (cold, sk.logs()[-5000:])
    status = openings_of(sk.port)  # saved once per distinct opening: the warm chats' and the new chats'
    assert status["entries"] == status["saved"] == 2, status
    if name != "llama":  # a live hybrid state goes back only to its checkpoints: each start is a restore
        assert status["hits"] >= 1 + 9, status
    else:  # the idle chats left the KV cache before each long new prompt, and came back all the same
        assert http_call(sk.port, "GET", "/slotkeeper/status").body["slots_parked"] > 0


@pytest.mark.parametrize("name", ["llama", "qwen35-thinking-off"])
def test_an_opening_shorter_than_min_save_tokens_writes_nothing(name, family_start):
    """An opening shorter than --min-save-tokens: no opening entry is written, while the chats themselves
    (longer than that) are saved at the swap."""
    family = FAMILIES[name]
    sk = family_start(family, own=("--min-save-tokens", str(MIN_SAVE_TOKENS)))
    chats = [Chat(i, family.request) for i in range(3)]
    assert opening_tokens(sk.port, chats[0]) < MIN_SAVE_TOKENS
    converse(chats, sk.port)
    converse(chats, sk.port)
    assert all(c.last_prompt_tokens > MIN_SAVE_TOKENS for c in chats)
    assert openings_of(sk.port)["saved"] == 0
    swap_out(sk)
    manifests = [json.loads(p.read_text()) for p in (sk.extra["save_dir"] / "entries").glob("*.json")]
    assert manifests, "the chats were not saved: the test shows nothing"
    assert not [m for m in manifests if m["opening"] or m["tokens"] < MIN_SAVE_TOKENS], manifests


def test_a_failed_opening_save_costs_only_the_entry(stub_slotkeeper):
    """llama-server refuses the opening's save (the stub's saves fail): the new chat is answered on its slot,
    one line says so, and no file is left behind."""
    sk = stub_slotkeeper(stub={"STUB_SAVE_FAIL": "1"})
    body = {
        "messages": [{"role": "system", "content": OPENING}, {"role": "user", "content": "Hello there."}],
        "max_tokens": 4,
    }
    reply = http_call(sk.port, "POST", "/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    assert "opening not saved from slot" in sk.logs(), sk.logs()[-3000:]
    status = http_call(sk.port, "GET", "/slotkeeper/status").body
    assert status["openings"]["saved"] == 0 and status["placements"] == {"new": 1}, status  # placed all the same
    assert not [p for p in (sk.extra["save_dir"] / "entries").iterdir()]
