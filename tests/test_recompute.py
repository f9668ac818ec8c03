"""Every chat survives what users change between two starts, on the real llama-server: another -np or KV cache
type (the saved states no longer load: recomputed from their tokens while idle), a raised -c (they load as
saved), a re-quantized model file of the same vocabulary (recomputed: the loader would take the old states,
then answer wrongly), and a llama-server upgrade that changes the state format (tests/test_upgrade.py).

Traffic as a chat front end sends it: six chats sharing a system prompt, a title request after each turn. After
the change and within a minute of idle, every chat's next turn reuses at least 90% of its previous prompt and
answers as a cold llama-server of the new configuration does (temperature 0).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from family_helpers import (
    LOGPROB_TOLERANCE,
    NO_THINKING,
    TEMPLATES,
    Chat,
    answer,
    converse,
    same_answer,
    swap_out,
    tokens_of,
)
from test_router import ROUTER, models_dir, statuses

from slotkeeper.placement.recompute import CHUNK_TOKENS
from slotkeeper.testing.harness import http_call, plain_server, wait_until
from slotkeeper.testing.realmodel import gemma3_270m_q4

ARGS = ["-t", "2", "--no-warmup"]
RECOMPUTE_WITHIN_S = 60.0
# The real 270M model prefills far slower than the tiny ones: its six chats (3,220 tokens) took 65 s here with
# the suite and two busy loops beside it (its own estimate, from an idle prefill rate, was ~8 s).
REAL_MODEL_RECOMPUTE_WITHIN_S = 600.0


def recompute_status(port: int) -> dict[str, Any]:
    return http_call(port, "GET", "/slotkeeper/status").body["recompute"]


def wait_recomputed(sk: Any, within: float = RECOMPUTE_WITHIN_S) -> dict[str, Any]:
    """Until nothing waits to be recomputed (within a minute of idle on the tiny models); the status then."""
    assert wait_until(lambda: recompute_status(sk.port)["pending"] == 0, within, interval=0.2), (
        recompute_status(sk.port),
        sk.logs()[-4000:],
    )
    return recompute_status(sk.port)


def cold_answers(server: str, args: list[str], chats: list[Chat], tmp_path: Path) -> list[tuple[str, list]]:
    """Each chat's next turn answered by a cold plain llama-server of the configuration."""
    with plain_server(server, args, tmp_path) as plain:
        return [answer(plain.port, chat, chat.messages) for chat in chats]


@pytest.mark.parametrize(
    ("family", "change"),
    [
        ("llama", "np"),
        ("llama", "ctk"),
        ("qwen35", "np"),
        ("gemma3", "np"),
    ],
)
def test_chats_saved_under_another_np_or_kv_type_are_recomputed_warm_and_right(
    starter, llama_server, family_models, tmp_path, family, change
):
    """-np 1 -> -np 2 (two KV streams) or f16 -> f32 K cache: llama-server refuses every saved state (400); each
    chat is recomputed from its tokens while idle, so that its next turn is warm and answers as a cold run (on
    full attention, the qwen35 hybrid and gemma3's sliding window with --swa-full: boundaries exact)."""
    model = ["-m", str(family_models[family]), *(("--swa-full",) if family == "gemma3" else ())]
    request = NO_THINKING if family == "qwen35" else {}
    before = [*model, *ARGS, "-c", "8192", "-np", "1"]
    after = [*model, *ARGS, "-c", "8192", *(("-np", "2") if change == "np" else ("-np", "1", "-ctk", "f32"))]
    chats = six_chats_saved(starter, llama_server, before, request)
    sk2 = starter(llama_server, after)()
    status = wait_recomputed(sk2)
    logs = sk2.logs()
    assert "recomputing the 6 most recent while idle" in logs, logs[-4000:]
    assert status["recomputed"] == 6, (status, logs[-4000:])
    assert "quarantined" not in logs
    metrics = str(http_call(sk2.port, "GET", "/slotkeeper/metrics").body)
    assert "slotkeeper_recomputed_total 6.0" in metrics and "slotkeeper_recompute_pending 0.0" in metrics, metrics
    next_turns_warm_and_right(sk2, chats, llama_server, after, tmp_path, same_steps=family == "gemma3")


