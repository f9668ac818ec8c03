"""Settling: once a hybrid chat's turn is over, its idle slot is brought to the turn boundary (nothing written).

The next turn extends the boundary, so this prefill is one it would pay anyway (the reply as the template
re-renders it, after a rollback to the checkpoint at the last user message): done here, it leaves the turn's
critical path while the user reads and types, and a later save needs no prefill. It starts SETTLE_AFTER_S
after the turn, so a request that comes back at once (a script, an agent's quick tool call) finds the slot as
plain llama-server leaves it; one that comes while this runs waits for it, then extends the boundary.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..chat.replies import ReplyReader
from ..log import log
from .keeper import Keeper
from .request import RequestKey
from .slots import Slot, SlotTable

SETTLE_AFTER_S = 0.25  # a hybrid chat's slot goes to its boundary once its turn has been over this long


class Settler:
    """The settle timers and the settles under way, per slot."""

    def __init__(self, table: SlotTable, keeper: Keeper) -> None:
        self.table = table
        self.keeper = keeper
        self._timers: dict[int, asyncio.TimerHandle] = {}  # per slot: its settle, not started yet
        self._running: set[asyncio.Future[None]] = set()
        self._stopping = False

    def later(self, slot: Slot, chat: dict[str, Any], reply: ReplyReader, key: RequestKey) -> None:
        """The turn of request `key` just ended on `slot`: settle it SETTLE_AFTER_S from now."""
        old = self._timers.pop(slot.id, None)
        if old is not None:
            old.cancel()
        self._timers[slot.id] = asyncio.get_running_loop().call_later(
            SETTLE_AFTER_S, self._start, slot, chat, reply, key
        )

    def _start(self, slot: Slot, chat: dict[str, Any], reply: ReplyReader, key: RequestKey) -> None:
        self._timers.pop(slot.id, None)
        if self._stopping or slot.busy or slot.last_request is not key:
            return  # the chat went on already (it pays what plain llama-server pays), or slotkeeper is stopping
        self.table.reserve(slot)
        task = asyncio.ensure_future(self._settle(slot, chat, reply))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _settle(self, slot: Slot, chat: dict[str, Any], reply: ReplyReader) -> None:
        try:
            await self.keeper.settle(slot, chat, reply)
        except (ConnectionError, ValueError, KeyError, TypeError) as exc:
            log.debug("slot %d not brought to its turn boundary: %r", slot.id, exc)
        except Exception as exc:  # noqa: BLE001 - an optimisation: the next turn or the save pays the prefill
            log.warning("slot %d not brought to its turn boundary (%r); its next turn prefills it", slot.id, exc)
        finally:
            self.table.release(slot)

    async def wait(self) -> None:
        """Until the settles under way end (their slots are reserved until then)."""
        if self._running:
            await asyncio.gather(*list(self._running), return_exceptions=True)

    def stop(self) -> None:
        """At stop: no slot is brought to its boundary any more but by the saves themselves."""
        self._stopping = True
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
