"""The decision: which slot a request runs on, and what must happen to that slot before it goes.

llama-server on its own sends a request to the idle slot with the longest common prefix when that exceeds
10% of the prompt, else to the least recently used one. Chats share a system prompt, so a returning chat
lands on a slot that holds *another* chat and overwrites it. slotkeeper pins `id_slot` instead:

* the chat is in an idle slot: that slot (the common case; recognised from the request's messages alone,
  without a tokenize round trip, when the slot holds the request's earlier messages: `continuing`);
* it is in the store only: an idle victim (empty slots first, then least recently used) is written back
  if it changed since its last save, the entry is restored into it, and the request goes there;
* a new chat: a victim chosen the same way, or a slot that holds its opening.

On hybrid and sliding-window models (`CachePolicy.EXTEND_ONLY`) an entry counts only when the request
extends it exactly, and a slot holding a restored state takes only requests that extend it (any other gets
the slot erased first: on a sliding-window model the server would otherwise reuse a state that lacks the
positions the request needs, and answer wrongly).

`decide` is a pure function of the slot table, the request's view and the store's index: it does no I/O,
changes nothing and counts nothing, so tests call it directly. The hook reserves the slot it returns in the
same synchronous step, so no two requests can choose one slot.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

from ..chat.media import shows_picture
from ..chat.openings import Opening
from ..chat.prefix import BLOCK_TOKENS, common_keys
from ..llama.policy import CachePolicy
from ..store.conversations import ConversationStore
from ..store.entries import Entry
from .request import NO_KEY, RequestKey, RequestView
from .slots import Slot

DEFAULT_MIN_TOKENS = 256
DEFAULT_PREFILL_TOKENS_PER_S = 500.0  # until llama-server has measured its own prompt speed (a modest CPU)
BRANCH_SHARE = (3, 4)  # a request sharing 3/4 of a slot's blocks branches that chat (an edited message)
RESTORE_MIN_GAIN_BLOCKS = 2  # restore an entry only when it covers this many more blocks than the best slot
SLOT_PROMPT_SIMILARITY = 0.1  # llama-server's --slot-prompt-similarity default (for unpinnable requests)


class Outcome(enum.StrEnum):
    """How a request was placed (the values label slotkeeper_placements)."""

    RESIDENT = "resident"  # its chat was in the slot: a hit
    RESTORED = "restored"  # restored from the store first
    BRANCH = "branch"  # an edit of the chat in the slot: a miss, after that chat was saved
    NEW = "new"  # a new chat, on a victim
    OPENING = "opening"  # a new chat, on a victim its saved opening (system prompt, tools) was restored into
    PINNED = "pinned"  # the client chose the slot (id_slot)
    UNPLACED = "unplaced"  # its tokens are unknown: a victim


class Miss(enum.Enum):
    """Why a request on an extend-only model found no entry to restore, though one shares its opening (the
    values label slotkeeper_extend_misses)."""

    DIVERGED = "diverged inside an entry"


@dataclass(frozen=True, kw_only=True)
class Rules:
    """What the decisions depend on besides the slots and the store."""

    policy: CachePolicy = CachePolicy.PREFIX
    min_tokens: int = DEFAULT_MIN_TOKENS  # an entry or opening shorter than this is not worth a file
    prefill_rate: float = DEFAULT_PREFILL_TOKENS_PER_S  # llama-server's prompt tokens per second, last known
    settle: bool = False  # extend-only models: bring a chat's idle slot to its boundary once its turn is over

    @property
    def extend_only(self) -> bool:
        return self.policy is CachePolicy.EXTEND_ONLY


@dataclass(frozen=True, kw_only=True)
class Lookup:
    """What the store's index said of the request (the hook counts and logs it)."""

    entry: Entry | None = None  # the entry worth restoring for it
    in_store: int = 0  # how many of that entry's blocks llama-server will reuse
    extended: bool = False  # extend-only: an entry the request extends exactly was found
    diverged: tuple[Entry, int] | None = None  # extend-only: an entry it diverges inside, and the blocks shared


