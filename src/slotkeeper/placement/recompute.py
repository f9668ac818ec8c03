"""Recompute: chats saved by another configuration, rebuilt from their tokens while llama-server is idle.

Why: an upgrade that changes the slot-file format, a new -np or KV cache type, or a re-quantized model file
leaves every saved state unloadable (store/fit.py says which), yet each entry still holds its chat's tokens,
which is all the running llama-server needs to compute the state again. The most recent chats come first,
up to a budget (--recompute N per model); each is prefilled into an idle slot and saved as a new entry in
the running format, at the very tokens it held (on hybrid and sliding-window models, its turn boundary: the
next request extends it). The old entry stays for a downgrade until the cap removes it.

Never in the user's way: it runs only while no request is in flight and the child is awake (it never wakes a
sleeping one), one chat at a time, in steps of CHUNK_TOKENS; a request that arrives waits at most for the
step under way, and the chat resumes where its slot stands once all is idle again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..chat.boundary import Boundary
from ..chat.prefix import block_keys, exact_key
from ..llama.sleep import SleepWatch
from ..log import fmt_ms, log
from ..store.entries import Entry
from ..store.statefile import StateFileError, read_header
from .boundarysaves import supersedes_nothing
from .decide import worth_keeping
from .keeper import Keeper
from .slots import Slot, SlotTable

CHUNK_TOKENS = 512  # one prefill step: llama-server's default micro-batch (what a request may wait for)
IDLE_POLL_S = 0.1  # how often idleness is looked at while requests run
PROGRESS_EVERY_S = 10.0  # a progress line at most this often during a long recompute
DEFAULT_PREFILL_TOKENS_PER_S = 500.0  # for the start line's estimate before any prefill was measured


@dataclass
class _Progress:
    """Where the chat being recomputed stands: its tokens, and how many of them `slot` holds."""

    entry: Entry
    token_ids: list[int]
    slot: Slot | None = None
    done: int = 0
    prefilled: int = 0
    seconds: float = 0.0


class Recomputer:
    """The recompute queue of one model, and the loop that works through it while all is idle."""

    def __init__(
        self,
        table: SlotTable,
        keeper: Keeper,
        *,
        budget: int,
        sleep: SleepWatch | None = None,
    ) -> None:
        self.table = table
        self.keeper = keeper
        self.store = keeper.store
        self.budget = budget
        self.sleep = sleep
        self.queue: list[Entry] = []
        self._latest: list[Entry] = []  # every chat that could be recomputed (the queue is the budget's share)
        self.paused = 0  # times a request came while a chat was half done
        self.recomputed = 0
        self.prefilled = 0
        self.seconds = 0.0
        self._current: _Progress | None = None

    def plan(self) -> list[Entry]:
        """The chats to recompute: the `budget` most recent recomputable entries, each the latest of its chat
        (an entry another one extends is that chat's earlier turn), and not saved here already."""
        store = self.store
        candidates = sorted(store.recomputable.values(), key=lambda e: e.last_used, reverse=True)
        # Keys are chained (chat.prefix): an entry's last key inside another's chain means that one holds all of
        # it and more. One pass over the keys, whatever the number of entries (an upgrade sets aside them all).
        inner_messages = {k for e in candidates for k in list(e.message_keys)[:-1]}
        inner_blocks = {k for e in candidates for k in list(e.keys)[:-1]}

        def continued(entry: Entry) -> bool:
            if entry.message_keys:
                return entry.message_keys[-1] in inner_messages
            return bool(entry.keys) and entry.keys[-1] in inner_blocks

        self._latest = [e for e in candidates if not continued(e) and store.find_exact(e.exact) is None]
        self.queue = self._latest[: max(self.budget, 0)]
        return self.queue

    def announce(self) -> None:
        """One line at start: how many chats wait, and what will be done about them."""
        store = self.store
        waiting = len(self._latest) + len(store.unfit)
        if not waiting:
            return
        versions = sorted({e.seq_version for e in store.recomputable.values()})
        current = store.current_format
        formats = (
            f" (state v{', v'.join(map(str, versions))}; this one writes v{current[0]})"
            if current is not None and versions != [current[0]]
            else ""
        )
        saved = f"{waiting} chat{' was' if waiting == 1 else 's were'} saved by another llama-server configuration"
        if not self.queue:
            why = "--recompute 0" if self.budget <= 0 else "none can be recomputed"
            log.warning("%s%s: kept, not used (%s)", saved, formats, why)
            return
        tokens = sum(e.n_tokens for e in self.queue)
        rate = self.keeper.known_prefill_rate() or DEFAULT_PREFILL_TOKENS_PER_S
        log.info(
            "%s%s: recomputing the %s while idle (%s tokens, ~%s of prefill)",
            saved,
            formats,
            "one" if len(self.queue) == 1 else f"{len(self.queue)} most recent",
            f"{tokens:,}",
            _duration(tokens / rate),
        )

    @property
    def pending(self) -> int:
        return len(self.queue)

    async def run(self, quiet: Callable[[], bool]) -> None:
        """Until the queue is done (or cancelled at stop): each chat in turn, each step only while `quiet()`
        (no request in flight), no slot is busy, and the child is awake."""
        while self.queue:
            entry = self.queue[0]
            try:
                finished = await self._recompute(entry, quiet)
            except (ConnectionError, OSError, StateFileError, ValueError) as exc:
                log.warning("chat %s not recomputed (%s); it stays as it was saved", entry.short, exc)
                finished = True
            if finished:
                self.queue.pop(0)
                self._current = None
        if self.recomputed:
            log.info(
                "recompute done: %d chat(s) recomputed, %s tokens prefilled in %s",
                self.recomputed,
                f"{self.prefilled:,}",
                fmt_ms(self.seconds),
            )

    async def _recompute(self, entry: Entry, quiet: Callable[[], bool]) -> bool:
        """One chat, step by step; True once it is saved (or cannot be)."""
        progress = self._current
        if progress is None or progress.entry is not entry:
            path = self.store.header_path(entry)
            header = await asyncio.to_thread(read_header, path)
            if header.images or exact_key(header.token_ids) != entry.exact:
                log.warning("chat %s not recomputed: its file does not hold the tokens its manifest names", entry.short)
                return True
            progress = self._current = _Progress(entry=entry, token_ids=list(header.token_ids))
        tokens = progress.token_ids
        last_line = time.monotonic()
        while True:
            slot = await self._idle_slot(progress, quiet)
            self.table.reserve(slot)
            try:
                if progress.slot is not slot:  # a fresh start here: the chat it held is not continued here
                    if slot.restored is not None:  # a restored state it cannot go back from (extend-only models)
                        await self.keeper.erase(slot, f"erased to recompute chat {entry.short}")
                    self.table.cleared(slot)
                    progress.slot, progress.done = slot, 0
                if len(tokens) - progress.done <= CHUNK_TOKENS:
                    return await self._finish(progress)
                step = progress.done + CHUNK_TOKENS
                started = time.monotonic()
                reached = await self.keeper.boundaries.reach(
                    slot.id, Boundary(token_ids=tokens[:step], prompt=tokens[:step])
                )
                self.table.task_ran(slot)
                if reached is None:
                    raise ConnectionError(f"llama-server did not prefill slot {slot.id}")
                self.table.held(slot, None, block_keys(tokens[:step]), step, exact_key(tokens[:step]))
                took = time.monotonic() - started
                progress.done, progress.prefilled = step, progress.prefilled + reached.prefilled
                progress.seconds += took
                self.prefilled += reached.prefilled  # (the status counts each step as it ends)
                self.seconds += took
            finally:
                self.table.release(slot)
            if time.monotonic() - last_line >= PROGRESS_EVERY_S:
                last_line = time.monotonic()
                log.info("recomputing chat %s: %s of %s tokens", entry.short, f"{progress.done:,}", f"{len(tokens):,}")

    async def _finish(self, progress: _Progress) -> bool:
        """The last step, and the save: the slot then holds the new entry."""
        entry, slot = progress.entry, progress.slot
        assert slot is not None
        tokens = progress.token_ids
        started = time.monotonic()
        reached, result = await self.keeper.reach_and_save(
            slot,
            Boundary(token_ids=tokens, prompt=tokens),
            key=entry.exact,
            message_keys=list(entry.message_keys),
            supersedes=supersedes_nothing,
            opening=entry.opening,
            marks_boundary=entry.boundary,
        )
        if reached is None or result is None:
            raise ConnectionError(f"llama-server did not prefill slot {slot.id}")
        took = time.monotonic() - started
        progress.prefilled += reached.prefilled
        progress.seconds += took
        self.prefilled += reached.prefilled
        self.seconds += took
        if result.entry is None:
            log.warning("chat %s recomputed but not saved: %s", entry.short, result.reason)
            return True
        new = result.entry
        self.store.recomputed(entry, new)
        self.recomputed += 1
        left = len(self.queue) - 1
        log.info(
            "chat %s recomputed into slot %d: %s tokens prefilled in %s, saved as entry %s%s",
            entry.short,
            slot.id,
            f"{progress.prefilled:,}",
            fmt_ms(progress.seconds),
            new.short,
            f" ({left} to go)" if left else "",
        )
        return True

    async def _idle_slot(self, progress: _Progress, quiet: Callable[[], bool]) -> Slot:
        """Once all is idle and the child awake: the slot that holds this chat's progress if it still does, else
        the least recently used idle slot holding nothing worth keeping."""
        waited = False
        while True:
            if quiet() and not any(s.busy for s in self.table) and not await self._asleep():
                held = progress.slot
                slot: Slot | None
                if held is not None and progress.done and held.exact == exact_key(progress.token_ids[: progress.done]):
                    slot = held
                else:
                    free = [s for s in self.table if not worth_keeping(s, self.keeper.rules)]
                    slot = min(free, key=lambda s: (s.entry is not None, s.last_used)) if free else None
                if slot is not None:
                    if waited and progress.done:  # (one line when it goes on, not one per look)
                        self.paused += 1
                        log.debug(
                            "recompute of chat %s resumes at %s of %s tokens in slot %d (it waited for requests)",
                            progress.entry.short,
                            f"{progress.done:,}",
                            f"{len(progress.token_ids):,}",
                            slot.id,
                        )
                    return slot
            waited = True
            await asyncio.sleep(IDLE_POLL_S)

    async def _asleep(self) -> bool:
        """Whether the child sleeps, asked each step (its /props does not wake it): a step would."""
        return self.sleep is not None and await self.sleep.asleep_now()


def _duration(seconds: float) -> str:
    """A rough duration for a line a user reads: seconds, or minutes."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
