"""The lifecycle, as one linear script: start → restore → serve → drain → save → stop.

One owner of the state (`Daemon.set_state` logs every transition). Signal handlers only set events: the
first SIGTERM/SIGINT asks for a graceful stop, a second one forces it (no save). Every wait has a named
timeout and logs when it gives up.
"""

from __future__ import annotations

import asyncio
import enum
import signal
import time
from typing import Any

from aiohttp import web

from .config import RunConfig
from .fingerprint import build_fingerprint
from .llama_client import LlamaClient, make_session
from .log import fmt_ms, log
from .proxy import Gate, Proxy
from .slots import SlotStore
from .supervisor import ChildProcess

HEALTH_POLL_S = 0.01
EXIT_OK = 0
EXIT_FORCED = 1
EXIT_STARTUP_FAILED = 1


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
        self.started_at = time.monotonic()
        self.total_slots = 0
        self.signals_received = 0
        self._early_signals = early_signals
        self.stop_requested = asyncio.Event()
        self.force_requested = asyncio.Event()
        self.store: SlotStore | None = None

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

    async def status(self, _request: web.Request) -> web.Response:
        """GET /slotkeeper/status: is the cache back, and what is on disk."""
        slots = {} if self.store is None else {
            str(info.slot_id): {k: v for k, v in vars(info).items() if k != "slot_id" and v is not None}
            for info in self.store.slots.values()
        }
        return web.json_response({
            "state": self.state.value,
            "child_pid": self.child.pid,
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "save_dir": str(self.config.save_dir),
            "total_slots": self.total_slots,
            "fingerprint": None if self.store is None else self.store.fingerprint,
            "slots": slots,
        })

    # ---- the script ----------------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)
        for sig in self._early_signals:
            self.on_signal(sig)
        child_exited = self.child.watch(loop)
        startup_deadline = self.started_at + self.options.startup_timeout
        session = make_session(self.child.endpoint)
        client = LlamaClient(session, self.config.api_key)
        gate = Gate()
        proxy = Proxy(session, gate, lambda: self.state.value, startup_deadline)
        proxy.own_routes["/slotkeeper/status"] = self.status
        runner = web.AppRunner(build_app(proxy), handler_cancellation=True, access_log=None)
        try:
            await runner.setup()
            await self.listen(runner)
            code = await self.startup(client, child_exited, startup_deadline)
            if code is not None:
                gate.close()
                return code
            gate.open()
            self.set_state(State.READY)
            log.info("ready in %s (pid %d)", fmt_ms(time.monotonic() - self.started_at), self.child.pid)
            code = await self.serve(child_exited)
            if code is not None:
                proxy.accepting = False
                return code
            return await self.shutdown(proxy, client, child_exited)
        finally:
            proxy.accepting = False
            if not child_exited.done():
                await self.child.stop(self.options.stop_timeout)
            self.set_state(State.STOPPED)
            await runner.cleanup()
            await session.close()

    async def listen(self, runner: web.AppRunner) -> None:
        """Public sockets open early so health checks see 503 (not connection refused) while loading."""
        for host in self.config.hosts:
            if host.endswith(".sock"):
                site: web.BaseSite = web.UnixSite(runner, host)
            else:
                site = web.TCPSite(runner, host, self.config.port, reuse_address=True)
            await site.start()
            log.info("listening on %s; llama-server on %s", site.name, self.child.endpoint.describe())

    async def _until(self, awaitable: Any, child_exited: asyncio.Future[int], deadline: float | None) -> str:
        """Wait for `awaitable`, the child's exit, a stop request, or the deadline; say which came first."""
        work = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self.stop_requested.wait())
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            done, _ = await asyncio.wait({work, stop, child_exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if work in done:
            work.result()
            return "done"
        work.cancel()
        if child_exited in done:
            return "child_exited"
        if stop in done:
            return "stopped"
        return "timeout"

    async def startup(self, client: LlamaClient, child_exited: asyncio.Future[int], deadline: float) -> int | None:
        """Wait for the child's health, then restore. Returns an exit code when startup ends the run."""
        outcome = await self._until(self.wait_healthy(client), child_exited, deadline)
        if outcome == "done":
            self.set_state(State.RESTORING)
            outcome = await self._until(self.restore(client), child_exited, deadline)
        if outcome == "done":
            return None
        if outcome == "child_exited":
            code = child_exited.result()
            log.error("llama-server exited with code %d during startup (its own output above says why)", code)
            return code or EXIT_STARTUP_FAILED
        if outcome == "stopped":
            log.info("stop requested during %s: stopping llama-server without saving", self.state.value)
            return EXIT_OK
        log.error("startup timed out after %.0f s (--startup-timeout) in state %s", self.options.startup_timeout, self.state.value)
        return EXIT_STARTUP_FAILED

    async def wait_healthy(self, client: LlamaClient) -> None:
        while True:
            try:
                if (await client.health()).ok:
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
        fingerprint = await asyncio.to_thread(
            build_fingerprint, model, self.config.child_args, self.total_slots, n_ctx
        )
        self.store = SlotStore(
            self.config.save_dir, client, fingerprint,
            fsync=self.options.fsync, restore_unverified=self.options.restore_unverified,
        )
        self.store.recover()
        log.info("%d slot(s); caches in %s", self.total_slots, self.config.save_dir)
        await self.store.restore_all(self.total_slots)

    async def serve(self, child_exited: asyncio.Future[int]) -> int | None:
        """Until a stop request; returns the child's exit code if it dies first."""
        outcome = await self._until(asyncio.Event().wait(), child_exited, None)
        if outcome == "child_exited":
            code = child_exited.result()
            log.error("llama-server exited with code %d while serving; exiting", code)
            return code
        return None

    async def shutdown(self, proxy: Proxy, client: LlamaClient, child_exited: asyncio.Future[int]) -> int:
        """Drain, save what changed inside the budget, stop the child. A second signal skips the rest of the save."""
        budget_end = time.monotonic() + self.options.save_timeout
        self.set_state(State.DRAINING)
        proxy.accepting = False
        drain = min(self.options.drain_timeout, self.options.save_timeout)
        if not await proxy.wait_idle(drain):
            cancelled = proxy.cancel_in_flight()
            log.warning("%d request(s) still running after %.1f s (--drain-timeout); cancelled", cancelled, drain)
            await proxy.wait_idle(1.0)
        if self.force_requested.is_set():
            return EXIT_FORCED
        self.set_state(State.SAVING)
        assert self.store is not None
        save = asyncio.ensure_future(self._save_dirty(budget_end))
        force = asyncio.ensure_future(self.force_requested.wait())
        done, _ = await asyncio.wait({save, force, child_exited}, return_when=asyncio.FIRST_COMPLETED)
        force.cancel()
        if save not in done:
            save.cancel()
            await asyncio.gather(save, return_exceptions=True)
        self.set_state(State.STOPPING)
        if force in done:
            await self.child.stop(min(self.options.stop_timeout, 0.5))
            return EXIT_FORCED
        if child_exited.done() and save not in done:
            log.error("llama-server exited with code %d while saving", child_exited.result())
        await self.child.stop(self.options.stop_timeout)
        return EXIT_OK

    async def _save_dirty(self, budget_end: float) -> None:
        assert self.store is not None
        targets = await self.store.dirty_slots(self.total_slots, self.config.slots_endpoint)
        if not targets:
            log.info("no slot changed since its cache was written; nothing to save")
            return
        started = time.monotonic()
        outcomes = await self.store.save_slots(targets, budget_end)
        saved = [o for o in outcomes if o.saved]
        log.info("saved %d of %d slot(s) in %s", len(saved), len(targets), fmt_ms(time.monotonic() - started))


def build_app(proxy: Proxy) -> web.Application:
    app = web.Application(client_max_size=0)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    return app
