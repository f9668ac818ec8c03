"""Reading llama-server's own command line.

slotkeeper is a drop-in for llama-server, so it must understand just enough of llama-server's argv to take
the listen address for itself and to know where slots are saved, how many there are and which API key the
child wants. Everything else is passed to the child untouched. This module is stdlib-only on purpose: it
runs before the child is spawned, and the child's load should not wait for heavy imports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


class ArgumentError(ValueError):
    """A llama-server argument slotkeeper must read is missing its value or malformed."""


# Flags slotkeeper takes out of the child's argv (it replaces them with its own values).
HOST_FLAGS = frozenset({"--host"})
PORT_FLAGS = frozenset({"--port"})
SAVE_PATH_FLAGS = frozenset({"--slot-save-path"})
# Flags slotkeeper reads but leaves in the child's argv.
PARALLEL_FLAGS = frozenset({"-np", "--parallel"})
API_KEY_FLAGS = frozenset({"--api-key"})
API_KEY_FILE_FLAGS = frozenset({"--api-key-file"})
MODEL_FLAGS = frozenset({"-m", "--model"})
HF_REPO_FLAGS = frozenset({"-hf", "-hfr", "--hf-repo"})
SLOTS_ENDPOINT_FLAGS = {"--slots": True, "--no-slots": False}
IDLE_SLOT_CACHE_FLAGS = {"--cache-idle-slots": True, "--no-cache-idle-slots": False}

_VALUE_FLAGS = (
    HOST_FLAGS | PORT_FLAGS | SAVE_PATH_FLAGS | PARALLEL_FLAGS | API_KEY_FLAGS | API_KEY_FILE_FLAGS
    | MODEL_FLAGS | HF_REPO_FLAGS
)
_REMOVED_FLAGS = HOST_FLAGS | PORT_FLAGS | SAVE_PATH_FLAGS

# Environment variables llama-server reads for the same settings; the command line wins, as in llama-server.
ENV_HOST = "LLAMA_ARG_HOST"
ENV_PORT = "LLAMA_ARG_PORT"
ENV_API_KEY = "LLAMA_API_KEY"
ENV_MODEL = "LLAMA_ARG_MODEL"
ENV_PARALLEL = "LLAMA_ARG_N_PARALLEL"
ENV_SLOTS_ENDPOINT = "LLAMA_ARG_ENDPOINT_SLOTS"
ENV_IDLE_SLOT_CACHE = "LLAMA_ARG_CACHE_IDLE_SLOTS"
# Never inherited by the child: slotkeeper gives it a private address on the command line instead.
CHILD_ENV_REMOVED = (ENV_HOST, ENV_PORT)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = "8080"


@dataclass
class LlamaArgs:
    """What slotkeeper learned from llama-server's argv; values are raw strings until config validates them."""

    passthrough: list[str] = field(default_factory=list)
    host: str = DEFAULT_HOST
    port: str = DEFAULT_PORT
    slot_save_path: str | None = None
    parallel: str | None = None
    api_keys: list[str] = field(default_factory=list)
    api_key_file: str | None = None
    model: str | None = None
    hf_repo: str | None = None
    slots_endpoint: bool = True
    idle_slot_cache: bool | None = None  # None: the user did not choose

    @property
    def model_label(self) -> str:
        """A short, stable name for the model, used to pick a default save directory."""
        if self.model:
            return Path(self.model).name
        if self.hf_repo:
            return self.hf_repo.replace("/", "_").replace(":", "_")
        return "default"


def _normalize(flag: str) -> str:
    """llama-server treats `_` as `-` in long flags (`--slot_save_path`)."""
    return flag.replace("_", "-") if flag.startswith("--") else flag


def _env_bool(value: str) -> bool:
    return value.strip().lower() in {"1", "true", "on", "yes", "enabled"}


def parse_llama_args(argv: list[str], env: os._Environ[str] | dict[str, str]) -> LlamaArgs:
    """Split llama-server's argv into what slotkeeper takes over and what the child keeps.

    Both `--flag value` and `--flag=value` are understood for the flags slotkeeper reads; llama-server itself
    only accepts the first form, so taken-over flags are always re-emitted that way.
    """
    args = LlamaArgs()
    args.host = env.get(ENV_HOST) or DEFAULT_HOST
    args.port = env.get(ENV_PORT) or DEFAULT_PORT
    if env.get(ENV_API_KEY):
        args.api_keys = [k.strip() for k in env[ENV_API_KEY].split(",") if k.strip()]
    args.model = env.get(ENV_MODEL) or None
    args.parallel = env.get(ENV_PARALLEL) or None
    if ENV_SLOTS_ENDPOINT in env:
        args.slots_endpoint = _env_bool(env[ENV_SLOTS_ENDPOINT])
    if ENV_IDLE_SLOT_CACHE in env:
        args.idle_slot_cache = _env_bool(env[ENV_IDLE_SLOT_CACHE])

    cli_api_keys: list[str] | None = None
    i = 0
    while i < len(argv):
        token = argv[i]
        name, has_inline, inline_value = token.partition("=") if token.startswith("--") else (token, "", "")
        name = _normalize(name)
        if name in SLOTS_ENDPOINT_FLAGS and not has_inline:
            args.slots_endpoint = SLOTS_ENDPOINT_FLAGS[name]
        elif name in IDLE_SLOT_CACHE_FLAGS and not has_inline:
            args.idle_slot_cache = IDLE_SLOT_CACHE_FLAGS[name]
        if name not in _VALUE_FLAGS:
            args.passthrough.append(token)
            i += 1
            continue
        if has_inline:
            value = inline_value
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ArgumentError(f"llama-server argument {name} needs a value")
            value = argv[i + 1]
            i += 2
        if name in HOST_FLAGS:
            args.host = value
        elif name in PORT_FLAGS:
            args.port = value
        elif name in SAVE_PATH_FLAGS:
            args.slot_save_path = value
        else:
            if name in PARALLEL_FLAGS:
                args.parallel = value
            elif name in API_KEY_FLAGS:
                cli_api_keys = (cli_api_keys or []) + [k.strip() for k in value.split(",") if k.strip()]
            elif name in API_KEY_FILE_FLAGS:
                args.api_key_file = value
            elif name in MODEL_FLAGS:
                args.model = value
            elif name in HF_REPO_FLAGS:
                args.hf_repo = value
            args.passthrough.extend([name, value])
    if cli_api_keys is not None:
        args.api_keys = cli_api_keys
    return args


def read_api_key_file(path: str) -> list[str]:
    """Keys from an `--api-key-file`: one per line, `#` starts a comment line (as llama-server reads it)."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]