@pytest.mark.parametrize("family", ["llama", "qwen35"])
def test_chats_saved_by_an_older_llama_server_are_recomputed_after_the_upgrade(
    starter, llama_server, llama_server_b11349, family_models, tmp_path, family
):
    """A real upgrade: chats saved through llama-server b11349 (slot-file format v3), then served by b11434
    (v4), which refuses every v3 file: each is recomputed from its tokens while idle, warm and right."""
    request = NO_THINKING if family == "qwen35" else {}
    args = ["-m", str(family_models[family]), *ARGS, "-c", "8192", "-np", "1"]
    chats = six_chats_saved(starter, llama_server_b11349, args, request)
    sk2 = starter(llama_server, args)()
    logs = sk2.logs()
    line = "6 chats were saved by another llama-server configuration (state v3; this one writes v4): recomputing"
    assert line in logs, logs[-4000:]
    status = wait_recomputed(sk2)
    assert status["recomputed"] == 6, (status, sk2.logs()[-4000:])
    next_turns_warm_and_right(sk2, chats, llama_server, args, tmp_path)


def test_a_raised_context_loads_the_saved_chats_as_they_are(starter, llama_server, family_models, tmp_path):
    """-c 4096 -> -c 8192: llama-server loads the saved states (tried once, at start): nothing is recomputed,
    and every chat is warm and right."""
    model = ["-m", str(family_models["llama"])]
    chats = six_chats_saved(starter, llama_server, [*model, *ARGS, "-c", "4096", "-np", "1"], {})
    after = [*model, *ARGS, "-c", "8192", "-np", "1"]
    sk2 = starter(llama_server, after)()
    logs = sk2.logs()
    assert "saved by another configuration used as saved: this llama-server loads them" in logs, logs[-4000:]
    assert "recomput" not in logs, logs[-4000:]
    next_turns_warm_and_right(sk2, chats, llama_server, after, tmp_path)


def test_a_requantized_model_of_the_same_vocabulary_recomputes_the_chats(starter, llama_server, models, tmp_path):
    """Another model file of the same vocabulary (a re-quantized download; here: other weights, same shape): the
    loader would take the old states and answer wrongly, so they are never loaded; each chat is recomputed."""
    chats = six_chats_saved(starter, llama_server, ["-m", str(models["A"]), *ARGS, "-c", "8192", "-np", "1"], {})
    after = ["-m", str(models["B"]), *ARGS, "-c", "8192", "-np", "1"]
    sk2 = starter(llama_server, after)()
    status = wait_recomputed(sk2)
    assert status["recomputed"] == 6, (status, sk2.logs()[-4000:])
    next_turns_warm_and_right(sk2, chats, llama_server, after, tmp_path)


def test_recomputed_chats_stay_warm_across_llama_servers_own_sleep(starter, llama_server, family_models, tmp_path):
    """-np 1 -> -np 2 with --sleep-idle-seconds: the chats are recomputed, then the child falls asleep and
    nothing of slotkeeper's wakes it (the recompute asks /props only); each chat's next turn wakes it, is
    restored from its recomputed entry, warm and right."""
    model = ["-m", str(family_models["llama"])]
    chats = six_chats_saved(starter, llama_server, [*model, *ARGS, "-c", "8192", "-np", "1"], {})
    after = [*model, *ARGS, "-c", "8192", "-np", "2"]
    sk2 = starter(llama_server, [*after, "--sleep-idle-seconds", "2"])()
    assert wait_recomputed(sk2)["recomputed"] == 6, sk2.logs()[-4000:]
    assert wait_until(lambda: "llama-server is asleep" in sk2.logs(), 30, interval=0.1), sk2.logs()[-3000:]
    time.sleep(3)  # (a window in which a wake would show)
    logs = sk2.logs()
    assert logs.count("server is entering sleeping state") == 1 and "exiting sleeping state" not in logs, logs[-3000:]
    next_turns_warm_and_right(sk2, chats, llama_server, after, tmp_path)


def test_the_real_gemma_requantized_recomputes_the_chats(starter, llama_server, real_gemma, tmp_path):
    """A re-downloaded quant of a real model: chats saved on Gemma 3 270M Q4_K_M (as published), then served by
    its F16 conversion (the same vocabulary and shape, other weights): recomputed, warm, and answering as a
    cold F16 llama-server does."""
    flags = ["--no-repack", "--swa-full", "--chat-template-file", str(TEMPLATES / "gemma3.jinja"), *ARGS]
    flags += ["-c", "8192", "-np", "1"]
    chats = six_chats_saved(starter, llama_server, ["-m", str(gemma3_270m_q4()), *flags], {})
    after = ["-m", str(real_gemma), *flags]
    sk2 = starter(llama_server, after)()
    status = wait_recomputed(sk2, REAL_MODEL_RECOMPUTE_WITHIN_S)
    assert status["recomputed"] == 6, (status, sk2.logs()[-4000:])
    next_turns_warm_and_right(sk2, chats, llama_server, after, tmp_path)


