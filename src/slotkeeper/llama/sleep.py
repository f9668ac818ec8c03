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
* a request that comes near or past the child's deadline (reckoned from the end of its last task, client.TaskClock)
  asks it too, before it is placed (`before_request`): the poll may not have seen the sleep yet, and a request
  placed on what the slot table still shows would go to an emptied slot, unrestored;
* once it has slept, every slot is empty: each chat comes back from the store on its next turn, as after a
  swap. A stop while it sleeps writes nothing.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable

from ..log import log
from .client import LlamaClient

POLL_S = 1.0  # how often /props is asked while nothing runs
PROPS_TIMEOUT_S = 2.0
SAVE_MARGIN_S = 2.0  # the idle save runs at least this long (at most half the sleep time) before the sleep
CHECK_MARGIN_S = 0.25  # a request asks whether the child sleeps from this long (and a poll) before its deadline
EDGE_S = 0.1  # how far either side of the reckoned deadline the child may fall asleep (its clock and ours differ)


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
        self.clock = client.clock  # when its last task ended: its deadline
        self.clock.lead_s = max(sleep_idle_s - POLL_S - CHECK_MARGIN_S, 0.0)
        if not self.clock.running:
            self.clock.check_from = self.clock.last_end + self.clock.lead_s
        self._checking = asyncio.Lock()  # one request asks at a time; those waiting find the answer

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
            log.info("llama-server woke up for a request (it reloads its model)")

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

    def sleeps_in(self) -> float | None:
        """Seconds until the child's own sleep as slotkeeper reckons it (< 0: overdue); None while a task runs or
        once it sleeps."""
        if self.state is ChildSleep.ASLEEP or self.clock.running:
            return None
        return self.clock.last_end + self.sleep_idle_s - time.monotonic()

    async def before_request(self) -> None:
        """Before a request is placed: if the child may sleep (near its deadline or past it), know it now, and
        empty the slot table as the poll would, before the plan reads it (a tokenize would wake the child).

        Far from the deadline, this is one comparison. Near it, /props answers; a child found awake has its idle
        clock restarted (GET /slots, a task), so that it cannot fall asleep while the request is planned (a
        tokenize does not restart it); one that is due to fall asleep within EDGE_S is waited for instead, since
        a restart could come just after it fell asleep, and wake it unnoticed.
        """
        if time.monotonic() < self.clock.check_from:
            return
        async with self._checking:
            if time.monotonic() < self.clock.check_from:
                return  # another request asked meanwhile
            if self.state is ChildSleep.ASLEEP or await self.asleep_now():
                self._woken()
                return
            deadline = self.clock.last_end + self.sleep_idle_s
            now = time.monotonic()
            if deadline - EDGE_S <= now < deadline + EDGE_S:
                await asyncio.sleep(deadline + EDGE_S - now)
                if await self.asleep_now():
                    self._woken()
                    return
            await self._restart_clock(deadline)

    def _woken(self) -> None:
        """The request about to go wakes the sleeping child (the table was emptied when it fell asleep); its idle
        clock starts again then."""
        self.set_state(ChildSleep.AWAKE)
        self.clock.restarted()

    async def _restart_clock(self, deadline: float) -> None:
        """A task that changes nothing (GET /slots): the awake child's idle clock starts again, so that it stays
        awake while the request is planned; a failure leaves the request to the poll, as before."""
        try:
            reply = await asyncio.wait_for(self.client.slots(), PROPS_TIMEOUT_S)
        except (TimeoutError, ConnectionError):
            return
        log.debug(
            "llama-server was awake %.2f s before its sleep (reckoned): its idle clock restarted (GET /slots: %d)",
            deadline - time.monotonic(),
            reply.status,
        )
