"""Placement: which slot a completion request runs on, so that every conversation finds its own cache.

llama-server on its own sends a request to the idle slot with the longest common prefix when that exceeds
10% of the prompt, else to the least recently used one. Chats share a system prompt, so a returning chat
lands on a slot that holds *another* chat and overwrites it. slotkeeper pins `id_slot` instead:

* the chat is in an idle slot: that slot (the common case; recognised from the request's messages alone,
  without a tokenize round trip, when the slot holds the request's earlier messages);
* it is in the store only: an idle victim (empty slots first, then least recently used) is written back
  if it changed since its last save, the entry is restored into it, and the request goes there;
* a new chat: a victim chosen the same way.

On hybrid and sliding-window models (`policy.CachePolicy.EXTEND_ONLY`) llama-server reuses a restored state
only when the request extends all of it. There a chat is saved at its turn boundaries (`boundary.py`: the
latest, and the one before as a fallback for a regenerate or an edit of the last message), an entry counts
only when the request extends it exactly, and a slot that holds a restored state takes only requests that
extend it (any other gets the slot erased first: on a sliding-window model the server would otherwise reuse
a state that lacks the positions the request needs, and answer wrongly).

The policy is here; the mechanism (files, slot actions) is the store's, and the proxy only calls `place`.
State is touched only on the event loop, and each decision reserves its slot in the same synchronous step
that makes it, so no two requests can choose one slot.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import chatform
from .boundary import Boundaries, Reached, Turn, turns_of
from .llama_client import LlamaClient
from .log import fmt_bytes, fmt_ms, log
from .metrics import Metrics
from .openings import Opening, Openings, is_opening, opening_turn
from .policy import CachePolicy
from .prefix import BLOCK_TOKENS, block_keys, common_keys, exact_key, extends_exactly, unit_keys
from .proxy.hook import Placed
from .replies import ReplyForm, ReplyReader, Usage
from .store import ConversationStore, Entry, SaveFailure, SaveResult

CHAT_PATHS = frozenset({"/chat/completions", "/v1/chat/completions", "/v1/responses", "/responses", "/v1/messages"})
PROMPT_PATHS = frozenset({"/completion", "/completions", "/v1/completions", "/infill"})
COMPLETION_PATHS = CHAT_PATHS | PROMPT_PATHS
# llama-server b11434 drops `id_slot` when it converts an Anthropic request to chat form: for these, the slot
# is prepared where llama-server's own choice will go (`Placement._llama_choice`), and once the request is over
# the slot it ran on is read from /slots (`Placement._ran_on`).
UNPINNABLE_PATHS = chatform.ANTHROPIC_PATHS
# Body fields that do not change the prompt: a chat whose turns differ only in these is still one chat.
# fmt: off
NOT_PROMPT_FIELDS = frozenset({
    "messages", "input", "prompt", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
    "max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict", "seed", "stop", "stop_sequences",
    "id_slot", "cache_prompt", "timings_per_token", "return_progress", "presence_penalty", "frequency_penalty",
    "repeat_penalty", "repeat_last_n", "typical_p", "mirostat", "mirostat_tau", "mirostat_eta", "logit_bias",
    "n_probs", "logprobs", "top_logprobs", "samplers", "user", "metadata", "store", "dry_multiplier",
    "dry_base", "dry_allowed_length", "dry_penalty_last_n", "xtc_probability", "xtc_threshold", "top_n_sigma",
    "t_max_predict_ms", "n_indent", "return_tokens", "post_sampling_probs", "response_fields", "lora",
})
# fmt: on
DEFAULT_MIN_TOKENS = 256
SETTLE_AFTER_S = 0.25  # a hybrid chat's slot goes to its boundary once its turn has been over this long
BRANCH_SHARE = (3, 4)  # a request sharing 3/4 of a slot's blocks branches that chat (an edited message)
RESTORE_MIN_GAIN_BLOCKS = 2  # restore an entry only when it covers this many more blocks than the best slot
SLOT_PROMPT_SIMILARITY = 0.1  # llama-server's --slot-prompt-similarity default (for unpinnable requests)
TOKENIZE_TIMEOUT_S = 30.0
PREFILL_RATE_MAX_AGE_S = 10.0
DEFAULT_PREFILL_TOKENS_PER_S = 500.0  # until llama-server has measured its own prompt speed (a modest CPU)
PREFILL_RATE_TIMEOUT_S = 1.0


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
    """Why a request on an extend-only model found no entry to restore, though one shares its opening."""

    DIVERGED = "diverged inside an entry"


@dataclass(frozen=True)
class FastKey:
    """What recognises a chat continuing in its slot without a tokenize round trip.

    Chat form: chained keys of the prompt-relevant settings and of each message. Prompt form: the prompt
    itself (text, or canonical JSON of a token list, open-ended so that only whole items compare).
    """

    units: tuple[str, ...] = ()
    prompt: str | None = None

    def continued_by(self, other: FastKey) -> bool:
        """`other` opens with everything this request had: the same chat, one turn on."""
        if self.units:
            n = len(self.units)
            return n >= 2 and n <= len(other.units) and common_keys(self.units, other.units) == n
        if self.prompt and other.prompt is not None:
            return other.prompt.startswith(self.prompt)
        return False


NO_KEY = FastKey()


@dataclass
class Slot:
    """What one llama-server slot holds, as far as slotkeeper placed it there."""

    id: int
    keys: Sequence[str] = field(default_factory=list)  # block keys of a prefix of what it holds
    fast: FastKey = NO_KEY  # the last request placed here
    tokens: int = 0  # tokens known to be there (a lower bound after a fast-path turn)
    entry: Entry | None = None  # the entry its content is saved as, while it has not changed since
    dirty: bool = False  # changed since its content was last saved
    busy: bool = False
    last_used: float = 0.0
    served: float = -1.0  # when llama-server's last task on it ended (its `t_last_used`: its own LRU order)
    label: str = ""  # the chat it holds, for log lines
    chat: dict[str, Any] | None = None  # extend-only models: the chat-form body of its last request ...
    reply: ReplyReader | None = None  # ... and that request's response (together: its turn boundaries)
    floor: Entry | None = None  # extend-only models: the restored state it holds; requests must extend it
    floor_checked: bool = False  # a request's tokens were seen to extend the floor (continuations may skip it)
    exact: str = ""  # prefix.exact_key of its tokens, when it holds exactly known tokens (a boundary it reached)

    def clear(self) -> None:
        """It holds nothing known (erased, or a restore into it failed)."""
        self.keys, self.fast, self.tokens, self.entry, self.dirty, self.label = [], NO_KEY, 0, None, False, ""
        self.floor, self.floor_checked, self.chat, self.reply, self.exact = None, False, None, None, ""

    def changed_unseen(self) -> None:
        """A request slotkeeper did not place ran here: what it holds is unknown, and worth a save to find out."""
        self.dirty, self.keys, self.tokens = True, [], 0

    def hold(self, entry: Entry | None, keys: Sequence[str], tokens: int, exact: str = "") -> None:
        """It now holds exactly `keys`/`tokens` (saved as `entry`, when that is not None; `exact`: the exact key
        of those tokens, when they are known to the token)."""
        self.entry, self.keys, self.tokens, self.dirty, self.exact = entry, keys, tokens, False, exact
        if entry is not None:
            self.label = entry.short

    def may_reach(self, tokens: list[int]) -> bool:
        """The slot may be brought to hold exactly these tokens: they do not go back before its restored state."""
        floor = self.floor
        return floor is None or (len(tokens) >= floor.tokens and exact_key(tokens, floor.tokens) == floor.exact)

    def extended_by(self, tokens: list[int]) -> bool:
        """A request with these tokens may run here: it extends the restored state, if there is one."""
        floor = self.floor
        return floor is None or extends_exactly(tokens, floor.tokens, floor.exact)


@dataclass
class Plan:
    """One decision: the slot, and what must happen to it before the request may go."""

    slot: Slot
    restore: Entry | None = None
    write_back: bool = False
    outcome: Outcome = Outcome.NEW
    keys: list[str] | None = None  # the prompt's block keys, when it was tokenized
    erase: bool = False  # the slot's restored state is not extended by the request: erased first
    opening: Opening | None = None  # a new chat's opening, not saved yet: reached and saved first
    cold: int = 0  # the prompt tokens llama-server is expected to prefill for it
    tokens: list[int] | None = None  # the prompt's tokens, when it was tokenized

    @property
    def n_tokens(self) -> int:
        return len(self.tokens or ())


def with_id_slot(body: bytes, slot_id: int) -> bytes:
    """The body with `"id_slot": N` added as its last member, every other byte unchanged.

    Last, because llama-server's JSON parser keeps the last of duplicate keys: an `"id_slot": -1` the client
    sent earlier in the object is overridden.
    """
    close = body.rstrip().rfind(b"}")
    if close < 0:
        return body
    last = len(body[:close].rstrip())  # just after the last member (or the opening brace)
    separator = b"" if body[last - 1 : last] == b"{" else b","
    return b'%s%s"id_slot":%d%s' % (body[:last], separator, slot_id, body[last:])


def fast_key(path: str, data: dict[str, Any]) -> tuple[FastKey, dict[str, Any] | None]:
    """A request's fast key, and its chat-form body (None for prompt-form requests)."""
    if path in CHAT_PATHS:
        chat = chatform.to_chat_form(path, data)
        if chat is None:
            return NO_KEY, None
        messages = chat.get("messages")
        if not isinstance(messages, list):
            return NO_KEY, chat
        return FastKey(units=tuple(chat_units(chat, messages))), chat
    prompt = data.get("prompt")
    if path == "/infill" or prompt is None:
        return NO_KEY, None
    if isinstance(prompt, str):
        return FastKey(prompt=prompt), None
    text = _canonical(prompt).decode()
    return FastKey(prompt=text[:-1] + "," if text.endswith("]") else text), None


