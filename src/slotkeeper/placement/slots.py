"""What each llama-server slot holds, as far as slotkeeper placed it there: the slot table.

The table is the one writer of slot state. Every change is one named event (reserved, released, held,
restored, ran, reached, cleared, unseen), so that fields that belong together change together: no caller sets
one field and forgets the one beside it. It does no I/O and makes no policy (that is `decide.py`); the keeper
and the hook call it once llama-server has done what the event says.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..chat.prefix import BLOCK_TOKENS, block_keys, common_keys, exact_key, extends_exactly
from ..chat.replies import ReplyReader
from ..store.entries import Entry
from .request import NO_KEY, RequestKey, RequestView


@dataclass
class Slot:
    """One slot's record. Read anywhere; written only by `SlotTable`."""

    id: int
    keys: Sequence[str] = field(default_factory=list)  # block keys of a prefix of what it holds
    last_request: RequestKey = NO_KEY  # the key of the last request placed here
    n_tokens: int = 0  # tokens known to be there (a lower bound after a turn that was not tokenized)
    entry: Entry | None = None  # the entry its content is saved as, while it has not changed since
    dirty: bool = False  # changed since its content was last saved
    busy: bool = False  # reserved: a request or a slot action runs on it
    last_used: float = 0.0
    task_ended: float = -1.0  # when llama-server's last task on it ended (its `t_last_used`: its own LRU order)
    label: str = ""  # the chat it holds, for log lines
    chat: dict[str, Any] | None = None  # extend-only models: the chat-form body of its last request ...
    reply: ReplyReader | None = None  # ... and that request's response (together: its turn boundaries)
    restored: Entry | None = None  # extend-only models: the restored state it holds; requests must extend it
    restored_extended: bool = False  # a request's tokens were seen to extend it (its continuations need not)
    exact: str = ""  # prefix.exact_key of its tokens, when they are known to the token (a boundary it reached)
    hidden_tail: bool = False  # it holds more than its keys show, unseen (see `SlotTable.ran`)

    def may_reach(self, tokens: Sequence[int]) -> bool:
        """The slot may be brought to hold exactly these tokens: they do not go back before its restored state."""
        restored = self.restored
        return restored is None or (
            len(tokens) >= restored.n_tokens and exact_key(tokens, restored.n_tokens) == restored.exact
        )

    def extended_by(self, tokens: Sequence[int]) -> bool:
        """A request with these tokens may run here: it extends the restored state, if there is one."""
        restored = self.restored
        return restored is None or extends_exactly(tokens, restored.n_tokens, restored.exact)


