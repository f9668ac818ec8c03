from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
from family_helpers import BASE, Family, model_path

from slotkeeper.cmdline import ConfigError, find_llama_server
from slotkeeper.testing.harness import Slotkeeper, clean_env, free_port
from slotkeeper.testing.tinymodel import PRESETS, TinyModelSpec, write_tiny_model

Starter = Callable[..., Slotkeeper]
ReadOnly = Callable[[Path], AbstractContextManager[None]]
# The stub llama-server (faults on demand) lives with the tests: it is no part of the install.
STUB_COMMAND = f"{sys.executable} {Path(__file__).resolve().parent / 'stub.py'}"


@pytest.fixture
def starter(tmp_path: Path) -> Iterator[Callable[[str, list[str]], Starter]]:
    """starter(llama_server_command, base_args) -> start(*extra, own=(), env={}, wait=True, save_dir=...)."""
    started: list[Slotkeeper] = []

    def make(server: str, base_args: list[str]) -> Starter:
        def start(
            *extra: str,
            own: tuple[str, ...] = (),
            env: dict[str, str] | None = None,
            port: int | None = None,
            wait: bool = True,
            save_dir: Path | None = None,
            replace_args: list[str] | None = None,
        ) -> Slotkeeper:
            full_env = clean_env(cache_home=tmp_path / "xdg-cache")
            full_env["LLAMA_SERVER"] = server
            full_env["STUB_LOG"] = str(tmp_path / "stub-events.jsonl")
            full_env.update(env or {})
            port = port or free_port()
            cache = save_dir or tmp_path / "cache"
            args = [*own, "--"] if own else []
            args += [
                *(replace_args if replace_args is not None else base_args),
                "--port",
                str(port),
                "--slot-save-path",
                str(cache),
                *extra,
            ]
            sk = Slotkeeper(args, full_env, tmp_path, port, tmp_path / f"slotkeeper-{len(started)}.log")
            sk.extra["save_dir"] = cache
            sk.extra["events"] = tmp_path / "stub-events.jsonl"
            started.append(sk.start())
            if wait:
                sk.wait_ready()
            return sk

        return start

    yield make
    for sk in started:
        sk.stop()


@pytest.fixture
def stub_slotkeeper(starter) -> Starter:
    """Start slotkeeper around the stub llama-server (the test double for faults)."""
    start = starter(STUB_COMMAND, ["-m", "stub-model.gguf"])

    def with_stub(*extra: str, stub: dict[str, str] | None = None, **kw) -> Slotkeeper:
        # The stub has no GGUF to read its memory from: it stands for a full-attention model.
        return start(*extra, env={"SLOTKEEPER_MODEL_MEMORY": "full", **(stub or {})}, **kw)

    return with_stub


@pytest.fixture(scope="session")
def llama_server() -> str:
    """A real llama-server. CI sets SLOTKEEPER_REQUIRE_LLAMA_SERVER=1 so these tests fail there, never skip."""
    try:
        return find_llama_server(None, os.environ)[0]
    except ConfigError as exc:
        if os.environ.get("SLOTKEEPER_REQUIRE_LLAMA_SERVER"):
            pytest.fail(f"a real llama-server is required here: {exc}")
        pytest.skip(f"no real llama-server: {exc}")


@pytest.fixture(scope="session")
def llama_server_b11349() -> str:
    """An older llama-server (b11349: seq-state format 3), installed into a cache directory on first use.
    Required like the venv's when SLOTKEEPER_REQUIRE_LLAMA_SERVER is set; skipped otherwise if it cannot be."""
    from slotkeeper.testing.olderserver import B11349, older_llama_server

    binary = older_llama_server(B11349)
    if binary is None:
        if os.environ.get("SLOTKEEPER_REQUIRE_LLAMA_SERVER"):
            pytest.fail(f"llama-server b{B11349.split('.')[0]} is required here and could not be installed")
        pytest.skip(f"llama-server b{B11349.split('.')[0]} could not be installed")
    return str(binary)


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model slow enough (~350-400 tokens/s on 2 quiet cores) that a 30,000-token generation takes over
    a minute: the tests of a client that leaves mid-answer need it still generating. (4 layers of 256 ran at
    5,000 tokens/s on a quiet CI machine, 6 s for 30,000 tokens: too fast for their checks.)"""
    spec = TinyModelSpec(n_layers=8, width=512, n_heads=4, n_kv_heads=1, seed=7)
    return write_tiny_model(tmp_path_factory.mktemp("slow") / "slow.gguf", spec)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random-weight GGUF models: A, B (same shape as A, other weights), and W (other dimensions)."""
    from slotkeeper.testing.tinymodel import TinyModelSpec, write_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {
        "A": write_tiny_model(root / "a.gguf", TinyModelSpec(seed=1)),
        "B": write_tiny_model(root / "b.gguf", TinyModelSpec(seed=2)),
        "W": write_tiny_model(root / "w.gguf", TinyModelSpec(seed=1, width=96, n_heads=4, n_kv_heads=4)),
    }


@pytest.fixture
def port() -> int:
    return free_port()


# ---- model families (real llama-server) ----


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family-models")
    models = {"llama": write_tiny_model(root / "llama.gguf", TinyModelSpec(seed=1))}
    for arch in ("qwen35", "lfm2", "gemma3"):
        models[arch] = write_tiny_model(root / f"{arch}.gguf", PRESETS[arch])
    return models


@pytest.fixture(scope="session")
def tiny_mmproj(tmp_path_factory) -> Callable[[int], Path]:
    """tiny_mmproj(n_embd) -> a tiny random-weight vision projector for a text model n_embd wide (one per width)."""
    from slotkeeper.testing.tinymmproj import write_tiny_mmproj

    root = tmp_path_factory.mktemp("mmproj")
    made: dict[int, Path] = {}

    def make(n_embd: int) -> Path:
        if n_embd not in made:
            made[n_embd] = write_tiny_mmproj(root / f"mmproj-{n_embd}.gguf", n_embd)
        return made[n_embd]

    return make


@pytest.fixture(scope="session")
def real_gemma() -> Path:
    """The real Gemma 3 270M (F16); CI requires it, as it requires llama-server."""
    from slotkeeper.testing.realmodel import RealModelUnavailable, gemma3_270m

    try:
        return gemma3_270m()
    except RealModelUnavailable as exc:
        if os.environ.get("SLOTKEEPER_REQUIRE_LLAMA_SERVER"):
            pytest.fail(f"the real Gemma 3 270M is required here: {exc}")
        pytest.skip(str(exc))


@pytest.fixture
def family_start(starter, llama_server, family_models, request):
    """family_start(family, *extra, **kw): slotkeeper around the real llama-server with that family's model."""

    def start(family: Family, *extra: str, **kw):
        model = model_path(family.model, family_models, request)
        return starter(llama_server, ["-m", str(model), *BASE, *family.args])(*extra, **kw)

    return start


@pytest.fixture
def read_only() -> Iterator[ReadOnly]:
    """read_only(path): a context in which `path` is a read-only bind mount of itself (a real EROFS)."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root (CI runs as root)")
    mounted: list[Path] = []

    @contextmanager
    def remount(path: Path) -> Iterator[None]:
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
        mounted.append(path)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield
        subprocess.run(["umount", str(path)], check=True)
        mounted.remove(path)

    yield remount
    for path in mounted:  # an assertion failed inside the context
        subprocess.run(["umount", "-l", str(path)], check=False)
