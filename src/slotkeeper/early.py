"""What a start reads while llama-server loads the model, each in a thread of its own, started right after the
spawn (cli.run) and before the daemon is imported: the model file's identity (a hash of its head and tail;
hashlib releases the GIL) and memory kind (its GGUF header), and the store's listing and guessed index
(store.prescan, which also reads ahead the chats the start will restore). The daemon's restore awaits them.

Why at the spawn: with a model that loads fast, the imports after the spawn are what a start waits for, and
at 20,000 entries the prescan is; started only once those imports were done, each added to the other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from .config import RunConfig
from .llama.modelinfo import ModelMemory, model_memory
from .store.fingerprint import model_identity, server_identity
from .store.prescan import Prescan, prescan

T = TypeVar("T")


@dataclass(frozen=True)
class EarlyReads:
    """The reads started at the spawn, each resolved by its own thread."""

    identity: Future[dict[str, Any]]
    memory: Future[ModelMemory | None]
    scanned: Future[Prescan]


def start_early_reads(config: RunConfig) -> EarlyReads:
    return EarlyReads(
        identity=in_thread("model identity", model_identity, config.model, config.save_dir),
        memory=in_thread("model memory", model_memory, config.model),
        scanned=in_thread(
            "prescan", prescan, config.save_dir, server_identity(config.llama_binary), config.expected_slots
        ),
    )


def in_thread(name: str, work: Callable[..., T], *args: Any) -> Future[T]:
    """`work(*args)` in a daemon thread, its result or error in the future (an error is raised where the
    daemon awaits it, which says why in one line)."""
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(work(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side, as asyncio.to_thread does
            done.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done
