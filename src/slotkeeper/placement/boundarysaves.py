"""Saves at turn boundaries, and of openings: the slot brought to exactly a boundary, then saved there.

Why apart from keeper.py: on hybrid and sliding-window models llama-server reuses a restored state only when
the next request extends all of it, so a chat is saved at its turn boundary (and new chats start from a saved
opening); reaching one is a prefill of its own, timed and counted. This is the Keeper's base: the Keeper owns
the state (the slot table, the store, the boundaries, the rules) and decides when.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..chat.boundary import Boundaries, Boundary, Reached, Turn
from ..chat.media import chat_pictures
from ..chat.openings import Opening, is_opening
from ..chat.prefix import BLOCK_TOKENS, block_keys, exact_key
from ..log import fmt_ms, log
from ..metrics import Metrics
from ..store.conversations import ConversationStore, SaveResult
from ..store.entries import Entry
from .decide import Rules
from .request import message_keys_of
from .slots import Slot, SlotTable

Supersedes = Callable[[Entry, Entry], bool]  # (new, old): the new entry makes the old one redundant


def supersedes_nothing(new: Entry, old: Entry) -> bool:
    """An opening's save supersedes nothing: chats share it."""
    return False


class BoundarySaves:
    """The boundary saves of the Keeper (its base): what they use of it is declared here."""

    table: SlotTable
    store: ConversationStore
    rules: Rules
    metrics: Metrics
    boundaries: Boundaries
    _measured_prefill: float | None

    async def _save_boundary(self, slot: Slot, chat: dict[str, Any], turn: Turn, why: str) -> tuple[Entry | None, bool]:
        """One boundary of the slot's chat as an entry, found saved already or reached and saved now; and
        whether the slot was moved to it."""
        boundary = await self.boundaries.find(chat, turn)
        if boundary is None:
            if chat_pictures({"messages": turn.history}):
                log.info(
                    "chat %s in slot %d: its turn boundary cannot be written with its pictures (given by URL, or a "
                    "template that renders them apart), so it is not saved there",
                    slot.label or "-",
                    slot.id,
                )
            return None, False
        tokens = boundary.token_ids
        if len(tokens) < self.rules.min_tokens and boundary.whole:
            return None, False
        if not slot.may_reach(tokens):
            return None, False  # before the restored state: the slot cannot go back there
        key = exact_key(tokens)
        existing = self.store.find_exact(key) if boundary.whole else None
        used_at = self.table.used_at(slot)
        if existing is not None:
            self.store.touch(existing, used_at)
            return existing, False
        reached, result = await self.reach_and_save(
            slot,
            boundary,
            key=key,
            message_keys=message_keys_of(chat, turn.history),
            supersedes=self._older_boundary,
            opening=is_opening(turn),
            used_at=used_at,
        )
        if reached is None or result is None:
            log.warning("slot %d not saved (%s): llama-server did not take it to its turn boundary", slot.id, why)
            return None, False
        if reached.seconds:
            self.metrics.boundary_reached(reached.prefilled, reached.seconds)
        if result.entry is None:
            log.warning("slot %d not saved (%s): %s; its previous entries are kept", slot.id, why, result.reason)
            return None, True
        entry = result.entry
        superseding = f", superseding {result.superseded}" if result.superseded else ""
        how = (
            f"{reached.prefilled:,} prefilled to reach it in {fmt_ms(reached.seconds)}"
            if reached.seconds
            else "the slot was there already"
        )
        log.info(
            "chat %s saved from slot %d at its turn boundary (%s): %s tokens (%s), %s in %s%s",
            entry.short,
            slot.id,
            why,
            f"{entry.n_tokens:,}",
            how,
            result.size_text,
            fmt_ms(result.seconds),
            superseding,
        )
        return entry, True

    async def reach_and_save(  # noqa: PLR0913 - what the entry is, each keyword-only
        self,
        slot: Slot,
        boundary: Boundary,
        *,
        key: str,
        message_keys: list[str],
        supersedes: Supersedes,
        opening: bool,
        marks_boundary: bool = True,
        used_at: float | None = None,
    ) -> tuple[Reached | None, SaveResult | None]:
        """Bring the slot to exactly the boundary (`key`), unless it is there already (`Reached` with no time
        spent), and save it as a boundary entry, which the slot then holds; (None, None) when llama-server did
        not take it there. Turn boundaries and openings are saved alike (and recomputed chats, which mark no boundary
        unless their old entry did: `marks_boundary`). `used_at`: when its chat was last used (else now)."""
        tokens = boundary.token_ids
        if slot.exact == key and boundary.whole:  # brought there once its turn was over, or by the last save
            reached = Reached(n_tokens=len(tokens), prefilled=0, seconds=0.0)
        else:
            moved = await self.boundaries.reach(slot.id, boundary)
            self.table.task_ran(slot)  # (a task ran there, taken or not)
            if moved is None:
                return None, None
            reached = moved
            self._measured(reached)
        if boundary.whole:
            self.table.held(slot, None, block_keys(tokens), len(tokens), key)
        result = await self.store.save_slot(
            slot.id,
            expected_bytes=self._expected_bytes(len(tokens)),
            message_keys=message_keys,
            boundary=boundary.expected,
            supersedes=supersedes,
            opening=opening,
            marks_boundary=marks_boundary,
            used_at=used_at,
        )
        if result.entry is not None:
            entry = result.entry
            self.table.held(slot, entry, entry.keys, entry.n_tokens, entry.exact)
        return reached, result

    def _older_boundary(self, new: Entry, old: Entry) -> bool:
        """A chat keeps its latest boundary and the one before it: a new boundary supersedes the chat's
        boundaries that another one lies between (never an opening: a system prompt that chats share)."""
        if old.opening or not (
            old.boundary and len(old.message_keys) >= 3 and _strict_prefix(old.message_keys, new.message_keys)
        ):
            return False
        return any(
            mid.boundary
            and _strict_prefix(old.message_keys, mid.message_keys)
            and _strict_prefix(mid.message_keys, new.message_keys)
            for mid in self.store.saved_within(new.message_keys)
        )

    async def save_opening(self, slot: Slot, opening: Opening) -> None:
        """Bring the slot to a new chat's opening and save it there, for the chats that share it; the request
        then extends it, so nothing is prefilled twice. A failure costs only the entry."""
        if not slot.may_reach(opening.token_ids):
            return  # a restored state that goes past it: this slot cannot go back there
        try:
            reached, result = await self.reach_and_save(
                slot,
                Boundary(token_ids=opening.token_ids, prompt=opening.token_ids),
                key=opening.key,
                message_keys=opening.message_keys,
                supersedes=supersedes_nothing,
                opening=True,
            )
        except (ConnectionError, ValueError) as exc:
            reached = result = None
            log.debug("reaching an opening failed: %r", exc)
        if reached is None or result is None:
            self.table.unseen(slot)
            log.warning("opening not saved: llama-server did not take slot %d to it", slot.id)
            return
        self.metrics.opening_reached(reached.prefilled, reached.seconds)
        if result.entry is None:
            log.warning("opening not saved from slot %d: %s", slot.id, result.reason)
            return
        entry = result.entry
        self.metrics.openings_saved += 1
        log.info(
            "opening %s saved from slot %d at its turn boundary (before the first user message, for the chats that "
            "share it): %s tokens (%s prefilled in %s), %s in %s",
            entry.short,
            slot.id,
            f"{entry.n_tokens:,}",
            f"{reached.prefilled:,}",
            fmt_ms(reached.seconds),
            result.size_text,
            fmt_ms(result.seconds),
        )

    def _expected_bytes(self, tokens: int) -> int:
        rate = self.store.bytes_per_token()
        return int(rate * tokens) if rate else 0

    def _measured(self, reached: Reached) -> None:
        """llama-server's prompt speed, from a prefill slotkeeper asked for (used when /metrics is off)."""
        if reached.prefilled >= BLOCK_TOKENS and reached.seconds > 0:
            self._measured_prefill = reached.prefilled / reached.seconds


def _strict_prefix(a: Sequence[str], b: Sequence[str]) -> bool:
    return len(a) < len(b) and b[: len(a)] == a
