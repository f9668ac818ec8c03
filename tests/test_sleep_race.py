"""A request that comes as llama-server falls asleep (`--sleep-idle-seconds`), before slotkeeper's once-a-second
poll has seen it, on the real llama-server: it is placed on what the sleep left (nothing), and each chat's next
turn is warm, restored from the store.

Why: the sleep empties every slot; a request placed on the slot table as it stood before would go to its
emptied slot unrestored. slotkeeper reckons the child's deadline from its last task and asks `/props` before
placing a request near or past it (llama.sleep.SleepWatch.before_request).
"""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
from family_helpers import FAMILIES, NO_THINKING, Chat
from test_router import LONG_S, ROUTER, models_dir

from slotkeeper.testing.harness import http_call, stream_lines, wait_until

SLEEP_S = 3
POLL_S = 0.02  # how often the tests ask /props: far more often than slotkeeper's poll (1 s)
ASLEEP = "llama-server is asleep"
LONG_CONTEXT = 65536


def sleeping(sk) -> bool:
    """llama-server's own answer, through the proxy (/props wakes nothing, and restarts no idle clock)."""
    return http_call(sk.port, "GET", "/props").body.get("is_sleeping") is True


def sleeps_in(sk) -> float | None:
    """Seconds until llama-server's sleep, as slotkeeper reckons it from its last task."""
    return http_call(sk.port, "GET", "/slotkeeper/status").body["child_sleeps_in_s"]


def asleep(sk, name: str) -> bool:
    """A router's model: llama-server's own answer for its child (/props?model= wakes nothing)."""
    return http_call(sk.port, "GET", f"/props?model={name}").body.get("is_sleeping") is True


def told_before_placed(logs: str) -> bool:
    """After the sleep, slotkeeper's 'asleep' line comes before the placement of the next turn, which restores."""
    after = logs.split("server is entering sleeping state", 1)[-1]
    asleep, placed = after.find(ASLEEP), after.find("request placed on slot")
    return 0 <= asleep < placed and "(restored)" in after[placed:].splitlines()[0]


@pytest.mark.parametrize("name", ["llama", "qwen35-thinking-off"])
def test_a_turn_sent_as_soon_as_llama_server_sleeps_is_warm(family_start, name):
    """Two chats; the next turns go the moment /props first says the child sleeps (asked every 20 ms, long
    before slotkeeper's own poll could see it): each reuses at least 90% of its previous prompt."""
    family = FAMILIES[name]
    sk = family_start(family, "--sleep-idle-seconds", str(SLEEP_S), own=("--log-level", "debug"))
    chats = [Chat(i, family.request) for i in range(2)]
    for chat in chats:
        chat.turn(sk.port)
    assert wait_until(lambda: sleeping(sk), 4 * SLEEP_S, interval=POLL_S), sk.logs()[-3000:]
    for chat in chats:
        timings = chat.turn(sk.port)
        assert chat.reused_enough(timings), (chat.n, timings, chat.previous_prompt_tokens, sk.logs()[-5000:])
    assert told_before_placed(sk.logs()), sk.logs()[-5000:]


@pytest.mark.parametrize("name", ["llama", "qwen35-thinking-off"])
def test_a_turn_sent_just_before_llama_server_sleeps_is_warm(family_start, name):
    """Two chats; the next turns go a few milliseconds before the child's deadline (after the idle save, which
    restarted its clock): whether it falls asleep before the request reaches it or not, each turn reuses at
    least 90% of its previous prompt."""
    family = FAMILIES[name]
    sk = family_start(family, "--sleep-idle-seconds", str(SLEEP_S), own=("--log-level", "debug"))
    chats = [Chat(i, family.request) for i in range(2)]
    for chat in chats:
        chat.turn(sk.port)

    def near() -> bool:  # past the idle save (half-way): nothing restarts the child's clock before its deadline
        remaining = sleeps_in(sk)
        return remaining is not None and remaining < SLEEP_S / 4

    assert wait_until(near, 4 * SLEEP_S, interval=POLL_S), sk.logs()[-3000:]
    deadline = time.monotonic() + (sleeps_in(sk) or 0.0)
    time.sleep(max(deadline - 0.05 - time.monotonic(), 0))
    while time.monotonic() < deadline - 0.003:
        pass  # (the last few ms busy: a sleep's wake-up is late by more than that on a loaded machine)
    for chat in chats:
        timings = chat.turn(sk.port)
        assert chat.reused_enough(timings), (chat.n, timings, chat.previous_prompt_tokens, sk.logs()[-5000:])
    logs = sk.logs()
    if "server is entering sleeping state" in logs:  # it fell asleep first: slotkeeper knew before placing
        assert told_before_placed(logs), logs[-5000:]


