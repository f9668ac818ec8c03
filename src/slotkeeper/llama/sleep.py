"""llama-server's own sleep (`--sleep-idle-seconds N`): saved before it, never woken by slotkeeper, known after.

Why: after N idle seconds llama-server unloads the model and every slot's KV cache by itself (b11434,
`server_queue::start_loop`), and its next task reloads the model. Left alone, slotkeeper's idle save would
run after that, find every slot empty, and wake the child to do it: a model load, and the memory the sleep
freed taken again. So:

* the idle save runs before the child's deadline (`save_after`), whatever --autosave-idle says: every task
  resets llama-server's idle clock, and slotkeeper's quiet time never exceeds the child's, so a save started
  by then always runs while it is awake;
* `GET /props` tells whether it sleeps (`is_sleeping`) without waking it. slotkeeper asks it once a second while
  nothing runs (`POLL_S`, the daemon's loop), and before any save; while the child sleeps it sends nothing else
  (a slot read, a save or a tokenize would wake it);
* once it has slept, every slot is empty: each chat comes back from the store on its next turn, as after a
  swap. A stop while it sleeps writes nothing.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable

from ..log import log
from .client import LlamaClient

POLL_S = 1.0  # how often /props is asked while nothing runs
PROPS_TIMEOUT_S = 2.0
SAVE_MARGIN_S = 2.0  # the idle save runs at least this long (at most half the sleep time) before the sleep


class ChildSleep(enum.Enum):
    AWAKE = "awake"
    ASLEEP = "asleep"


def save_after(sleep_idle_s: float, autosave_idle: float) -> float:
    """The idle seconds after which slotkeeper saves what changed: --autosave-idle (0: off), but always before
    llama-server sleeps."""
    before_sleep = sleep_idle_s - min(SAVE_MARGIN_S, sleep_idle_s / 2)
    return min(autosave_idle, before_sleep) if autosave_idle > 0 else before_sleep


class SleepWatch:
    """The one owner of what slotkeeper knows of one llama-server's sleep (a router's model: its child's)."""

    def __init__(self, sleep_idle_s: int, client: LlamaClient, on_sleep: Callable[[], int]) -> None:
        self.sleep_idle_s = sleep_idle_s
        self.client = client  # (a router's model: /props?model= answers for its child)
        self.on_sleep = on_sleep  # every slot is empty now; returns how many chats wait in the store
        self.state = ChildSleep.AWAKE
        self.sleeps = 0

    def set_state(self, state: ChildSleep, chats: int = 0) -> None:
        if state is self.state:
            return
        self.state = state
        if state is ChildSleep.ASLEEP:
            self.sleeps += 1
            log.info(
                "llama-server is asleep (idle %d s, --sleep-idle-seconds): its KV cache is gone; %d chat(s) come back "
                "from the store on their next turn",
                self.sleep_idle_s,
                chats,
            )
        else:
            log.info("llama-server woke up for a request (it reloaded its model)")

    async def asleep_now(self) -> bool:
        """Whether the child sleeps, asked now (without waking it); the last known state when it cannot say."""
        try:
            reply = await asyncio.wait_for(self.client.props(), PROPS_TIMEOUT_S)
        except (TimeoutError, ConnectionError):
            return self.state is ChildSleep.ASLEEP
        if not reply.ok or not isinstance(reply.body, dict):
            return self.state is ChildSleep.ASLEEP
        if reply.body.get("is_sleeping") is True:
            if self.state is ChildSleep.AWAKE:
                self.set_state(ChildSleep.ASLEEP, self.on_sleep())
            return True
        self.set_state(ChildSleep.AWAKE)
        return False
