"""The lifecycle, as one linear script: start → restore → serve → drain → save → stop.

One owner of the state (`Daemon.set_state` logs every transition). Signal handlers only set events: the
first SIGTERM/SIGINT asks for a graceful stop, a second one forces it (no save). Every wait has a named
timeout and logs when it gives up.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import os
import signal
import socket
import time
from functools import partial
from typing import Any

from .chat.attribution import AttributionFilter
from .cmdline import misplaced_own_options
from .config import RunConfig
from .early import EarlyReads
from .idlesaves import Activity, IdleSaves
from .llama.client import LlamaClient
from .llama.policy import CachePolicy
from .llama.sleep import POLL_S, ChildSleep, save_after
from .llama.supervisor import ChildProcess
from .log import MODEL, describe_error, fmt_bytes, fmt_ms, log
from .metrics import Metrics
from .model import Model, open_model, read_server_facts
from .proxy.hook import CompletionHook
from .proxy.messages import Reply
from .proxy.server import Gate, Proxy
from .router import Router
from .store.layout import SNAPSHOTS_DIR
from .store.prescan import Prescan
from .store.scan import remove_transients

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


# The lifecycle's only ways on, as llama-swap's process.go checks its own: a signal, the child's exit or an
# error may end any state early (STOPPING: a forced stop; STOPPED: the run's end), and nothing comes back.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.RESTORING, State.STOPPING, State.STOPPED}),
    State.RESTORING: frozenset({State.READY, State.STOPPING, State.STOPPED}),
    State.READY: frozenset({State.DRAINING, State.STOPPING, State.STOPPED}),
    State.DRAINING: frozenset({State.SAVING, State.STOPPING, State.STOPPED}),
    State.SAVING: frozenset({State.STOPPING, State.STOPPED}),
    State.STOPPING: frozenset({State.STOPPED}),
    State.STOPPED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A state change the lifecycle does not allow: a bug, said in one line (the run then stops)."""


class Race(enum.Enum):
    """Which came first in `Daemon._race`."""

    DONE = "done"
    INTERRUPTED = "interrupted"
    CHILD_EXITED = "child exited"
    TIMEOUT = "timeout"


