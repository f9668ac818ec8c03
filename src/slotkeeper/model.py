"""One model's state: what slotkeeper keeps for the model one llama-server serves, built in one place.

Why one object: the fingerprint, the memory kind and its cache policy, the store, placement, the shared tier
and the counters belong together and live as long as the model is loaded. Built by `open_model` from that
model's file and its server's /props, and handed to the daemon, a process can hold several of them (one per
model a router serves) without globals.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .chat.media import MediaBook
from .config import RunConfig
from .llama.client import LlamaClient
from .llama.ggufheader import vocabulary_key
from .llama.modelinfo import (
    MemoryKind,
    ModelInfoError,
    ModelMemory,
    kv_cache_bytes,
    llama_server_slots,
    model_memory,
)
from .llama.policy import CachePolicy, cache_policy
from .llama.sleep import SleepWatch
from .log import fmt_bytes, log
from .metrics import Metrics
from .placement.decide import Rules
from .placement.hook import Placement
from .placement.recompute import Recomputer
from .store.conversations import ConversationStore, default_cap
from .store.fingerprint import build_fingerprint, kv_flags, model_identity, namespace_key, server_identity
from .store.layout import SNAPSHOTS_DIR
from .store.prescan import Prescan

if TYPE_CHECKING:  # (imported only with --remote-store: obstore is under it)
    from .remote.tier import RemoteTier

REMOTE_JOURNAL_DIR = "remote-pending"  # in the save directory: uploads not finished yet
REMOTE_PROBE_TIMEOUT_S = 5.0  # the shared tier's reachability probe at start (in the background)


@dataclass(frozen=True, kw_only=True)
class ServerFacts:
    """What a model's llama-server says of itself at start (its /props), and what the model file says."""

    n_slots: int
    n_ctx_slot: int | None  # context tokens per slot
    identity: dict[str, Any]  # the model file's identity (fingerprint.model_identity)
    memory: ModelMemory | None  # its memory kind, from its GGUF header (None: unreadable)
    router: bool = False  # llama-server runs as a router (a child per model): it has no slots of its own
    media_marker: str | None = None  # with --mmproj: what stands for a picture in its rendered prompts


