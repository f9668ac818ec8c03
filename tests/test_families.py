"""Every chat comes back warm on the models people run: full attention, hybrid (attention plus a recurrent
state, with thinking on and off), and sliding window with --swa-full; on the real llama-server.

Traffic as a chat front end sends it: chats sharing a system prompt, a title request after each turn, more
chats than slots, a swap. "Warm" is llama-server's own `timings.cache_n`. On hybrid and sliding-window
models llama-server reuses a restored state only when the request extends all of its tokens, so these pass
only when chats are saved at their turn boundaries and restored only where they are extended; and a
restore must never change what the model answers.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from family_helpers import (
    BASE,
    FAMILIES,
    LOGPROB_TOLERANCE,
    PAUSE_S,
    Chat,
    Family,
    answer,
    cold_ones,
    common_prefix,
    converse,
    max_difference,
    same_answer,
    swap_out,
    tokens_of,
)

from slotkeeper.testing.harness import PlainServer, clean_env, free_port, http_call


@pytest.mark.parametrize("name", list(FAMILIES))
def test_six_chats_with_title_requests_come_back_warm_on_every_family(family_start, name):
    """Six chats sharing a system prompt on four slots, a title request after each turn: the second round
    (chats restored on demand) and the round after a swap reuse at least 90% of each chat's previous prompt."""
    family = FAMILIES[name]
    sk = family_start(family)
    chats = [Chat(i, family.request) for i in range(6)]
    converse(chats, sk.port)
    within = converse(chats, sk.port)
    assert not cold_ones(chats, within), (cold_ones(chats, within), sk.logs()[-5000:])
    swap_out(sk)
    sk2 = family_start(family)
    after = converse(chats, sk2.port)
    assert not cold_ones(chats, after), (cold_ones(chats, after), sk2.logs()[-5000:])
    if family.reasoning:
        assert all(all(chat.reasoning) for chat in chats), "the replies carried no reasoning"
    status = http_call(sk2.port, "GET", "/slotkeeper/status").body
    expected = "prefix" if name == "llama" else "extend-only"
    assert status["model_memory"]["policy"] == expected, status["model_memory"]


@pytest.mark.parametrize("name", ["qwen35-thinking-off", "lfm2", "gemma3-swa-full", "llama"])
def test_a_regenerate_and_an_edit_after_a_swap_reuse_the_previous_boundary(family_start, name):
    """After a swap, a regenerate of the last reply and an edit of the last user message both reuse at least
    everything before the last user message (the common prefix of the two requests' tokens)."""
    family = FAMILIES[name]
    sk = family_start(family)
    chat = Chat(0, family.request)
    chat.turn(sk.port)
    chat.turn(sk.port)
    swap_out(sk)
    sk2 = family_start(family)
    regenerate = chat.messages[:-2]  # the last request again
    edit = [*chat.messages[:-3], {"role": "user", "content": "Instead, say something about rivers."}]
    boundary = common_prefix(tokens_of(sk2.port, chat, regenerate), tokens_of(sk2.port, chat, edit))
    assert boundary > 0.5 * chat.last_prompt_tokens
    for messages in (regenerate, edit):
        timings = chat.send(sk2.port, messages)["timings"]
        assert timings["cache_n"] >= boundary, (timings, boundary, sk2.logs()[-4000:])


def test_with_swa_full_a_request_diverging_inside_a_restored_window_answers_as_a_cold_run(
    family_start, llama_server, family_models, tmp_path
):
    """Sliding window with --swa-full: after a swap, a request that changes an earlier reply (inside the last
    window of the chat's saved state) gets the same reply and top log-probabilities as a cold llama-server.
    The control shows the scenario is sensitive: restoring by common prefix, as on a full-attention model,
    changes the answer."""
    family = FAMILIES["gemma3-swa-full"]

    def after_a_swap(*own: str) -> tuple[str, list]:
        chat = Chat(0, family.request)
        sk = family_start(family, own=own, save_dir=tmp_path / ("cache" + "-".join(own)))
        for _ in range(4):  # the last window then holds the chat's distinct turns
            chat.turn(sk.port)
        swap_out(sk)
        sk2 = family_start(family, own=own, save_dir=tmp_path / ("cache" + "-".join(own)))
        # An edit of the second reply of four: some 100 tokens before the end, inside the last window
        diverging = [dict(m) for m in chat.messages]
        diverging[4]["content"] = "Also. " + diverging[4]["content"]
        try:
            return answer(sk2.port, chat, diverging)
        finally:
            swap_out(sk2)
            diverging_requests.append(diverging)

    diverging_requests: list[list[dict[str, Any]]] = []
    warm = after_a_swap()
    port = free_port()
    plain = PlainServer(
        llama_server,
        ["-m", str(family_models["gemma3"]), *BASE, *family.args],
        port,
        tmp_path / "plain.log",
        clean_env(llama_server),
    )
    try:
        plain.wait_ready()
        cold = answer(port, Chat(0, family.request), diverging_requests[0])
    finally:
        plain.stop()
    print("max logprob difference warm vs cold:", max_difference(warm, cold))
    assert same_answer(warm, cold, LOGPROB_TOLERANCE), (warm, cold)
    prefix_restored = after_a_swap("--model-memory", "full")
    print("control:", prefix_restored[0], cold[0], max_difference(prefix_restored, cold))
    assert not same_answer(prefix_restored, cold, LOGPROB_TOLERANCE), "the scenario does not show a wrong restore"