@dataclass(frozen=True)
class SlowOpening:
    """A new chat's saved opening, not restored: reading it is estimated slower than prefilling what it saves."""

    entry: Entry
    n_tokens: int  # the tokens its restore would have spared


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One decision: the slot, and what must happen to it before the request may go."""

    slot: Slot
    outcome: Outcome
    view: RequestView
    restore: Entry | None = None
    write_back: bool = False  # the slot's content is saved first, if it is worth keeping
    erase: bool = False  # the slot's restored state is not extended by the request: erased first
    opening: Opening | None = None  # a new chat's opening, not saved yet: reached and saved first
    cold: int = 0  # the prompt tokens llama-server is expected to prefill for it
    lookup: Lookup = field(default_factory=Lookup)
    slow_opening: SlowOpening | None = None  # the saved opening it did not restore, and why (logged)


def continuing(slots: Sequence[Slot], key: RequestKey) -> Slot | None:
    """The slot whose last request this one continues (same chat, one turn on), busy or not."""
    if key is NO_KEY:
        return None
    continued = [s for s in slots if s.last_request.continued_by(key) and (s.restored is None or s.restored_extended)]
    return max(
        continued, key=lambda s: len(s.last_request.message_keys), default=None
    )  # (a restored entry, and its turn on)


def decide(
    slots: Sequence[Slot],
    view: RequestView,
    store: ConversationStore,
    rules: Rules,
    saving_openings: Collection[str] = (),
) -> Plan | None:
    """The plan for a request, or None when it must wait for a slot. `saving_openings`: the exact keys of the
    openings being saved now (each is saved once, however many new chats come)."""
    if view.pinned is not None:
        slot = slots[view.pinned]
        if slot.busy:
            return None
        shared = shared_blocks(slot, view.keys, view.token_ids) if view.keys else 0
        plan = Plan(slot=slot, outcome=Outcome.PINNED, view=view, write_back=not holds(slot, shared, view))
        return _complete(plan, store, rules, ())
    idle = [s for s in slots if not s.busy]
    if not idle:
        return None
    if view.keys is None:  # tokens unknown: a victim, whose content then is unknown too
        plan = Plan(slot=victim(idle, rules), outcome=Outcome.UNPLACED, view=view, write_back=True)
        return _complete(plan, store, rules, ())
    lookup = _lookup(view.keys, view.token_ids, store, rules)
    if view.unpinnable:
        plan = _decide_unpinnable(slots, idle, view, lookup, store, rules)
    else:
        plan = _decide_pinnable(slots, idle, view, lookup, store, rules)
    return _complete(plan, store, rules, saving_openings)


def _complete(plan: Plan, store: ConversationStore, rules: Rules, saving_openings: Collection[str]) -> Plan:
    """The plan with what follows from its slot: the tokens left to prefill, an erase, an opening to save."""
    view, slot = plan.view, plan.slot
    cold = 0
    if view.token_ids is not None and view.keys is not None:
        reused = len(plan.restore.keys) if plan.restore is not None else shared_blocks(slot, view.keys, view.token_ids)
        cold = max(0, len(view.token_ids) - reused * BLOCK_TOKENS)
    erase = (
        rules.extend_only
        and plan.restore is None
        and slot.restored is not None
        and (view.token_ids is None or not slot.extended_by(view.token_ids))
    )
    opening = view.opening
    new_opening = (
        opening is not None
        and plan.outcome is Outcome.NEW
        and len(opening.token_ids) >= rules.min_tokens
        and opening.key not in saving_openings
        and store.find_exact(opening.key) is None
    )
    return replace(plan, erase=erase, opening=opening if new_opening else None, cold=cold)


def _decide_pinnable(
    slots: Sequence[Slot],
    idle: list[Slot],
    view: RequestView,
    lookup: Lookup,
    store: ConversationStore,
    rules: Rules,
) -> Plan:
    keys, tokens, opening = view.keys or [], view.token_ids, view.opening
    best, shared = max(((s, shared_blocks(s, keys, tokens)) for s in idle), key=lambda p: (p[1], p[0].last_used))
    start = starting_opening(opening, lookup, store)
    if worth_restoring(slots, lookup, shared, start, rules, view.token_ids):
        return Plan(
            slot=victim(idle, rules),
            outcome=Outcome.RESTORED,
            view=view,
            restore=lookup.entry,
            write_back=True,
            lookup=lookup,
        )
    if shared and holds(best, shared, view) and not other_chat(best, shared, opening, view.key, rules):
        return Plan(slot=best, outcome=Outcome.RESIDENT, view=view, lookup=lookup)
    if branches(best, shared, start, rules):  # an edit of this chat's past
        return Plan(slot=best, outcome=Outcome.BRANCH, view=view, write_back=True, lookup=lookup)
    # A new chat: where its opening (a shared system prompt) already is, if that costs no write-back.
    reusable = [
        (s, n)
        for s, n in ((s, shared_blocks(s, keys, tokens)) for s in idle)
        if n * BLOCK_TOKENS >= rules.min_tokens
        and not worth_keeping(s, rules)
        and (start is None or holds_opening(s, n, start, rules))
    ]
    if reusable:
        return Plan(slot=max(reusable, key=lambda p: p[1])[0], outcome=Outcome.NEW, view=view, lookup=lookup)
    if start is not None and not rules.extend_only and shared >= len(start.keys):
        # Its opening is live in `best`: the chat there is written back and llama-server reuses the opening
        # in place, as it would on its own (measured faster than restoring the opening into another slot).
        return Plan(slot=best, outcome=Outcome.NEW, view=view, write_back=True, lookup=lookup)
    chosen = victim(idle, rules)
    slow = None
    if start is not None:  # its saved opening, restored into the victim (when that beats prefilling it)
        on_victim = shared_blocks(chosen, keys, tokens)
        # (a live hybrid state goes back only to its checkpoints: what it shares is not reused for sure)
        gained = len(start.keys) - (0 if rules.extend_only else on_victim)
        if not holds_opening(chosen, on_victim, start, rules) and gained >= RESTORE_MIN_GAIN_BLOCKS:
            slow = slow_restore(start, gained * BLOCK_TOKENS, store, rules)
            if slow is None:
                return Plan(
                    slot=chosen, outcome=Outcome.OPENING, view=view, restore=start, write_back=True, lookup=lookup
                )
    return Plan(slot=chosen, outcome=Outcome.NEW, view=view, write_back=True, lookup=lookup, slow_opening=slow)


def _decide_unpinnable(
    slots: Sequence[Slot],
    idle: list[Slot],
    view: RequestView,
    lookup: Lookup,
    store: ConversationStore,
    rules: Rules,
) -> Plan:
    """llama-server chooses the slot of a request it cannot be told one for: slotkeeper predicts that choice
    and prepares the slot there. A restore keeps the prediction true: the slot it restores into then shares
    more of the prompt than any other idle one."""
    keys, tokens, opening = view.keys or [], view.token_ids, view.opening
    choice = llama_choice(idle, keys, view.n_tokens, tokens)
    shared = shared_blocks(choice, keys, tokens)
    start = starting_opening(opening, lookup, store)
    if worth_restoring(slots, lookup, shared, start, rules, view.token_ids):
        return Plan(
            slot=choice, outcome=Outcome.RESTORED, view=view, restore=lookup.entry, write_back=True, lookup=lookup
        )
    if shared and holds(choice, shared, view) and not other_chat(choice, shared, opening, view.key, rules):
        return Plan(slot=choice, outcome=Outcome.RESIDENT, view=view, lookup=lookup)
    if branches(choice, shared, start, rules):
        return Plan(slot=choice, outcome=Outcome.BRANCH, view=view, write_back=True, lookup=lookup)
    slow = None
    if start is not None and not holds_opening(choice, shared, start, rules):
        gained = len(start.keys) - (0 if rules.extend_only else shared)
        if gained >= RESTORE_MIN_GAIN_BLOCKS:
            slow = slow_restore(start, gained * BLOCK_TOKENS, store, rules)
            if slow is None:
                return Plan(
                    slot=choice, outcome=Outcome.OPENING, view=view, restore=start, write_back=True, lookup=lookup
                )
    return Plan(slot=choice, outcome=Outcome.NEW, view=view, write_back=True, lookup=lookup, slow_opening=slow)


def _lookup(keys: list[str], tokens: list[int] | None, store: ConversationStore, rules: Rules) -> Lookup:
    """The entry worth restoring for this prompt, and how many of its blocks llama-server will reuse."""
    if rules.policy is CachePolicy.NONE:
        return Lookup()
    if not rules.extend_only:
        entry, in_store = store.lookup(keys)
        return (
            Lookup(entry=entry, in_store=in_store)
            if entry is not None and in_store * 2 >= len(entry.keys)
            else Lookup()
        )
    entry = store.lookup_extended(tokens, keys) if tokens is not None else None
    if entry is not None:
        return Lookup(entry=entry, in_store=len(entry.keys), extended=True)
    near, shared = store.lookup(keys)
    if near is not None and shared * BLOCK_TOKENS >= rules.min_tokens:
        return Lookup(diverged=(near, shared))
    return Lookup()


def shared_blocks(slot: Slot, keys: Sequence[str], tokens: Sequence[int] | None) -> int:
    """How many of the request's blocks llama-server can reuse from what the slot holds."""
    if slot.restored is not None and (tokens is None or not slot.extended_by(tokens)):
        return 0
    return common_keys(slot.keys, keys)