@dataclass(kw_only=True)
class Model:
    """Everything slotkeeper keeps for one model."""

    facts: ServerFacts
    fingerprint: dict[str, Any]
    policy: CachePolicy
    store: ConversationStore
    placement: Placement
    metrics: Metrics
    remote: RemoteTier | None
    forced_memory: str  # --model-memory ("auto": read from the model's header)
    name: str = ""  # a router's model: its id (log lines and status name it)
    sleep: SleepWatch | None = None  # with --sleep-idle-seconds: what is known of its llama-server's sleep
    recomputer: Recomputer | None = None  # chats of another configuration, recomputed while idle ...
    _recomputing: asyncio.Future[None] | None = field(default=None, init=False, repr=False)  # ... by this task

    def describe_memory(self) -> dict[str, Any]:
        memory = self.facts.memory
        return {
            "architecture": memory.architecture if memory else None,
            "kind": self.forced_memory if self.forced_memory != "auto" else memory.kind.value if memory else None,
            "sliding_window": memory.sliding_window if memory else None,
            "policy": self.policy.value,
        }

    def status(self) -> dict[str, Any]:
        """This model's part of /slotkeeper/status."""
        store, metrics = self.store, self.metrics.status()
        return {
            "model_memory": self.describe_memory(),
            "child_sleep": None if self.sleep is None else self.sleep.state.value,
            "child_sleeps_in_s": None if self.sleep is None else self.sleep.sleeps_in(),
            "fingerprint": store.fingerprint,
            "slots": self.placement.describe(),
            "store": {
                "entries": len(store.entries),
                "bytes": store.total_bytes,
                "disk_bytes": store.disk_bytes,  # each shared block once, entries kept unused too: what the cap counts
                "cap_bytes": store.cap_bytes,
                "kept_unused": len(store.skipped),
                **store.image_counts(),
            },
            **metrics,
            "openings": {"entries": len(store.openings()), **metrics["openings"]},
            "remote": None if self.remote is None else {"url": self.remote.config.url, **vars(self.remote.stats)},
            "recompute": self.recompute_status(),
        }

    def plan_recompute(self) -> None:
        """At start, once its recent chats are restored: which chats of other configurations will be recomputed
        (one line says how many, before ready)."""
        if self.recomputer is not None:
            self.recomputer.plan()
            self.recomputer.announce()

    def start_recompute(self, quiet: Callable[[], bool]) -> None:
        """Once the model serves: the planned chats recomputed while `quiet()` (no request in flight) and the
        child awake, most recent first."""
        recomputer = self.recomputer
        if recomputer is not None and recomputer.pending:
            self._recomputing = asyncio.ensure_future(recomputer.run(quiet))

    async def stop_recompute(self) -> None:
        """Before a stop or an unload: the recompute ends (a step under way is cancelled; its slot holds part of
        a chat, saved nowhere and needing no save)."""
        task, self._recomputing = self._recomputing, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def recompute_status(self) -> dict[str, Any]:
        """Chats of other configurations: waiting to be recomputed, recomputed, and not recomputable (why)."""
        skipped: dict[str, int] = {}
        for why in self.store.unfit.values():
            skipped[why.value] = skipped.get(why.value, 0) + 1
        recomputer = self.recomputer
        return {
            "pending": 0 if recomputer is None else recomputer.pending,
            "recomputed": 0 if recomputer is None else recomputer.recomputed,
            "prefilled_tokens": 0 if recomputer is None else recomputer.prefilled,
            "seconds": 0.0 if recomputer is None else round(recomputer.seconds, 3),
            "paused": 0 if recomputer is None else recomputer.paused,
            "skipped": skipped,
        }

    def save_estimate(self, served: bool, budget_s: float) -> dict[str, float] | None:
        """What a stop-time save must write: the changed slots (`served`: once requests were placed; before, at
        most one entry per slot, the largest), at the speed the saves measured."""
        store = self.store
        rate = store.save_rate()
        if not rate:
            return None
        per_token = store.bytes_per_token() or 0.0
        largest = max((e.nbytes for e in store.entries.values()), default=0)
        if served:
            nbytes = sum(int(s.n_tokens * per_token) if s.n_tokens else largest for s in self.placement.dirty_slots())
        else:  # before any request: what the slots could hold, the largest entries' sizes
            nbytes = sum(sorted((e.nbytes for e in store.entries.values()), reverse=True)[: self.facts.n_slots])
        return {"bytes": nbytes, "bytes_per_s": rate, "seconds": nbytes / rate, "budget_s": budget_s}


async def read_server_facts(
    config: RunConfig,
    client: LlamaClient,
    identity: Awaitable[dict[str, Any]],
    memory: Awaitable[ModelMemory | None],
) -> ServerFacts:
    """The slot count and context from /props (never address a slot beyond it); the model file's identity and
    memory kind (`identity` and `memory` were started at the spawn, read while llama-server loaded the model),
    read again from the file /props names when that is another one (e.g. -hf)."""
    props = await client.props()
    body = props.body if props.ok and isinstance(props.body, dict) else {}
    if body.get("role") == "router":
        return ServerFacts(n_slots=0, n_ctx_slot=None, identity=await identity, memory=None, router=True)
    if "total_slots" in body:
        n_slots = int(body["total_slots"])
    else:
        hint = config.total_slots_hint or 0
        n_slots = hint if hint > 0 else 1
        log.warning("GET /props answered %d (%s); assuming %d slot(s)", props.status, props.error, n_slots)
    n_ctx = body.get("default_generation_settings", {}).get("n_ctx")
    model = body.get("model_path") or config.model
    found = await identity
    if model and found.get("model") != str(Path(model).resolve()):  # e.g. -hf: /props names the file
        found = await asyncio.to_thread(model_identity, model)
    kind = await memory
    if model and model != config.model:
        kind = await asyncio.to_thread(model_memory, model)
    modalities = body.get("modalities") or {}
    marker = body.get("media_marker") if any(modalities.values()) else None
    return ServerFacts(
        n_slots=n_slots,
        n_ctx_slot=n_ctx,
        identity=found,
        memory=kind,
        media_marker=marker if isinstance(marker, str) else None,
    )


