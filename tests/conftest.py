from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness import STUB_COMMAND, Slotkeeper, free_port


def clean_env(tmp_path: Path) -> dict[str, str]:
    """The test's environment without the developer's llama-server or slotkeeper settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "SLOTKEEPER_", "STUB_"))}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg-cache")
    return env


@pytest.fixture
def stub_slotkeeper(tmp_path: Path) -> Iterator[Callable[..., Slotkeeper]]:
    """Start slotkeeper around the stub llama-server; every process is killed at the end of the test."""
    started: list[Slotkeeper] = []
    save_dir = tmp_path / "cache"

    def start(*extra: str, own: tuple[str, ...] = (), stub: dict[str, str] | None = None,
              port: int | None = None, wait: bool = True) -> Slotkeeper:
        env = clean_env(tmp_path)
        env["LLAMA_SERVER"] = STUB_COMMAND
        env["STUB_LOG"] = str(tmp_path / "stub-events.jsonl")
        env.update(stub or {})
        port = port or free_port()
        args = [*own, "--"] if own else []
        args += ["-m", "stub-model.gguf", "--port", str(port), "--slot-save-path", str(save_dir), *extra]
        sk = Slotkeeper(args, env, tmp_path, port, tmp_path / f"slotkeeper-{len(started)}.log")
        sk.extra["save_dir"] = save_dir
        sk.extra["events"] = tmp_path / "stub-events.jsonl"
        started.append(sk.start())
        if wait:
            sk.wait_ready()
        return sk

    yield start
    for sk in started:
        sk.stop()


@pytest.fixture
def port() -> int:
    return free_port()
