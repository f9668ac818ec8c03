"""The proxy's completion hook: each request's placement, from its body to the end of its answer.

`Placement.place` strings the parts together: the request's view (`request.py`), the decision (`decide.py`,
reserved in the same synchronous step), the slot prepared by the keeper (`keeper.py`), and, once the answer
is over, the slot table told what the slot now holds (`slots.py`). It also runs what happens between requests
(settling a hybrid chat at its boundary) and at start and stop (restoring recent chats, saving changed ones).
State is touched only on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..chat.apis import api_of
from ..chat.prefix import block_keys
from ..chat.replies import ReplyReader
from ..llama.client import LlamaClient
from ..llama.policy import CachePolicy
from ..log import fmt_bytes, fmt_ms, log
from ..metrics import Metrics
from ..proxy.hook import Placed
from ..store.conversations import ConversationStore, SaveFailure
from ..store.entries import Entry
from .decide import Miss, Outcome, Plan, Rules, continuing, decide, worth_keeping
from .keeper import Keeper
from .prep import Preparer
from .request import CompletionRequest, RequestView, read_request, with_id_slot
from .settle import Settler
from .slots import Slot, SlotTable

if TYPE_CHECKING:  # (imported only with --remote-store: obstore is under it)
    from ..llama.sleep import SleepWatch
    from ..remote.tier import RemoteTier

__all__ = ["Placement"]


class Placement:
    """The completion hook (proxy.CompletionHook) for one llama-server's slots."""

    def __init__(
        self,
        store: ConversationStore,
        client: LlamaClient,
        n_slots: int,
        *,
        rules: Rules | None = None,
        metrics: Metrics | None = None,
        remote: RemoteTier | None = None,
    ) -> None:
        self.store = store
        self.client = client
        self.rules = rules = rules or Rules()
        self.metrics = metrics or Metrics()
        self.slots = SlotTable(n_slots)
        self.keeper = Keeper(self.slots, store, client, rules, self.metrics)
        self.prep = Preparer(self.slots, self.keeper, remote)
        self.settler = Settler(self.slots, self.keeper) if rules.settle and rules.extend_only else None
        self._opening_saves: set[str] = set()  # openings being saved now (exact keys): saved once
        self._confirming: set[asyncio.Future[None]] = set()  # unpinnable requests' slots being read (ran_on)
        self.sleep: SleepWatch | None = None  # with --sleep-idle-seconds: asked before a plan (model.open_model)

    # ---- the proxy's hook ---------------------------------------------------------------------------------

    def wants(self, method: bytes, path: str) -> bool:
        return method == b"POST" and api_of(path) is not None

    async def place(self, path: str, body: bytes) -> Placed:
        """Choose the slot, make it hold the chat's cache, pin the request to it. Never raises."""
        if self.sleep is not None:
            await self._unless_asleep()
        try:
            request = read_request(path, body, len(self.slots))
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return Placed(body)  # llama-server answers it with its own message
        if request is None:
            return Placed(body)
        api, chat, unpinnable = request.api, request.chat, request.unpinnable
        plan: Plan | None = None
        try:
            plan = await self._plan(request)
            self._log_decision(path, plan)
            await self.prep.prepare(plan)
        except asyncio.CancelledError:
            if plan is not None:
                self.slots.release(plan.slot)
            raise
        except Exception as exc:  # noqa: BLE001 - placement is an optimisation: the request goes on unplaced
            log.warning("placement failed (%r); the request goes on as it came", exc)
            if plan is not None:
                self.slots.release(plan.slot)
            return Placed(body)
        finally:
            if plan is not None and plan.opening is not None:
                self._opening_saves.discard(plan.opening.key)
        self.metrics.placements[plan.outcome] += 1
        self._count_start(plan)
        out = body if unpinnable or request.pinned is not None else with_id_slot(body, plan.slot.id)
        reader = (
            ReplyReader(api) if api.templated and chat is not None and (self.rules.extend_only or unpinnable) else None
        )
        done_plan, clock = plan, self.client.clock
        if unpinnable:

            def done(status: int) -> None:
                clock.ended(status in (200, 499))
                task = asyncio.ensure_future(self._unpinned_done(done_plan, status, chat, reader))
                self._confirming.add(task)
                task.add_done_callback(self._confirming.discard)
        else:

            def done(status: int) -> None:
                clock.ended(status in (200, 499))
                self._finished(done_plan, done_plan.slot, status, chat, reader)

        clock.started()  # (the child's task from here to done: its idle clock restarts when it ends)
        return Placed(out, done, None if reader is None else reader.feed)

    async def _unless_asleep(self) -> None:
        """Before the plan reads the slot table: a child that may have fallen asleep since its last task is asked,
        and the table emptied if it did (SleepWatch.before_request)."""
        assert self.sleep is not None
        try:
            await self.sleep.before_request()
        except Exception as exc:  # noqa: BLE001 - the request goes on; the poll still watches the sleep
            log.warning("whether llama-server sleeps is unknown (%r); the request is placed as things stood", exc)

    async def _plan(self, request: CompletionRequest) -> Plan:
        """Decide (waiting for an idle slot if need be); the chosen slot is reserved."""
        if request.pinned is None:
            while (resident := continuing(self.slots.slots, request.key)) is not None:
                if not resident.busy:
                    view = RequestView(unpinnable=request.unpinnable, key=request.key)  # (not tokenized)
                    return Plan(slot=self.slots.reserve(resident), outcome=Outcome.RESIDENT, view=view)
                await self.slots.wait_freed()  # its own previous request: this one goes after it, as in llama-server
        rendered = await self.keeper.render_prompt(request)
        tokens = None if rendered is None else rendered.token_ids
        keys = block_keys(tokens) if tokens is not None else None
        if keys:
            await self.prep.fetch_if_faster(keys)
        opening = None
        if request.chat is not None and tokens is not None and request.pinned is None:
            opening = await self.keeper.opening(request.chat, tokens)
        view = RequestView(
            keys=keys,
            n_tokens=len(tokens or ()),
            token_ids=tokens,
            pinned=request.pinned,
            unpinnable=request.unpinnable,
            opening=opening,
            key=request.key,
            partial=rendered is not None and not rendered.whole,
        )
        rules = replace(self.rules, prefill_rate=self.keeper.known_prefill_rate())
        while (plan := decide(self.slots.slots, view, self.store, rules, self._opening_saves)) is None:
            await self.slots.wait_freed()
        self.slots.reserve(plan.slot)  # (in the step that decided: no other request can choose it)
        if plan.opening is not None:
            self._opening_saves.add(plan.opening.key)  # saved before the request goes, once
        self._count_lookup(plan)
        return plan

    def _count_lookup(self, plan: Plan) -> None:
        lookup = plan.lookup
        if lookup.extended:
            self.metrics.extend_hits += 1
        if lookup.diverged is not None:
            near, shared = lookup.diverged
            self.metrics.extend_misses[Miss.DIVERGED.value] += 1
            log.debug(
                "request diverges inside entry %s (%d of its %d blocks): not restored",
                near.short,
                shared,
                len(near.keys),
            )
        if plan.slow_opening is not None and log.isEnabledFor(logging.DEBUG):
            entry, tokens = plan.slow_opening.entry, plan.slow_opening.n_tokens
            restore_s, rate = self.store.restore_seconds(entry) or 0.0, self.keeper.known_prefill_rate()
            log.debug(
                "opening %s not restored: reading %s (~%s) is slower than prefilling %s tokens (~%s)",
                entry.short,
                fmt_bytes(entry.nbytes),
                fmt_ms(restore_s),
                f"{tokens:,}",
                fmt_ms(tokens / rate),
            )

    def _log_decision(self, path: str, plan: Plan) -> None:
        """One debug line per placement: where the request goes, why, and what llama-server will reuse there."""
        if not log.isEnabledFor(logging.DEBUG):
            return
        slot, n_tokens = plan.slot, plan.view.n_tokens
        if n_tokens:
            reused = f"{n_tokens - plan.cold:,} of {n_tokens:,} prompt tokens expected reused"
        else:
            reused = (
                "prompt not tokenized (the chat continues in its slot)"
                if plan.outcome is Outcome.RESIDENT
                else "prompt tokens unknown"
            )
        written_back = plan.write_back and worth_keeping(slot, self.rules)
        steps = [
            what
            for what, done in (
                (f"chat {slot.label or '-'} there written back first", written_back),
                (f"entry {plan.restore.short} restored first" if plan.restore else "", plan.restore is not None),
                ("erased first", plan.erase),
                ("its opening saved first", plan.opening is not None),
            )
            if done
        ]
        log.debug(
            "%s request placed on slot %d (%s): %s%s",
            path,
            slot.id,
            plan.outcome.value,
            reused,
            "; " + ", ".join(steps) if steps else "",
        )

    def _count_start(self, plan: Plan) -> None:
        """A new chat placed on a slot that holds exactly a saved opening (restored for it, or found there)."""
        slot, entry = plan.slot, plan.slot.entry
        if plan.opening is not None or entry is None or slot.dirty:
            return
        if not (entry.opening or plan.outcome is Outcome.OPENING):
            return
        self.store.started_from(entry)
        self.metrics.opening_hits += 1
        self.metrics.opening_tokens_saved += entry.n_tokens
        if plan.restore is None:
            log.info(
                "a new chat starts from opening %s in slot %d: %s tokens", entry.short, slot.id, f"{entry.n_tokens:,}"
            )

    # ---- after the request --------------------------------------------------------------------------------

    async def _unpinned_done(
        self, plan: Plan, status: int, chat: dict[str, Any] | None, reader: ReplyReader | None
    ) -> None:
        """An unpinnable request ended: the slot it ran on is found before the table records it (its predicted
        slot stays reserved until then, so that nothing else is placed on the strength of a guess)."""
        predicted = plan.slot
        ran = None
        if status in (200, 499):
            try:
                ran = await self.keeper.ran_on(predicted, reader.usage() if reader is not None else None)
            except asyncio.CancelledError:
                self._finished(plan, predicted, status, chat, reader)
                raise
            except Exception as exc:  # noqa: BLE001 - then the prediction stands, as before the check
                log.debug("the slot a request ran on is unknown: %r", exc)
        if ran is None or ran is predicted:
            self._finished(plan, predicted, status, chat, reader)
            return
        self.slots.release(predicted)  # it holds what slotkeeper left there
        if ran.busy:
            log.warning(
                "a request slotkeeper prepared slot %d for ran on slot %d (llama-server's own choice), which is in "
                "use again: what it left there is not kept",
                predicted.id,
                ran.id,
            )
            return
        lost = (
            f"; chat {ran.label} there had changed since its last save and is lost"
            if worth_keeping(ran, self.rules)
            else ""
        )
        log.warning(
            "a request slotkeeper prepared slot %d for ran on slot %d (llama-server's own choice): slot %d now holds "
            "its chat%s",
            predicted.id,
            ran.id,
            ran.id,
            lost,
        )
        self.metrics.unpinned_elsewhere += 1
        self.slots.reserve(ran)
        tokens = plan.view.token_ids
        if tokens is None or not ran.extended_by(tokens):
            self.slots.lost_restored(ran)  # it ran there all the same: that state is gone
        # (a resident plan's tokens were not counted: what that slot holds is unknown)
        self._finished(
            replace(plan, outcome=Outcome.UNPLACED) if plan.outcome is Outcome.RESIDENT else plan,
            ran,
            status,
            chat,
            reader,
        )

    def _finished(
        self, plan: Plan, slot: Slot, status: int, chat: dict[str, Any] | None, reader: ReplyReader | None
    ) -> None:
        """The request ended on `slot`: it now holds its prompt and what was generated (unless it was refused)."""
        if status in (200, 499):  # answered, or the client left while it ran: the slot holds (part of) it
            key = plan.view.key
            self.metrics.prefill_tokens_saved += self.slots.ran(
                slot,
                plan.view,
                resident=plan.outcome is Outcome.RESIDENT,
                chat=chat,
                reply=reader if status == 200 else None,
            )
            if self.settler is not None and status == 200 and chat is not None and reader is not None:
                self.settler.later(slot, chat, reader, key)
        self.slots.release(slot)

    def stop_settling(self) -> None:
        """At stop: no slot is brought to its boundary any more but by the saves themselves."""
        if self.settler is not None:
            self.settler.stop()

    # ---- start, idle and stop -----------------------------------------------------------------------------

    async def restore_recent(self) -> None:
        """At start, before /health says ready: the most recently used entries, one per slot."""
        if self.rules.policy is CachePolicy.NONE:
            return
        extend_only = self.rules.extend_only

        def skip(entry: Entry) -> bool:
            """Chats only (openings are restored for the new chats that need them); on extend-only models, their
            latest boundaries only (not a fallback, or an older kind of entry)."""
            return entry.opening or (
                extend_only and (not entry.boundary or self.store.saved_beyond(entry.message_keys))
            )

        for slot, entry in zip(self.slots, self.store.most_recent(len(self.slots), skip)):
            self.slots.reserve(slot)
            try:
                await self.keeper.restore_into(slot, entry, on_demand=False)
            except Exception as exc:  # noqa: BLE001 - one entry's failure is its line: the others are restored
                self.slots.cleared(slot)
                log.warning("chat %s not restored into slot %d (%r); it starts cold", entry.short, slot.id, exc)
            finally:
                self.slots.release(slot)
        # Each restore marks its entry used; those manifest writes end before ready, so that what a start
        # leaves in the store is settled when it says so (a manifest's .partial is never seen after ready).
        await self.store.flush()

    def dirty_slots(self) -> list[Slot]:
        """Slots changed since their last save and worth a file, most recently used first."""
        if self.rules.policy is CachePolicy.NONE:
            return []
        return sorted((s for s in self.slots if worth_keeping(s, self.rules)), key=lambda s: s.last_used, reverse=True)

    async def save_dirty(self, why: str, deadline: float | None = None, *, live: bool = False) -> tuple[int, int]:
        """Write back every idle changed slot, each reserved while it is saved; (saved, attempted)."""
        saved = attempted = 0
        if self._confirming:  # those slots are reserved until it is known which one ran the request
            await asyncio.gather(*list(self._confirming), return_exceptions=True)
        if self.settler is not None:  # those slots are reserved until their boundary is reached: then saved
            await self.settler.wait()
        for slot in self.dirty_slots():
            if slot.busy:
                continue
            if deadline is not None and deadline - time.monotonic() <= 0:
                log.warning("slot %d not saved: the save budget ran out; its previous entries are kept", slot.id)
                self.metrics.save_failed(SaveFailure.BUDGET.value)
                continue
            self.slots.reserve(slot)
            attempted += 1
            try:
                saved += await self.keeper.write_back(slot, why, deadline, live=live)
            except TimeoutError:
                self.metrics.save_failed(SaveFailure.BUDGET.value)
                log.warning(
                    "slot %d save abandoned: the save budget (--save-timeout) ran out; its previous entries are kept",
                    slot.id,
                )
            finally:
                self.slots.release(slot)
        return saved, attempted

    async def note_unplaced_changes(self, slots_endpoint: bool) -> None:
        """With placement off, llama-server chose the slots: every slot that ran a task since the last look is
        marked changed (`slots_endpoint`: llama-server answers /slots)."""
        for slot in await self.prep.unplaced_changes(slots_endpoint):
            self.slots.unseen(slot)

    def busy(self) -> bool:
        """Some slot is reserved: a request, a save, a restore or a settle is under way."""
        return any(slot.busy for slot in self.slots)

    def cache_dropped(self) -> int:
        """llama-server dropped every slot's KV cache by itself (its sleep): the idle slots hold nothing now.
        Returns how many held a chat, which its entry brings back; a chat changed since its last save is lost
        (one line each: the save before the sleep failed)."""
        chats = 0
        for slot in self.slots:
            if slot.busy:
                continue  # a request placed since: what it leaves there is recorded when it ends
            if worth_keeping(slot, self.rules):
                log.warning(
                    "chat %s in slot %d had changed since its last save: lost with llama-server's cache",
                    slot.label or "-",
                    slot.id,
                )
            elif slot.entry is not None or slot.keys:
                chats += 1
            self.slots.cleared(slot)
        return chats

    def held_entries(self) -> set[str]:
        """Entries a slot holds unchanged: evicting one would lose what only that slot still has."""
        return {s.entry.id for s in self.slots if s.entry is not None}

    def describe(self) -> list[dict[str, Any]]:
        """Per slot, for /slotkeeper/status."""
        return self.slots.describe()