def model_vocabulary(path: str | None, memory: ModelMemory | None) -> str:
    """What another file of this model shares with it (a re-quantized download): its vocabulary (from its GGUF
    header) and its shape (layers, KV widths). "" when either cannot be read: nothing saved by another model
    file is recomputed then. The shape keeps another model of the same vocabulary (another size of a family)
    from taking over the chats of a model it alternates with in one save directory."""
    if not path or memory is None:
        return ""
    try:
        vocabulary = vocabulary_key(path)
    except (ModelInfoError, OSError) as exc:
        log.debug("vocabulary of %s unknown: %s", path, exc)
        return ""
    shape = (
        memory.architecture,
        memory.n_layers,
        memory.recurrent_layers,
        memory.sliding_window,
        tuple((layer.k, layer.v, layer.swa) for layer in memory.kv_layers),
    )
    return f"{vocabulary}:{hashlib.blake2b(repr(shape).encode(), digest_size=8).hexdigest()}"


async def open_model(
    config: RunConfig,
    client: LlamaClient,
    facts: ServerFacts,
    metrics: Metrics,
    root: Path | None = None,
    scanned: Prescan | None = None,
) -> Model:
    """The model's store opened (its entries indexed, its format checked against this llama-server's), its
    placement and its shared tier: ready for the restore at start. `root`: the store's directory, when it is
    not the save directory (a router's models each have one below it, and share its snapshots/). `scanned`:
    what store.prescan read of it at the spawn."""
    options = config.options
    store_root = root or config.save_dir
    swa_full = "swa_full" in kv_flags(config.child_args)
    policy = cache_policy(facts.memory, swa_full, options.model_memory)
    _say_memory(config, facts, policy)
    fingerprint = build_fingerprint(facts.identity, config.child_args, facts.n_slots, facts.n_ctx_slot)
    cap = int(options.max_cache_bytes) if options.max_cache_bytes else None
    remote = _remote_tier(options.remote_store, fingerprint, store_root)
    vocabulary = await asyncio.to_thread(model_vocabulary, facts.identity.get("model"), facts.memory)
    store = ConversationStore(
        store_root,
        client,
        fingerprint,
        server_identity(config.llama_binary),
        fsync=options.fsync,
        cap_bytes=cap,
        restore_unverified=options.restore_unverified,
        metrics=metrics,
        on_commit=None if remote is None else remote.upload_committed,
        snapshots=None if root is None else config.save_dir / SNAPSHOTS_DIR,
        media=MediaBook(facts.media_marker),
        vocabulary=vocabulary,
        ram_staging=options.ram_staging,
    )
    await store.load(scanned)
    if store.cap_bytes is None:
        store.cap_bytes = default_cap(store_root, store.disk_bytes)
    await store.check_format()
    await store.check_fit()
    if remote is not None:
        _start_remote(remote)
    metrics.store_entries = lambda: len(store.entries)
    metrics.store_bytes = lambda: store.total_bytes
    metrics.store_disk_bytes = lambda: store.disk_bytes
    metrics.store_images = lambda: store.image_counts()["images"]
    memory = facts.memory
    settle = memory is None or memory.kind is MemoryKind.RECURRENT
    rules = Rules(policy=policy, min_tokens=options.min_save_tokens, settle=settle)
    placement = Placement(store, client, facts.n_slots, rules=rules, metrics=metrics, remote=remote)
    model = Model(
        facts=facts,
        fingerprint=fingerprint,
        policy=policy,
        store=store,
        placement=placement,
        metrics=metrics,
        remote=remote,
        forced_memory=options.model_memory,
    )
    sleep_s = config.child_sleeps_after
    if sleep_s is not None:
        model.sleep = placement.sleep = SleepWatch(sleep_s, client, placement.cache_dropped)
    if store.recomputable or store.unfit:
        model.recomputer = Recomputer(placement.slots, placement.keeper, budget=options.recompute, sleep=model.sleep)
    metrics.memory = model.describe_memory
    metrics.recompute = model.recompute_status
    if remote is not None:
        metrics.remote = lambda: remote.stats
    other = f"; {len(store.skipped)} kept but not used (see above)" if store.skipped else ""
    log.info(
        "%d slot(s); %d conversation(s) in %s (%s of a %s cap)%s",
        facts.n_slots,
        len(store.entries),
        store_root,
        fmt_bytes(store.disk_bytes),
        fmt_bytes(store.cap_bytes or 0),
        other,
    )
    return model