def test_sliding_window_without_swa_full_says_so_saves_nothing_and_keeps_chats_apart(family_start):
    """No --swa-full: one line at start says llama-server reuses no restored chat and what --swa-full would
    cost; no save or restore is spent, and three chats with title requests each keep their own slot."""
    family = Family("gemma3")
    sk = family_start(family)
    chats = [Chat(i, family.request) for i in range(3)]
    converse(chats, sk.port)
    results = converse(chats, sk.port)
    assert not cold_ones(chats, results), (cold_ones(chats, results), sk.logs()[-4000:])
    swap_out(sk)
    logs = sk.logs()
    line = [x for x in logs.splitlines() if "sliding window" in x]
    assert len(line) == 1 and "unless --swa-full (KV " in line[0], logs
    assert " saved " not in logs and "restored into" not in logs, logs
    assert not list((sk.extra["save_dir"] / "entries").iterdir())


def test_resident_turns_on_the_hybrid_write_nothing_and_reach_no_boundary(family_start):
    """A hybrid chat's turns in its own slot, the user pausing between them: no file written, no save-time
    boundary reached, no tokenize; and each turn reuses the whole previous one (the slot was brought to its
    boundary while the user paused: plain llama-server rolls back to its checkpoint at the last user message)."""
    family = FAMILIES["qwen35-thinking-off"]
    sk = family_start(family, "-np", "2", own=("--autosave-idle", "0"))
    chat = Chat(0, family.request)
    chat.turn(sk.port)
    entries = sk.extra["save_dir"] / "entries"
    before = sorted(p.name for p in entries.iterdir())
    asked = http_call(sk.port, "GET", "/slotkeeper/status").body
    for _ in range(4):
        time.sleep(PAUSE_S)
        timings = chat.turn(sk.port)
        assert chat.reused_enough(timings), timings
    status = http_call(sk.port, "GET", "/slotkeeper/status").body
    assert sorted(p.name for p in entries.iterdir()) == before
    assert status["placements"].get("resident", 0) >= 4, status
    assert status["prompt_tokenizations"] == asked["prompt_tokenizations"], status
    assert status["extend_only"]["boundaries_reached"] == 0, status
    assert status["extend_only"]["boundaries_settled"] >= 4, status


def test_more_chats_than_slots_on_the_hybrid_stay_warm_on_one_slot(family_start):
    """-np 1 on the hybrid: three chats in turn, each restored into the one slot at its boundary after the
    chat before it was saved there; every return is warm, without any restart."""
    family = FAMILIES["qwen35-thinking-off"]
    sk = family_start(family, "-np", "1")
    chats = [Chat(i, family.request) for i in range(3)]
    for chat in chats:
        chat.turn(sk.port)
    for _ in range(2):
        results = [chat.turn(sk.port) for chat in chats]
        assert not cold_ones(chats, results), (cold_ones(chats, results), sk.logs()[-4000:])
    saves = [line for line in sk.logs().splitlines() if " saved from slot " in line]
    assert saves and all("at its turn boundary" in line for line in saves), saves


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    ],
}


def test_a_chat_with_tool_calls_comes_back_warm_and_its_tool_result_is_a_boundary(family_start):
    """A hybrid chat with tools, a tool call and its result: after a swap its next turn is warm, and a request
    with another tool result reuses everything before the result (the boundary before a tool message)."""
    family = FAMILIES["qwen35-thinking-off"]
    sk = family_start(family)
    chat = Chat(0, {**family.request, "tools": TOOLS})
    chat.messages += [CALL, {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C, light wind."}]
    chat.turn(sk.port)
    swap_out(sk)
    sk2 = family_start(family)
    asked = chat.messages[:-2]  # the request that got the last reply
    other = [*asked[:-1], {"role": "tool", "tool_call_id": "call_1", "content": "Rain all day."}]
    boundary = common_prefix(tokens_of(sk2.port, chat, asked), tokens_of(sk2.port, chat, other))
    timings = chat.send(sk2.port, other)["timings"]
    assert timings["cache_n"] >= boundary, (timings, boundary, sk2.logs()[-4000:])
    chat.last_prompt_tokens = chat.previous_prompt_tokens = 0
    timings = chat.turn(sk2.port)
    swap_out(sk2)
    sk3 = family_start(family)
    timings = chat.turn(sk3.port)
    assert chat.reused_enough(timings), (timings, chat.previous_prompt_tokens, sk3.logs()[-4000:])


@pytest.mark.parametrize("name", ["llama", "qwen35-thinking-off"])
def test_a_start_restores_by_when_chats_were_used_not_when_they_were_saved(family_start, name):
    """Two chats, the longer one used last; a stop saves the most recent first, so the other is saved later.
    The next start restores the one used last into slot 0 and keeps it over the other when a new chat needs a
    slot: its next turn is warm where it stayed, with no restore."""
    family = FAMILIES[name]
    sk = family_start(family, "-np", "2")
    older, recent = (Chat(n, family.request, system=f"You are assistant {n}.", facts=f) for n, f in ((1, 15), (2, 45)))
    older.turn(sk.port)
    recent.turn(sk.port)
    swap_out(sk)
    sk = family_start(family, "-np", "2")
    restored = re.findall(r"chat \w+ restored into slot (\d): ([\d,]+) tokens", sk.logs())
    by_slot = {int(slot): int(tokens.replace(",", "")) for slot, tokens in restored}
    assert len(by_slot) == 2 and by_slot[0] > by_slot[1], sk.logs()[-3000:]  # `recent` is the longer
    Chat(3, family.request, system="Hi.", facts=0).turn(sk.port)  # short (parks nothing): takes the older's slot
    timings = recent.turn(sk.port)
    assert recent.reused_enough(timings), (timings, sk.logs()[-3000:])
    assert len(re.findall(r"restored into slot", sk.logs())) == 2, sk.logs()[-3000:]
