"""llama-server's own sleep (`--sleep-idle-seconds`): the chats are saved before it, the child is never woken by
slotkeeper, and every chat comes back warm after it, on the real llama-server.

llama-server unloads the model and every KV cache after N idle seconds, and logs `server is entering sleeping
state` (and `exiting sleeping state` when a task wakes it). The child's output is in slotkeeper's log.
"""

from __future__ import annotations

import time

import pytest
from family_helpers import FAMILIES, Chat, swap_out

from slotkeeper.testing.harness import http_call, wait_until

SLEEP_S = 3
ASLEEP = "server is entering sleeping state"
AWOKE = "exiting sleeping state"


def sleeping(sk) -> bool:
    return http_call(sk.port, "GET", "/props").body.get("is_sleeping") is True


@pytest.mark.parametrize("name", ["llama", "qwen35-thinking-off"])
def test_a_chat_is_warm_after_llama_server_slept(family_start, name):
    """Two chats, an idle wait past --sleep-idle-seconds: the child fell asleep once, nothing woke it before
    the next turn, and that turn reused at least 90% of each chat's previous prompt (restored from the store)."""
    family = FAMILIES[name]
    sk = family_start(family, "--sleep-idle-seconds", str(SLEEP_S))
    chats = [Chat(i, family.request) for i in range(2)]
    for chat in chats:
        chat.turn(sk.port)
    assert wait_until(lambda: sleeping(sk), 4 * SLEEP_S, interval=0.2), sk.logs()[-3000:]
    time.sleep(SLEEP_S)  # a while asleep: slotkeeper's idle save, status and probes must not wake it
    assert sleeping(sk), "something woke llama-server while it slept:\n" + sk.logs()[-3000:]
    logs = sk.logs()
    assert logs.count(ASLEEP) == 1 and AWOKE not in logs, logs[-3000:]
    assert "llama-server is asleep" in logs, logs[-3000:]
    for chat in chats:
        timings = chat.turn(sk.port)
        assert chat.reused_enough(timings), (timings, chat.previous_prompt_tokens, sk.logs()[-4000:])
    assert "llama-server woke up" in sk.logs() or wait_until(lambda: "llama-server woke up" in sk.logs(), 5)


@pytest.mark.parametrize("name", ["llama", "qwen35-thinking-off"])
def test_a_swap_while_llama_server_sleeps_writes_nothing_and_the_chat_is_warm_after(family_start, name):
    """A chat, the child asleep, a swap: the stop writes nothing and does not wake the child; after the
    restart the chat's next turn is warm (from what was saved before the sleep)."""
    family = FAMILIES[name]
    sk = family_start(family, "--sleep-idle-seconds", str(SLEEP_S))
    chat = Chat(0, family.request)
    chat.turn(sk.port)
    chat.turn(sk.port)
    assert wait_until(lambda: sleeping(sk), 4 * SLEEP_S, interval=0.2), sk.logs()[-3000:]
    entries = http_call(sk.port, "GET", "/slotkeeper/status").body["store"]["entries"]
    assert entries >= 1, "nothing was saved before the sleep"
    swap_out(sk)
    logs = sk.logs()
    assert AWOKE not in logs, "the stop woke llama-server:\n" + logs[-3000:]
    assert "nothing to save" in logs and " saved from slot" not in logs.split("SIGTERM received")[-1], logs[-3000:]
    sk2 = family_start(family, "--sleep-idle-seconds", str(SLEEP_S))
    timings = chat.turn(sk2.port)
    assert chat.reused_enough(timings), (timings, chat.previous_prompt_tokens, sk2.logs()[-4000:])