class SlotTable:
    """The slots of one llama-server, and the events that change them."""

    def __init__(self, n_slots: int) -> None:
        self.slots = [Slot(i) for i in range(n_slots)]
        self._freed = asyncio.Event()
        self._clock = 0.0

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[Slot]:
        return iter(self.slots)

    def __getitem__(self, slot_id: int) -> Slot:
        return self.slots[slot_id]

    def tick(self) -> float:
        """A strictly increasing time: two events never share one (least-recently-used order needs that)."""
        self._clock = max(self._clock + 1e-6, time.monotonic())
        return self._clock

    @staticmethod
    def used_at(slot: Slot) -> float:
        """When the slot was last used, in wall-clock seconds: what its saved entry records as its last use (a
        save's own time would order chats by when they were saved, and a stop saves the most recent first)."""
        return time.time() - max(0.0, time.monotonic() - slot.last_used)

    # ---- reservation ----------------------------------------------------------------------------------------

    def reserve(self, slot: Slot) -> Slot:
        slot.busy = True
        return slot

    def release(self, slot: Slot) -> None:
        slot.busy = False
        self._freed.set()

    async def wait_freed(self) -> None:
        """Until some slot is released."""
        self._freed.clear()
        await self._freed.wait()

    # ---- what llama-server did to a slot --------------------------------------------------------------------

    def held(self, slot: Slot, entry: Entry | None, keys: Sequence[str], tokens: int, exact: str = "") -> None:
        """It now holds exactly `keys`/`tokens`, saved as `entry` (when that is not None); `exact`: the exact key
        of those tokens, when they are known to the token."""
        slot.entry, slot.keys, slot.n_tokens, slot.dirty, slot.exact = entry, keys, tokens, False, exact
        slot.hidden_tail = False
        if entry is not None:
            slot.label = entry.short

    def restored(self, slot: Slot, entry: Entry, *, extend_only: bool, on_demand: bool = True) -> None:
        """The entry was restored into it: it holds that, unchanged since saved; on an extend-only model,
        requests must extend it. Restored for a request, the slot is used now; restored at start, it was last
        used when its chat was (the most recent chat in slot 0 is not the least recently used slot)."""
        self.held(slot, entry, entry.keys, entry.n_tokens, entry.exact)
        slot.last_request = RequestKey(message_keys=tuple(entry.message_keys))
        slot.chat = slot.reply = None
        if extend_only:
            slot.restored, slot.restored_extended = entry, False
        if on_demand:
            slot.last_used = self.tick()
        else:
            slot.last_used = time.monotonic() - max(0.0, time.time() - entry.last_used)

    def reached(self, slot: Slot, tokens: Sequence[int]) -> None:
        """llama-server brought it to exactly these tokens (a turn boundary), its content otherwise unchanged."""
        slot.keys, slot.n_tokens, slot.exact, slot.hidden_tail = (
            block_keys(tokens),
            len(tokens),
            exact_key(tokens),
            False,
        )

    def task_ran(self, slot: Slot) -> None:
        """llama-server ran a task of slotkeeper's there, taken or not: its LRU clock moved."""
        slot.task_ended = self.tick()

    def all_saved(self, slot: Slot) -> None:
        """All it holds worth keeping is in the store, though no new entry names it: its saves found their
        entries saved already, or it held nothing worth a file."""
        slot.dirty = False

    def save_failed(self, slot: Slot) -> None:
        """A save of it failed once its content had been moved to a boundary: it still holds a change not saved
        (tried again at the next save)."""
        slot.dirty = True

    def cleared(self, slot: Slot) -> None:
        """It holds nothing known (erased, or a restore into it failed)."""
        slot.keys, slot.last_request, slot.n_tokens, slot.entry, slot.dirty = [], NO_KEY, 0, None, False
        slot.hidden_tail = False
        slot.label, slot.restored, slot.restored_extended, slot.chat, slot.reply, slot.exact = (
            "",
            None,
            False,
            None,
            None,
            "",
        )

    def unseen(self, slot: Slot) -> None:
        """A request slotkeeper did not place ran here: what it holds is unknown, and worth a save to find out."""
        slot.dirty, slot.keys, slot.n_tokens, slot.hidden_tail = True, [], 0, False

    def lost_restored(self, slot: Slot) -> None:
        """A request that does not extend its restored state ran there all the same: that state is gone."""
        slot.restored, slot.restored_extended = None, False

    def ran(
        self,
        slot: Slot,
        view: RequestView,
        *,
        resident: bool,
        chat: dict[str, Any] | None,
        reply: ReplyReader | None,
    ) -> int:
        """A request placed there ended with an answer (or the client left while it ran): the slot holds its
        prompt and (part of) what was generated. The view's keys: the prompt's block keys, when it was tokenized
        (of its prompt up to a picture not known yet, when partial: the answer says its size); `resident`: it
        continued the chat there. Returns the prompt tokens llama-server is taken to have reused.

        What the slot holds past its keys is unseen (`hidden_tail`) when the view stopped before a picture not
        known yet, or when the chat continued there untokenized (its keys are an older turn's): only a request
        that continues its chat by its messages is then taken for it; any other is a branch or another chat,
        and the slot is saved before it runs there."""
        request, keys = view.key, view.keys
        slot.chat, slot.reply = chat, reply
        slot.restored_extended = slot.restored_extended or keys is not None
        if keys is not None:
            reused = common_keys(slot.keys, keys) * BLOCK_TOKENS
            slot.keys, slot.n_tokens = keys, len(keys) * BLOCK_TOKENS
            usage = reply.usage() if view.partial and reply is not None else None
            slot.n_tokens = max(slot.n_tokens, usage.prompt if usage is not None else 0)
            slot.hidden_tail = view.partial
        elif resident:
            reused = slot.n_tokens
            slot.hidden_tail = True
        else:  # unplaced: what it holds is unknown
            reused = 0
            slot.keys, slot.n_tokens, slot.hidden_tail = [], 0, False
        slot.last_request, slot.entry, slot.dirty, slot.last_used = request, None, True, self.tick()
        slot.task_ended = slot.last_used
        if not resident or not slot.label:
            slot.label = request.message_keys[-1][:4] if request.message_keys else f"s{slot.id}"
        slot.exact = ""
        return reused

    def describe(self) -> list[dict[str, Any]]:
        """Per slot, for /slotkeeper/status."""
        return [
            {
                "slot": s.id,
                "chat": s.label or None,
                "entry": s.entry.id if s.entry else None,
                "tokens_known": s.n_tokens,
                "images": len(s.entry.images) if s.entry is not None else 0,
                "dirty": s.dirty,
                "busy": s.busy,
                "restored_state": s.restored.id if s.restored else None,
                "opening": s.entry.id if s.entry is not None and s.entry.opening and not s.dirty else None,
            }
            for s in self.slots
        ]