def chat_units(chat: dict[str, Any], messages: list[Any]) -> list[str]:
    """The chained keys of a chat's prompt-relevant settings and of each of these messages."""
    settings = {k: v for k, v in chat.items() if k not in NOT_PROMPT_FIELDS}
    return unit_keys([_canonical(settings), *map(_canonical, messages)])


def _never(new: Entry, old: Entry) -> bool:
    """An opening's save supersedes nothing."""
    return False


def _strict_prefix(a: Sequence[str], b: Sequence[str]) -> bool:
    return len(a) < len(b) and b[: len(a)] == a


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def is_multi_prompt(data: dict[str, Any]) -> bool:
    """A prompt-form request with several prompts runs on several slots at once: llama-server places it."""
    prompt = data.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt)


class Placement:
    """The completion hook (proxy.CompletionHook) and the table of what each slot holds."""

    def __init__(
        self,
        store: ConversationStore,
        client: LlamaClient,
        n_slots: int,
        *,
        min_tokens: int = DEFAULT_MIN_TOKENS,
        metrics: Metrics | None = None,
        policy: CachePolicy = CachePolicy.PREFIX,
        settle: bool = False,
    ) -> None:
        self.store = store
        self.client = client
        self.policy = policy
        self.extend_only = policy is CachePolicy.EXTEND_ONLY
        self.settle = settle and self.extend_only  # bring hybrid chats to their boundary once a turn is over
        self.boundaries = Boundaries(client)
        self.openings = Openings(self.boundaries)
        self._opening_saves: set[str] = set()  # openings being saved now (exact keys): saved once
        self.slots = [Slot(i) for i in range(n_slots)]
        self.min_tokens = min_tokens
        self.metrics = metrics or Metrics()
        self._freed = asyncio.Event()
        self._clock = 0.0
        self.remote: Any = None  # remote.RemoteTier: asked when a chat is in no slot and not in the store
        self._prefill: tuple[float, float | None] = (-PREFILL_RATE_MAX_AGE_S, None)  # (when, tokens/s)
        self._measured_prefill: float | None = None  # tokens/s of slotkeeper's own last boundary prefill
        self._background: set[asyncio.Future[None]] = set()
        self._settling: set[asyncio.Future[None]] = set()  # slots being brought to their boundary (_settle)
        self._confirming: set[asyncio.Future[None]] = set()  # unpinnable requests' slots being read (_ran_on)
        self._settle_timers: dict[int, asyncio.TimerHandle] = {}  # per slot: its settle, not started yet
        self._stopping = False

    # ---- the proxy's hook ---------------------------------------------------------------------------------

    def wants(self, method: bytes, path: str) -> bool:
        return method == b"POST" and path in COMPLETION_PATHS

    async def place(self, path: str, body: bytes) -> Placed:
        """Choose the slot, make it hold the chat's cache, pin the request to it. Never raises."""
        try:
            data = json.loads(body)
            if not isinstance(data, dict) or (path in PROMPT_PATHS and is_multi_prompt(data)):
                return Placed(body)
            fast, chat = fast_key(path, data)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return Placed(body)  # llama-server answers it with its own message
        unpinnable = path in UNPINNABLE_PATHS
        pinned = None if unpinnable else data.get("id_slot")
        pinned = pinned % len(self.slots) if isinstance(pinned, int) and pinned >= 0 else None
        plan: Plan | None = None
        try:
            plan = await self._plan(path, body, data, chat, fast, pinned, unpinnable)
            self._log_decision(path, plan)
            await self._prepare(plan, unpinnable)
        except asyncio.CancelledError:
            if plan is not None:
                self._release(plan.slot)
            raise
        except Exception as exc:  # noqa: BLE001 - placement is an optimisation: the request goes on unplaced
            log.warning("placement failed (%r); the request goes on as it came", exc)
            if plan is not None:
                self._release(plan.slot)
            return Placed(body)
        self.metrics.placements[plan.outcome] += 1
        self._count_start(plan)
        out = body if unpinnable or pinned is not None else with_id_slot(body, plan.slot.id)
        form = ReplyForm.of(path)
        reader = (
            ReplyReader(form) if form is not None and chat is not None and (self.extend_only or unpinnable) else None
        )
        if unpinnable:

            def done(status: int) -> None:
                task = asyncio.ensure_future(self._unpinned_done(plan, status, fast, chat, reader))
                self._confirming.add(task)
                task.add_done_callback(self._confirming.discard)
        else:

            def done(status: int) -> None:
                self._finished(plan, status, fast, chat, reader)

        return Placed(out, done, None if reader is None else reader.feed)

    def _log_decision(self, path: str, plan: Plan) -> None:
        """One debug line per placement: where the request goes, why, and what llama-server will reuse there."""
        if not log.isEnabledFor(logging.DEBUG):
            return
        slot = plan.slot
        if plan.n_tokens:
            reused = f"{plan.n_tokens - plan.cold:,} of {plan.n_tokens:,} prompt tokens expected reused"
        else:
            reused = (
                "prompt not tokenized (the chat continues in its slot)"
                if plan.outcome is Outcome.RESIDENT
                else "prompt tokens unknown"
            )
        steps = [
            what
            for what, done in (
                (f"chat {slot.label or '-'} there written back first", plan.write_back and self._worth_keeping(slot)),
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

    async def _plan(
        self,
        path: str,
        body: bytes,
        data: dict[str, Any],
        chat: dict[str, Any] | None,
        fast: FastKey,
        pinned: int | None,
        unpinnable: bool = False,
    ) -> Plan:
        """Decide (waiting for an idle slot if need be); the chosen slot is reserved."""
        if pinned is None:
            while (resident := self._resident(fast)) is not None:
                if not resident.busy:
                    return Plan(self._reserve(resident), outcome=Outcome.RESIDENT)
                await self._wait_freed()  # its own previous request: this one goes after it, as in llama-server
        tokens = await self._tokens(path, body, data, chat)
        keys = block_keys(tokens) if tokens is not None else None
        if keys and self.remote is not None:
            await self._fetch_if_faster(keys)
        opening = None
        if chat is not None and tokens is not None and pinned is None:
            opening = await self._opening(chat, tokens)
        while (plan := self._decide(keys, len(tokens or ()), pinned, unpinnable, tokens, opening, fast)) is None:
            await self._wait_freed()
        plan.keys = keys
        plan.tokens = tokens
        if tokens is not None and keys is not None:
            reused = len(plan.restore.keys) if plan.restore is not None else self._shared(plan.slot, keys, tokens)
            plan.cold = max(0, len(tokens) - reused * BLOCK_TOKENS)
        if self.extend_only and plan.restore is None:
            plan.erase = plan.slot.floor is not None and (tokens is None or not plan.slot.extended_by(tokens))
        if (
            opening is not None
            and plan.outcome is Outcome.NEW
            and len(opening.tokens) >= self.min_tokens
            and opening.key not in self._opening_saves
            and self.store.find_exact(opening.key) is None
        ):
            plan.opening = opening  # a new opening: saved before the request goes (once, however many come)
            self._opening_saves.add(opening.key)
        return plan

    async def _opening(self, chat: dict[str, Any], tokens: list[int]) -> Opening | None:
        """The chat's opening, when the request extends it (None when it is unknown)."""
        messages = chat.get("messages")
        turn = opening_turn(messages) if isinstance(messages, list) and self.policy is not CachePolicy.NONE else None
        if turn is None:
            return None
        try:
            opening = await asyncio.wait_for(
                self.openings.of(chat, turn, chat_units(chat, turn.history), tokens), TOKENIZE_TIMEOUT_S
            )
        except (TimeoutError, ConnectionError, ValueError, KeyError, TypeError) as exc:
            log.debug("the opening of a chat is unknown: %r", exc)
            return None
        return opening

    # ---- deciding (synchronous: decide and reserve in one step) -------------------------------------------

    def _resident(self, fast: FastKey) -> Slot | None:
        """The slot whose last request this one continues (same chat, one turn on)."""
        if fast is NO_KEY:
            return None
        continued = [s for s in self.slots if s.fast.continued_by(fast) and (s.floor is None or s.floor_checked)]
        return max(continued, key=lambda s: len(s.fast.units), default=None)  # (a restored entry, and its turn on)

    @staticmethod
    def _shared(slot: Slot, keys: list[str], tokens: list[int] | None) -> int:
        """How many of the request's blocks llama-server can reuse from what the slot holds."""
        if slot.floor is not None and (tokens is None or not slot.extended_by(tokens)):
            return 0
        return common_keys(slot.keys, keys)

    def _stored(self, keys: list[str], tokens: list[int] | None) -> tuple[Entry | None, int]:
        """The entry worth restoring for this prompt, and how many of its blocks llama-server will reuse."""
        if self.policy is CachePolicy.NONE:
            return None, 0
        if not self.extend_only:
            entry, in_store = self.store.lookup(keys)
            return (entry, in_store) if entry is not None and in_store * 2 >= len(entry.keys) else (None, 0)
        entry = self.store.lookup_extended(tokens, keys) if tokens is not None else None
        if entry is not None:
            self.metrics.extend_hits += 1
            return entry, len(entry.keys)
        near, shared = self.store.lookup(keys)
        if near is not None and shared * BLOCK_TOKENS >= self.min_tokens:
            self.metrics.extend_misses[Miss.DIVERGED.value] += 1
            log.debug(
                "request diverges inside entry %s (%d of its %d blocks): not restored",
                near.short,
                shared,
                len(near.keys),
            )
        return None, 0

    def _decide(
        self,
        keys: list[str] | None,
        n_tokens: int,
        pinned: int | None,
        unpinnable: bool,
        tokens: list[int] | None = None,
        opening: Opening | None = None,
        fast: FastKey = NO_KEY,
    ) -> Plan | None:
        """The plan for a request whose prompt has these block keys (and tokens: extend-only models need them),
        or None when it must wait for a slot. `opening`: the request's opening, when it is known."""
        if pinned is not None:
            slot = self.slots[pinned]
            if slot.busy:
                return None
            shared = self._shared(slot, keys, tokens) if keys else 0
            return Plan(self._reserve(slot), write_back=not self._holds(slot, shared), outcome=Outcome.PINNED)
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        if keys is None:  # tokens unknown: a victim, whose content then is unknown too
            return Plan(self._reserve(self._victim(idle)), write_back=True, outcome=Outcome.UNPLACED)
        entry, in_store = self._stored(keys, tokens)
        if unpinnable:
            return self._decide_unpinnable(idle, keys, n_tokens, tokens, entry, in_store, opening, fast)
        best, shared = max(((s, self._shared(s, keys, tokens)) for s in idle), key=lambda p: (p[1], p[0].last_used))
        start = self._start(opening, entry, in_store)
        if self._worth_restoring(entry, in_store, shared, start):
            return Plan(self._reserve(self._victim(idle)), restore=entry, write_back=True, outcome=Outcome.RESTORED)
        if shared and self._holds(best, shared) and not self._other_chat(best, shared, opening, fast):
            return Plan(self._reserve(best), outcome=Outcome.RESIDENT)
        if self._branches(best, shared, start):
            return Plan(self._reserve(best), write_back=True, outcome=Outcome.BRANCH)  # an edit of this chat's past
        # A new chat: where its opening (a shared system prompt) already is, if that costs no write-back.
        reusable = [
            (s, n)
            for s, n in ((s, self._shared(s, keys, tokens)) for s in idle)
            if n * BLOCK_TOKENS >= self.min_tokens
            and not self._worth_keeping(s)
            and (start is None or self._holds_opening(s, n, start))
        ]
        if reusable:
            return Plan(self._reserve(max(reusable, key=lambda p: p[1])[0]), outcome=Outcome.NEW)
        if start is not None and not self.extend_only and shared >= len(start.keys):
            # Its opening is live in `best`: the chat there is written back and llama-server reuses the opening
            # in place, as it would on its own (measured faster than restoring the opening into another slot).
            return Plan(self._reserve(best), write_back=True, outcome=Outcome.NEW)
        victim = self._victim(idle)
        if start is not None:  # its saved opening, restored into the victim (when that beats prefilling it)
            there = self._shared(victim, keys, tokens)
            # (a live hybrid state goes back only to its checkpoints: what it shares is not reused for sure)
            gained = len(start.keys) - (0 if self.extend_only else there)
            if (
                not self._holds_opening(victim, there, start)
                and gained >= RESTORE_MIN_GAIN_BLOCKS
                and self._restore_pays(start, gained * BLOCK_TOKENS)
            ):
                return Plan(self._reserve(victim), restore=start, write_back=True, outcome=Outcome.OPENING)
        return Plan(self._reserve(victim), write_back=True, outcome=Outcome.NEW)

    def _decide_unpinnable(
        self,
        idle: list[Slot],
        keys: list[str],
        n_tokens: int,
        tokens: list[int] | None,
        entry: Entry | None,
        in_store: int,
        opening: Opening | None,
        fast: FastKey,
    ) -> Plan:
        """llama-server chooses the slot of a request it cannot be told one for: slotkeeper predicts that choice
        and prepares the slot there. A restore keeps the prediction true: the slot it restores into then shares
        more of the prompt than any other idle one."""
        choice = self._llama_choice(idle, keys, n_tokens, tokens)
        shared = self._shared(choice, keys, tokens)
        start = self._start(opening, entry, in_store)
        if self._worth_restoring(entry, in_store, shared, start):
            return Plan(self._reserve(choice), restore=entry, write_back=True, outcome=Outcome.RESTORED)
        if shared and self._holds(choice, shared) and not self._other_chat(choice, shared, opening, fast):
            return Plan(self._reserve(choice), outcome=Outcome.RESIDENT)
        if self._branches(choice, shared, start):
            return Plan(self._reserve(choice), write_back=True, outcome=Outcome.BRANCH)
        if start is not None and not self._holds_opening(choice, shared, start):
            gained = len(start.keys) - (0 if self.extend_only else shared)
            if gained >= RESTORE_MIN_GAIN_BLOCKS and self._restore_pays(start, gained * BLOCK_TOKENS):
                return Plan(self._reserve(choice), restore=start, write_back=True, outcome=Outcome.OPENING)
        return Plan(self._reserve(choice), write_back=True, outcome=Outcome.NEW)

    def _worth_restoring(self, entry: Entry | None, in_store: int, shared: int, start: Entry | None) -> bool:
        """The entry found for the request beats what the best slot shares with it, and is not a new chat's
        opening (that is `start`), nor in a slot already."""
        return (
            entry is not None
            and start is None
            and not self._in_a_slot(entry)
            and in_store >= shared + RESTORE_MIN_GAIN_BLOCKS
            and in_store * BLOCK_TOKENS >= self.min_tokens
        )

    def _branches(self, slot: Slot, shared: int, start: Entry | None) -> bool:
        """The request shares most of the slot's chat: an edit of that chat's past (it is saved first)."""
        return (
            shared * BLOCK_TOKENS >= self.min_tokens
            and shared * BRANCH_SHARE[1] >= len(slot.keys) * BRANCH_SHARE[0]
            and (start is None or shared >= len(start.keys) + RESTORE_MIN_GAIN_BLOCKS)
        )

    def _start(self, opening: Opening | None, deepest: Entry | None, shared: int) -> Entry | None:
        """The saved opening a new chat starts from: the request's opening has an entry, and no saved chat
        shares much more of the request (then it is that chat, or an edit of it, and `deepest` is restored)."""
        if opening is None:
            return None
        found = self.store.find_exact(opening.key)
        if found is None or (
            deepest is not None and deepest is not found and shared >= len(found.keys) + RESTORE_MIN_GAIN_BLOCKS
        ):
            return None
        return found

    def _other_chat(self, slot: Slot, shared: int, opening: Opening | None, fast: FastKey) -> bool:
        """The slot holds another chat that starts with the request's opening, though the request shares all its
        blocks but the last (the slack `_holds` allows a re-templated reply): taking the slot as this chat's would
        overwrite that chat unsaved. The request's messages tell (they do not continue the slot's), else its
        blocks (the slot holds a block past the opening that the request does not share); on a hybrid the slot
        must be exactly at the opening, as a live state may not go back there."""
        if opening is None or shared > len(opening.tokens) // BLOCK_TOKENS + 1:
            return False
        units = slot.fast.units
        if units and tuple(opening.units) == units[: len(opening.units)] and not slot.fast.continued_by(fast):
            return slot.exact != opening.key
        if shared <= len(opening.tokens) // BLOCK_TOKENS < len(slot.keys):
            return True
        return self.extend_only and slot.exact != opening.key

    def _holds_opening(self, slot: Slot, shared: int, opening: Entry) -> bool:
        """The slot holds all of the opening, so that llama-server reuses it there. On extend-only models only
        a slot at exactly the opening does (elsewhere a live hybrid state rolls back only to its checkpoints)."""
        if self.extend_only:
            return slot.exact == opening.exact
        return shared >= len(opening.keys)

    def _restore_pays(self, entry: Entry, tokens: int) -> bool:
        """Restoring the entry is estimated faster than prefilling the `tokens` it saves (this server's measured
        prompt speed, and the store's measured restore speed)."""
        restore_s = self.store.restore_seconds(entry)
        rate = self._prefill[1] or self._measured_prefill or DEFAULT_PREFILL_TOKENS_PER_S
        if restore_s is None or restore_s < tokens / rate:
            return True
        log.debug(
            "opening %s not restored: reading %s (~%s) is slower than prefilling %s tokens (~%s)",
            entry.short,
            fmt_bytes(entry.nbytes),
            fmt_ms(restore_s),
            f"{tokens:,}",
            fmt_ms(tokens / rate),
        )
        return False

    @staticmethod
    def _holds(slot: Slot, shared: int) -> bool:
        """The request continues what the slot holds (all its full blocks, give or take the last one)."""
        return bool(slot.keys) and shared >= len(slot.keys) - 1

    def _in_a_slot(self, entry: Entry) -> bool:
        return any(s.entry is entry for s in self.slots)

    def _victim(self, idle: list[Slot]) -> Slot:
        """Slots holding nothing worth keeping first (empty, a title request), then ones whose chat is saved
        (no write-back needed), then changed ones; the least recently used among equals."""
        return min(idle, key=lambda s: (self._worth_keeping(s), s.entry is not None, s.last_used))

    def _llama_choice(self, idle: list[Slot], keys: list[str], n_tokens: int, tokens: list[int] | None) -> Slot:
        """Where llama-server itself will put an unpinnable request (`get_available_slot`, b11434): the idle slot
        sharing the longest prefix with the prompt, the first of equals, if that covers over
        SLOT_PROMPT_SIMILARITY of it; else the one its last task left longest ago, the last of equals. (A slot
        whose restored state the request does not extend counts as empty: it is erased before the request goes.)"""
        best, shared = idle[0], 0
        for slot in idle:
            n = self._shared(slot, keys, tokens)
            if n > shared:
                best, shared = slot, n
        if n_tokens and shared * BLOCK_TOKENS / n_tokens > SLOT_PROMPT_SIMILARITY:
            return best
        return min(reversed(idle), key=lambda s: s.served)

    def _worth_keeping(self, slot: Slot) -> bool:
        """Worth a file: enough tokens, or content slotkeeper could not see (saved to find out); on extend-only
        models, a chat whose turn boundary is known. (Where llama-server reuses no restored state, nothing is
        saved, but such a slot still holds a chat that only it has: it goes last as a victim all the same.)"""
        if not slot.dirty:
            return False
        if self.extend_only:
            return slot.chat is not None and slot.tokens >= self.min_tokens
        return slot.tokens >= self.min_tokens or not slot.keys

    def _reserve(self, slot: Slot) -> Slot:
        slot.busy = True
        return slot

    async def _wait_freed(self) -> None:
        self._freed.clear()
        await self._freed.wait()

    def _release(self, slot: Slot) -> None:
        slot.busy = False
        self._freed.set()

    # ---- preparing the slot -------------------------------------------------------------------------------

    async def _prepare(self, plan: Plan, unpinnable: bool = False) -> None:
        """Write the victim back if it changed since its last save, then restore the entry into it."""
        slot = plan.slot
        try:
            if unpinnable and self.extend_only:
                await self._clear_unextended(plan)
            if plan.write_back and self.policy is not CachePolicy.NONE and self._worth_keeping(slot):
                await self.write_back(slot, "before it is reused")
            if self.policy is CachePolicy.PREFIX and plan.cold >= self.min_tokens:
                await self._park_idle(slot)  # first: what is restored or prefilled then lands in the freed cells
            if plan.restore is not None:
                await self.restore_into(slot, plan.restore)
            elif plan.erase:
                await self.erase(slot, "erased: the request does not extend the chat restored there")
            if plan.opening is not None:
                await self._save_opening(slot, plan.opening)
        finally:
            if plan.opening is not None:
                self._opening_saves.discard(plan.opening.key)

    async def _clear_unextended(self, plan: Plan) -> None:
        """Before a request llama-server places itself, on an extend-only model: every other idle slot holding a
        restored state the request does not extend is saved if it changed, and erased. llama-server might
        choose one of them, and on a sliding-window model reusing such a state answers wrongly."""
        if plan.tokens is None:
            return  # its chat continues in its slot (which shares the most with it), or its tokens are unknown
        for slot in self.slots:
            if slot is plan.slot or slot.busy or slot.extended_by(plan.tokens):
                continue
            self._reserve(slot)
            try:  # (one whose save fails stays: the request is very likely placed elsewhere, see _llama_choice)
                await self._save_and_erase(
                    slot,
                    "before a request llama-server places itself",
                    lambda _: "erased: a request llama-server places itself does not extend the chat restored there",
                )
            finally:
                self._release(slot)

    async def _save_and_erase(self, slot: Slot, saved_why: str, erased_why: Callable[[Slot], str]) -> bool:
        """Save a (reserved) slot if it changed, then erase it; False when the save failed and it was kept.
        (`erased_why` is asked after the save, which names the slot's chat.)"""
        if self._worth_keeping(slot):
            await self.write_back(slot, saved_why)
        if self._worth_keeping(slot):
            return False
        await self.erase(slot, erased_why(slot))
        return True

    async def _park_idle(self, active: Slot) -> None:
        """Before a long prefill on `active`, the other idle slots' chats leave the KV cache for the store (saved
        if they changed, then erased), as llama-server's own idle-slot caching moves them to RAM.

        Why: with a unified KV cache (llama-server's default) a prompt attends over every cell in use, so each
        chat resident in another slot slows the prefill (measured on plain llama-server: 1.7 s alone, 2.6 s with
        three 2.6k-token chats resident, for the same 2.6k-token prompt). A parked chat comes back by a restore,
        which costs milliseconds. Parking comes before the restore and the prefill: llama-server puts new cells
        from the start of the cache again once most of it is free, and a prompt attends up to its highest cell.
        A slot whose save fails keeps its chat."""
        for slot in self.slots:
            if slot is active or slot.busy or not (slot.keys or slot.tokens or slot.dirty or slot.entry):
                continue
            self._reserve(slot)
            try:
                if await self._save_and_erase(
                    slot,
                    f"parked: a long prompt runs on slot {active.id}",
                    lambda saved: (
                        f"parked (chat {saved.label or '-'} is in the store): its KV cells are freed "
                        f"for a long prompt on slot {active.id}"
                    ),
                ):
                    self.metrics.slots_parked += 1
            except (ConnectionError, TimeoutError) as exc:
                log.debug("slot %d not parked: %r", slot.id, exc)
            finally:
                self._release(slot)

    async def _save_opening(self, slot: Slot, opening: Opening) -> None:
        """Bring the (reserved) slot to the new chat's opening and save it there, for the chats that share it;
        the request then extends it, so nothing is prefilled twice. A failure costs only the entry."""
        if not slot.may_reach(opening.tokens):
            return  # a restored state that goes past it: this slot cannot go back there
        try:
            reached, result = await self._reach_and_save(slot, opening.tokens, opening.key, opening.units, _never, True)
        except (ConnectionError, ValueError) as exc:
            reached = result = None
            log.debug("reaching an opening failed: %r", exc)
        if reached is None or result is None:
            slot.changed_unseen()
            log.warning("opening not saved: llama-server did not take slot %d to it", slot.id)
            return
        self.metrics.opening_reached(reached.prefilled, reached.seconds)
        if result.entry is None:
            log.warning("opening not saved from slot %d: %s", slot.id, result.reason)
            return
        entry = result.entry
        slot.exact = entry.exact
        self.metrics.openings_saved += 1
        log.info(
            "opening %s saved from slot %d at its turn boundary (before the first user message, for the chats "
            "that share it): %s tokens (%s prefilled in %s), %s in %s",
            entry.short,
            slot.id,
            f"{entry.tokens:,}",
            f"{reached.prefilled:,}",
            fmt_ms(reached.seconds),
            fmt_bytes(entry.nbytes),
            fmt_ms(result.seconds),
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
        self.metrics.opening_tokens_saved += entry.tokens
        if plan.restore is None:
            log.info(
                "a new chat starts from opening %s in slot %d: %s tokens", entry.short, slot.id, f"{entry.tokens:,}"
            )

    def _measured(self, reached: Reached) -> None:
        """llama-server's prompt speed, from a prefill slotkeeper asked for (used when /metrics is off)."""
        if reached.prefilled >= BLOCK_TOKENS and reached.seconds > 0:
            self._measured_prefill = reached.prefilled / reached.seconds

    async def erase(self, slot: Slot, why: str) -> None:
        """Empty a (reserved) slot: one whose restored state the request does not extend (llama-server would
        reuse a state it cannot roll back, a wasted prefill, or with sliding-window attention answer wrongly),
        or an idle one parked before a long prefill. `why` ends the log line."""
        reply = await self.client.slot_action(slot.id, "erase")
        if not reply.ok:
            raise ConnectionError(f"erasing slot {slot.id} failed: {reply.status} {reply.error}")
        slot.clear()
        log.info("slot %d %s", slot.id, why)

    async def write_back(self, slot: Slot, why: str, deadline: float | None = None, *, live: bool = False) -> bool:
        """Save a (reserved) slot's content as an entry (extend-only models: at its turn boundaries); True when
        something was saved. `live`: the slot goes on serving its chat afterwards (an idle save)."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self.extend_only:
            return await asyncio.wait_for(self._save_boundaries(slot, why, live), timeout)
        save = self._save_whole(slot)
        result = await asyncio.wait_for(save, timeout)
        if result.entry is None:
            if result.failure is SaveFailure.EMPTY:
                if slot.tokens:
                    log.warning(
                        "slot %d held nothing to save (%s), though chat %s was placed there: %s tokens of it "
                        "are not kept",
                        slot.id,
                        why,
                        slot.label or "-",
                        f"{slot.tokens:,}",
                    )
                    self.metrics.chats_found_empty += 1
                slot.dirty = False
                return False
            log.warning("slot %d not saved (%s): %s; its previous entries are kept", slot.id, why, result.reason)
            return False
        entry = result.entry
        slot.hold(entry, entry.keys, entry.tokens)
        superseding = f", superseding {result.superseded}" if result.superseded else ""
        log.info(
            "chat %s saved from slot %d (%s): %s tokens, %s in %s%s",
            entry.short,
            slot.id,
            why,
            f"{entry.tokens:,}",
            fmt_bytes(entry.nbytes),
            fmt_ms(result.seconds),
            superseding,
        )
        return True

    async def _save_boundaries(self, slot: Slot, why: str, live: bool) -> bool:
        """Bring the slot to its chat's turn boundaries and save each one not saved yet: the latest first (one
        step back from the reply), then the fallback (back to the checkpoint at the last request's new
        messages). A live slot gets the latest back from its file."""
        chat, message = slot.chat, (slot.reply.message() if slot.reply is not None else None)
        if chat is None:
            slot.dirty = False
            return False
        current, previous = turns_of(chat.get("messages") or [], message)
        if current is None:
            self.metrics.boundary_unknown += 1
            log.info(
                "chat %s in slot %d: its reply is unknown (cut off, or not a chat completion), so only its "
                "earlier boundary can be saved",
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
        slot.dirty = failed
        if live and moved and latest is not None and slot.entry is not latest:
            await self.restore_into(slot, latest, on_demand=False)  # back to the end of the chat, from its file
        return saved

    async def _save_boundary(self, slot: Slot, chat: dict[str, Any], turn: Turn, why: str) -> tuple[Entry | None, bool]:
        """One boundary of the slot's chat as an entry, found saved already or reached and saved now; and
        whether the slot was moved to it."""
        tokens = await self.boundaries.tokens(chat, turn)
        if tokens is None or len(tokens) < self.min_tokens:
            return None, False
        if not slot.may_reach(tokens):
            return None, False  # before the restored state: the slot cannot go back there
        key = exact_key(tokens)
        existing = self.store.find_exact(key)
        if existing is not None:
            self.store.touch(existing)
            return existing, False
        reached, result = await self._reach_and_save(
            slot, tokens, key, chat_units(chat, turn.history), self._older_boundary, is_opening(turn)
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
            f"{entry.tokens:,}",
            how,
            fmt_bytes(entry.nbytes),
            fmt_ms(result.seconds),
            superseding,
        )
        return entry, True

    async def _reach_and_save(
        self,
        slot: Slot,
        tokens: list[int],
        key: str,
        units: list[str],
        supersedes: Callable[[Entry, Entry], bool],
        opening: bool,
    ) -> tuple[Reached | None, SaveResult | None]:
        """Bring the (reserved) slot to exactly `tokens` (`key`), unless it is there already (`Reached` with no
        time spent), and save it as a boundary entry, which the slot then holds; (None, None) when llama-server
        did not take it there. Turn boundaries and openings are saved alike."""
        if slot.exact == key:  # brought there once its turn was over
            reached = Reached(len(tokens), 0, 0.0)
        else:
            went = await self.boundaries.reach(slot.id, tokens)
            slot.served = self._tick()  # (a task ran there, taken or not)
            if went is None:
                return None, None
            reached = went
            self._measured(reached)
        slot.hold(None, block_keys(tokens), len(tokens), key)
        result = await self.store.save_slot(
            slot.id, self._expected_bytes(slot), units, boundary=tokens, supersedes=supersedes, opening=opening
        )
        if result.entry is not None:
            slot.hold(result.entry, result.entry.keys, result.entry.tokens, key)
        return reached, result

    def _older_boundary(self, new: Entry, old: Entry) -> bool:
        """A chat keeps its latest boundary and the one before it: a new boundary supersedes the chat's
        boundaries that another one lies between (never an opening: a system prompt that chats share)."""
        if old.opening or not (old.boundary and len(old.units) >= 3 and _strict_prefix(old.units, new.units)):
            return False
        return any(
            mid.boundary and _strict_prefix(old.units, mid.units) and _strict_prefix(mid.units, new.units)
            for mid in self.store.units_within(new.units)
        )

    async def restore_into(self, slot: Slot, entry: Entry, *, on_demand: bool = True) -> bool:
        """Restore an entry into a (reserved) slot; the slot then holds it, unchanged since saved."""
        result = await self.store.restore(entry, slot.id)
        if not result.ok:
            slot.clear()
            if not result.quarantined:  # (a quarantine has its own line)
                log.warning(
                    "chat %s not restored into slot %d (%s); the request starts cold",
                    entry.short,
                    slot.id,
                    result.reason,
                )
            return False
        slot.hold(entry, entry.keys, entry.tokens)
        slot.exact = entry.exact
        slot.fast = FastKey(units=tuple(entry.units))
        slot.chat = slot.reply = None
        if self.extend_only:
            slot.floor, slot.floor_checked = entry, False
        slot.last_used = self._tick()
        self.metrics.on_demand_restores += on_demand
        log.info(
            "%s %s restored into slot %d: %s tokens, %s in %s",
            "opening" if entry.opening else "chat",
            entry.short,
            slot.id,
            f"{result.tokens:,}",
            fmt_bytes(result.nbytes),
            fmt_ms(result.seconds),
        )
        return True

    def _expected_bytes(self, slot: Slot, tokens: int | None = None) -> int:
        rate = self.store.bytes_per_token()
        return int(rate * (slot.tokens if tokens is None else tokens)) if rate else 0

    async def _save_whole(self, slot: Slot) -> SaveResult:
        """Save all a slot holds. The free-space check needs its size: llama-server's own count of the slot's
        tokens (`n_prompt_tokens` of /slots: the prompt and what it generated), not slotkeeper's (the prompt it
        placed), which a chat of long replies exceeds many times over."""
        held = slot.tokens
        try:
            reply = await self.client.slots()
            if reply.ok and isinstance(reply.body, list):
                info = next((s for s in reply.body if isinstance(s, dict) and s.get("id") == slot.id), {})
                held = max(held, int(info.get("n_prompt_tokens") or 0))
        except (ConnectionError, TypeError, ValueError):
            pass  # the save itself will say what is wrong
        return await self.store.save_slot(slot.id, self._expected_bytes(slot, held), list(slot.fast.units))

    # ---- the shared tier ----------------------------------------------------------------------------------

    async def _fetch_if_faster(self, keys: list[str]) -> None:
        """A chat found nowhere here may be in the remote tier: download it into the store when that is
        estimated faster than the prefill it saves (measured transfer speed vs this server's prompt speed).
        Only this request waits; a concurrent miss for the same entry shares the download."""
        local = max([common_keys(s.keys, keys) for s in self.slots] + [self.store.lookup(keys)[1]])
        if len(keys) - local < RESTORE_MIN_GAIN_BLOCKS:
            return
        match = await self.remote.find(keys, BLOCK_TOKENS)
        if (
            match is None
            or match.entry_id in self.store.entries
            or match.matched_blocks < local + RESTORE_MIN_GAIN_BLOCKS
        ):
            return
        nbytes = int(match.manifest.get("bytes", 0))
        gained = (match.matched_blocks - local) * BLOCK_TOKENS
        fetch_s = self.remote.estimated_fetch_seconds(nbytes)
        rate = await self._prefill_rate()
        prefill_s = gained / (rate or DEFAULT_PREFILL_TOKENS_PER_S)
        if fetch_s is not None and fetch_s >= prefill_s:
            self.metrics.remote_prefill_faster += 1
            log.info(
                "chat %s is in the remote store, but fetching %s (~%.1f s) is slower than prefilling %s "
                "tokens (~%.1f s): prefilling",
                match.entry_id[:4],
                fmt_bytes(nbytes),
                fetch_s,
                f"{gained:,}",
                prefill_s,
            )
            return
        # Without a measured speed yet, the request waits no longer than its prefill would take; the download
        # goes on in the background (it is shared), so the entry is here for the chat's next turn.
        try:
            fetched = await asyncio.wait_for(
                self.remote.fetch(match, self.store.entries_dir), None if fetch_s is not None else prefill_s
            )
        except TimeoutError:
            log.info(
                "chat %s: its download outlasts the ~%.1f s prefill; prefilling while it goes on",
                match.entry_id[:4],
                prefill_s,
            )
            self._adopt_later(match)
            return
        if fetched is not None and self.store.adopt(fetched[1]) is not None:
            self.metrics.remote_fetches += 1

    def _adopt_later(self, match: Any) -> None:
        """Take the entry in once its (shared) download completes, for the next turn."""

        async def adopt() -> None:
            fetched = await self.remote.fetch(match, self.store.entries_dir)
            if fetched is not None and match.entry_id not in self.store.entries:
                self.store.adopt(fetched[1])

        self._background_task(adopt())

    async def _prefill_rate(self) -> float | None:
        """This server's prompt tokens per second, refreshed at most every PREFILL_RATE_MAX_AGE_S."""
        at, rate = self._prefill
        if time.monotonic() - at >= PREFILL_RATE_MAX_AGE_S:
            try:
                rate = await asyncio.wait_for(self.client.prompt_rate(), PREFILL_RATE_TIMEOUT_S)
            except (TimeoutError, ConnectionError, ValueError):
                rate = None
            self._prefill = (time.monotonic(), rate or self._prefill[1])
        return self._prefill[1]

    # ---- after the request --------------------------------------------------------------------------------

    async def _unpinned_done(
        self, plan: Plan, status: int, fast: FastKey, chat: dict[str, Any] | None, reader: ReplyReader | None
    ) -> None:
        """An unpinnable request ended: the slot it ran on is found before the table records it (its predicted
        slot stays reserved until then, so that nothing else is placed on the strength of a guess)."""
        predicted = plan.slot
        ran = None
        if status in (200, 499):
            try:
                ran = await self._ran_on(predicted, reader.usage() if reader is not None else None)
            except asyncio.CancelledError:
                self._finished(plan, status, fast, chat, reader)
                raise
            except Exception as exc:  # noqa: BLE001 - then the prediction stands, as before the check
                log.debug("the slot a request ran on is unknown: %r", exc)
        if ran is None or ran is predicted:
            self._finished(plan, status, fast, chat, reader)
            return
        self._release(predicted)  # it holds what slotkeeper left there
        if ran.busy:
            log.warning(
                "a request slotkeeper prepared slot %d for ran on slot %d (llama-server's own choice), which "
                "is in use again: what it left there is not kept",
                predicted.id,
                ran.id,
            )
            return
        lost = (
            f"; chat {ran.label} there had changed since its last save and is lost" if self._worth_keeping(ran) else ""
        )
        log.warning(
            "a request slotkeeper prepared slot %d for ran on slot %d (llama-server's own choice): slot %d "
            "now holds its chat%s",
            predicted.id,
            ran.id,
            ran.id,
            lost,
        )
        self.metrics.unpinned_elsewhere += 1
        plan.slot = self._reserve(ran)
        if plan.tokens is None or not ran.extended_by(plan.tokens):
            ran.floor, ran.floor_checked = None, False  # it ran there all the same: that state is gone
        if plan.outcome is Outcome.RESIDENT:
            plan.outcome = Outcome.UNPLACED  # its tokens were not counted: what the slot holds is unknown
        self._finished(plan, status, fast, chat, reader)

    async def _ran_on(self, predicted: Slot, usage: Usage | None) -> Slot | None:
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
            and 0 <= info["id"] < len(self.slots)
        ]
        if not found:
            return None
        if any(info["id"] == predicted.id for info in found):
            return predicted
        return self.slots[max(found, key=lambda info: info.get("id_task") or -1)["id"]]

    def _finished(
        self,
        plan: Plan,
        status: int,
        fast: FastKey,
        chat: dict[str, Any] | None = None,
        reader: ReplyReader | None = None,
    ) -> None:
        """The request ended: the slot now holds its prompt and what was generated (unless it was refused)."""
        slot = plan.slot
        if status in (200, 499):  # answered, or the client left while it ran: the slot holds (part of) it
            slot.chat, slot.reply = chat, (reader if status == 200 else None)
            slot.floor_checked = slot.floor_checked or plan.keys is not None
            if plan.keys is not None:
                self.metrics.prefill_tokens_saved += common_keys(slot.keys, plan.keys) * BLOCK_TOKENS
                slot.keys, slot.tokens = plan.keys, len(plan.keys) * BLOCK_TOKENS
            elif plan.outcome is Outcome.RESIDENT:
                self.metrics.prefill_tokens_saved += slot.tokens
            else:  # unplaced: what it holds is unknown
                slot.keys, slot.tokens = [], 0
            slot.fast, slot.entry, slot.dirty, slot.last_used = fast, None, True, self._tick()
            slot.served = slot.last_used
            if plan.outcome is not Outcome.RESIDENT or not slot.label:
                slot.label = fast.units[-1][:4] if fast.units else f"s{slot.id}"
            slot.exact = ""
            if self.settle and status == 200 and chat is not None and reader is not None:
                old = self._settle_timers.pop(slot.id, None)
                if old is not None:
                    old.cancel()
                self._settle_timers[slot.id] = asyncio.get_running_loop().call_later(
                    SETTLE_AFTER_S, self._start_settle, slot, chat, reader, fast
                )
        self._release(slot)

    def _start_settle(self, slot: Slot, chat: dict[str, Any], reader: ReplyReader, fast: FastKey) -> None:
        """The chat's turn ended SETTLE_AFTER_S ago and its slot is still idle: bring it to the boundary."""
        self._settle_timers.pop(slot.id, None)
        if self._stopping or slot.busy or slot.fast is not fast:
            return  # the chat went on already (it pays what plain llama-server pays), or slotkeeper is stopping
        self._reserve(slot)
        task = asyncio.ensure_future(self._settle(slot, chat, reader))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def stop_settling(self) -> None:
        """At stop: no slot is brought to its boundary any more but by the saves themselves."""
        self._stopping = True
        for handle in self._settle_timers.values():
            handle.cancel()
        self._settle_timers.clear()

    def _background_task(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background_ended)

    def _background_ended(self, task: asyncio.Future[None]) -> None:
        """A background task's error is its one line: nobody awaits it (taking in a downloaded entry, which a
        later miss fetches again), and unseen it would end as a traceback when the task is collected."""
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("background task failed (%r)", exc)

    async def _settle(self, slot: Slot, chat: dict[str, Any], reader: ReplyReader) -> None:
        """Once a hybrid chat's turn is over, bring its idle slot to the turn boundary (nothing is written).

        The next turn extends the boundary, so this prefill is one it would pay anyway (the reply as the
        template re-renders it, after a rollback to the checkpoint at the last user message): done here, it
        leaves the turn's critical path while the user reads and types, and a later save needs no prefill.
        It starts SETTLE_AFTER_S after the turn, so a request that comes back at once (a script, an agent's
        quick tool call) finds the slot as plain llama-server leaves it; one that comes while this runs waits
        for it, then extends the boundary."""
        try:
            current, _ = turns_of(chat.get("messages") or [], reader.message())
            tokens = None if current is None else await self.boundaries.tokens(chat, current)
            if tokens is None or not slot.may_reach(tokens):
                return
            reached = await self.boundaries.reach(slot.id, tokens)
            slot.served = self._tick()
            if reached is not None:
                self._measured(reached)
                slot.keys, slot.tokens, slot.exact = block_keys(tokens), len(tokens), exact_key(tokens)
                self.metrics.boundary_settled(reached.prefilled, reached.seconds)
        except (ConnectionError, ValueError, KeyError, TypeError) as exc:
            log.debug("slot %d not brought to its turn boundary: %r", slot.id, exc)
        except Exception as exc:  # noqa: BLE001 - an optimisation: the next turn or the save pays the prefill
            log.warning("slot %d not brought to its turn boundary (%r); its next turn prefills it", slot.id, exc)
        finally:
            self._release(slot)

    def _tick(self) -> float:
        self._clock = max(self._clock + 1e-6, time.monotonic())
        return self._clock

    # ---- tokens -------------------------------------------------------------------------------------------

    async def _tokens(
        self, path: str, body: bytes, data: dict[str, Any], chat: dict[str, Any] | None
    ) -> list[int] | None:
        """The prompt's tokens, as llama-server will see them (template applied); None when it cannot say."""
        try:
            return await asyncio.wait_for(self._ask_tokens(path, body, data, chat), TOKENIZE_TIMEOUT_S)
        except (TimeoutError, ConnectionError, ValueError, KeyError, TypeError) as exc:
            log.debug("tokens of a %s request unknown: %r", path, exc)
            return None

    async def _ask_tokens(
        self, path: str, body: bytes, data: dict[str, Any], chat: dict[str, Any] | None
    ) -> list[int] | None:
        self.metrics.prompt_tokenizations += 1
        if path in CHAT_PATHS:
            if chat is None:
                return None
            return await self.client.chat_tokens(
                body if chat is data else json.dumps(chat, separators=(",", ":")).encode()
            )
        prompt = data.get("prompt")
        if path == "/infill" or prompt is None:
            return None
        return await self.client.tokenize(prompt)

    # ---- start, idle and stop -----------------------------------------------------------------------------

    async def restore_recent(self) -> None:
        """At start, before /health says ready: the most recently used entries, one per slot."""
        if self.policy is CachePolicy.NONE:
            return

        def skip(entry: Entry) -> bool:
            """Chats only (openings are restored for the new chats that need them); on extend-only models, their
            latest boundaries only (not a fallback, or an older kind of entry)."""
            return entry.opening or (
                self.extend_only and (not entry.boundary or self.store.units_extended(entry.units))
            )

        for slot, entry in zip(self.slots, self.store.most_recent(len(self.slots), skip)):
            self._reserve(slot)
            try:
                await self.restore_into(slot, entry, on_demand=False)
            except Exception as exc:  # noqa: BLE001 - one entry's failure is its line: the others are restored
                slot.clear()
                log.warning("chat %s not restored into slot %d (%r); it starts cold", entry.short, slot.id, exc)
            finally:
                self._release(slot)
        # Each restore marks its entry used; those manifest writes end before ready, so that what a start
        # leaves in the store is settled when it says so (a manifest's .partial is never seen after ready).
        await self.store.flush()

    def dirty_slots(self) -> list[Slot]:
        """Slots changed since their last save and worth a file, most recently used first."""
        if self.policy is CachePolicy.NONE:
            return []
        return sorted((s for s in self.slots if self._worth_keeping(s)), key=lambda s: s.last_used, reverse=True)

    async def save_dirty(self, why: str, deadline: float | None = None, *, live: bool = False) -> tuple[int, int]:
        """Write back every idle changed slot, each reserved while it is saved; (saved, attempted)."""
        saved = attempted = 0
        if self._confirming:  # those slots are reserved until it is known which one ran the request
            await asyncio.gather(*list(self._confirming), return_exceptions=True)
        if self._settling:  # those slots are reserved until their boundary is reached: then they are saved
            await asyncio.gather(*list(self._settling), return_exceptions=True)
        for slot in self.dirty_slots():
            if slot.busy:
                continue
            if deadline is not None and deadline - time.monotonic() <= 0:
                log.warning("slot %d not saved: the save budget ran out; its previous entries are kept", slot.id)
                self.metrics.save_failed(SaveFailure.BUDGET.value)
                continue
            self._reserve(slot)
            attempted += 1
            try:
                saved += await self.write_back(slot, why, deadline, live=live)
            except TimeoutError:
                self.metrics.save_failed(SaveFailure.BUDGET.value)
                log.warning(
                    "slot %d save abandoned: the save budget (--save-timeout) ran out; its previous entries are kept",
                    slot.id,
                )
            finally:
                self._release(slot)
        return saved, attempted

    def held_entries(self) -> set[str]:
        """Entries a slot holds unchanged: evicting one would lose what only that slot still has."""
        return {s.entry.id for s in self.slots if s.entry is not None}

    def describe(self) -> list[dict[str, Any]]:
        """Per slot, for /slotkeeper/status."""
        return [
            {
                "slot": s.id,
                "chat": s.label or None,
                "entry": s.entry.id if s.entry else None,
                "tokens_known": s.tokens,
                "dirty": s.dirty,
                "busy": s.busy,
                "restored_state": s.floor.id if s.floor else None,
                "opening": s.entry.id if s.entry is not None and s.entry.opening and not s.dirty else None,
            }
            for s in self.slots
        ]