def holds(slot: Slot, shared: int, view: RequestView) -> bool:
    """The request continues what the slot holds (all its full blocks, give or take the last one), and nothing
    unseen may differ. A slot that holds more than its keys show (`Slot.hidden_tail`: past a picture not known
    yet, or a turn that ran untokenized) may hold another chat, or a later turn of this one, past them; so may
    a slot that holds more than the request's tokens show, when they stop before a picture not known yet
    (`promptview`). Such a slot is saved first (its file shows what it held, pictures included)."""
    if not slot.keys or shared < len(slot.keys) - 1:
        return False
    return not slot.hidden_tail and not (view.partial and slot.n_tokens > view.n_tokens)


def worth_keeping(slot: Slot, rules: Rules) -> bool:
    """Worth a file: enough tokens, or content slotkeeper could not see (saved to find out); on extend-only
    models, a chat whose turn boundary is known. (Where llama-server reuses no restored state, nothing is
    saved, but such a slot still holds a chat that only it has: it goes last as a victim all the same.)"""
    if not slot.dirty:
        return False
    if rules.extend_only:
        return slot.chat is not None and slot.n_tokens >= rules.min_tokens
    return slot.n_tokens >= rules.min_tokens or not slot.keys


def victim(idle: list[Slot], rules: Rules) -> Slot:
    """Slots holding nothing worth keeping first (empty, a title request), then ones whose chat is saved
    (no write-back needed), then changed ones; the least recently used among equals."""
    return min(idle, key=lambda s: (worth_keeping(s, rules), s.entry is not None, s.last_used))


