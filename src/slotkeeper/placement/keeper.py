"""The keeper: the one part of placement that talks to llama-server, the turn boundaries and the store.

It carries out what a plan says (save a slot, restore an entry into it, erase it, bring it to a turn
boundary) and tells the slot table what llama-server did. Which slot and why is `decide.py`'s; when is the
hook's. Every method here runs on a slot the caller has reserved.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from ..chat.apis import Api
from ..chat.boundary import Boundaries, turns_of
from ..chat.openings import Opening, Openings, opening_turn
from ..chat.promptview import PromptViewer, Rendered
from ..chat.replies import ReplyReader, Usage
from ..llama.client import LlamaClient
from ..llama.policy import CachePolicy
from ..log import fmt_bytes, fmt_ms, log
from ..metrics import Metrics
from ..store.conversations import ConversationStore, RestoreOutcome, SaveFailure, SaveResult
from ..store.entries import Entry
from .boundarysaves import BoundarySaves
from .decide import DEFAULT_PREFILL_TOKENS_PER_S, Rules, worth_keeping
from .request import CompletionRequest, message_keys_of
from .slots import Slot, SlotTable

TOKENIZE_TIMEOUT_S = 30.0
PREFILL_RATE_MAX_AGE_S = 10.0
PREFILL_RATE_TIMEOUT_S = 1.0


class Keeper(BoundarySaves):
    """Slot actions and saves for one llama-server's slots (those at turn boundaries: BoundarySaves)."""

    def __init__(
        self, table: SlotTable, store: ConversationStore, client: LlamaClient, rules: Rules, metrics: Metrics
    ) -> None:
        self.table = table
        self.store = store
        self.client = client
        self.rules = rules
        self.metrics = metrics
        self.viewer = PromptViewer(client, store.media)
        self.boundaries = Boundaries(self.viewer)
        self.openings = Openings(self.boundaries)
        self._prefill: tuple[float, float | None] = (-PREFILL_RATE_MAX_AGE_S, None)  # (when, tokens/s) of /metrics
        self._measured_prefill: float | None = None  # tokens/s of slotkeeper's own last boundary prefill

    # ---- what llama-server says ---------------------------------------------------------------------------

    async def render_prompt(self, request: CompletionRequest) -> Rendered | None:
        """The prompt's tokens, as llama-server will see them (template applied); None when it cannot say."""
        try:
            return await asyncio.wait_for(self._render_prompt(request), TOKENIZE_TIMEOUT_S)
        except (TimeoutError, ConnectionError, ValueError, KeyError, TypeError) as exc:
            log.debug("tokens of a %s request unknown: %r", request.path, exc)
            return None

    async def _render_prompt(self, request: CompletionRequest) -> Rendered | None:
        """`render_prompt()` without its timeout: /apply-template and /tokenize (`promptview`: pictures as
        llama-server holds them), or /tokenize of the prompt."""
        self.metrics.prompt_tokenizations += 1
        api, chat = request.api, request.chat
        if api.templated:
            if chat is None:
                return None
            return await self.viewer.chat(chat, request.body if chat is request.data else None)
        prompt = request.data.get("prompt")
        if api is Api.INFILL or prompt is None:
            return None
        tokens = await self.client.tokenize(prompt)
        return None if tokens is None else Rendered(tokens, "")

    async def opening(self, chat: dict[str, Any], tokens: list[int]) -> Opening | None:
        """The chat's opening, when the request extends it (None when it is unknown)."""
        messages = chat.get("messages")
        turn = (
            opening_turn(messages) if isinstance(messages, list) and self.rules.policy is not CachePolicy.NONE else None
        )
        if turn is None:
            return None
        try:
            return await asyncio.wait_for(
                self.openings.of(chat, turn, message_keys_of(chat, turn.history), tokens), TOKENIZE_TIMEOUT_S
            )
        except (TimeoutError, ConnectionError, ValueError, KeyError, TypeError) as exc:
            log.debug("the opening of a chat is unknown: %r", exc)
            return None

    def known_prefill_rate(self) -> float:
        """llama-server's prompt tokens per second as last seen (its /metrics, else slotkeeper's own prefill)."""
        return self._prefill[1] or self._measured_prefill or DEFAULT_PREFILL_TOKENS_PER_S

    async def prefill_rate(self) -> float | None:
        """This server's prompt tokens per second from its /metrics, refreshed at most every
        PREFILL_RATE_MAX_AGE_S."""
        at, rate = self._prefill
        if time.monotonic() - at >= PREFILL_RATE_MAX_AGE_S:
            try:
                rate = await asyncio.wait_for(self.client.prompt_rate(), PREFILL_RATE_TIMEOUT_S)
            except (TimeoutError, ConnectionError, ValueError):
                rate = None
            self._prefill = (time.monotonic(), rate or self._prefill[1])
        return self._prefill[1]

    async def ran_on(self, predicted: Slot, usage: Usage | None) -> Slot | None:
        """The slot llama-server ran a request on, read from /slots once it is over: the idle slot holding as
        many tokens as its prompt and reply (llama-server keeps all but the last token it generated); the
        predicted one among equals, else the latest task's. None when the response did not say its counts."""
        if usage is None:
            return None
        reply = await asyncio.wait_for(self.client.slots(), TOKENIZE_TIMEOUT_S)
        if not reply.ok or not isinstance(reply.body, list):
            return None
        held = {usage.prompt + usage.generated - 1, usage.prompt + usage.generated, usage.prompt}
        found = [
            info
            for info in reply.body
            if isinstance(info, dict)
            and not info.get("is_processing")
            and info.get("n_prompt_tokens") in held
            and isinstance(info.get("id"), int)
            and 0 <= info["id"] < len(self.table)
        ]
        if not found:
            return None
        if any(info["id"] == predicted.id for info in found):
            return predicted
        return self.table[max(found, key=lambda info: info.get("id_task") or -1)["id"]]

    # ---- changing a slot ----------------------------------------------------------------------------------

    async def erase(self, slot: Slot, why: str) -> None:
        """Empty a slot: one whose restored state the request does not extend (llama-server would reuse a state
        it cannot roll back, a wasted prefill, or with sliding-window attention answer wrongly), or an idle one
        parked before a long prefill. `why` ends the log line."""
        reply = await self.client.slot_action(slot.id, "erase")
        if not reply.ok:
            raise ConnectionError(f"erasing slot {slot.id} failed: {reply.status} {reply.error}")
        self.table.cleared(slot)
        log.info("slot %d %s", slot.id, why)

    async def restore_into(self, slot: Slot, entry: Entry, *, on_demand: bool = True) -> RestoreOutcome:
        """Restore an entry into the slot; the slot then holds it, unchanged since saved."""
        result = await self.store.restore(entry, slot.id, used=on_demand)
        if not result.ok:
            self.table.cleared(slot)
            if result.outcome is not RestoreOutcome.QUARANTINED:  # (a quarantine has its own line)
                log.warning(
                    "chat %s not restored into slot %d (%s); the request starts cold",
                    entry.short,
                    slot.id,
                    result.reason,
                )
            return result.outcome
        self.table.restored(slot, entry, extend_only=self.rules.extend_only, on_demand=on_demand)
        self.metrics.on_demand_restores += on_demand
        pictures = f" with {len(entry.images)} picture(s)" if entry.images else ""
        log.info(
            "%s %s restored into slot %d: %s tokens%s, %s in %s",
            "opening" if entry.opening else "chat",
            entry.short,
            slot.id,
            f"{result.n_tokens:,}",
            pictures,
            fmt_bytes(result.nbytes),
            fmt_ms(result.seconds),
        )
        return result.outcome

    async def save_and_erase(self, slot: Slot, saved_why: str, erased_why: Callable[[Slot], str]) -> bool:
        """Save the slot if it changed, then erase it; False when the save failed and it was kept. (`erased_why`
        is asked after the save, which names the slot's chat.)"""
        if worth_keeping(slot, self.rules):
            await self.write_back(slot, saved_why)
        if worth_keeping(slot, self.rules):
            return False
        await self.erase(slot, erased_why(slot))
        return True

    async def write_back(self, slot: Slot, why: str, deadline: float | None = None, *, live: bool = False) -> bool:
        """Save the slot's content as an entry (extend-only models: at its turn boundaries); True when something
        was saved. `live`: the slot goes on serving its chat afterwards (an idle save)."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self.rules.extend_only:
            return await asyncio.wait_for(self._save_boundaries(slot, why, live), timeout)
        result = await asyncio.wait_for(self._save_whole(slot), timeout)
        if result.entry is None:
            if result.failure is SaveFailure.EMPTY:
                if slot.n_tokens:
                    log.warning(
                        "slot %d held nothing to save (%s), though chat %s was placed there: %s tokens of it are "
                        "not kept",
                        slot.id,
                        why,
                        slot.label or "-",
                        f"{slot.n_tokens:,}",
                    )
                    self.metrics.chats_found_empty += 1
                self.table.all_saved(slot)
                return False
            log.warning("slot %d not saved (%s): %s; its previous entries are kept", slot.id, why, result.reason)
            return False
        entry = result.entry
        self.table.held(slot, entry, entry.keys, entry.n_tokens)
        superseding = f", superseding {result.superseded}" if result.superseded else ""
        log.info(
            "chat %s saved from slot %d (%s): %s tokens, %s in %s%s",
            entry.short,
            slot.id,
            why,
            f"{entry.n_tokens:,}",
            result.size_text,
            fmt_ms(result.seconds),
            superseding,
        )
        return True

    async def _save_whole(self, slot: Slot) -> SaveResult:
        """Save all the slot holds. The free-space check needs its size: llama-server's own count of the slot's
        tokens (`n_prompt_tokens` of /slots: the prompt and what it generated), not slotkeeper's (the prompt it
        placed), which a chat of long replies exceeds many times over."""
        held = slot.n_tokens
        try:
            reply = await self.client.slots()
            if reply.ok and isinstance(reply.body, list):
                info = next((s for s in reply.body if isinstance(s, dict) and s.get("id") == slot.id), {})
                held = max(held, int(info.get("n_prompt_tokens") or 0))
        except (ConnectionError, TypeError, ValueError):
            pass  # the save itself will say what is wrong
        return await self.store.save_slot(
            slot.id,
            expected_bytes=self._expected_bytes(held),
            message_keys=slot.last_request.message_keys,
            used_at=self.table.used_at(slot),
        )

    async def _save_boundaries(self, slot: Slot, why: str, live: bool) -> bool:
        """Bring the slot to its chat's turn boundaries and save each one not saved yet: the latest first (one
        step back from the reply), then the fallback (back to the checkpoint at the last request's new
        messages). A live slot gets the latest back from its file."""
        chat, message = slot.chat, (slot.reply.message() if slot.reply is not None else None)
        if chat is None:
            self.table.all_saved(slot)
            return False
        current, previous = turns_of(chat.get("messages") or [], message)
        if current is None:
            self.metrics.boundary_unknown += 1
            log.info(
                "chat %s in slot %d: its reply is unknown (cut off, or not a chat completion), so only its earlier "
                "boundary can be saved",
                slot.label,
                slot.id,
            )
        saved = moved = failed = False
        latest: Entry | None = None
        for turn in (current, previous):
            if turn is None:
                continue
            entry, reached = await self._save_boundary(slot, chat, turn, why)
            moved = moved or reached
            saved = saved or (reached and entry is not None)
            failed = failed or (reached and entry is None)  # a full disk, a read-only remount: tried again
            latest = latest or (entry if turn is current else None)
        if failed:
            self.table.save_failed(slot)
        else:
            self.table.all_saved(slot)
        if live and moved and latest is not None and slot.entry is not latest:
            await self.restore_into(slot, latest, on_demand=False)  # back to the end of the chat, from its file
        return saved

    async def settle(self, slot: Slot, chat: dict[str, Any], reply: ReplyReader) -> None:
        """Bring an idle slot to its chat's latest turn boundary, nothing written (see `settle.Settler.later`)."""
        current, _ = turns_of(chat.get("messages") or [], reply.message())
        boundary = None if current is None else await self.boundaries.find(chat, current)
        if boundary is None or not boundary.whole or not slot.may_reach(boundary.token_ids):
            return
        reached = await self.boundaries.reach(slot.id, boundary)
        self.table.task_ran(slot)
        if reached is not None:
            self._measured(reached)
            self.table.reached(slot, boundary.token_ids)
            self.metrics.boundary_settled(reached.prefilled, reached.seconds)
