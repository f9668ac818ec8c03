"""Router mode: llama-server with no model of its own starts a child per model (`--models-dir`,
`--models-preset`), and slotkeeper keeps every model's chats as it does for one.

Why slotkeeper decides the unloads: at `--models-max` the router unloads its least recently used model by
itself, and that model's KV caches go unsaved. So slotkeeper runs the router with `--models-max 0` (no limit
of its own), loads a model itself before a request for it goes (when the user's autoload setting allows it),
and before a load that would exceed the user's `--models-max` it saves the least recently used model's
changed slots and unloads it. A client's own `POST /models/unload` goes on after the save. Once a model is
loaded, its most recent chats are restored before its first request goes, as at start.

Each model has its own `model.Model` (fingerprint, store below the save directory, placement); the children
share the router's `--slot-save-path`, so their stores share its snapshots/.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

from .chat.apis import api_of
from .config import RunConfig
from .idlesaves import Activity
from .llama.client import LlamaClient
from .llama.policy import CachePolicy
from .log import MODEL, describe_error, fmt_ms, log
from .metrics import Metrics
from .model import Model, ServerFacts, open_model, read_server_facts
from .proxy.hook import Placed
from .store.layout import MODELS_DIR

MODEL_ACTIONS = frozenset({"/models/load", "/models/unload"})
STATUS_POLL_S = 0.05
LOADED = frozenset({"loaded", "loading"})  # what counts against --models-max
MAX_UNLOADS = 64  # _make_room's bound: each turn unloads one model
UNLOAD_TIMEOUT_S = 60.0


class ModelStatus(NamedTuple):
    """One model's status as the router's GET /models reports it: `value` (`loaded`, `loading`, `unloaded`,
    `sleeping`, ...), and whether its child exited with an error (`failed`, `unloaded` with `exit_code`)."""

    value: str
    failed: bool = False
    exit_code: int | None = None


class LoadFailed(Exception):
    """The router's child for a model exited as it loaded (a file that is no model, too little memory...)."""