def llama_choice(idle: list[Slot], keys: Sequence[str], n_tokens: int, tokens: Sequence[int] | None) -> Slot:
    """Where llama-server itself will put an unpinnable request (`get_available_slot`, b11434): the idle slot
    sharing the longest prefix with the prompt, the first of equals, if that covers over
    SLOT_PROMPT_SIMILARITY of it; else the one its last task left longest ago, the last of equals. (A slot
    whose restored state the request does not extend counts as empty: it is erased before the request goes.)"""
    best, shared = idle[0], 0
    for slot in idle:
        n = shared_blocks(slot, keys, tokens)
        if n > shared:
            best, shared = slot, n
    if n_tokens and shared * BLOCK_TOKENS / n_tokens > SLOT_PROMPT_SIMILARITY:
        return best
    return min(reversed(idle), key=lambda s: s.task_ended)


def worth_restoring(
    slots: Sequence[Slot],
    lookup: Lookup,
    shared: int,
    start: Entry | None,
    rules: Rules,
    tokens: Sequence[int] | None,
) -> bool:
    """The entry found for the request beats what the best slot shares with it, and is not a new chat's
    opening (that is `start`), nor in a slot already. It beats it by RESTORE_MIN_GAIN_BLOCKS, or by any block
    that shows a picture (of the request's `tokens`): restoring it spares the vision encoder, which costs far
    more than prefilling the picture's positions."""
    entry, in_store = lookup.entry, lookup.in_store
    gained = in_store - shared
    spares_encoder = (
        gained > 0 and tokens is not None and shows_picture(tokens, shared * BLOCK_TOKENS, in_store * BLOCK_TOKENS)
    )
    return (
        entry is not None
        and start is None
        and not any(s.entry is entry for s in slots)
        and in_store * BLOCK_TOKENS >= rules.min_tokens
        and (gained >= RESTORE_MIN_GAIN_BLOCKS or spares_encoder)
    )