def _say_memory(config: RunConfig, facts: ServerFacts, policy: CachePolicy) -> None:
    """The model's memory decides what llama-server reuses, and so what is worth saving: one line."""
    memory, forced = facts.memory, config.options.model_memory
    if forced != "auto":
        log.info("model memory: %s (--model-memory): cache policy %s", forced, policy.value)
    elif memory is None:
        log.warning(
            "model memory unknown (its GGUF header could not be read): chats are saved at turn boundaries and "
            "restored only into requests that extend them"
        )
    elif policy is CachePolicy.NONE:
        swa_kv = swa_full_cost(memory, facts, config)
        cost = f" (KV {fmt_bytes(swa_kv[0])} -> {fmt_bytes(swa_kv[1])})" if swa_kv else ""
        log.warning(
            "%s uses a %s-token sliding window: llama-server reuses no restored chat of it unless --swa-full%s; "
            "nothing is saved, and each chat keeps its own slot",
            memory.architecture,
            f"{memory.sliding_window:,}",
            cost,
        )
    elif policy is CachePolicy.EXTEND_ONLY:
        log.info(
            "model: %s, %s: chats are saved at turn boundaries and restored only into requests that extend them",
            memory.architecture,
            memory.describe(),
        )
    else:
        log.info("model: %s, %s", memory.architecture, memory.describe())


def swa_full_cost(memory: ModelMemory, facts: ServerFacts, config: RunConfig) -> tuple[int, int] | None:
    """llama-server's KV cache for this model as it runs, and with --swa-full (from the model's shape)."""
    if not facts.n_ctx_slot:
        return None
    unified_flag = kv_flags(config.child_args).get("kv_unified")
    slots, unified = llama_server_slots(
        config.total_slots_hint, None if unified_flag is None else not unified_flag.startswith("no")
    )
    n_seq = max(facts.n_slots or slots, 1)
    n_ctx = facts.n_ctx_slot if unified else facts.n_ctx_slot * n_seq
    try:
        return (
            kv_cache_bytes(memory, n_ctx, n_seq, swa_full=False, unified=unified),
            kv_cache_bytes(memory, n_ctx, n_seq, swa_full=True, unified=unified),
        )
    except ValueError:
        return None


def _remote_tier(url: str | None, fingerprint: dict[str, Any], save_dir: Path) -> RemoteTier | None:
    """The shared tier (--remote-store): uploads after each local commit, lookups on a miss. Nothing here waits
    on the network: reachability is probed in the background, so an unreachable server never delays readiness."""
    if not url:
        return None
    from .remote.tier import RemoteConfig, RemoteTier  # (obstore under it: imported only when used)

    try:
        config = RemoteConfig.from_url(url, os.environ)
        tier = RemoteTier(config, namespace_key(fingerprint), save_dir / REMOTE_JOURNAL_DIR)
    except ValueError as exc:
        log.warning("remote store not used: %s", exc)
        return None
    return tier


def _start_remote(tier: RemoteTier) -> None:
    """Once the local store is open: the uploads the last run left resume, and reachability is probed."""
    resumed = tier.resume()
    if resumed:
        log.info("remote: %d upload(s) left by the last run resume", resumed)
    tier.probe_in_background(REMOTE_PROBE_TIMEOUT_S)
