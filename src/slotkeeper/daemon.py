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
from .fingerprint import build_fingerprint, model_identity
from .llama_client import LlamaClient
from .log import fmt_bytes, fmt_ms, log
from .metrics import Metrics
from .proxy import Gate, Proxy, Reply
from .slots import SlotStore, evict_over_cap, read_manifest
from .supervisor import ChildProcess

HEALTH_POLL_S = 0.01
EXIT_OK = 0
EXIT_FORCED = 1
EXIT_STARTUP_FAILED = 1
FORCED_STOP_TIMEOUT_S = 0.5  # a second signal: the child gets this long after SIGTERM before SIGKILL


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
        self.store: SlotStore | None = None
        self._autosave: asyncio.Future[None] | None = None
        self.metrics = Metrics(state=lambda: self.state.value)
        self._identity: asyncio.Future[dict[str, Any]] | None = None

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

    async def metrics_endpoint(self) -> Reply:
        """GET /slotkeeper/metrics: Prometheus text exposition."""
        body, content_type = self.metrics.render()
        return Reply(200, body, content_type)

    async def status(self) -> Reply:
        """GET /slotkeeper/status: is the cache back, and what is on disk."""
        slots: dict[str, dict[str, Any]] = {}
        if self.store is not None:
            dirty: set[int] = set()
            if self.state is State.READY and self.config.slots_endpoint:
                dirty = {slot_id for slot_id, _ in await self.store.dirty_slots(self.total_slots, True)}
            for info in self.store.slots.values():
                entry = {k: v for k, v in vars(info).items() if k not in ("slot_id", "saved_task") and v is not None}
                entry["dirty"] = info.slot_id in dirty
                slots[str(info.slot_id)] = entry
        return Reply.json({
            "state": self.state.value,
            "child_pid": self.child.pid,
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "save_dir": str(self.config.save_dir),
            "total_slots": self.total_slots,
            "fingerprint": None if self.store is None else self.store.fingerprint,
            "slots": slots,
            "save_estimate": self.save_estimate(),
        })

    # ---- the script ----------------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)
        for sig in self._early_signals:
            self.on_signal(sig)
        child_exited = self.child.watch(loop)
        # Hash the model file while llama-server loads it (hashlib releases the GIL): ready for the restore.
        self._identity = asyncio.ensure_future(asyncio.to_thread(model_identity, self.config.model))
        startup_deadline = self.started_at + self.options.startup_timeout
        gate = Gate()
        proxy = Proxy(self.child.endpoint, gate, lambda: self.state.value, startup_deadline)
        client = LlamaClient(proxy.pool, self.config.api_key)
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
            gate.open()
            # What start-up built (modules, pydantic models, the loop) lives as long as the process: moved out
            # of the collector's sight, a full collection no longer walks it while requests are proxied.
            gc.freeze()
            self.set_state(State.READY)
            now = time.monotonic()
            log.info(
                "ready %s after starting llama-server (pid %d; it answered healthy at %s, restore took %s)",
                fmt_ms(now - self.started_at), self.child.pid, fmt_ms((self.healthy_at or now) - self.started_at),
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
        """Wait for the child's health, then restore. Returns an exit code when startup ends the run."""
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
            log.info("stop requested during %s: stopping llama-server without saving", self.state.value)
            return EXIT_OK
        log.error("startup timed out after %.0f s (--startup-timeout) in state %s", self.options.startup_timeout, self.state.value)
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
            log.warning(
                "GET /props answered %d (%s); assuming %d slot(s)", props.status, props.error, self.total_slots
            )
        n_ctx = body.get("default_generation_settings", {}).get("n_ctx")
        model = body.get("model_path") or self.config.model
        assert self._identity is not None
        identity = await self._identity
        if model and identity.get("model") != str(Path(model).resolve()):  # e.g. -hf: /props names the file
            identity = await asyncio.to_thread(model_identity, model)
        fingerprint = build_fingerprint(identity, self.config.child_args, self.total_slots, n_ctx)
        self.store = SlotStore(
            self.config.save_dir, client, fingerprint,
            fsync=self.options.fsync, restore_unverified=self.options.restore_unverified, metrics=self.metrics,
        )
        self.store.recover()
        log.info("%d slot(s); caches in %s", self.total_slots, self.config.save_dir)
        await self.store.restore_all(self.total_slots)

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

        A cache saved while idle survives a crash or a SIGKILL, and leaves little for the stop-time save.
        """
        assert self.store is not None
        idle_s = self.options.autosave_idle
        seen = proxy.requests_total
        while not self.stop_requested.is_set():
            quiet = time.monotonic() - proxy.last_activity
            if proxy.in_flight or proxy.requests_total == seen or quiet < idle_s:
                await asyncio.sleep(max(idle_s - quiet, 0.2) if not proxy.in_flight else idle_s)
                continue
            seen = proxy.requests_total
            outcomes = await self.store.save_dirty(self.total_slots, self.config.slots_endpoint, None)
            if outcomes:
                self.enforce_cache_cap()

    def enforce_cache_cap(self) -> None:
        if self.options.max_cache_bytes:
            evict_over_cap(self.config.save_dir, int(self.options.max_cache_bytes))

    async def shutdown(self, proxy: Proxy, child_exited: asyncio.Future[int]) -> int:
        """Drain, save what changed inside the budget, stop the child. A second signal skips the rest of the save."""
        budget_end = time.monotonic() + self.options.save_timeout
        self.set_state(State.DRAINING)
        proxy.accepting = False
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
        outcome, attempted = await self._race(self.save_at_stop(budget_end), self.force_requested, child_exited)
        if self._autosave is not None:
            self._autosave.cancel()
        if outcome == "interrupted":
            return await self.stop_forced()
        self.set_state(State.STOPPING)
        if outcome == "child_exited":
            log.error("llama-server exited with code %d while saving", child_exited.result())
        # Saved files are complete once llama-server has answered: fsync and rename them while it exits.
        committed, _ = await asyncio.gather(self.store.flush(), self.child.stop(self.options.stop_timeout))
        if attempted:
            log.info("saved %d of %d changed slot(s)", sum(o.saved for o in committed), len(attempted))
        self.enforce_cache_cap()
        return EXIT_OK

    async def stop_forced(self) -> int:
        """A second signal: no (more) saving; the child gets FORCED_STOP_TIMEOUT_S after SIGTERM."""
        self.set_state(State.STOPPING)
        await self.child.stop(min(self.options.stop_timeout, FORCED_STOP_TIMEOUT_S))
        if self.store is not None:
            await self.store.flush()  # files llama-server had already finished: cheap to keep
        return EXIT_FORCED

    async def save_at_stop(self, budget_end: float) -> list[Any]:
        assert self.store is not None
        remaining = budget_end - time.monotonic()
        try:
            outcomes = await asyncio.wait_for(
                self.store.save_dirty(self.total_slots, self.config.slots_endpoint, budget_end, overlap_commits=True),
                max(remaining, 0.0),
            )
        except TimeoutError:
            log.warning("the save budget (--save-timeout %.1f s) ran out; slots not saved yet keep their previous file",
                        self.options.save_timeout)
            return []
        if not outcomes:
            log.info("no slot changed since its cache was written; nothing to save")
        return outcomes

    def save_estimate(self) -> dict[str, float] | None:
        """What saving every cache in the directory would take, at the speed the last saves measured."""
        manifests = [m for m in (read_manifest(p) for p in self.config.save_dir.glob("*.json")) if m]
        timed = [(m["bytes"], m["save_ms"]) for m in manifests if m.get("save_ms") and m.get("bytes")]
        if not timed:
            return None
        rate = sum(b for b, _ in timed) / (sum(ms for _, ms in timed) / 1000)  # bytes per second
        total = sum(int(m.get("bytes", 0)) for m in manifests)
        return {"bytes": total, "bytes_per_s": rate, "seconds": total / rate, "budget_s": self.options.save_timeout}

    def warn_if_save_exceeds_budget(self) -> None:
        estimate = self.save_estimate()
        if estimate and estimate["seconds"] > self.options.save_timeout:
            log.warning(
                "saving these caches (%s) takes ~%.1f s at the last measured %s/s, more than --save-timeout %.1f s: "
                "raise --save-timeout, and llama-swap's unloadTimeout (and healthCheckTimeout for swaps) above it",
                fmt_bytes(int(estimate["bytes"])), estimate["seconds"], fmt_bytes(int(estimate["bytes_per_s"])),
                self.options.save_timeout,
            )