def test_in_router_mode_a_model_recomputes_its_chats_once_it_is_loaded(starter, llama_server, family_models, tmp_path):
    """Router mode, -np 1 -> -np 2: nothing is recomputed for a model the router has not loaded (a's child does
    not exist yet); a client's load of it starts its recompute, and then every chat's next turn is warm and
    answers as a cold plain llama-server of a's new configuration."""
    models = models_dir(tmp_path, family_models)
    router = ["--models-dir", str(models), *ROUTER]
    chats = six_chats_saved(starter, llama_server, [*router, "-np", "1"], {"model": "a"})
    sk2 = starter(llama_server, [*router, "-np", "2"])()
    assert statuses(sk2.port)["a"] != "loaded" and "recomputing" not in sk2.logs(), sk2.logs()[-3000:]
    assert http_call(sk2.port, "POST", "/models/load", {"model": "a"}).status == 200, sk2.logs()[-3000:]

    def recompute_of_a() -> dict[str, Any]:
        models_status = http_call(sk2.port, "GET", "/slotkeeper/status").body["models"] or {}
        return models_status.get("a", {}).get("recompute", {"pending": -1})

    assert wait_until(lambda: recompute_of_a()["pending"] == 0, RECOMPUTE_WITHIN_S, interval=0.2), (
        recompute_of_a(),
        sk2.logs()[-4000:],
    )
    assert recompute_of_a()["recomputed"] == 6, (recompute_of_a(), sk2.logs()[-4000:])
    plain_args = ["-m", str(models / "a.gguf"), *ROUTER, "-np", "2"]
    next_turns_warm_and_right(sk2, chats, llama_server, plain_args, tmp_path)


def six_chats_saved(starter: Any, server: str, args: list[str], request: dict[str, Any]) -> list[Chat]:
    """Six chats sharing a system prompt, two turns each with a title request after each, then a swap."""
    chats = [Chat(i, request) for i in range(6)]
    sk = starter(server, args)()
    converse(chats, sk.port)
    converse(chats, sk.port)
    swap_out(sk)
    return chats


def next_turns_warm_and_right(
    sk: Any, chats: list[Chat], server: str, args: list[str], tmp_path: Path, *, same_steps: bool = False
) -> None:
    """Each chat's next turn reuses at least 90% of its previous prompt and answers as a cold plain
    llama-server of `args` does (the same greedy reply, the same top log-probabilities within tolerance).

    `same_steps`: for a model whose near-ties are closer than what the prefill's split changes, the tiny
    gemma3 (a top-2 gap of 0.01 where one request's prefill and 512-token steps differ by up to 0.05), the
    cold run's reply is no stable reference: the whole reply is compared with plain llama-server's own prefill
    of the same tokens in the recompute's steps, and with the cold run the first token's log-probabilities."""
    turns = [chat.send(sk.port, chat.messages, max_tokens=12, logprobs=True, top_logprobs=5) for chat in chats]
    warm = [(chat.n, t["timings"]["cache_n"], chat.last_prompt_tokens) for chat, t in zip(chats, turns)]
    assert all(cache_n >= 0.9 * previous for _, cache_n, previous in warm), (warm, sk.logs()[-4000:])
    got = [_as_answer(t) for t in turns]
    cold = cold_answers(server, args, chats, tmp_path)
    if not same_steps:
        for chat, answer_, expected in zip(chats, got, cold):
            assert same_answer(answer_, expected, LOGPROB_TOLERANCE), (chat.n, answer_, expected)
        return
    stepped = stepped_answers(server, args, chats, [cache_n for _, cache_n, _ in warm], tmp_path)
    for chat, answer_, expected, first in zip(chats, got, stepped, cold):
        assert same_answer(answer_, expected, LOGPROB_TOLERANCE), (chat.n, answer_, expected)
        assert same_answer(("", answer_[1][:1]), ("", first[1][:1]), LOGPROB_TOLERANCE), (chat.n, answer_, first)