def store_dir(save_dir: Path, name: str) -> Path:
    """The model's store directory: its name, made safe as one path component."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".") or "_"
    return save_dir / MODELS_DIR / safe


class Router:
    """The completion hook in router mode, and the one owner of the models slotkeeper keeps."""

    def __init__(self, config: RunConfig, client: LlamaClient, metrics: Metrics) -> None:
        self.config = config
        self.client = client
        metrics.models = lambda: {name: model.metrics for name, model in self.models.items()}
        self.models: OrderedDict[str, Model] = OrderedDict()  # loaded and opened, least recently used first
        self._aliases: dict[str, str] = {}  # a name a request may use -> the model's id
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._using: collections.Counter[str] = collections.Counter()  # per model: its requests not ended yet
        self._requests: collections.Counter[str] = collections.Counter()  # per model: its requests so far
        self._last_end: dict[str, float] = {}  # per model: when its last request ended
        self._leaving: dict[str, Model] = {}  # being saved before an unload (a stop saves them too)
        self._opening: set[asyncio.Future[Model | None]] = set()  # models a client loaded, opened when loaded

    # ---- the proxy's hook ---------------------------------------------------------------------------------

    def wants(self, method: bytes, path: str) -> bool:
        return method == b"POST" and (api_of(path) is not None or path in MODEL_ACTIONS)

    async def place(self, path: str, body: bytes) -> Placed:
        """The request's model made ready (loaded, its chats restored), then its placement. Never raises: what
        cannot be done here is left to the router's own answer."""
        try:
            data = json.loads(body)
            name = data.get("model") if isinstance(data, dict) else None
        except (ValueError, RecursionError):
            return Placed(body)
        if not isinstance(name, str) or not name:
            return Placed(body)  # the router says "model name is missing from the request"
        try:
            if path in MODEL_ACTIONS:
                return await self._model_action(path, name, body)
            model = await self.ready(name)
        except LoadFailed as exc:  # (the router tries it again for this request, and answers its own error)
            log.warning("model %s: %s; the router answers the request", name, exc)
            return Placed(body)
        except Exception as exc:  # noqa: BLE001 - the request goes on as it came; the router answers it
            log.warning("model %s: not made ready (%s); the request goes on as it came", name, describe_error(exc))
            return Placed(body)
        if model is None:
            return Placed(body)
        self._using[model.name] += 1  # (in the step ready() returned it: it is not unloaded until this ends)
        self._requests[model.name] += 1
        token = MODEL.set(model.name)
        try:
            placed = await model.placement.place(path, body)
        except BaseException:
            self._ended(model.name)
            raise
        finally:
            MODEL.reset(token)
        inner = placed.done

        def done(status: int) -> None:
            try:
                if inner is not None:
                    inner(status)
            finally:
                self._ended(model.name)

        return Placed(placed.body, done, placed.observe)

    def _ended(self, model_id: str) -> None:
        self._last_end[model_id] = time.monotonic()
        self._using[model_id] -= 1
        if self._using[model_id] <= 0:
            del self._using[model_id]

    async def _model_action(self, path: str, name: str, body: bytes) -> Placed:
        """A client's own load or unload: the model it unloads is saved first; room is made for the one it
        loads (the least recently used saved and unloaded), and that one is opened once it has loaded."""
        model_id = await self._model_id(name)
        if model_id is None:
            return Placed(body)
        if path == "/models/unload":
            async with self._lock:
                if model_id in self.models:
                    await self._put_away(model_id, "a client unloads it", unload=False)
            return Placed(body)
        async with self._lock:
            await self._make_room(model_id)

        def loaded(status: int) -> None:
            if status == 200:  # opened (and its chats restored) once it has loaded
                task = asyncio.ensure_future(self._ready_quietly(model_id))
                self._opening.add(task)
                task.add_done_callback(self._opening.discard)

        return Placed(body, loaded)

    # ---- models -------------------------------------------------------------------------------------------

    async def ready(self, name: str) -> Model | None:
        """The model a request names, loaded and opened; None when the router should answer it itself (a
        model it does not know, or one not loaded while autoload is off)."""
        model_id = self._aliases.get(name) or await self._model_id(name)
        if model_id is None:
            return None
        if model_id in self.models:
            self.models.move_to_end(model_id)
            return self.models[model_id]
        async with self._lock:
            if model_id in self.models:
                return self.models[model_id]
            known = (await self._statuses()).get(model_id)
            status = known.value if known else None
            if status not in LOADED and not self.config.models_autoload:
                return None
            await self._make_room(model_id)  # (one the router loaded itself counts too)
            if status not in LOADED:
                await self._load(model_id)  # (a model that failed before is tried again, as the router would)
            if status != "loaded":
                reached = await self._until(model_id, {"loaded"}, self.config.options.startup_timeout)
                if reached.failed:
                    raise LoadFailed(
                        f"the router could not load it (its llama-server exited with status {reached.exit_code})"
                    )
            model = await self._open(model_id)
            self.models[model_id] = model
            return model

    async def _ready_quietly(self, model_id: str) -> Model | None:
        """`ready()` for a load a client asked for: nobody awaits it, so its failure is its one line."""
        try:
            return await self.ready(model_id)
        except LoadFailed as exc:
            log.warning("model %s: %s", model_id, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - the model's first request tries again
            log.warning("model %s: not opened after its load (%s)", model_id, describe_error(exc))
            return None

    async def _open(self, model_id: str) -> Model:
        """The loaded model's state: its child's /props and its file, its store; its recent chats restored."""
        token = MODEL.set(model_id)
        try:
            started = time.monotonic()
            client = self.client.for_model(model_id)
            facts: ServerFacts = await read_server_facts(self.config, client, _done({"model": None}), _done(None))
            root = store_dir(self.config.save_dir, model_id)
            root.mkdir(parents=True, exist_ok=True)
            model = await open_model(self.config, client, facts, Metrics(), root)  # (counted apart, labelled)
            model.name = model_id
            if self.config.options.placement or model.policy is CachePolicy.PREFIX:
                await model.placement.restore_recent()
                model.plan_recompute()
                model.start_recompute(lambda: not any(self._using.values()))  # (only while it stays loaded)
            log.info("ready for its first request %s after the router loaded it", fmt_ms(time.monotonic() - started))
            return model
        finally:
            MODEL.reset(token)

    async def _make_room(self, incoming: str) -> None:
        """Before `incoming` loads: while the user's --models-max is reached, the least recently used model is
        unloaded, its changed slots saved first (one the router loaded for a GET, with nothing placed on it,
        is unloaded as it is)."""
        limit = self.config.models_max
        if limit <= 0:
            return
        for _ in range(MAX_UNLOADS):
            loaded = [m for m, state in (await self._statuses()).items() if state.value in LOADED and m != incoming]
            if len(loaded) < limit:
                return
            ours = [m for m in self.models if m != incoming]
            if ours:
                await self._put_away(ours[0], f"model {incoming} loads")
            else:
                await self._unload(loaded[0])

    async def _put_away(self, model_id: str, why: str, *, unload: bool = True) -> None:
        """Once the model's requests have ended (new ones wait for the lock), save its changed slots and its
        store's state, then (`unload`) have the router unload it."""
        model = self._leaving[model_id] = self.models.pop(model_id)
        token = MODEL.set(model_id)
        try:
            await model.stop_recompute()
            deadline = time.monotonic() + self.config.options.drain_timeout
            while (self._using[model_id] or model.placement.busy()) and time.monotonic() < deadline:
                await asyncio.sleep(STATUS_POLL_S)
            if self._using[model_id]:
                log.warning(
                    "%d request(s) still running after %g s (--drain-timeout): unloading it all the same",
                    self._using[model_id],
                    self.config.options.drain_timeout,
                )
            model.placement.stop_settling()
            saved, attempted = await model.placement.save_dirty(f"before it is unloaded: {why}")
            model.store.evict_over_cap(model.placement.held_entries())
            await model.store.flush()
            await model.store.write_cache()
            log.info("unloading (%s): saved %d of %d changed slot(s)", why, saved, attempted)
        finally:
            self._leaving.pop(model_id, None)
            MODEL.reset(token)
        if unload:
            await self._unload(model_id)

    async def _unload(self, model_id: str) -> None:
        reply = await self.client.call_json("POST", "/models/unload", {"model": model_id})
        if not reply.ok:
            log.warning("model %s: the router did not unload it: %s", model_id, reply.error)
            return
        await self._until(model_id, {"unloaded"}, UNLOAD_TIMEOUT_S)

    async def _load(self, model_id: str) -> None:
        reply = await self.client.call_json("POST", "/models/load", {"model": model_id})
        if not reply.ok:
            raise ConnectionError(f"the router did not load {model_id}: {reply.error}")

    async def _until(self, model_id: str, states: set[str], timeout: float) -> ModelStatus:
        """Until the router reports the model in one of `states`, or failed (its child exited with an error: no
        state comes after that until it is loaded again); the status it reported then."""
        deadline = time.monotonic() + timeout
        while True:
            status = (await self._statuses()).get(model_id)
            if status is not None and (status.value in states or status.failed):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"model {model_id} not {' or '.join(sorted(states))} after {timeout:g} s")
            await asyncio.sleep(STATUS_POLL_S)

    async def _statuses(self) -> dict[str, ModelStatus]:
        """Each model's id -> its status, from the router's GET /models; the aliases are learnt on the way."""
        reply = await self.client.call_json("GET", "/models")
        data = reply.body.get("data") if reply.ok and isinstance(reply.body, dict) else None
        statuses: dict[str, ModelStatus] = {}
        for item in data if isinstance(data, list) else ():
            if not isinstance(item, dict):
                continue
            model_id, status = item.get("id"), item.get("status")
            status = status if isinstance(status, dict) else {}
            if isinstance(model_id, str):
                exit_code = status.get("exit_code")
                statuses[model_id] = ModelStatus(
                    str(status.get("value")),
                    status.get("failed") is True,
                    exit_code if isinstance(exit_code, int) else None,
                )
                self._aliases[model_id] = model_id
                for alias in item.get("aliases") or ():
                    if isinstance(alias, str):
                        self._aliases[alias] = model_id
        return statuses

    async def _model_id(self, name: str) -> str | None:
        if name not in self._aliases:
            await self._statuses()
        return self._aliases.get(name)

    def activity(self, model_id: str) -> Activity:
        """One model's own requests, for its idle save (idlesaves.py): another model's work delays nothing."""
        return Activity(
            in_flight=self._using[model_id],
            last_end=self._last_end.get(model_id, 0.0),
            requests=self._requests[model_id],
        )

    def kept(self) -> list[Model]:
        """The models whose changed slots a save must write: the loaded ones, and any being put away (whose own
        save a stop may cut short)."""
        return [*self.models.values(), *self._leaving.values()]

    def status(self) -> dict[str, Any]:
        """Each model slotkeeper keeps, for /slotkeeper/status."""
        return {name: model.status() for name, model in self.models.items()}


def _done(value: Any) -> asyncio.Future[Any]:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future
