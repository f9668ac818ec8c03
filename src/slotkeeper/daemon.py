"""The lifecycle, as one linear script: start → restore → serve → drain → save → stop.

One owner of the state (`Daemon.set_state` logs every transition). Signal handlers only set events: the
first SIGTERM/SIGINT asks for a graceful stop, a second one forces it (no save). Every wait has a named
timeout and logs when it gives up.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import signal
import time
from pathlib import Path
from typing import Any

from .config import RunConfig
from .fingerprint import build_fingerprint, kv_flags, model_identity, namespace_key
from .llama_client import LlamaClient
from .log import fmt_bytes, fmt_ms, log
from .metrics import Metrics
from .modelinfo import MemoryKind, ModelInfoError, ModelMemory, kv_cache_bytes, llama_server_slots, read_model_memory
from .placement import Placement
from .policy import CachePolicy, cache_policy
from .proxy.messages import Reply
from .proxy.server import Gate, Proxy
from .store import ConversationStore, default_cap, server_identity
from .supervisor import ChildProcess

HEALTH_POLL_S = 0.01
EXIT_OK = 0
EXIT_FORCED = 1
EXIT_STARTUP_FAILED = 1
FORCED_STOP_TIMEOUT_S = 0.5
REMOTE_JOURNAL_DIR = "remote-pending"  # in the save directory: uploads not finished yet
REMOTE_PROBE_TIMEOUT_S = 5.0  # a second signal: the child gets this long after SIGTERM before SIGKILL
AUTOSAVE_RETRY_MAX_S = 300.0  # a failing idle autosave is tried again after --autosave-idle, doubling up to this


FORCED_POLICIES = {  # --model-memory, and whether --swa-full is set
    ("full", False): CachePolicy.PREFIX,
    ("full", True): CachePolicy.PREFIX,
    ("recurrent", False): CachePolicy.EXTEND_ONLY,
    ("recurrent", True): CachePolicy.EXTEND_ONLY,
    ("sliding-window", False): CachePolicy.NONE,
    ("sliding-window", True): CachePolicy.EXTEND_ONLY,
}


def describe_error(exc: BaseException) -> str:
    """An unexpected error in a few words for its one log line: `[Errno 30] Read-only file system`,
    `KeyError: 'id'` (an OSError says what it is; other errors need their type to mean anything)."""
    text = str(exc)
    if isinstance(exc, OSError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class State(enum.Enum):
    STARTING = "starting"
    RESTORING = "restoring"
    READY = "ready"
    DRAINING = "draining"
    SAVING = "saving"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Daemon:
    """Owns the child, the public server and the slot store for one run."""

    def __init__(self, config: RunConfig, child: ChildProcess, early_signals: list[int]) -> None:
        self.config = config
        self.options = config.options
        self.child = child
        self.state = State.STARTING
        self.started_at = child.started_at  # the spawn: imports and the model load overlap from here
        self.healthy_at: float | None = None
        self.total_slots = 0
        self.signals_received = 0
        self._early_signals = early_signals
        self.stop_requested = asyncio.Event()
        self.force_requested = asyncio.Event()
        self.store: ConversationStore | None = None
        self.placement: Placement | None = None
        self._seen_tasks: dict[int, int] = {}  # with placement off: llama-server's id_task per slot at the last look
        self._autosave: asyncio.Future[None] | None = None
        self.remote: Any = None  # remote.RemoteTier, with --remote-store
        self._remote_probe: asyncio.Future[bool] | None = None
        self._client: LlamaClient | None = None  # once run() made it
        self.metrics = Metrics(state=lambda: self.state.value)
        self._identity: asyncio.Future[dict[str, Any]] | None = None
        self._memory: asyncio.Future[ModelMemory | None] | None = None
        self.memory: ModelMemory | None = None
        self.policy = CachePolicy.EXTEND_ONLY

    def set_state(self, state: State) -> None:
        if state is not self.state:
            log.info("state: %s -> %s", self.state.value, state.value)
            self.state = state

    def on_signal(self, signum: int) -> None:
        """Only sets events (no work in a signal handler): first = graceful stop, second = forced."""
        self.signals_received += 1
        if self.signals_received == 1:
            log.info("%s received: stopping (send it again to skip saving)", signal.Signals(signum).name)
            self.stop_requested.set()
        else:
            log.warning("%s received again: stopping now, without saving", signal.Signals(signum).name)
            self.force_requested.set()

    def on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """An error no task took (a callback's, a forgotten future's): one line, never a traceback; the run goes
        on. The last resort behind the background work's own handling (with --log-level debug: the traceback)."""
        exc = context.get("exception")
        what = context.get("message") or "unexpected error"
        log.warning(
            "%s%s",
            what,
            f": {describe_error(exc)}" if exc is not None else "",
            exc_info=exc if exc is not None and self.options.log_level == "debug" else None,
        )

    async def metrics_endpoint(self) -> Reply:
        """GET /slotkeeper/metrics: Prometheus text exposition."""
        body, content_type = self.metrics.render()
        return Reply(200, body, content_type)

    async def status(self) -> Reply:
        """GET /slotkeeper/status: which slot holds which chat, what the store holds, what a stop must write."""
        store, placement = self.store, self.placement
        return Reply.json(
            {
                "state": self.state.value,
                "child_pid": self.child.pid,
                "uptime_s": round(time.monotonic() - self.started_at, 3),
                "save_dir": str(self.config.save_dir),
                "total_slots": self.total_slots,
                "placement": self.options.placement,
                "model_memory": self.describe_memory(),
                "fingerprint": None if store is None else store.fingerprint,
                "slots": [] if placement is None else placement.describe(),
                "store": None
                if store is None
                else {
                    "entries": len(store.entries),
                    "bytes": store.total_bytes,
                    "cap_bytes": store.cap_bytes,
                    "kept_unused": len(store.skipped),
                },
                "placements": dict(self.metrics.placements),
                "on_demand_restores": self.metrics.on_demand_restores,
                "prefill_tokens_saved": self.metrics.prefill_tokens_saved,
                "prompt_tokenizations": self.metrics.prompt_tokenizations,
                "slots_parked": self.metrics.slots_parked,
                "unpinned_elsewhere": self.metrics.unpinned_elsewhere,
                "chats_found_empty": self.metrics.chats_found_empty,
                "extend_only": {
                    "hits": self.metrics.extend_hits,
                    "misses": dict(self.metrics.extend_misses),
                    "boundaries_reached": self.metrics.boundaries_reached,
                    "boundaries_settled": self.metrics.boundaries_settled,
                    "settle_prefill_tokens": self.metrics.settle_prefill_tokens,
                    "settle_ms": round(self.metrics.settle_seconds * 1000, 1),
                    "boundary_prefill_tokens": self.metrics.boundary_prefill_tokens,
                    "boundary_ms": round(self.metrics.boundary_seconds * 1000, 1),
                    "boundary_unknown": self.metrics.boundary_unknown,
                },
                "openings": {
                    "entries": 0 if store is None else len(store.openings()),
                    "saved": self.metrics.openings_saved,
                    "hits": self.metrics.opening_hits,
                    "tokens_saved": self.metrics.opening_tokens_saved,
                    "prefill_tokens": self.metrics.opening_prefill_tokens,
                    "prefill_ms": round(self.metrics.opening_seconds * 1000, 1),
                },
                "save_estimate": self.save_estimate(),
                "remote": None if self.remote is None else {"url": self.remote.config.url, **vars(self.remote.stats)},
            }
        )

    # ---- the script ----------------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for handled in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(handled, self.on_signal, handled)
        for early in self._early_signals:
            self.on_signal(early)
        loop.set_exception_handler(self.on_loop_error)
        child_exited = self.child.watch(loop)
        # Hash the model file while llama-server loads it (hashlib releases the GIL): ready for the restore.
        self._identity = asyncio.ensure_future(asyncio.to_thread(model_identity, self.config.model))
        self._memory = asyncio.ensure_future(asyncio.to_thread(model_memory, self.config.model))
        startup_deadline = self.started_at + self.options.startup_timeout
        gate = Gate()
        proxy = Proxy(self.child.endpoint, gate, lambda: self.state.value, startup_deadline, self.config.api_keys)
        client = LlamaClient(proxy.pool, self.config.api_key)
        self._client = client
        proxy.own_routes["/slotkeeper/status"] = self.status
        proxy.own_routes["/slotkeeper/metrics"] = self.metrics_endpoint
        self.metrics.requests_in_flight = lambda: len(proxy.in_flight)
        self.metrics.requests_by_status = lambda: dict(proxy.status_counts)
        try:
            await self.listen(proxy)
            code = await self.startup(client, child_exited, startup_deadline)
            if code is not None:
                gate.close()
                return code
            if self.options.placement and self.placement is not None:
                proxy.hook = self.placement
            gate.open()
            # What start-up built (modules, pydantic models, the loop) lives as long as the process: moved out
            # of the collector's sight, a full collection no longer walks it while requests are proxied.
            gc.freeze()
            self.set_state(State.READY)
            now = time.monotonic()
            log.info(
                "ready %s after starting llama-server (pid %d; it answered healthy at %s, restore took %s)",
                fmt_ms(now - self.started_at),
                self.child.pid,
                fmt_ms((self.healthy_at or now) - self.started_at),
                fmt_ms(now - (self.healthy_at or now)),
            )
            self.warn_if_save_exceeds_budget()
            code = await self.serve(proxy, child_exited)
            if code is not None:
                proxy.accepting = False
                return code
            return await self.shutdown(proxy, child_exited)
        finally:
            proxy.accepting = False
            if self._autosave is not None:
                self._autosave.cancel()
            if not child_exited.done():
                await self.child.stop(self.options.stop_timeout)
            self.set_state(State.STOPPED)
            await proxy.stop_listening()
            proxy.close()

    async def listen(self, proxy: Proxy) -> None:
        """Public sockets open early so health checks see 503 (not connection refused) while loading."""
        for host in self.config.hosts:
            name = await proxy.listen(host, self.config.port)
            log.info("listening on %s; llama-server on %s", name, self.child.endpoint.describe())

    async def _race(
        self,
        awaitable: Any,
        interrupt: asyncio.Event,
        child_exited: asyncio.Future[int] | None = None,
        deadline: float | None = None,
    ) -> tuple[str, Any]:
        """Wait for `awaitable`, the interrupting event, the child's exit, or the deadline; say which came first.

        Returns ("done", result), or ("interrupted" | "child_exited" | "timeout", None) after the unfinished
        work has been cancelled and has run its cleanup.
        """
        work = asyncio.ensure_future(awaitable)
        interrupted = asyncio.ensure_future(interrupt.wait())
        waiters: set[asyncio.Future[Any]] = {work, interrupted}
        if child_exited is not None:
            waiters.add(child_exited)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            interrupted.cancel()
        if work in done:
            return "done", work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        if interrupted in done:
            return "interrupted", None
        if child_exited is not None and child_exited in done:
            return "child_exited", None
        return "timeout", None

    async def startup(self, client: LlamaClient, child_exited: asyncio.Future[int], deadline: float) -> int | None:
        """Wait for the child's health, then restore. Returns an exit code when startup ends the run.

        A stop cancels the restore (no further entry is restored; nothing changed, so nothing is saved), but
        the slot action already under way runs to its end, for up to --stop-timeout, before llama-server is
        signalled: it honours SIGTERM only after the action, and would otherwise be SIGKILLed."""
        outcome, _ = await self._race(self.wait_healthy(client), self.stop_requested, child_exited, deadline)
        if outcome == "done":
            self.set_state(State.RESTORING)
            outcome, _ = await self._race(self.restore(client), self.stop_requested, child_exited, deadline)
        if outcome == "done":
            return None
        if outcome == "child_exited":
            code = child_exited.result()
            log.error("llama-server exited with code %d during startup (its own output above says why)", code)
            return code or EXIT_STARTUP_FAILED
        if outcome == "interrupted":
            busy = client.busy_with()
            after = f" once its slot {busy} under way ends (up to {self.options.stop_timeout:g} s)" if busy else ""
            log.info("stop requested during %s: stopping llama-server without saving%s", self.state.value, after)
            outcome, _ = await self._race(
                client.until_idle(time.monotonic() + self.options.stop_timeout), self.force_requested, child_exited
            )
            if outcome == "interrupted":
                return await self.stop_forced()
            return EXIT_OK
        log.error(
            "startup timed out after %.0f s (--startup-timeout) in state %s",
            self.options.startup_timeout,
            self.state.value,
        )
        return EXIT_STARTUP_FAILED

    async def wait_healthy(self, client: LlamaClient) -> None:
        while True:
            try:
                if (await client.health()).ok:
                    self.healthy_at = time.monotonic()
                    return
            except (OSError, Exception):  # noqa: BLE001 - socket not there yet, connection refused while loading
                pass
            await asyncio.sleep(HEALTH_POLL_S)

    async def restore(self, client: LlamaClient) -> None:
        """Learn the slot count from /props (never address a slot beyond it), then restore what matches."""
        props = await client.props()
        body = props.body if props.ok and isinstance(props.body, dict) else {}
        if "total_slots" in body:
            self.total_slots = int(body["total_slots"])
        else:
            hint = self.config.total_slots_hint or 0
            self.total_slots = hint if hint > 0 else 1
            log.warning("GET /props answered %d (%s); assuming %d slot(s)", props.status, props.error, self.total_slots)
        n_ctx = body.get("default_generation_settings", {}).get("n_ctx")
        model = body.get("model_path") or self.config.model
        assert self._identity is not None
        identity = await self._identity
        if model and identity.get("model") != str(Path(model).resolve()):  # e.g. -hf: /props names the file
            identity = await asyncio.to_thread(model_identity, model)
        assert self._memory is not None
        memory = await self._memory
        if model and model != self.config.model:
            memory = await asyncio.to_thread(model_memory, model)
        self.learn_memory(memory, n_ctx)
        fingerprint = build_fingerprint(identity, self.config.child_args, self.total_slots, n_ctx)
        cap = int(self.options.max_cache_bytes) if self.options.max_cache_bytes else None
        store = ConversationStore(
            self.config.save_dir,
            client,
            fingerprint,
            server_identity(self.config.llama_binary),
            fsync=self.options.fsync,
            cap_bytes=cap,
            restore_unverified=self.options.restore_unverified,
            metrics=self.metrics,
        )
        await asyncio.to_thread(store.open)
        if store.cap_bytes is None:
            store.cap_bytes = default_cap(self.config.save_dir, store.total_bytes)
        if store.needs_format_probe():  # entries from another llama-server: is its state format this one's?
            store.current_format = await store.probe_format(0)
            if store.current_format is not None:
                store.check_formats()
        self.store = store
        self.metrics.store_entries = lambda: len(store.entries)
        self.metrics.store_bytes = lambda: store.total_bytes
        self.placement = Placement(
            store,
            client,
            self.total_slots,
            min_tokens=self.options.min_save_tokens,
            metrics=self.metrics,
            policy=self.policy,
            settle=self.memory is None or self.memory.kind is MemoryKind.RECURRENT,
        )
        if self.options.remote_store:
            self.attach_remote(store, self.placement, fingerprint)
        other = f"; {len(store.skipped)} kept but not used (see above)" if store.skipped else ""
        log.info(
            "%d slot(s); %d conversation(s) in %s (%s of a %s cap)%s",
            self.total_slots,
            len(store.entries),
            self.config.save_dir,
            fmt_bytes(store.total_bytes),
            fmt_bytes(store.cap_bytes or 0),
            other,
        )
        if self.options.placement or self.policy is CachePolicy.PREFIX:
            await self.placement.restore_recent()
        else:  # nothing would keep a request that diverges inside a restored state off its slot
            log.warning("--no-placement on a model whose restored states only extend: nothing is restored or saved")

    def learn_memory(self, memory: ModelMemory | None, n_ctx_slot: int | None) -> None:
        """The model's memory decides what llama-server reuses, and so what is worth saving: one line."""
        swa_full = "swa_full" in kv_flags(self.config.child_args)
        self.memory, self.policy = memory, cache_policy(memory, swa_full)
        self.metrics.memory = self.describe_memory
        forced = self.options.model_memory
        if forced != "auto":
            self.policy = FORCED_POLICIES[forced, swa_full]
            log.info("model memory: %s (--model-memory): cache policy %s", forced, self.policy.value)
        elif memory is None:
            log.warning(
                "model memory unknown (its GGUF header could not be read): chats are saved at turn "
                "boundaries and restored only into requests that extend them"
            )
        elif self.policy is CachePolicy.NONE:
            cost = (
                f" (KV {fmt_bytes(swa_kv[0])} -> {fmt_bytes(swa_kv[1])})"
                if (swa_kv := self.swa_full_cost(memory, n_ctx_slot))
                else ""
            )
            log.warning(
                "%s uses a %s-token sliding window: llama-server reuses no restored chat of it unless "
                "--swa-full%s; nothing is saved, and each chat keeps its own slot",
                memory.architecture,
                f"{memory.sliding_window:,}",
                cost,
            )
        elif self.policy is CachePolicy.EXTEND_ONLY:
            log.info(
                "model: %s, %s: chats are saved at turn boundaries and restored only into requests that extend them",
                memory.architecture,
                memory.describe(),
            )
        else:
            log.info("model: %s, %s", memory.architecture, memory.describe())

    def swa_full_cost(self, memory: ModelMemory, n_ctx_slot: int | None) -> tuple[int, int] | None:
        """llama-server's KV cache for this model as it runs, and with --swa-full (from the model's shape)."""
        if not n_ctx_slot:
            return None
        unified_flag = kv_flags(self.config.child_args).get("kv_unified")
        slots, unified = llama_server_slots(
            self.config.total_slots_hint, None if unified_flag is None else not unified_flag.startswith("no")
        )
        n_seq = max(self.total_slots or slots, 1)
        n_ctx = n_ctx_slot if unified else n_ctx_slot * n_seq
        try:
            return (
                kv_cache_bytes(memory, n_ctx, n_seq, swa_full=False, unified=unified),
                kv_cache_bytes(memory, n_ctx, n_seq, swa_full=True, unified=unified),
            )
        except ValueError:
            return None

    def describe_memory(self) -> dict[str, Any]:
        memory = self.memory
        return {
            "architecture": memory.architecture if memory else None,
            "kind": self.options.model_memory
            if self.options.model_memory != "auto"
            else memory.kind.value
            if memory
            else None,
            "sliding_window": memory.sliding_window if memory else None,
            "policy": self.policy.value,
        }

    def attach_remote(self, store: ConversationStore, placement: Placement, fingerprint: dict[str, Any]) -> None:
        """The shared tier: uploads after each local commit, lookups on a miss. Nothing here waits on the network:
        reachability is probed in the background, so an unreachable server never delays readiness."""
        import os

        from .remote import RemoteConfig, RemoteTier

        try:
            config = RemoteConfig.from_url(self.options.remote_store or "", os.environ)
            tier = RemoteTier(config, namespace_key(fingerprint), self.config.save_dir / REMOTE_JOURNAL_DIR)
        except ValueError as exc:
            log.warning("remote store not used: %s", exc)
            return
        self.remote = tier
        store.on_commit = lambda entry, path: tier.schedule_upload(entry.id, path, entry.manifest())
        placement.remote = tier
        resumed = tier.resume()
        if resumed:
            log.info("remote: %d upload(s) left by the last run resume", resumed)
        self._remote_probe = asyncio.ensure_future(tier.probe(REMOTE_PROBE_TIMEOUT_S))
        self.metrics.remote = lambda: tier.stats

    async def serve(self, proxy: Proxy, child_exited: asyncio.Future[int]) -> int | None:
        """Until a stop request, autosaving when idle; returns the child's exit code if it dies first."""
        autosave = asyncio.ensure_future(self.autosave_loop(proxy)) if self.options.autosave_idle > 0 else None
        self._autosave = autosave
        outcome, _ = await self._race(asyncio.Event().wait(), self.stop_requested, child_exited)
        if outcome == "child_exited":
            if autosave is not None:
                autosave.cancel()
            code = child_exited.result()
            log.error("llama-server exited with code %d while serving; exiting", code)
            return code
        return None

    async def autosave_loop(self, proxy: Proxy) -> None:
        """After --autosave-idle seconds with no request in flight, save what changed (in the background).

        A cache saved while idle survives a crash or a SIGKILL, and leaves little for the stop-time save. A save
        that fails (the disk full or remounted read-only, or an error nobody expected: one line) leaves its
        slots changed, and is tried again while idle, after --autosave-idle, then twice as long each time up to
        AUTOSAVE_RETRY_MAX_S: such failures pass, and this loop ends only with the run.
        """
        idle_s = self.options.autosave_idle
        seen = proxy.requests_total
        retry_s = 0.0  # after a failed save: wait this long, then try again without waiting for a request
        while not self.stop_requested.is_set():
            quiet = time.monotonic() - proxy.last_activity
            if proxy.in_flight or quiet < idle_s or (proxy.requests_total == seen and not retry_s):
                await asyncio.sleep(max(idle_s - quiet, 0.2) if not proxy.in_flight else idle_s)
                continue
            seen = proxy.requests_total
            try:
                await self.save_changed("idle", None, live=True)
                failed = None
            except Exception as exc:  # noqa: BLE001 - one line, and the loop goes on (never CancelledError)
                failed = describe_error(exc)
            if failed is None and not self.unsaved():
                retry_s = 0.0
                continue
            retry_s = min(max(retry_s * 2, idle_s), AUTOSAVE_RETRY_MAX_S)
            if failed is not None:  # else the slot's own line said why it was not saved
                log.warning("idle autosave failed: %s; retrying in %g s", failed, retry_s)
            await asyncio.sleep(retry_s)

    def unsaved(self) -> bool:
        """Some idle slot still holds a change that no entry has (its save failed)."""
        assert self.placement is not None
        return any(not slot.busy for slot in self.placement.dirty_slots())

    async def save_changed(self, why: str, deadline: float | None, *, live: bool = False) -> tuple[int, int]:
        """Write every changed slot back into the store, then keep the store within its cap."""
        assert self.placement is not None and self.store is not None
        if not self.options.placement:
            await self.note_unplaced_changes()
        outcome = await self.placement.save_dirty(why, deadline, live=live)
        self.store.evict_over_cap(self.placement.held_entries())
        return outcome

    async def note_unplaced_changes(self) -> None:
        """With placement off, llama-server chose the slots: /slots says which ran a new task since the last look."""
        assert self.placement is not None
        if not self.config.slots_endpoint:  # --no-slots: nothing to ask; every slot may have changed
            for slot in self.placement.slots:
                slot.changed_unseen()
            return
        assert self._client is not None
        try:
            reply = await self._client.slots()
        except ConnectionError as exc:
            log.warning("GET /slots failed (%s); saving every slot", exc)
            reply = None
        entries = reply.body if reply is not None and reply.ok and isinstance(reply.body, list) else None
        for slot in self.placement.slots:
            info: dict[str, Any] = next((e for e in entries or () if e.get("id") == slot.id), {})
            task = info.get("id_task")
            if entries is None or (
                task is not None and info.get("n_prompt_tokens", 0) > 0 and self._seen_tasks.get(slot.id) != task
            ):
                slot.changed_unseen()
                if task is not None:
                    self._seen_tasks[slot.id] = task

    async def shutdown(self, proxy: Proxy, child_exited: asyncio.Future[int]) -> int:
        """Drain, save what changed inside the budget, stop the child. A second signal skips the rest of the save."""
        budget_end = time.monotonic() + self.options.save_timeout
        self.set_state(State.DRAINING)
        proxy.accepting = False
        if self.placement is not None:
            self.placement.stop_settling()
        drain = min(self.options.drain_timeout, self.options.save_timeout)
        outcome, idle = await self._race(proxy.wait_idle(drain), self.force_requested)
        if not idle:
            cancelled = proxy.cancel_in_flight()
            if outcome != "interrupted":
                log.warning("%d request(s) still running after %.1f s (--drain-timeout); cancelled", cancelled, drain)
            await proxy.wait_idle(1.0)
        if outcome == "interrupted":
            return await self.stop_forced()
        self.set_state(State.SAVING)
        assert self.store is not None
        if self._autosave is not None:
            self._autosave.cancel()
            await asyncio.gather(self._autosave, return_exceptions=True)
        outcome, counts = await self._race(self.save_at_stop(budget_end), self.force_requested, child_exited)
        if outcome == "interrupted":
            return await self.stop_forced()
        client = self._client
        assert client is not None
        if outcome == "child_exited":
            log.error("llama-server exited with code %d while saving", child_exited.result())
        elif client.running:  # e.g. the restore of a request the drain cancelled: llama-server finishes it first
            log.info(
                "llama-server is busy with a slot %s: it is stopped once that ends (inside --save-timeout)",
                client.busy_with(),
            )
            outcome, _ = await self._race(client.until_idle(budget_end), self.force_requested, child_exited)
            if outcome == "interrupted":
                return await self.stop_forced()
        self.set_state(State.STOPPING)
        await asyncio.gather(self.settle_store(), self.child.stop(self.options.stop_timeout))
        if counts and counts[1]:
            log.info("saved %d of %d changed slot(s)", *counts)
        if self.remote is not None:  # uploads may use what is left of the budget, never more
            try:
                await self.remote.close(budget_end)
            except Exception as exc:  # noqa: BLE001 - the journal keeps what was not uploaded; the stop goes on
                log.warning(
                    "remote: closing failed: %s; the uploads not done resume at the next start", describe_error(exc)
                )
        return EXIT_OK

    async def settle_store(self) -> None:
        """The store's files as the run leaves them: manifest updates written, then the manifest cache (while
        llama-server exits: the next start reads one file; written once ready instead, it slowed the first
        requests)."""
        assert self.store is not None
        await self.store.flush()
        await self.store.write_cache()

    async def stop_forced(self) -> int:
        """A second signal: no (more) saving; the child gets FORCED_STOP_TIMEOUT_S after SIGTERM."""
        self.set_state(State.STOPPING)
        await self.child.stop(min(self.options.stop_timeout, FORCED_STOP_TIMEOUT_S))
        if self.store is not None:
            await self.store.flush()
        return EXIT_FORCED

    async def save_at_stop(self, budget_end: float) -> tuple[int, int] | None:
        """The stop's save, inside the budget; None when it ran out or failed (one line: the stop goes on, and
        llama-server is still stopped by its SIGTERM)."""
        remaining = budget_end - time.monotonic()
        try:
            counts = await asyncio.wait_for(self.save_changed("at stop", budget_end), max(remaining, 0.0))
        except TimeoutError:
            log.warning(
                "the save budget (--save-timeout %.1f s) ran out; slots not saved yet keep their previous entries",
                self.options.save_timeout,
            )
            return None
        except Exception as exc:  # noqa: BLE001 - never CancelledError: a second signal still forces the stop
            log.warning(
                "saving at stop failed: %s; slots not saved yet keep their previous entries", describe_error(exc)
            )
            return None
        if not counts[1]:
            log.info("no slot changed since its cache was written; nothing to save")
        return counts

    def save_estimate(self) -> dict[str, float] | None:
        """What the stop-time save must write: the changed slots (at start, at most one entry per slot), at the
        speed the saves measured."""
        store, placement = self.store, self.placement
        if store is None or placement is None:
            return None
        rate = store.save_rate()
        if not rate:
            return None
        per_token = store.bytes_per_token() or 0.0
        largest = max((e.nbytes for e in store.entries.values()), default=0)
        # a restore at start marks its slot used too: "a request ran" is a placed request
        if self.state is State.READY and any(self.metrics.placements.values()):
            nbytes = sum(int(s.tokens * per_token) if s.tokens else largest for s in placement.dirty_slots())
        else:  # before any request: what the slots could hold, the largest entries' sizes
            nbytes = sum(sorted((e.nbytes for e in store.entries.values()), reverse=True)[: self.total_slots])
        return {"bytes": nbytes, "bytes_per_s": rate, "seconds": nbytes / rate, "budget_s": self.options.save_timeout}

    def warn_if_save_exceeds_budget(self) -> None:
        estimate = self.save_estimate()
        if estimate and estimate["seconds"] > self.options.save_timeout:
            log.warning(
                "saving the slots (up to %s) takes ~%.1f s at the last measured %s/s, more than --save-timeout %.1f s: "
                "raise --save-timeout, and llama-swap's unloadTimeout (and healthCheckTimeout for swaps) above it",
                fmt_bytes(int(estimate["bytes"])),
                estimate["seconds"],
                fmt_bytes(int(estimate["bytes_per_s"])),
                self.options.save_timeout,
            )


def model_memory(path: str | None) -> ModelMemory | None:
    """The model's memory kind from its GGUF header, or None (one line) when it cannot be read."""
    if not path:
        return None
    try:
        return read_model_memory(path)
    except (ModelInfoError, OSError) as exc:
        log.debug("model memory of %s unknown: %s", path, exc)
        return None
