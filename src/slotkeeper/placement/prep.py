"""Making a slot ready for the request a plan sends there: the steps the plan names, in the order that keeps
every chat (write back, park the other idle chats, restore or erase, save a new opening), and the shared
tier asked first when a chat is nowhere here.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..chat.prefix import BLOCK_TOKENS, common_keys
from ..llama.policy import CachePolicy
from ..log import fmt_bytes, log
from .decide import DEFAULT_PREFILL_TOKENS_PER_S, RESTORE_MIN_GAIN_BLOCKS, Plan, worth_keeping
from .keeper import Keeper
from .slots import Slot, SlotTable

if TYPE_CHECKING:  # (the shared tier, and obstore under it, is imported only with --remote-store)
    from ..remote.tier import RemoteTier
    from ..store.entries import Entry


class Preparer:
    """The steps before a request goes, each on a reserved slot."""

    def __init__(self, table: SlotTable, keeper: Keeper, remote: RemoteTier | None) -> None:
        self.table = table
        self.keeper = keeper
        self.rules = keeper.rules
        self.remote = remote
        self._seen_tasks: dict[int, int] = {}  # with placement off: llama-server's id_task per slot at the last look

    async def prepare(self, plan: Plan) -> None:
        """Write the slot back if it changed since its last save, then restore the entry into it (or erase it),
        then save the new chat's opening there."""
        slot, keeper, rules = plan.slot, self.keeper, self.rules
        if plan.view.unpinnable and rules.extend_only:
            await self._clear_unextended(plan)
        if plan.write_back and rules.policy is not CachePolicy.NONE and worth_keeping(slot, rules):
            await keeper.write_back(slot, "before it is reused")
        if rules.policy is CachePolicy.PREFIX and plan.cold >= rules.min_tokens:
            await self._park_idle(slot)  # first: what is restored or prefilled then lands in the freed cells
        if plan.restore is not None and self._holds_superseded(slot, plan.restore):
            log.debug("chat %s not restored: the write-back of slot %d superseded it", plan.restore.short, slot.id)
        elif plan.restore is not None:
            await keeper.restore_into(slot, plan.restore)
        elif plan.erase:
            await keeper.erase(slot, "erased: the request does not extend the chat restored there")
        if plan.opening is not None:
            await keeper.save_opening(slot, plan.opening)

    def _holds_superseded(self, slot: Slot, entry: Entry) -> bool:
        """The slot's write-back just superseded the entry to restore: the slot held more of that chat than its
        keys showed (`Slot.hidden_tail`), and still holds all of it. (On extend-only models a live state is
        not reused by a request that leaves it: the restore goes ahead, and says why it fails.)"""
        return (
            not self.rules.extend_only
            and entry.id not in self.keeper.store.entries
            and slot.entry is not None
            and common_keys(slot.keys, entry.keys) >= len(entry.keys)
        )

    async def _clear_unextended(self, plan: Plan) -> None:
        """Before a request llama-server places itself, on an extend-only model: every other idle slot holding a
        restored state the request does not extend is saved if it changed, and erased. llama-server might
        choose one of them, and on a sliding-window model reusing such a state answers wrongly."""
        tokens = plan.view.token_ids
        if tokens is None:
            return  # its chat continues in its slot (which shares the most with it), or its tokens are unknown
        for slot in self.table:
            if slot is plan.slot or slot.busy or slot.extended_by(tokens):
                continue
            self.table.reserve(slot)
            try:  # (one whose save fails stays: the request is very likely placed elsewhere, see llama_choice)
                await self.keeper.save_and_erase(
                    slot,
                    "before a request llama-server places itself",
                    lambda _: "erased: a request llama-server places itself does not extend the chat restored there",
                )
            finally:
                self.table.release(slot)

    async def _park_idle(self, active: Slot) -> None:
        """Before a long prefill on `active`, the other idle slots' chats leave the KV cache for the store (saved
        if they changed, then erased), as llama-server's own idle-slot caching moves them to RAM.

        Why: with a unified KV cache (llama-server's default) a prompt attends over every cell in use, so each
        chat resident in another slot slows the prefill (measured on plain llama-server: 1.7 s alone, 2.6 s with
        three 2.6k-token chats resident, for the same 2.6k-token prompt). A parked chat comes back by a restore,
        which costs milliseconds. Parking comes before the restore and the prefill: llama-server puts new cells
        from the start of the cache again once most of it is free, and a prompt attends up to its highest cell.
        A slot whose save fails keeps its chat."""
        for slot in self.table:
            if slot is active or slot.busy or not (slot.keys or slot.n_tokens or slot.dirty or slot.entry):
                continue
            self.table.reserve(slot)
            try:
                if await self.keeper.save_and_erase(
                    slot,
                    f"parked: a long prompt runs on slot {active.id}",
                    lambda saved: (
                        f"parked (chat {saved.label or '-'} is in the store): its KV cells are freed for a "
                        f"long prompt on slot {active.id}"
                    ),
                ):
                    self.keeper.metrics.slots_parked += 1
            except (ConnectionError, TimeoutError) as exc:
                log.debug("slot %d not parked: %r", slot.id, exc)
            finally:
                self.table.release(slot)

    async def fetch_if_faster(self, keys: list[str]) -> None:
        """A chat found nowhere here may be in the shared tier: download it into the store when that is
        estimated faster than the prefill it saves (measured transfer speed vs this server's prompt speed).
        Only this request waits; a concurrent miss for the same entry shares the download."""
        remote, store, metrics = self.remote, self.keeper.store, self.keeper.metrics
        if remote is None:
            return
        from ..remote.tier import Fetched, bytes_to_fetch

        local = max([common_keys(s.keys, keys) for s in self.table] + [store.lookup(keys)[1]])
        if len(keys) - local < RESTORE_MIN_GAIN_BLOCKS:
            return
        match = await remote.find(keys, BLOCK_TOKENS)
        if match is None or match.entry_id in store.entries or match.matched_blocks < local + RESTORE_MIN_GAIN_BLOCKS:
            return
        nbytes = await asyncio.to_thread(bytes_to_fetch, match.manifest, store.blocks_dir)
        gained = (match.matched_blocks - local) * BLOCK_TOKENS
        fetch_s = remote.estimated_fetch_seconds(nbytes)
        rate = await self.keeper.prefill_rate()
        prefill_s = gained / (rate or DEFAULT_PREFILL_TOKENS_PER_S)
        if fetch_s is not None and fetch_s >= prefill_s:
            metrics.remote_prefill_faster += 1
            log.info(
                "chat %s is in the remote store, but fetching %s (~%.1f s) is slower than prefilling %s tokens "
                "(~%.1f s): prefilling",
                match.entry_id[:4],
                fmt_bytes(nbytes),
                fetch_s,
                f"{gained:,}",
                prefill_s,
            )
            return
        # Without a measured speed yet, the request waits no longer than its prefill would take; the download
        # goes on in the background (it is shared), so the entry is here for the chat's next turn.
        fetched = await remote.fetch_into(match, store, None if fetch_s is not None else prefill_s)
        if fetched is Fetched.ADOPTED:
            metrics.remote_fetches += 1
        elif fetched is Fetched.LATER:
            log.info(
                "chat %s: its download outlasts the ~%.1f s prefill; prefilling while it goes on",
                match.entry_id[:4],
                prefill_s,
            )

    async def unplaced_changes(self, slots_endpoint: bool) -> list[Slot]:
        """With placement off, llama-server chose the slots: the slots /slots says ran a new task since the last
        look (every slot, when it cannot say)."""
        if not slots_endpoint:  # --no-slots: nothing to ask; every slot may have changed
            return list(self.table)
        try:
            reply = await self.keeper.client.slots()
        except ConnectionError as exc:
            log.warning("GET /slots failed (%s); saving every slot", exc)
            reply = None
        listed = reply.body if reply is not None and reply.ok and isinstance(reply.body, list) else None
        changed = []
        for slot in self.table:
            info: dict[str, Any] = next((e for e in listed or () if e.get("id") == slot.id), {})
            task = info.get("id_task")
            if listed is None or (
                task is not None and info.get("n_prompt_tokens", 0) > 0 and self._seen_tasks.get(slot.id) != task
            ):
                changed.append(slot)
                if task is not None:
                    self._seen_tasks[slot.id] = task
        return changed