def branches(slot: Slot, shared: int, start: Entry | None, rules: Rules) -> bool:
    """The request shares most of the slot's chat: an edit of that chat's past (it is saved first)."""
    return (
        shared * BLOCK_TOKENS >= rules.min_tokens
        and shared * BRANCH_SHARE[1] >= len(slot.keys) * BRANCH_SHARE[0]
        and (start is None or shared >= len(start.keys) + RESTORE_MIN_GAIN_BLOCKS)
    )


def starting_opening(opening: Opening | None, lookup: Lookup, store: ConversationStore) -> Entry | None:
    """The saved opening a new chat starts from: the request's opening has an entry, and no saved chat
    shares much more of the request (then it is that chat, or an edit of it, and that entry is restored)."""
    if opening is None:
        return None
    found = store.find_exact(opening.key)
    deepest = lookup.entry
    if found is None or (
        deepest is not None and deepest is not found and lookup.in_store >= len(found.keys) + RESTORE_MIN_GAIN_BLOCKS
    ):
        return None
    return found


def other_chat(slot: Slot, shared: int, opening: Opening | None, key: RequestKey, rules: Rules) -> bool:
    """The slot holds another chat that starts with the request's opening, though the request shares all its
    blocks but the last (the slack `holds` allows a re-templated reply): taking the slot as this chat's would
    overwrite that chat unsaved. The request's messages tell (they do not continue the slot's), else its
    blocks (the slot holds a block past the opening that the request does not share); on a hybrid the slot
    must be exactly at the opening, as a live state may not go back there."""
    if opening is None or shared > len(opening.token_ids) // BLOCK_TOKENS + 1:
        return False
    messages = slot.last_request.message_keys
    if (
        messages
        and tuple(opening.message_keys) == messages[: len(opening.message_keys)]
        and not slot.last_request.continued_by(key)
    ):
        return slot.exact != opening.key
    if shared <= len(opening.token_ids) // BLOCK_TOKENS < len(slot.keys):
        return True
    return rules.extend_only and slot.exact != opening.key


def holds_opening(slot: Slot, shared: int, opening: Entry, rules: Rules) -> bool:
    """The slot holds all of the opening, so that llama-server reuses it there. On extend-only models only
    a slot at exactly the opening does (elsewhere a live hybrid state rolls back only to its checkpoints)."""
    if rules.extend_only:
        return slot.exact == opening.exact
    return shared >= len(opening.keys)


def slow_restore(entry: Entry, n_tokens: int, store: ConversationStore, rules: Rules) -> SlowOpening | None:
    """None when restoring the entry is estimated faster than prefilling the `n_tokens` it saves (this server's
    measured prompt speed, and the store's measured restore speed); else why it is not restored."""
    restore_s = store.restore_seconds(entry)
    if restore_s is None or restore_s < n_tokens / rules.prefill_rate:
        return None
    return SlowOpening(entry, n_tokens)