def test_in_router_mode_a_turn_sent_as_soon_as_a_models_child_sleeps_is_warm(
    starter, llama_server, family_models, tmp_path
):
    """Router mode (a child per model, each with its own sleep): a chat on a (llama) and one on b (qwen35);
    each next turn goes the moment /props?model= first says that model's child sleeps, and is warm."""
    models = models_dir(tmp_path, family_models)
    start = starter(llama_server, ["--models-dir", str(models), *ROUTER, "--sleep-idle-seconds", str(SLEEP_S)])
    sk = start(own=("--log-level", "debug"))
    chats = [Chat(0, {"model": "a"}), Chat(1, {"model": "b", **NO_THINKING})]
    for chat in chats:
        chat.turn(sk.port)

    for chat in chats:
        name = chat.request["model"]
        assert wait_until(partial(asleep, sk, name), 4 * SLEEP_S, interval=POLL_S), sk.logs()[-3000:]
        timings = chat.turn(sk.port)
        assert chat.reused_enough(timings), (name, timings, chat.previous_prompt_tokens, sk.logs()[-5000:])
        assert f"model {name}: {ASLEEP}" in sk.logs(), sk.logs()[-5000:]


def test_in_router_mode_a_models_chat_is_saved_before_its_child_sleeps_while_another_model_answers(
    starter, llama_server, family_models, tmp_path
):
    """Router mode: a turn on a (llama), then b (qwen35) streams an answer that outlasts a's sleep. a's changed chat
    is saved on a's own idle clock while b answers, before a's child falls asleep; its next turn is warm.

    Why: each child sleeps on its own; a save that waited for every model to be quiet lost a's chat with its cache
    (found on a loaded machine, where b's first request outlasted a's 3 s)."""
    models = models_dir(tmp_path, family_models)
    # a context b's answer takes far longer to fill than a takes to fall asleep, on a quiet machine too
    long_context = ("-c", str(LONG_CONTEXT))
    args = ["--models-dir", str(models), *ROUTER, *long_context, "--sleep-idle-seconds", str(SLEEP_S)]
    sk = starter(llama_server, args)(own=("--log-level", "debug"))
    chat = Chat(0, {"model": "a"})
    chat.turn(sk.port)
    chat.turn(sk.port)  # changed since its opening's save

    stop, streamed = threading.Event(), []
    body = {
        "model": "b",
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": 100_000,
        "ignore_eos": True,
        "stream": True,
        **NO_THINKING,
    }

    def answer_b() -> None:
        lines = stream_lines(sk.port, "/v1/chat/completions", body, timeout=LONG_S)
        try:
            for _, line in lines:
                streamed.append(line)
                if stop.is_set():
                    return
        finally:
            lines.close()  # the client goes: llama-server stops generating

    streaming = threading.Thread(target=answer_b)
    streaming.start()
    try:
        assert wait_until(lambda: len(streamed) > 1, 120), sk.logs()[-3000:]
        assert wait_until(lambda: asleep(sk, "a"), 4 * SLEEP_S, interval=POLL_S), sk.logs()[-3000:]
        assert streaming.is_alive(), "b's answer ended before a slept: the case is not made"
    finally:
        stop.set()
        streaming.join(LONG_S)
    timings = chat.turn(sk.port)
    assert chat.reused_enough(timings), (timings, chat.previous_prompt_tokens, sk.logs()[-5000:])
    logs = sk.logs()
    assert "lost with llama-server's cache" not in logs, logs[-5000:]


def test_status_polls_never_in_flight_do_not_keep_the_save_from_running_before_the_sleep(family_start):
    """Monitors ask /props and /health back to back while the chat idles, so one is nearly always in flight:
    neither makes llama-server work (its idle clock runs on), so neither delays the idle save; the chat is saved
    before the child sleeps, and its next turn is warm. (A save that waited for no request at all in flight
    slept another --autosave-idle when it found one, past the child's sleep.)"""
    family = FAMILIES["llama"]
    sk = family_start(family, "--sleep-idle-seconds", str(SLEEP_S), own=("--log-level", "debug"))
    chat = Chat(0, family.request)
    chat.turn(sk.port)
    chat.turn(sk.port)
    stop = threading.Event()

    def monitor(path: str) -> None:
        while not stop.is_set():
            http_call(sk.port, "GET", path)

    monitors = [threading.Thread(target=monitor, args=(path,)) for path in ("/props", "/health", "/props", "/health")]
    for thread in monitors:
        thread.start()
    try:
        assert wait_until(lambda: sleeping(sk), 4 * SLEEP_S, interval=POLL_S), sk.logs()[-3000:]
    finally:
        stop.set()
        for thread in monitors:
            thread.join()
    timings = chat.turn(sk.port)
    assert chat.reused_enough(timings), (timings, chat.previous_prompt_tokens, sk.logs()[-5000:])
    assert "lost with llama-server's cache" not in sk.logs(), sk.logs()[-5000:]