def stepped_answers(
    server: str, args: list[str], chats: list[Chat], held: list[int], tmp_path: Path
) -> list[tuple[str, list]]:
    """Each chat's next turn on a plain llama-server of `args` whose slot 0 first prefilled the `held` tokens
    of the chat's prompt in the recompute's steps (CHUNK_TOKENS at a time, n_predict 0)."""
    answers = []
    with plain_server(server, [*args, "--slot-save-path", str(tmp_path)], tmp_path) as plain:  # (for its erase)
        for chat, n_held in zip(chats, held):
            token_ids = tokens_of(plain.port, chat, chat.messages)[:n_held]
            assert http_call(plain.port, "POST", "/slots/0?action=erase").status == 200
            for cut in [*range(CHUNK_TOKENS, n_held, CHUNK_TOKENS), n_held]:
                body = {"prompt": token_ids[:cut], "n_predict": 0, "id_slot": 0, "cache_prompt": True}
                assert http_call(plain.port, "POST", "/completion", body).status == 200
            reply = chat.send(plain.port, chat.messages, max_tokens=12, logprobs=True, top_logprobs=5, id_slot=0)
            answers.append(_as_answer(reply))
    return answers


def _as_answer(body: dict) -> tuple[str, list]:
    choice = body["choices"][0]
    tops = [[(alt["token"], alt["logprob"]) for alt in item["top_logprobs"]] for item in choice["logprobs"]["content"]]
    return choice["message"].get("content") or "", tops


def test_a_request_that_comes_mid_recompute_waits_for_one_step_at_most(starter, llama_server, family_models):
    """One slot, six long chats to recompute (seconds of prefill): a new chat's request that comes meanwhile is
    answered about as fast as when all is idle (it waits for the step under way at most, not for the chat or
    the queue), and the recompute resumes and finishes."""
    model = ["-m", str(family_models["llama"])]
    chats = [Chat(i, {}, facts=400) for i in range(6)]
    sk = starter(llama_server, [*model, *ARGS, "-c", "32768", "-np", "2"])()
    converse(chats, sk.port)
    swap_out(sk)
    sk2 = starter(
        llama_server,
        [*model, *ARGS, "-c", "16384", "-np", "1"],
    )(own=("--log-level", "debug"))
    assert wait_until(lambda: "recomputing the 6 most recent" in sk2.logs(), 10, interval=0.01), sk2.logs()[-3000:]
    # A chat under way: its first step prefilled (a chat is ~7.5k tokens, ~15 steps).
    assert wait_until(lambda: recompute_status(sk2.port)["prefilled_tokens"] > 0, 30, interval=0.01), sk2.logs()[-3000:]
    during = waited_new_chat(sk2.port, 100)
    status = wait_recomputed(sk2)
    idle = waited_new_chat(sk2.port, 101)
    assert status["recomputed"] == 6 and status["paused"] >= 1, (status, sk2.logs()[-3000:])
    step_s = status["seconds"] / (status["prefilled_tokens"] / CHUNK_TOKENS)
    print(
        f"new chat waited during recompute {during:.3f} s, idle {idle:.3f} s, a step {step_s:.3f} s, "
        f"all {status['seconds']} s"
    )
    # the step under way (an early one is slower), and slotkeeper's own time on a loaded machine; far less than
    # the rest of a chat (~15 steps), which a recompute that did not give way between steps makes it wait for
    bound = idle + 4 * step_s + 0.2
    assert status["seconds"] > 3 * bound, "the recompute is long enough to tell waiting for it from a step"
    assert during <= bound, (during, idle, step_s, sk2.logs()[-3000:])


def waited_new_chat(port: int, n: int) -> float:
    """A new chat's first request (no system prompt: no opening to save first): how long it waited, that is its
    time end to end less llama-server's own prompt and generation time for it.

    Why not the time end to end: on a machine loaded past its cores, llama.cpp's threads wait for each other at
    every step, and the request's own compute took from 0.05 s to 2.4 s from one run to the next (eight tokens
    at 0.3 ms or at 230 ms each), with or without a recompute beside it. What the recompute may add is the wait
    for its step under way, which this measures alone."""
    body = {
        "messages": [
            {"role": "user", "content": f"Chat {n}. " + " ".join(f"Item {n + i} is blue." for i in range(90))}
        ],
        "max_tokens": 8,
        "temperature": 0,
    }
    started = time.monotonic()
    reply = http_call(port, "POST", "/v1/chat/completions", body)
    elapsed = time.monotonic() - started
    assert reply.status == 200, reply.body
    timings = reply.body["timings"]
    return elapsed - (timings["prompt_ms"] + timings["predicted_ms"]) / 1000