class Daemon:
    """Owns the child, the public server and the model's state for one run."""

    def __init__(self, config: RunConfig, child: ChildProcess, early_signals: list[int], reads: EarlyReads) -> None:
        self.config = config
        self.options = config.options
        self.child = child
        self.state = State.STARTING
        self.started_at = child.started_at  # the spawn: imports and the model load overlap from here
        self.healthy_at: float | None = None
        self.signals_received = 0
        self._early_signals = early_signals
        self._reads = reads  # started at the spawn (cli.run)
        self.stop_requested = asyncio.Event()
        self.force_requested = asyncio.Event()
        self.metrics = Metrics(state=lambda: self.state.value)
        self.model: Model | None = None  # once restore() opened it
        self.router: Router | None = None  # llama-server runs as a router: a Model per model it loads
        self._autosave: asyncio.Future[None] | None = None
        self._sleep_watch: asyncio.Future[None] | None = None

    def set_state(self, state: State) -> None:
        """The one writer of the state: every change is checked against TRANSITIONS and logged; setting the
        current state again changes nothing."""
        if state is self.state:
            return
        if state not in TRANSITIONS[self.state]:
            raise InvalidTransition(f"state {self.state.value} cannot become {state.value}")
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
        from .exposition import render  # at the first scrape: its table of families is not on the start-up path

        body, content_type = render(self.metrics)
        return Reply(200, body, content_type)

    async def status(self) -> Reply:
        """GET /slotkeeper/status: which slot holds which chat, what the store holds, what a stop must write."""
        model = self.model
        return Reply.json(
            {
                "state": self.state.value,
                "child_pid": self.child.pid,
                "uptime_s": round(time.monotonic() - self.started_at, 3),
                "save_dir": str(self.config.save_dir),
                "total_slots": 0 if model is None else model.facts.n_slots,
                "placement": self.options.placement,
                "router": self.router is not None,
                "attribution_lines_dropped": self.metrics.attribution_lines_dropped(),
                "models": None if self.router is None else self.router.status(),
                **(self._starting_status() if model is None else model.status()),
                "save_estimate": self.save_estimate(),
            }
        )

    def _starting_status(self) -> dict[str, Any]:
        """The model's part of the status before its store is open."""
        forced = self.options.model_memory
        memory = {
            "architecture": None,
            "kind": None if forced == "auto" else forced,
            "sliding_window": None,
            "policy": CachePolicy.EXTEND_ONLY.value,
        }
        counters = self.metrics.status()
        return {
            "model_memory": memory,
            "fingerprint": None,
            "slots": [],
            "store": None,
            **counters,
            "openings": {"entries": 0, **counters["openings"]},
            "remote": None,
        }

    # ---- the script ----------------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for handled in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(handled, self.on_signal, handled)
        for signum in self._early_signals:
            self.on_signal(signum)
        loop.set_exception_handler(self.on_loop_error)
        child_exited = self.child.watch(loop)
        startup_deadline = self.started_at + self.options.startup_timeout
        gate = Gate()
        proxy = Proxy(self.child.endpoint, gate, lambda: self.state.value, startup_deadline, self.config.api_keys)
        client = LlamaClient(proxy.pool, self.config.api_key)
        proxy.own_routes["/slotkeeper/status"] = self.status
        proxy.own_routes["/slotkeeper/metrics"] = self.metrics_endpoint
        self.metrics.requests_in_flight = lambda: len(proxy.in_flight)
        self.metrics.requests_by_status = lambda: dict(proxy.status_counts)
        try:
            if not await self.listen(proxy):
                gate.close()
                self.child.kill_now()  # it has served nothing: stopped at once, as llama-server exits on its own
                return EXIT_STARTUP_FAILED
            code = await self.startup(client, child_exited, startup_deadline)
            if code is not None:
                gate.close()
                return code
            proxy.hook = self.completion_hook()
            gate.open()
            # What start-up built since the prescan's freeze (cli.collect_from_now_on: the store's open, the loop)
            # lives as long as the process: moved out of the collector's sight, a full collection no longer walks
            # it while requests are proxied.
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
            code = await self.serve(proxy, client, child_exited)
            if code is not None:
                proxy.accepting = False
                return code
            return await self.shutdown(proxy, client, child_exited)
        finally:
            proxy.accepting = False
            for background in (self._autosave, self._sleep_watch):
                if background is not None:
                    background.cancel()
            for model in self.kept():
                await model.stop_recompute()
            if not child_exited.done():
                await self.child.stop(self.options.stop_timeout)
            self.set_state(State.STOPPED)
            await proxy.stop_listening()
            proxy.close()

    async def listen(self, proxy: Proxy) -> bool:
        """Public sockets open early so health checks see 503 (not connection refused) while loading. False,
        after one line naming the address and why, when one cannot be opened (a port taken, a host that does not
        resolve): a user's mistake, which plain llama-server also reports in one line and exit code 1."""
        for host in self.config.hosts:
            try:
                name = await proxy.listen(host, self.config.port)
            except OSError as exc:  # (socket.gaierror too)
                where = host if host.endswith(".sock") else f"{host}:{self.config.port}"
                why = exc.strerror if isinstance(exc, socket.gaierror) or not exc.errno else os.strerror(exc.errno)
                log.error("cannot listen on %s: %s", where, why or exc)
                return False
            log.info("listening on %s; llama-server on %s", name, self.child.endpoint.describe())
        return True

    async def _race(
        self,
        awaitable: Any,
        interrupt: asyncio.Event,
        child_exited: asyncio.Future[int] | None = None,
        deadline: float | None = None,
    ) -> tuple[Race, Any]:
        """Wait for `awaitable`, the interrupting event, the child's exit, or the deadline; say which came first.

        Returns (DONE, result), or (INTERRUPTED | CHILD_EXITED | TIMEOUT, None) after the unfinished work has
        been cancelled and has run its cleanup.
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
            return Race.DONE, work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        if interrupted in done:
            return Race.INTERRUPTED, None
        if child_exited is not None and child_exited in done:
            return Race.CHILD_EXITED, None
        return Race.TIMEOUT, None

    async def startup(self, client: LlamaClient, child_exited: asyncio.Future[int], deadline: float) -> int | None:
        """Wait for the child's health, then restore. Returns an exit code when startup ends the run.

        A stop cancels the restore (no further entry is restored; nothing changed, so nothing is saved), but
        the slot action already under way runs to its end, for up to --stop-timeout, before llama-server is
        signalled: it honours SIGTERM only after the action, and would otherwise be SIGKILLed."""
        outcome, _ = await self._race(self.wait_healthy(client), self.stop_requested, child_exited, deadline)
        if outcome is Race.DONE:
            self.set_state(State.RESTORING)
            restore = self.restore(client)
            outcome, _ = await self._race(restore, self.stop_requested, child_exited, deadline)
        if outcome is Race.DONE:
            return None
        if outcome is Race.CHILD_EXITED:
            code = child_exited.result()
            misplaced = misplaced_own_options(self.config.child_args) if code else []
            hint = f"; {' and '.join(misplaced)}: slotkeeper's own, given before a --" if misplaced else ""
            log.error("llama-server exited with code %d during startup (its own output above says why)%s", code, hint)
            return code or EXIT_STARTUP_FAILED
        if outcome is Race.INTERRUPTED:
            busy = client.busy_with()
            after = f" once its slot {busy} under way ends (up to {self.options.stop_timeout:g} s)" if busy else ""
            log.info("stop requested during %s: stopping llama-server without saving%s", self.state.value, after)
            outcome, _ = await self._race(
                client.until_idle(time.monotonic() + self.options.stop_timeout), self.force_requested, child_exited
            )
            if outcome is Race.INTERRUPTED:
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
            except OSError:  # the socket not there yet, or refused while the model loads (ConnectionError)
                pass
            await asyncio.sleep(HEALTH_POLL_S)

    async def restore(self, client: LlamaClient) -> None:
        """Open the model's state (its store, placement, shared tier), then restore its most recent chats."""
        reads = self._reads  # read while llama-server loaded the model (early.py)
        facts = await read_server_facts(
            self.config, client, asyncio.wrap_future(reads.identity), asyncio.wrap_future(reads.memory)
        )
        try:
            scanned: Prescan | None = await asyncio.wrap_future(reads.scanned)
        except OSError:  # the store's open reads it again, and says why it cannot
            scanned = None
        if facts.router:
            self.router = Router(self.config, client, self.metrics)
            remove_transients(self.config.save_dir / SNAPSHOTS_DIR)  # (the models' stores share it)
            log.info(
                "llama-server runs as a router (a child per model: --models-dir or --models-preset): slotkeeper "
                "loads and unloads the models itself (--models-max %d), saving each one's chats first",
                self.config.models_max,
            )
            return
        model = self.model = await open_model(self.config, client, facts, self.metrics, scanned=scanned)
        if self.options.placement or model.policy is CachePolicy.PREFIX:
            await model.placement.restore_recent()
            model.plan_recompute()
        else:  # nothing would keep a request that diverges inside a restored state off its slot
            log.warning("--no-placement on a model whose restored states only extend: nothing is restored or saved")

    async def serve(self, proxy: Proxy, client: LlamaClient, child_exited: asyncio.Future[int]) -> int | None:
        """Until a stop request, autosaving when idle (and watching llama-server's own sleep, with
        --sleep-idle-seconds); returns the child's exit code if it dies first."""
        sleep_s = self.config.child_sleeps_after
        if sleep_s is not None:
            self._sleep_watch = asyncio.ensure_future(self.watch_sleep(proxy))
            log.info(
                "llama-server sleeps after %d s idle (--sleep-idle-seconds): changed chats are saved after %g s idle, "
                "and come back from the store once it has slept",
                sleep_s,
                self.idle_save_after(),
            )
        if self.model is not None:
            self.model.start_recompute(lambda: not proxy.upstream_in_flight())
        saving = (self.model is not None or self.router is not None) and self.idle_save_after() > 0
        autosave = asyncio.ensure_future(self.autosave_loop(proxy)) if saving else None
        self._autosave = autosave
        outcome, _ = await self._race(asyncio.Event().wait(), self.stop_requested, child_exited)
        if outcome is Race.CHILD_EXITED:
            if autosave is not None:
                autosave.cancel()
            code = child_exited.result()
            log.error("llama-server exited with code %d while serving; exiting", code)
            return code
        return None

    async def autosave_loop(self, proxy: Proxy) -> None:
        """Save each model's changed chats once it has been idle for --autosave-idle (idlesaves.py), in the
        background: a cache saved while idle survives a crash, a SIGKILL or llama-server's own sleep, and leaves
        little for the stop-time save. Each model saves apart, so one's save never waits for another's work; a
        failed save (one line) is tried again while idle, and this loop ends only with the run."""
        schedule = IdleSaves(idle_s=self.idle_save_after())
        saving: dict[str, asyncio.Future[None]] = {}
        woken = asyncio.Event()  # a save ended: its retry, if any, is due on its own clock

        def saved(name: str, _: asyncio.Future[None]) -> None:
            saving.pop(name, None)
            woken.set()

        try:
            while not self.stop_requested.is_set():
                now = time.monotonic()
                wake = now + schedule.idle_s  # no save can come due before: a request ending now is due then
                for model in self.idle_saved():
                    activity = self.activity(proxy, model)
                    due = None if model.name in saving else schedule.due(model.name, activity)
                    if due is None:
                        continue
                    if due > now:
                        wake = min(wake, due)
                        continue
                    schedule.started(model.name, activity)
                    saving[model.name] = asyncio.ensure_future(self.idle_save(model, schedule))
                    saving[model.name].add_done_callback(partial(saved, model.name))
                woken.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), max(wake - time.monotonic(), 0.01))
        finally:
            for task in saving.values():
                task.cancel()
            await asyncio.gather(*saving.values(), return_exceptions=True)

    async def idle_save(self, model: Model, schedule: IdleSaves) -> None:
        """One model's idle save; what it leaves behind is tried again (one line if it failed)."""
        token = MODEL.set(model.name)
        try:
            try:
                await self.save_model(model, "idle", None, live=True)
                failed = None
            except Exception as exc:  # noqa: BLE001 - one line, and the saves go on (never CancelledError)
                failed = describe_error(exc)
            left = failed is not None or any(not slot.busy for slot in model.placement.dirty_slots())
            retry_s = schedule.ended(model.name, left_changes=left, now=time.monotonic())
            if failed is not None:  # else the slot's own line said why it was not saved
                log.warning("idle autosave failed: %s; retrying in %g s", failed, retry_s)
        finally:
            MODEL.reset(token)

    def idle_saved(self) -> list[Model]:
        """The models an idle save may write: the one, or each one a router keeps loaded (one being put away
        is saved by that)."""
        if self.router is not None:
            return list(self.router.models.values())
        return [] if self.model is None else [self.model]

    def activity(self, proxy: Proxy, model: Model) -> Activity:
        """The model's own requests: a router's, per model; with one model, every request that makes
        llama-server work."""
        if self.router is not None:
            return self.router.activity(model.name)
        return Activity(in_flight=proxy.working, last_end=proxy.last_activity, requests=proxy.work_total)

    async def watch_sleep(self, proxy: Proxy) -> None:
        """Until cancelled: learn when each model's llama-server falls asleep and wakes (llama/sleep.py), asking
        once a second while nothing runs."""
        while True:
            await asyncio.sleep(POLL_S)
            for model in self.kept():
                sleep = model.sleep
                if (
                    sleep is None
                    or sleep.clock.running
                    or model.placement.busy()
                    or self.activity(proxy, model).in_flight
                ):
                    continue  # (its own work only: a router's other models keep it from nothing)
                token = MODEL.set(model.name)
                try:
                    await sleep.asleep_now()
                finally:
                    MODEL.reset(token)

    def idle_save_after(self) -> float:
        """The idle seconds after which changed slots are saved (0: never): --autosave-idle, but always before
        llama-server's own sleep."""
        sleep_s = self.config.child_sleeps_after
        return self.options.autosave_idle if sleep_s is None else save_after(sleep_s, self.options.autosave_idle)

    def kept(self) -> list[Model]:
        """The models whose chats slotkeeper keeps: the one, or each one a router has loaded."""
        if self.router is not None:
            return self.router.kept()
        return [] if self.model is None else [self.model]

    async def save_changed(self, why: str, deadline: float | None, *, live: bool = False) -> tuple[int, int]:
        """Write every changed slot back into its model's store, then keep each store within its cap."""
        saved = attempted = 0
        for model in self.kept():
            token = MODEL.set(model.name)
            try:
                one, tried = await self.save_model(model, why, deadline, live=live)
            finally:
                MODEL.reset(token)
            saved, attempted = saved + one, attempted + tried
        return saved, attempted

    async def save_model(self, model: Model, why: str, deadline: float | None, *, live: bool) -> tuple[int, int]:
        """Write one model's changed slots back into its store, then keep it within its cap."""
        if model.sleep is not None and await model.sleep.asleep_now():
            return 0, 0  # every slot is empty, and a slot read or a save would wake it
        placement = model.placement
        if not self.options.placement:
            await placement.note_unplaced_changes(self.config.slots_endpoint)
        counts = await placement.save_dirty(why, deadline, live=live)
        model.store.evict_over_cap(placement.held_entries())
        return counts

    async def shutdown(self, proxy: Proxy, client: LlamaClient, child_exited: asyncio.Future[int]) -> int:
        """Drain, save what changed inside the budget, stop the child. A second signal skips the rest of the save."""
        budget_end = time.monotonic() + self.options.save_timeout
        self.set_state(State.DRAINING)
        proxy.accepting = False
        for model in self.kept():
            await model.stop_recompute()
            model.placement.stop_settling()
        if await self.drain(proxy) is Race.INTERRUPTED:
            return await self.stop_forced()
        self.set_state(State.SAVING)
        if self._autosave is not None:
            self._autosave.cancel()
            await asyncio.gather(self._autosave, return_exceptions=True)
        outcome, counts = await self._race(self.save_at_stop(budget_end), self.force_requested, child_exited)
        if outcome is Race.INTERRUPTED:
            return await self.stop_forced()
        if outcome is Race.CHILD_EXITED:
            log.error("llama-server exited with code %d while saving", child_exited.result())
        elif client.running:  # e.g. the restore of a request the drain cancelled: llama-server finishes it first
            log.info(
                "llama-server is busy with a slot %s: it is stopped once that ends (inside --save-timeout)",
                client.busy_with(),
            )
            outcome, _ = await self._race(client.until_idle(budget_end), self.force_requested, child_exited)
            if outcome is Race.INTERRUPTED:
                return await self.stop_forced()
        self.set_state(State.STOPPING)
        kept = self.kept()
        await asyncio.gather(*(self.settle_store(model) for model in kept), self.child.stop(self.options.stop_timeout))
        if counts and counts[1]:
            log.info("saved %d of %d changed slot(s)", *counts)
        for model in kept:
            if model.remote is None:
                continue
            try:  # uploads may use what is left of the budget, never more
                await model.remote.close(budget_end)
            except Exception as exc:  # noqa: BLE001 - the journal keeps what was not uploaded; the stop goes on
                log.warning(
                    "remote: closing failed: %s; the uploads not done resume at the next start", describe_error(exc)
                )
        return EXIT_OK

    async def drain(self, proxy: Proxy) -> Race:
        """Let running requests finish (--drain-timeout, inside --save-timeout), then cancel what is left;
        INTERRUPTED when a second signal came meanwhile."""
        drain = min(self.options.drain_timeout, self.options.save_timeout)
        outcome, idle = await self._race(proxy.wait_idle(drain), self.force_requested)
        if not idle:
            cancelled = proxy.cancel_in_flight()
            if outcome is not Race.INTERRUPTED:
                log.warning("%d request(s) still running after %.1f s (--drain-timeout); cancelled", cancelled, drain)
            await proxy.wait_idle(1.0)
        return outcome

    async def settle_store(self, model: Model) -> None:
        """The store's files as the run leaves them: manifest updates written, then the manifest cache (while
        llama-server exits: the next start reads one file; written once ready instead, it slowed the first
        requests)."""
        await model.store.flush()
        await model.store.write_cache()

    async def stop_forced(self) -> int:
        """A second signal: no (more) saving; the child gets FORCED_STOP_TIMEOUT_S after SIGTERM."""
        self.set_state(State.STOPPING)
        await self.child.stop(min(self.options.stop_timeout, FORCED_STOP_TIMEOUT_S))
        for model in self.kept():
            await model.store.flush()
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
        asleep = [m for m in self.kept() if m.sleep is not None and m.sleep.state is ChildSleep.ASLEEP]
        if not counts[1] and asleep and len(asleep) == len(self.kept()):
            log.info("llama-server is asleep, its slots empty: nothing to save")
        elif not counts[1]:
            log.info("no slot changed since its cache was written; nothing to save")
        return counts

    def completion_hook(self) -> CompletionHook | None:
        """What completion requests go through: the router or placement (unless --no-placement), behind the
        attribution filter (unless --keep-attribution-line)."""
        inner: CompletionHook | None = None
        if self.router is not None:
            inner = self.router
        elif self.options.placement and self.model is not None:
            inner = self.model.placement
        if self.options.keep_attribution_line:
            return inner
        hook = AttributionFilter(inner)
        self.metrics.attribution_lines_dropped = lambda: hook.dropped
        return hook

    def save_estimate(self) -> dict[str, float] | None:
        """What the stop-time save must write (a restore at start marks its slot used too: "served" means a
        request was placed)."""
        if self.model is None:
            return None
        served = self.state is State.READY and any(self.metrics.placements.values())
        return self.model.save_estimate(served, self.options.save_timeout)

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
