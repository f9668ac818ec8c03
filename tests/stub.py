"""A fault-injecting stand-in for llama.cpp's ``llama-server`` (build b11434).

Why: slotkeeper exists to survive llama-server's hazards -- slow or failing model loads, a save killed
half-way through (llama-server writes slot files in place), a 0-token save replacing a good file, a
restore of a foreign or truncated file, a crash mid-request. Those are slow or impossible to provoke with
the real binary, so tests run this stub instead. It speaks the same HTTP API on the same kinds of address
(a ``*.sock`` host is a unix socket), with the same status codes, error bodies and slot quirks, and each
hazard is switched on by an environment variable. It needs no model: one token is one UTF-8 byte of the
prompt, and the "model" answers with a run of letters fixed by the prompt (see :func:`generate_tokens`).

Run it exactly like llama-server::

    python tests/stub.py --host /tmp/x/llama.sock --slot-save-path /tmp/x/slots -np 2 -m m.gguf

Behaviour copied from llama-server b11434 (tools/server, common/arg.cpp, src/llama-context.cpp):

* Every request is answered 503 "Loading model" until loading ends (not only /health; "/" excepted), then
  the API key is checked, then the route. ``/health``, ``/v1/health`` and ``/`` need no key. The key is
  taken from ``Authorization``, or from ``X-Api-Key`` when ``Authorization`` is absent or empty; a leading
  ``"Bearer "`` is stripped from either. Unknown paths and wrong methods are 404 "File Not Found".
* Slot ids in ``/slots/{id}`` are parsed with C ``stoi`` (``"1abc"`` is 1, ``"abc"`` is 400 "Invalid slot
  ID") and then wrapped, never rejected: slot ``id % n_slots`` where a negative id is first taken as an
  unsigned 64-bit number (with 4 slots -1 is slot 3; with 3 slots -1 is slot 0). The response echoes the id
  as requested. Completions' ``id_slot`` wraps the same way (-1 means "any").
* ``/slots`` actions (erase included) are 501 without ``--slot-save-path``. Save and restore wait until the
  slot is idle, and hold the task loop while they work, so completions on other slots stall meanwhile.
* A save of an empty slot succeeds, writes a header-only file and answers ``n_saved: 0``. Restoring such a
  file succeeds with ``n_restored: 0``. Any failed restore clears the slot.
* An idle slot only reports ``id_task``/``n_prompt_tokens`` once it has run a task since start; a restored
  slot that never ran one shows only ``id``, ``n_ctx``, ``speculative``, ``is_processing``.
* Slot choice for completions: the requested slot, else the idle slot whose cached tokens cover more than
  ``--slot-prompt-similarity`` (0.1) of the prompt, else the least recently used idle slot (on ties the
  highest id, so a fresh server starts with the last slot). ``cache_n`` is the common prefix, but at least
  one prompt token is always evaluated. Afterwards the slot holds prompt + generated tokens minus the last
  generated token (which is sampled, never decoded).
* The RAM prompt cache (``--cache-ram``, default on) and ``--cache-idle-slots`` (default on): when a
  completion starts, every idle slot is copied into the prompt cache and, with a unified KV cache (the
  default when ``-np`` is not given or is -1, or with ``-kvu``), **cleared**. A slot picked by LRU (or one
  that would keep less than half its tokens) first stores its tokens and then loads the best cached prompt.
* ``SIGTERM``/``SIGINT`` are only handled once the model is loaded (before that they kill the process, as
  with llama-server); then the stub exits 0 once any in-progress save/restore has finished. A second signal
  exits 1 at once. The unix socket file is never removed, and an existing one makes the bind fail (exit 1).

Fault knobs (environment variables, all optional):

=============================  ========================================================================
``STUB_LOAD_SECONDS``          time spent "loading the model" (503 everywhere), default 0.2
``STUB_CRASH_AT_LOAD``         exit with this status at the end of loading, after an error line
``STUB_CRASH_AFTER_REQUESTS``  crash when the N-th completion request (any completion/chat path) arrives
``STUB_CRASH_CODE``            exit status of that crash, default 134
``STUB_CRASH_SIGNAL``          kill itself with this signal number instead (e.g. 9 or 6)
``STUB_SAVE_SECONDS``          a save writes half of the file, flushes, sleeps this long, writes the rest
``STUB_RESTORE_SECONDS``       a restore sleeps this long before reading the file
``STUB_SAVE_FAIL``             saves answer 500 "Unable to save slot" and write nothing
``STUB_SAVE_ZERO``             saves write a header-only (0-token) file in place and answer ``n_saved: 0``
``STUB_FAIL_PATHS``            comma list of paths answered 500 server_error (any method, after the key check)
``STUB_IGNORE_SIGTERM``        ignore SIGTERM from the start (only SIGKILL stops the stub)
``STUB_TOKEN_SECONDS``         delay before each generated token, default 0
``STUB_BYTES_PER_TOKEN``       padding bytes per token in slot files, default 64
``STUB_STATE_VERSION``         the seq-state format version it writes and reads, default 4 (an upgrade)
``STUB_CHATTY``                print N extra long lines at start (pass-through tests)
``STUB_CHATTY_BYTES``          length of each chatty line, default 100000
``STUB_CHATTY_STREAM``         ``stderr`` (default) or ``stdout`` for the chatty lines
``STUB_LOG``                   append one JSON line per event to this file (see :class:`EventLog`)
=============================  ========================================================================

Slot file format (:func:`encode_slot_file`): llama.cpp's seq-state header (``ggsq`` magic, the format
version, a word count) and b11434's packed tokens (NULL marker, payload version 1, N, the N tokens, 0 media
chunks) as little-endian 32-bit words, then the stub's "state": a JSON line ``{"model": "<-m value>",
"bytes_per_token": P}\\n`` and N*P padding bytes. A restore refuses a file with another magic or format
version, a payload or header that does not parse, a size other than the header implies (a truncated save)
or another model, with 400 "Unable to restore slot: No available space in KV cache or invalid slot save
file".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import secrets
import signal
import socket
import struct
import sys
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

SEQ_MAGIC = 0x67677371  # llama.cpp's 'ggsq'
SEQ_VERSION = 4  # LLAMA_STATE_SEQ_VERSION in b11434 (STUB_STATE_VERSION changes it)
BUILD_INFO = "stub"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
AUTO_SLOTS = 4  # llama-server's n_parallel when -np is absent or -1
DEFAULT_N_CTX = 4096  # what "-c 0" (the model's training context) means for the stub
DEFAULT_N_PREDICT = 16
LOADING_MESSAGE = "Loading model"
RESTORE_INVALID = "No available space in KV cache or invalid slot save file"
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/"})  # "/" is the web UI, public even when not built
FRONTEND_PATHS = frozenset({"/"})  # answered even while loading
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ERROR_CODES = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "server_error": 500,
    "not_supported_error": 501,
    "unavailable_error": 503,
    "exceed_context_size_error": 400,
}


# --------------------------------------------------------------------------------------------------------
# Small pure helpers (importable by tests)


def tokenize(prompt: Any) -> list[int]:
    """One token per UTF-8 byte, so token counts and cache_n are predictable; a token list passes through.

    A list may mix strings and token ids (as llama-server's "mixed" prompts); it is one prompt here.
    """
    if isinstance(prompt, str):
        return list(prompt.encode("utf-8"))
    if isinstance(prompt, list):
        tokens: list[int] = []
        for part in prompt:
            if isinstance(part, str):
                tokens.extend(part.encode("utf-8"))
            elif isinstance(part, int) and not isinstance(part, bool):
                tokens.append(part)
            else:
                raise RequestError('"prompt" must be a string, a list of tokens, or a list of mixed strings & tokens')
        return tokens
    raise RequestError('"prompt" must be a string, a list of tokens, or a list of mixed strings & tokens')


def detokenize(tokens: Sequence[int]) -> str:
    """Inverse of :func:`tokenize`; ids outside 0..255 are not in the stub's vocabulary and are dropped."""
    return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")


def generate_tokens(prompt_tokens: Sequence[int], n: int) -> list[int]:
    """The stub's "model": n lowercase letters cycling through the alphabet from a prompt-seeded start.

    Deterministic, so a test can predict a completion (and so equal prompts give equal answers, as greedy
    sampling would); letters are one byte, so each generated token is also one character.
    """
    seed = hashlib.sha256(bytes(t % 256 for t in prompt_tokens)).digest()
    start = int.from_bytes(seed[:4], "little") % 26
    return [ord("a") + (start + i) % 26 for i in range(n)]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix: how many cached tokens a prompt can reuse."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def encode_slot_file(tokens: Sequence[int], model: str, bytes_per_token: int = 64, version: int = SEQ_VERSION) -> bytes:
    """The bytes a save writes: llama.cpp's seq-state header and b11434's packed tokens, then the "state"
    (a JSON line naming the model, and padding); see the module docstring."""
    packed = [-1, 1, len(tokens), *tokens, 0]  # LLAMA_TOKEN_NULL, payload version 1, n, tokens, no media
    head = struct.pack("<III", SEQ_MAGIC, version, len(packed)) + struct.pack(f"<{len(packed)}i", *packed)
    state = json.dumps({"model": model, "bytes_per_token": bytes_per_token}).encode("utf-8") + b"\n"
    return head + state + b"\x5a" * (bytes_per_token * len(tokens))


class SlotFileError(Exception):
    """A slot file a restore must refuse; the message is what follows "Unable to restore slot: "."""


def decode_slot_file(data: bytes, model: str | None = None, version: int = SEQ_VERSION) -> list[int]:
    """The tokens of a slot file; raises :class:`SlotFileError` for a foreign, truncated, other-format or
    other-model file (llama-server's misleading message for all of them)."""
    if len(data) < 12:
        raise SlotFileError(RESTORE_INVALID)
    magic, file_version, count = struct.unpack_from("<III", data)
    if magic != SEQ_MAGIC or file_version != version or len(data) < 12 + 4 * count or count < 4:
        raise SlotFileError(RESTORE_INVALID)
    packed = struct.unpack_from(f"<{count}i", data, 12)
    n_tokens = packed[2]
    if packed[0] != -1 or packed[1] != 1 or count != n_tokens + 4:
        raise SlotFileError(RESTORE_INVALID)
    start = 12 + 4 * count
    end = data.find(b"\n", start)
    try:
        header = json.loads(data[start:end])
        pad, file_model = header["bytes_per_token"], header["model"]
    except (ValueError, KeyError, TypeError) as exc:
        raise SlotFileError(RESTORE_INVALID) from exc
    if end < 0 or not isinstance(pad, int) or len(data) != end + 1 + n_tokens * pad:
        raise SlotFileError(RESTORE_INVALID)
    if model is not None and file_model != model:
        raise SlotFileError(RESTORE_INVALID)
    return list(packed[3 : 3 + n_tokens])


_C_STOI = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


def c_stoi(text: str) -> int:
    """C++ ``std::stoi``: leading whitespace, a sign, digits, anything after ignored; int32 range."""
    match = _C_STOI.match(text)
    if not match:
        raise ValueError("stoi")
    value = int(match.group(1))
    if not -(2**31) <= value < 2**31:
        raise ValueError("stoi")
    return value


def validate_filename(filename: str) -> bool:
    """llama.cpp's fs_validate_filename (common/common.cpp), without subdirectories."""
    raw = filename.encode("utf-8", errors="surrogatepass")
    if not filename or len(raw) > 255:
        return False
    for ch in filename:
        c = ord(ch)
        if (
            c <= 0x1F
            or c == 0x7F
            or 0x80 <= c <= 0x9F
            or c in (0xFF0E, 0x2215, 0x2216, 0xFFFD, 0xFEFF)
            or 0xD800 <= c <= 0xDFFF
            or ch in ':*?"<>|/\\'
        ):
            return False
    if filename[0] == " " or filename[-1] in " .":
        return False
    return ".." not in filename and filename != "."


# --------------------------------------------------------------------------------------------------------
# Command line


class UsageError(Exception):
    """A command line llama-server refuses to start with; it prints the message and exits 1."""


@dataclass
class ServerArgs:
    """The parts of llama-server's argv (and LLAMA_* environment) the stub models; all else is ignored."""

    argv: list[str]
    hosts: list[str] = field(default_factory=lambda: [DEFAULT_HOST])
    port: int = DEFAULT_PORT
    slot_save_path: str | None = None  # with a trailing separator, as llama-server keeps it
    n_parallel: int = -1
    kv_unified: bool = False
    api_keys: list[str] = field(default_factory=list)
    model: str = ""
    aliases: set[str] = field(default_factory=set)
    endpoint_slots: bool = True
    endpoint_metrics: bool = False
    n_ctx: int = 0
    slot_prompt_similarity: float = 0.1
    cache_ram_mib: int = 8192
    cache_idle_slots: bool = True

    @property
    def total_slots(self) -> int:
        return AUTO_SLOTS if self.n_parallel < 0 else self.n_parallel

    @property
    def unified(self) -> bool:
        """llama-server forces a unified KV cache when the slot count is automatic."""
        return self.n_parallel < 0 or self.kv_unified

    @property
    def slot_n_ctx(self) -> int:
        total = self.n_ctx if self.n_ctx > 0 else DEFAULT_N_CTX
        return total if self.unified else max(1, total // self.total_slots)

    @property
    def model_name(self) -> str:
        """What responses call the model: the first alias in sorted order (a std::set), else the -m path."""
        return min(self.aliases) if self.aliases else self.model


def _set_hosts(a: ServerArgs, v: str) -> None:
    hosts = [h.strip() for h in v.split(",") if h.strip()]
    if not hosts:
        raise ValueError("--host requires at least one address")
    a.hosts = hosts


def _set_port(a: ServerArgs, v: str) -> None:
    a.port = c_stoi(v)


def _set_slot_save_path(a: ServerArgs, v: str) -> None:
    if not os.path.isdir(v):
        raise ValueError(f"not a directory: {v}")
    a.slot_save_path = v if v.endswith(os.sep) else v + os.sep


def _set_parallel(a: ServerArgs, v: str) -> None:
    n = c_stoi(v)
    if n == 0:
        raise ValueError("error: invalid value for n_parallel\n")
    a.n_parallel = n


def _add_api_keys(a: ServerArgs, v: str) -> None:
    a.api_keys.extend(k for k in v.split(",") if k)


def _add_api_key_file(a: ServerArgs, v: str) -> None:
    try:
        with open(v, encoding="utf-8", newline="") as f:
            lines = f.read().split("\n")  # like std::getline: a trailing "\r" stays part of the key
    except OSError:
        raise ValueError(f"error: failed to open file '{v}'\n") from None
    a.api_keys.extend(line for line in lines if line and not line.startswith("#"))


def _set_model(a: ServerArgs, v: str) -> None:
    a.model = v


def _add_aliases(a: ServerArgs, v: str) -> None:
    a.aliases.update(x.strip() for x in v.split(",") if x.strip())


def _set_ctx(a: ServerArgs, v: str) -> None:
    a.n_ctx = c_stoi(v)


def _set_similarity(a: ServerArgs, v: str) -> None:
    a.slot_prompt_similarity = float(v)


def _set_cache_ram(a: ServerArgs, v: str) -> None:
    a.cache_ram_mib = c_stoi(v)


VALUE_OPTIONS: dict[str, Callable[[ServerArgs, str], None]] = {
    "--host": _set_hosts,
    "--port": _set_port,
    "--slot-save-path": _set_slot_save_path,
    "-np": _set_parallel,
    "--parallel": _set_parallel,
    "--api-key": _add_api_keys,
    "--api-key-file": _add_api_key_file,
    "-m": _set_model,
    "--model": _set_model,
    "-a": _add_aliases,
    "--alias": _add_aliases,
    "-c": _set_ctx,
    "--ctx-size": _set_ctx,
    "-sps": _set_similarity,
    "--slot-prompt-similarity": _set_similarity,
    "-cram": _set_cache_ram,
    "--cache-ram": _set_cache_ram,
}
BOOL_OPTIONS: dict[str, tuple[str, bool]] = {
    "--slots": ("endpoint_slots", True),
    "--no-slots": ("endpoint_slots", False),
    "--metrics": ("endpoint_metrics", True),
    "-kvu": ("kv_unified", True),
    "--kv-unified": ("kv_unified", True),
    "-no-kvu": ("kv_unified", False),
    "--no-kv-unified": ("kv_unified", False),
    "--cache-idle-slots": ("cache_idle_slots", True),
    "--no-cache-idle-slots": ("cache_idle_slots", False),
}
# llama-server reads these first; the command line then overrides (or, for keys, adds to) them.
ENV_VALUE_OPTIONS: dict[str, Callable[[ServerArgs, str], None]] = {
    "LLAMA_ARG_HOST": _set_hosts,
    "LLAMA_ARG_PORT": _set_port,
    "LLAMA_ARG_N_PARALLEL": _set_parallel,
    "LLAMA_API_KEY": _add_api_keys,
    "LLAMA_ARG_API_KEY_FILE": _add_api_key_file,
    "LLAMA_ARG_MODEL": _set_model,
    "LLAMA_ARG_ALIAS": _add_aliases,
    "LLAMA_ARG_CTX_SIZE": _set_ctx,
    "LLAMA_ARG_CACHE_RAM": _set_cache_ram,
}
ENV_BOOL_OPTIONS = {
    "LLAMA_ARG_ENDPOINT_SLOTS": "endpoint_slots",
    "LLAMA_ARG_ENDPOINT_METRICS": "endpoint_metrics",
    "LLAMA_ARG_KV_UNIFIED": "kv_unified",
    "LLAMA_ARG_CACHE_IDLE_SLOTS": "cache_idle_slots",
}


def parse_args(argv: Sequence[str], env: Mapping[str, str]) -> ServerArgs:
    """Read the options the stub models; unknown tokens (other flags and their values) are skipped.

    Values are consumed only for known value-taking flags, so an unknown flag's value is just one more
    ignored token. Both ``--flag value`` and ``--flag=value`` are accepted (llama-server itself only takes the
    first form); ``_`` in a long flag means ``-``, as in llama-server.
    """
    args = ServerArgs(argv=list(argv))
    for name, setter in ENV_VALUE_OPTIONS.items():
        if name in env:
            try:
                setter(args, env[name])
            except (ValueError, OSError) as exc:
                raise UsageError(f'error while handling environment variable "{name}": {exc}\n') from None
    for name, attr in ENV_BOOL_OPTIONS.items():
        if name in env:
            value = env[name]
            if value in ("on", "enabled", "true", "1"):
                setattr(args, attr, True)
            elif value in ("off", "disabled", "false", "0"):
                setattr(args, attr, False)
            else:
                raise UsageError(f'error while handling environment variable "{name}": invalid boolean value\n')
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        flag, eq, inline = token.partition("=") if token.startswith("-") else (token, "", "")
        if flag.startswith("--"):
            flag = flag.replace("_", "-")
        if flag in VALUE_OPTIONS:
            if eq:
                value = inline
            elif i < len(argv):
                value = argv[i]
                i += 1
            else:
                raise UsageError(f'error while handling argument "{flag}": expected value for argument')
            try:
                VALUE_OPTIONS[flag](args, value)
            except (ValueError, OSError) as exc:
                raise UsageError(
                    f'error while handling argument "{flag}": {exc}\n\nto show complete usage, run with -h'
                ) from None
        elif flag in BOOL_OPTIONS and not eq:
            attr, value_bool = BOOL_OPTIONS[flag]
            setattr(args, attr, value_bool)
    return args


# --------------------------------------------------------------------------------------------------------
# Knobs and the event log


def _env_float(env: Mapping[str, str], name: str, default: float) -> float:
    value = env.get(name, "").strip()
    return float(value) if value else default


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value else None


def _env_flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Knobs:
    """The fault-injection settings, read once from ``STUB_*`` environment variables (module docstring)."""

    load_seconds: float = 0.2
    crash_at_load: int | None = None
    crash_after_requests: int | None = None
    crash_code: int = 134
    crash_signal: int | None = None
    save_seconds: float = 0.0
    restore_seconds: float = 0.0
    save_fail: bool = False
    save_zero: bool = False
    fail_paths: frozenset[str] = frozenset()
    ignore_sigterm: bool = False
    token_seconds: float = 0.0
    bytes_per_token: int = 64
    state_version: int = SEQ_VERSION
    chatty: int = 0
    chatty_bytes: int = 100_000
    chatty_stream: str = "stderr"
    log_path: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Knobs:
        crash_code = _env_int(env, "STUB_CRASH_CODE")
        bytes_per_token = _env_int(env, "STUB_BYTES_PER_TOKEN")
        chatty_bytes = _env_int(env, "STUB_CHATTY_BYTES")
        return cls(
            load_seconds=_env_float(env, "STUB_LOAD_SECONDS", 0.2),
            crash_at_load=_env_int(env, "STUB_CRASH_AT_LOAD"),
            crash_after_requests=_env_int(env, "STUB_CRASH_AFTER_REQUESTS"),
            crash_code=134 if crash_code is None else crash_code,
            crash_signal=_env_int(env, "STUB_CRASH_SIGNAL"),
            save_seconds=_env_float(env, "STUB_SAVE_SECONDS", 0.0),
            restore_seconds=_env_float(env, "STUB_RESTORE_SECONDS", 0.0),
            save_fail=_env_flag(env, "STUB_SAVE_FAIL"),
            save_zero=_env_flag(env, "STUB_SAVE_ZERO"),
            fail_paths=frozenset(p.strip() for p in env.get("STUB_FAIL_PATHS", "").split(",") if p.strip()),
            ignore_sigterm=_env_flag(env, "STUB_IGNORE_SIGTERM"),
            token_seconds=_env_float(env, "STUB_TOKEN_SECONDS", 0.0),
            bytes_per_token=64 if bytes_per_token is None else bytes_per_token,
            state_version=_env_int(env, "STUB_STATE_VERSION") or SEQ_VERSION,
            chatty=_env_int(env, "STUB_CHATTY") or 0,
            chatty_bytes=100_000 if chatty_bytes is None else chatty_bytes,
            chatty_stream=env.get("STUB_CHATTY_STREAM", "stderr").strip() or "stderr",
            log_path=env.get("STUB_LOG") or None,
        )


class EventLog:
    """``STUB_LOG``: one JSON object per line, written with one O_APPEND ``write`` so it is on disk at once.

    Why: tests prove ordering across processes (e.g. that no completion reached the stub before the restore
    finished, or that a save was in progress when slotkeeper was killed) by reading this file. Events:
    ``start`` (argv), ``listening`` (addresses), ``ready``, ``request``, ``response`` (status),
    ``cancelled`` (client went away mid-generation), ``save_begin`` (file truncated and half written),
    ``save``, ``restore_begin``, ``restore``, ``erase`` (each with ``ok``), ``crash``, ``term``.
    Every line has ``t`` (time.time()), ``event``, ``method``, ``path``, ``query`` (null outside a
    request) and ``pid``, plus event-specific fields.
    """

    def __init__(self, path: str | None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None

    def write(self, event: str, request: web.Request | None = None, **fields: Any) -> None:
        if self._fd is None:
            return
        record: dict[str, Any] = {
            "t": time.time(),
            "event": event,
            "method": request.method if request is not None else None,
            "path": request.path if request is not None else None,
            "query": request.query_string if request is not None else None,
            "pid": os.getpid(),
        }
        record.update(fields)
        os.write(self._fd, (json.dumps(record) + "\n").encode("utf-8"))


def eprint(*parts: object) -> None:
    """Log to stderr, flushed, as llama-server logs (slotkeeper passes the child's output through)."""
    print(*parts, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------
# Errors and responses


class RequestError(Exception):
    """An error answered in llama-server's shape: ``{"error": {"code", "message", "type"}}``."""

    def __init__(self, message: str, error_type: str = "invalid_request_error", **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.error_type = error_type
        self.extra = extra


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        status=status,
        text=json.dumps(data, ensure_ascii=False, separators=(",", ":")),
        content_type="application/json",
        charset="utf-8",
    )


def error_response(message: str, error_type: str, **extra: Any) -> web.Response:
    """format_error_response's body (handlers); keys in its order, though clients should not care."""
    code = ERROR_CODES[error_type]
    return json_response({"error": {"code": code, "message": message, "type": error_type, **extra}}, code)


def middleware_error(message: str, error_type: str) -> web.Response:
    """The bodies llama-server's HTTP layer writes itself (503 loading, 401, 404): another key order."""
    code = ERROR_CODES[error_type]
    return json_response({"error": {"message": message, "type": error_type, "code": code}}, code)


def json_type_name(value: Any) -> str:
    """nlohmann::json's name for a value's type, for its error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else type(value).__name__


def sse(data: Any) -> bytes:
    """One server-sent event per object (a list is several events), as llama-server's format_oai_sse."""
    items = data if isinstance(data, list) else [data]
    return b"".join(
        b"data: " + json.dumps(item, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n" for item in items
    )


def _require(body: Any, key: str) -> Any:
    """``json.at(key)``: a missing key or a non-object body is a 400, with nlohmann's wording."""
    if not isinstance(body, dict):
        raise RequestError(f"[json.exception.type_error.304] cannot use at() with {json_type_name(body)}")
    if key not in body:
        raise RequestError(f"[json.exception.out_of_range.403] key '{key}' not found")
    return body[key]


def _int_field(body: dict[str, Any], key: str, default: int) -> int:
    """``json_value(body, key, default)``: a missing or mistyped value gives the default."""
    value = body.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


# --------------------------------------------------------------------------------------------------------
# Slots and generation


@dataclass(eq=False)
class Slot:
    """One llama-server slot: its cached tokens and what /slots reports about it."""

    id: int
    n_ctx: int
    tokens: list[int] = field(default_factory=list)
    processing: bool = False
    id_task: int | None = None  # the current or last task; None until the slot has run one
    t_last_used: int = -1
    n_prompt_processed: int = 0
    n_prompt_cached: int = 0
    n_decoded: int = 0
    n_remain: int = -1
    params: dict[str, Any] = field(default_factory=dict)

    def release(self) -> None:
        """End of a task: idle, marked used now (LRU), stats reset like llama-server's slot.reset()."""
        self.processing = False
        self.t_last_used = time.monotonic_ns() // 1000
        self.n_prompt_processed = self.n_prompt_cached = self.n_decoded = 0
        self.n_remain = -1

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.id,
            "n_ctx": self.n_ctx,
            "speculative": False,
            "is_processing": self.processing,
        }
        if self.id_task is not None:
            data["id_task"] = self.id_task
            data["n_prompt_tokens"] = len(self.tokens)
            data["n_prompt_tokens_processed"] = self.n_prompt_processed
            data["n_prompt_tokens_cache"] = self.n_prompt_cached
            data["params"] = self.params
            data["next_token"] = [
                {
                    "has_next_token": self.processing,
                    "has_new_line": False,
                    "n_remain": self.n_remain,
                    "n_decoded": self.n_decoded,
                }
            ]
        return data


class ClientGone(Exception):
    """The client disconnected mid-generation; llama-server then cancels the task and frees the slot."""


@dataclass
class Generation:
    """One completion task in flight, with what its responses report."""

    kind: str  # "native" (/completion), "oai_cmpl" (/v1/completions) or "oai_chat"
    id_task: int
    slot: Slot
    prompt: list[int]
    n_predict: int
    stream: bool
    return_tokens: bool
    include_usage: bool
    params: dict[str, Any]
    cache_n: int = 0
    generated: list[int] = field(default_factory=list)
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    completion_id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(16))
    created: int = field(default_factory=lambda: int(time.time()))

    def timings(self) -> dict[str, Any]:
        prompt_n = len(self.prompt) - self.cache_n
        predicted_n = len(self.generated)
        return {
            "cache_n": self.cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1e3 * prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / predicted_n if predicted_n else 0.0,
            "predicted_per_second": 1e3 * predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0,
        }

    def usage(self) -> dict[str, Any]:
        n = len(self.generated)
        return {
            "completion_tokens": n,
            "prompt_tokens": len(self.prompt),
            "total_tokens": n + len(self.prompt),
            "prompt_tokens_details": {"cached_tokens": self.cache_n},
        }


class StubServer:
    """The HTTP side and the slot bookkeeping of one stub process."""

    def __init__(self, args: ServerArgs, knobs: Knobs, log: EventLog) -> None:
        self.args = args
        self.knobs = knobs
        self.log = log
        self.slots = [Slot(i, args.slot_n_ctx) for i in range(args.total_slots)]
        # llama-server's task loop: one thread owns the slots. Holding this condition's lock stands for
        # "the loop is busy", so a slow save/restore stalls generation and /slots like the real one.
        self.task_loop = asyncio.Condition()
        # The RAM prompt cache (--cache-ram, 0 disables it): token lists of prompts evicted from slots.
        self.prompt_cache: list[list[int]] | None = [] if args.cache_ram_mib != 0 else None
        self.ready = False
        self.terminating = False
        self.next_task_id = 0
        self.n_completion_requests = 0
        self.addresses: list[str] = []

    # ---- process lifecycle ------------------------------------------------------------------------------

    async def serve(self) -> int:
        """Listen first, then "load" (503 meanwhile), then serve until a signal ends the process."""
        app = self.make_app()
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        for host in self.args.hosts:
            try:
                sock, address = bind_socket(host, self.args.port)
            except OSError as exc:
                eprint(
                    f"srv          start: couldn't bind HTTP server socket, hostname: {host}, "
                    f"port: {self.args.port} ({exc.strerror})"
                )
                eprint("srv           main: exiting due to HTTP server error")
                return 1
            await web.SockSite(runner, sock).start()
            self.addresses.append(address)
            eprint(f"stub: listening on {address}")
        self.log.write("listening", addresses=self.addresses)
        eprint(f"stub: loading model {self.args.model or '(none)'}")
        self._chatter()
        await asyncio.sleep(self.knobs.load_seconds)
        if self.knobs.crash_at_load is not None:
            eprint(f"srv     load_model: failed to load model, '{self.args.model}'")
            eprint("srv           main: exiting due to model loading error")
            self.log.write("crash", reason="load", code=self.knobs.crash_at_load)
            os._exit(self.knobs.crash_at_load)
        self.ready = True
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            if not (sig == signal.SIGTERM and self.knobs.ignore_sigterm):
                loop.add_signal_handler(sig, self._on_signal, sig)
        self.log.write("ready", addresses=self.addresses)
        eprint(f"stub: model loaded, {len(self.slots)} slots of n_ctx {self.args.slot_n_ctx}, ready")
        await asyncio.Event().wait()  # the process ends through os._exit
        return 0

    def _chatter(self) -> None:
        """``STUB_CHATTY``: long single lines, to prove slotkeeper passes output through unsplit and unblocked."""
        stream = sys.stdout if self.knobs.chatty_stream == "stdout" else sys.stderr
        for i in range(self.knobs.chatty):
            prefix = f"stub: chatty line {i} "
            stream.write(prefix + "x" * max(0, self.knobs.chatty_bytes - len(prefix)) + "\n")
            stream.flush()

    def _on_signal(self, sig: int) -> None:
        if self.terminating:
            eprint("Received second interrupt, terminating immediately.")
            os._exit(1)
        self.terminating = True
        eprint("stub: terminating")
        self.log.write("term", signal=sig)
        asyncio.get_running_loop().create_task(self._exit_when_loop_free())

    async def _exit_when_loop_free(self) -> None:
        """llama-server stops its task loop between tasks, so a save or restore under way completes first."""
        async with self.task_loop:
            await asyncio.sleep(0.05)  # let a just-finished save's response reach its client
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    def _crash(self, reason: str) -> None:
        self.log.write("crash", reason=reason, code=self.knobs.crash_code, signal=self.knobs.crash_signal)
        eprint(f"stub: injected crash ({reason})")
        if self.knobs.crash_signal:
            if self.knobs.crash_signal not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(self.knobs.crash_signal, signal.SIG_DFL)  # undo asyncio's handler, if any
            os.kill(os.getpid(), self.knobs.crash_signal)
            time.sleep(1)  # the default action happens right away; this is only a fallback
        os._exit(self.knobs.crash_code)

    # ---- HTTP plumbing ----------------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=256 * 1024 * 1024)
        r = app.router
        r.add_get("/health", self.get_health)
        r.add_get("/v1/health", self.get_health)
        r.add_get("/props", self.get_props)
        r.add_get("/models", self.get_models)
        r.add_get("/v1/models", self.get_models)
        r.add_get("/metrics", self.get_metrics)
        r.add_get("/slots", self.get_slots)
        r.add_post("/slots/{id_slot}", self.post_slots)
        r.add_post("/completion", self.post_completion)
        r.add_post("/completions", self.post_completion)
        r.add_post("/v1/completions", self.post_completion_oai)
        r.add_post("/chat/completions", self.post_chat)
        r.add_post("/v1/chat/completions", self.post_chat)
        r.add_post("/tokenize", self.post_tokenize)
        r.add_post("/apply-template", self.post_apply_template)
        r.add_post("/detokenize", self.post_detokenize)
        app.on_response_prepare.append(self._default_headers)
        return app

    @staticmethod
    async def _default_headers(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["Server"] = "llama.cpp"
        response.headers.setdefault("Access-Control-Allow-Origin", "*")

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.log.write("request", request)
        response = await self._dispatch(request, handler)
        self.log.write("response", request, status=response.status)
        return response

    async def _dispatch(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """llama-server's pre-routing order: CORS preflight, loading state, API key; then the route."""
        if request.method == "OPTIONS":
            return web.Response(
                text="",
                content_type="text/html",
                headers={
                    "Access-Control-Allow-Credentials": "false",
                    "Access-Control-Allow-Methods": "GET, POST",
                    "Access-Control-Allow-Headers": "*",
                },
            )
        if not self.ready and request.path not in FRONTEND_PATHS:
            return middleware_error(LOADING_MESSAGE, "unavailable_error")
        if self.args.api_keys and request.path not in PUBLIC_PATHS and not self._api_key_ok(request):
            eprint("srv  log_server_r: unauthorized: Invalid API Key")
            return middleware_error("Invalid API Key", "authentication_error")
        if request.path in self.knobs.fail_paths:
            return error_response(f"stub: injected failure on {request.path}", "server_error")
        try:
            return await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed):
            return middleware_error("File Not Found", "not_found_error")
        except RequestError as exc:
            return error_response(exc.message, exc.error_type, **exc.extra)
        except web.HTTPException:
            raise
        except Exception as exc:  # noqa: BLE001  (ex_wrapper: anything else is a 500 with its text)
            return error_response(str(exc) or type(exc).__name__, "server_error")

    def _api_key_ok(self, request: web.Request) -> bool:
        key = request.headers.get("Authorization", "")
        if not key:
            key = request.headers.get("X-Api-Key", "")
        return key.removeprefix("Bearer ") in self.args.api_keys

    @staticmethod
    async def _read_json(request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise RequestError(f"[json.exception.parse_error.101] parse error: {exc}") from None

    def _new_task_id(self) -> int:
        task_id = self.next_task_id
        self.next_task_id += 1
        return task_id

    def slot_by_id(self, id_slot: int) -> Slot:
        """llama-server's get_slot_by_id: ``id_slot % slots.size()``, where the size_t divisor turns a
        negative id into a huge unsigned one first. Never fails, so a wrong id silently hits some slot."""
        return self.slots[(id_slot % 2**64) % len(self.slots)]

    # ---- simple endpoints -------------------------------------------------------------------------------

    async def get_health(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    def _default_params(self) -> dict[str, Any]:
        return {
            "n_predict": -1,
            "seed": 4294967295,
            "temperature": 0.8,
            "top_k": 40,
            "top_p": 0.95,
            "min_p": 0.05,
            "stream": False,
            "cache_prompt": True,
        }

    async def get_props(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "default_generation_settings": {"params": self._default_params(), "n_ctx": self.args.slot_n_ctx},
                "total_slots": len(self.slots),
                "model_alias": self.args.model_name,
                "model_ftype": "stub",
                "model_path": self.args.model,
                "modalities": {"vision": False, "video": False, "audio": False},
                "media_marker": "<__media__>",
                "endpoint_slots": self.args.endpoint_slots,
                "endpoint_props": False,
                "endpoint_metrics": self.args.endpoint_metrics,
                "ui": False,
                "ui_settings": {},
                "chat_template": "",
                "chat_template_caps": {},
                "bos_token": "",
                "eos_token": "",
                "build_info": BUILD_INFO,
                "is_sleeping": False,
                "cors_proxy_enabled": False,
            }
        )

    async def get_models(self, request: web.Request) -> web.Response:
        entry = {
            "id": self.args.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "llamacpp",
            "meta": {"n_ctx_train": DEFAULT_N_CTX, "n_vocab": 256},
        }
        return json_response(
            {
                "models": [{"name": self.args.model_name, "model": self.args.model_name}],
                "object": "list",
                "data": [entry],
            }
        )

    async def get_metrics(self, request: web.Request) -> web.Response:
        if not self.args.endpoint_metrics:
            raise RequestError(
                "This server does not support metrics endpoint. Start it with `--metrics`", "not_supported_error"
            )
        busy = sum(s.processing for s in self.slots)
        text = (
            f"# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing {busy}\n"
            f"# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 0\n"
        )
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def post_apply_template(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        messages = _require(body, "messages")
        if not isinstance(messages, list):
            raise RequestError("Expected 'messages' to be an array")
        return json_response({"prompt": chat_prompt(messages)})

    async def post_tokenize(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        tokens: list[Any] = []
        if isinstance(body, dict) and "content" in body:
            ids = tokenize(body["content"])
            if body.get("with_pieces"):
                for t in ids:
                    piece = bytes([t % 256])
                    try:
                        tokens.append({"id": t, "piece": piece.decode("utf-8")})
                    except UnicodeDecodeError:
                        tokens.append({"id": t, "piece": list(piece)})
            else:
                tokens = list(ids)
        return json_response({"tokens": tokens})

    async def post_detokenize(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        content = ""
        if isinstance(body, dict) and "tokens" in body:
            tokens = body["tokens"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise RequestError("[json.exception.type_error.302] type must be number")
            content = detokenize(tokens)
        return json_response({"content": content})

    # ---- slots ------------------------------------------------------------------------------------------

    async def get_slots(self, request: web.Request) -> web.Response:
        if not self.args.endpoint_slots:
            raise RequestError(
                "This server does not support slots endpoint. Start it with `--slots`", "not_supported_error"
            )
        async with self.task_loop:  # answered by the task loop, so it waits out a save/restore
            self._new_task_id()
            data = [slot.to_json() for slot in self.slots]
            n_idle = sum(not slot.processing for slot in self.slots)
        if request.query.get("fail_on_no_slot") and n_idle == 0:
            raise RequestError("no slot available", "unavailable_error")
        return json_response(data)

    async def post_slots(self, request: web.Request) -> web.Response:
        if self.args.slot_save_path is None:
            raise RequestError(
                "This server does not support slots action. Start it with `--slot-save-path`", "not_supported_error"
            )
        try:
            id_slot = c_stoi(request.match_info["id_slot"])
        except ValueError:
            raise RequestError("Invalid slot ID") from None
        action = request.query.get("action", "")
        if action in ("save", "restore"):
            body = await self._read_json(request)
            filename = _require(body, "filename")
            if not isinstance(filename, str):
                raise RequestError(
                    f"[json.exception.type_error.302] type must be string, but is {json_type_name(filename)}"
                )
            if not validate_filename(filename):
                raise RequestError("Invalid filename")
            if action == "save":
                return await self._save(request, id_slot, filename)
            return await self._restore(request, id_slot, filename)
        if action == "erase":
            return await self._erase(request, id_slot)
        raise RequestError("Invalid action")

    async def _save(self, request: web.Request, id_slot: int, filename: str) -> web.Response:
        """Write the slot's tokens in place (open "wb", no temp file), like llama_state_seq_save_file."""
        assert self.args.slot_save_path is not None
        path = self.args.slot_save_path + filename
        slot = self.slot_by_id(id_slot)
        async with self.task_loop:
            self._new_task_id()
            await self.task_loop.wait_for(lambda: not slot.processing)  # a busy slot defers the save
            t0 = time.perf_counter()
            if self.knobs.save_fail:
                self.log.write("save", request, id_slot=id_slot, slot=slot.id, filename=filename, ok=False)
                raise RequestError("Unable to save slot", "server_error")
            tokens = [] if self.knobs.save_zero else list(slot.tokens)
            data = encode_slot_file(tokens, self.args.model, self.knobs.bytes_per_token, self.knobs.state_version)
            try:
                with open(path, "wb") as f:
                    half = len(data) // 2
                    f.write(data[:half])
                    f.flush()
                    self.log.write(
                        "save_begin",
                        request,
                        id_slot=id_slot,
                        slot=slot.id,
                        filename=filename,
                        n_tokens=len(tokens),
                        n_bytes=len(data),
                    )
                    if self.knobs.save_seconds > 0:
                        await asyncio.sleep(self.knobs.save_seconds)
                    f.write(data[half:])
            except OSError as exc:
                eprint(f"llama_state_seq_save_file: error saving sequence state file: {exc}")
                self.log.write("save", request, id_slot=id_slot, slot=slot.id, filename=filename, ok=False)
                raise RequestError("Unable to save slot", "server_error") from None
            save_ms = (time.perf_counter() - t0) * 1e3
            self.log.write(
                "save",
                request,
                id_slot=id_slot,
                slot=slot.id,
                filename=filename,
                ok=True,
                n_saved=len(tokens),
                n_written=len(data),
            )
        return json_response(
            {
                "id_slot": id_slot,
                "filename": filename,
                "n_saved": len(tokens),
                "n_written": len(data),
                "timings": {"save_ms": save_ms},
            }
        )

    async def _restore(self, request: web.Request, id_slot: int, filename: str) -> web.Response:
        """Load a slot file; any failure (missing, foreign, truncated, other model) clears the slot."""
        assert self.args.slot_save_path is not None
        path = self.args.slot_save_path + filename
        slot = self.slot_by_id(id_slot)
        async with self.task_loop:
            self._new_task_id()
            await self.task_loop.wait_for(lambda: not slot.processing)
            self.log.write("restore_begin", request, id_slot=id_slot, slot=slot.id, filename=filename)
            t0 = time.perf_counter()
            if self.knobs.restore_seconds > 0:
                await asyncio.sleep(self.knobs.restore_seconds)
            try:
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError:
                    raise SlotFileError(RESTORE_INVALID) from None
                tokens = decode_slot_file(data, self.args.model, self.knobs.state_version)
                if len(tokens) > slot.n_ctx:
                    raise SlotFileError("Restored prompt does not fit in the slot context")
                if any(not 0 <= t < 256 for t in tokens):
                    raise SlotFileError("Invalid tokens in slot save file")
            except SlotFileError as exc:
                slot.tokens = []
                self.log.write(
                    "restore", request, id_slot=id_slot, slot=slot.id, filename=filename, ok=False, reason=str(exc)
                )
                raise RequestError(f"Unable to restore slot: {exc}") from None
            slot.tokens = tokens
            restore_ms = (time.perf_counter() - t0) * 1e3
            self.log.write(
                "restore",
                request,
                id_slot=id_slot,
                slot=slot.id,
                filename=filename,
                ok=True,
                n_restored=len(tokens),
                n_read=len(data),
            )
        return json_response(
            {
                "id_slot": id_slot,
                "filename": filename,
                "n_restored": len(tokens),
                "n_read": len(data),
                "timings": {"restore_ms": restore_ms},
            }
        )

    async def _erase(self, request: web.Request, id_slot: int) -> web.Response:
        slot = self.slot_by_id(id_slot)
        async with self.task_loop:
            self._new_task_id()
            await self.task_loop.wait_for(lambda: not slot.processing)
            n_erased = len(slot.tokens)
            slot.tokens = []
            self.log.write("erase", request, id_slot=id_slot, slot=slot.id, ok=True, n_erased=n_erased)
        return json_response({"id_slot": id_slot, "n_erased": n_erased})

    # ---- the prompt cache and slot choice ---------------------------------------------------------------

    def _cache_store(self, tokens: list[int]) -> None:
        """server_prompt_cache::alloc: skip a prompt already covered; drop entries the new one covers."""
        if self.prompt_cache is None or not tokens:
            return
        if any(common_prefix(entry, tokens) == len(tokens) for entry in self.prompt_cache):
            return
        self.prompt_cache[:] = [e for e in self.prompt_cache if common_prefix(e, tokens) != len(e)]
        self.prompt_cache.append(list(tokens))
        if self.args.cache_ram_mib > 0:  # the size limit, counting a token as the bytes it takes in a file
            limit = self.args.cache_ram_mib * 1024 * 1024
            per_token = 4 + self.knobs.bytes_per_token
            while len(self.prompt_cache) > 1 and sum(map(len, self.prompt_cache)) * per_token > limit:
                self.prompt_cache.pop(0)

    def _cache_load(self, slot: Slot, prompt: list[int]) -> None:
        """server_prompt_cache::load: swap in the cached prompt that keeps and matches more than the slot's."""
        if self.prompt_cache is None or not prompt:
            return
        lcp = common_prefix(slot.tokens, prompt)
        keep_best = lcp / len(slot.tokens) if slot.tokens else -1.0
        sim_best = lcp / len(prompt)
        best: int | None = None
        for index, entry in enumerate(self.prompt_cache):
            lcp_cur = common_prefix(entry, prompt)
            keep, sim = lcp_cur / len(entry), lcp_cur / len(prompt)
            if keep < 0.25:
                continue
            if keep_best < keep and sim_best < sim:
                keep_best, sim_best, best = keep, sim, index
        if best is not None:
            slot.tokens = self.prompt_cache.pop(best)

    def _select_slot(self, prompt: list[int], id_slot: int) -> Slot | None:
        """llama-server's get_available_slot; None means "defer" (no idle slot, or the requested one is busy)."""
        chosen = self.slot_by_id(id_slot) if id_slot != -1 else None
        update_cache = False
        sps = self.args.slot_prompt_similarity
        if sps != 0:
            best_lcp, best_sim = 0, 0.0
            for slot in self.slots:
                if id_slot != -1 and slot.id != id_slot:
                    continue
                if slot.processing or not slot.tokens or not prompt:
                    continue
                lcp = common_prefix(slot.tokens, prompt)
                sim = lcp / len(prompt)
                if sim > best_sim and sim > sps:
                    best_lcp, best_sim, chosen = lcp, sim, slot
            if chosen is not None and chosen.tokens:
                update_cache = best_lcp / len(chosen.tokens) < 0.5
        if chosen is None:
            t_last = -1
            for slot in self.slots:
                if slot.processing:
                    continue
                if chosen is None or slot.t_last_used <= t_last:
                    t_last, chosen = slot.t_last_used, slot
            update_cache = chosen is not None
        if chosen is None or chosen.processing:
            return None
        if update_cache and self.prompt_cache is not None:
            self._cache_store(chosen.tokens)
            self._cache_load(chosen, prompt)
        return chosen

    # ---- completions ------------------------------------------------------------------------------------

    async def post_completion(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "native")

    async def post_completion_oai(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "oai_cmpl")

    async def post_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "oai_chat")

    def _count_completion_request(self) -> None:
        self.n_completion_requests += 1
        if (
            self.knobs.crash_after_requests is not None
            and self.n_completion_requests >= self.knobs.crash_after_requests
        ):
            self._crash(f"completion request {self.n_completion_requests}")

    async def _completion(self, request: web.Request, kind: str) -> web.StreamResponse:
        self._count_completion_request()
        body = await self._read_json(request)
        if kind == "oai_chat":
            messages = _require(body, "messages")
            if not isinstance(messages, list):
                raise RequestError("Expected 'messages' to be an array")
            prompt = tokenize(chat_prompt(messages))
            n_predict = _int_field(
                body, "n_predict", _int_field(body, "max_completion_tokens", _int_field(body, "max_tokens", -1))
            )
        else:
            prompt = tokenize(_require(body, "prompt"))
            n_predict = _int_field(body, "n_predict", _int_field(body, "max_tokens", -1))
        if n_predict < 0:
            n_predict = DEFAULT_N_PREDICT
        stream = bool(body.get("stream", False))
        stream_options = body.get("stream_options")
        gen_params = {
            **self._default_params(),
            "n_predict": n_predict,
            "stream": stream,
            "cache_prompt": bool(body.get("cache_prompt", True)),
        }
        gen = await self._start_generation(
            kind=kind,
            prompt=prompt,
            n_predict=n_predict,
            stream=stream,
            id_slot=_int_field(body, "id_slot", -1),
            cache_prompt=gen_params["cache_prompt"],
            return_tokens=bool(body.get("return_tokens", False)),
            include_usage=isinstance(stream_options, dict) and bool(stream_options.get("include_usage")),
            params=gen_params,
        )
        try:
            if not stream:
                async with aclosing(self._generate(request, gen)) as tokens:
                    async for _ in tokens:
                        pass
                return json_response(self._final(gen))
            response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            async with aclosing(self._generate(request, gen)) as tokens:
                async for token in tokens:
                    await response.write(sse(self._partial(gen, token)))
            await response.write(sse(self._final(gen)))
            if kind != "native":
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        except (ClientGone, ConnectionError):
            await self._cancel(request, gen)
            return web.Response(status=499)  # never delivered: the client is gone
        except asyncio.CancelledError:
            asyncio.get_running_loop().create_task(self._cancel(request, gen))
            raise

    async def _start_generation(
        self,
        *,
        kind: str,
        prompt: list[int],
        n_predict: int,
        stream: bool,
        id_slot: int,
        cache_prompt: bool,
        return_tokens: bool,
        include_usage: bool,
        params: dict[str, Any],
    ) -> Generation:
        """Take a slot (waiting for one like a deferred task), evict idle slots, then "process" the prompt."""
        async with self.task_loop:
            id_task = self._new_task_id()
            slot = await self.task_loop.wait_for(lambda: self._select_slot(prompt, id_slot))
            assert slot is not None
            slot.processing = True
            slot.id_task = id_task
            slot.params = params
            slot.n_remain = n_predict
            if self.args.cache_idle_slots and self.prompt_cache is not None:
                for other in self.slots:
                    if not other.processing:
                        self._cache_store(other.tokens)
                        if self.args.unified:
                            other.tokens = []
            gen = Generation(
                kind=kind,
                id_task=id_task,
                slot=slot,
                prompt=prompt,
                n_predict=n_predict,
                stream=stream,
                return_tokens=return_tokens,
                include_usage=include_usage,
                params=params,
            )
            if prompt and len(prompt) >= slot.n_ctx:
                self._release(slot)
                raise RequestError(
                    f"request ({len(prompt)} tokens) exceeds the available context size ({slot.n_ctx} tokens), "
                    "try increasing it",
                    "exceed_context_size_error",
                    n_prompt_tokens=len(prompt),
                    n_ctx=slot.n_ctx,
                )
            t0 = time.perf_counter()
            cache_n = common_prefix(slot.tokens, prompt) if cache_prompt else 0
            if prompt and cache_n >= len(prompt):
                cache_n = len(prompt) - 1  # llama-server always evaluates at least the last prompt token
            gen.cache_n = cache_n
            slot.tokens = list(prompt)
            slot.n_prompt_cached = cache_n
            slot.n_prompt_processed = len(prompt) - cache_n
            gen.prompt_ms = (time.perf_counter() - t0) * 1e3
            if not prompt:  # llama-server answers an empty prompt at once, generating nothing
                gen.n_predict = 0
            else:
                gen.n_predict = min(n_predict, slot.n_ctx - len(prompt))
            return gen

    async def _generate(self, request: web.Request, gen: Generation) -> AsyncGenerator[int, None]:
        """Yield each generated token, keeping the slot busy; frees it at the end (the caller on disconnect).

        The previous token enters the slot's cache as each new one is produced, so a finished slot holds
        prompt + generated tokens minus the last one, as in llama-server.
        """
        tokens = generate_tokens(gen.prompt, gen.n_predict)
        t0 = time.perf_counter()
        for i, token in enumerate(tokens):
            if self.knobs.token_seconds > 0:
                await asyncio.sleep(self.knobs.token_seconds)
            if request.transport is None or request.transport.is_closing():
                raise ClientGone()
            async with self.task_loop:  # stalls while a save/restore holds the task loop
                if i > 0:
                    gen.slot.tokens.append(tokens[i - 1])
                gen.generated.append(token)
                gen.slot.n_decoded = i + 1
                gen.slot.n_remain = gen.n_predict - (i + 1)
            gen.predicted_ms = (time.perf_counter() - t0) * 1e3
            yield token
        async with self.task_loop:
            gen.slot.n_remain = 0
            self._release(gen.slot)

    async def _cancel(self, request: web.Request, gen: Generation) -> None:
        async with self.task_loop:
            if gen.slot.processing and gen.slot.id_task == gen.id_task:
                self._release(gen.slot)
                self.log.write(
                    "cancelled", request, id_slot=gen.slot.id, id_task=gen.id_task, n_decoded=len(gen.generated)
                )
                eprint(f"stub: slot {gen.slot.id}: task {gen.id_task} cancelled, client disconnected")

    def _release(self, slot: Slot) -> None:
        """Free a slot; the caller holds the task loop, whose waiters (deferred tasks) are woken."""
        slot.release()
        self.task_loop.notify_all()

    # ---- response bodies --------------------------------------------------------------------------------

    def _partial(self, gen: Generation, token: int) -> Any:
        piece = detokenize([token])
        if gen.kind == "native":
            return {
                "index": 0,
                "content": piece,
                "tokens": [token],
                "stop": False,
                "id_slot": gen.slot.id,
                "tokens_predicted": len(gen.generated),
                "tokens_evaluated": len(gen.prompt),
            }
        head = {
            "created": int(time.time()),
            "id": gen.completion_id,
            "model": self.args.model_name,
            "system_fingerprint": BUILD_INFO,
        }
        if gen.kind == "oai_cmpl":
            return {
                "choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": None}],
                **head,
                "object": "text_completion",
            }
        chunks = []
        if len(gen.generated) == 1:  # OpenAI clients expect the role in a first chunk of its own
            chunks.append(
                {
                    "choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}],
                    **head,
                    "object": "chat.completion.chunk",
                }
            )
        chunks.append(
            {
                "choices": [{"finish_reason": None, "index": 0, "delta": {"content": piece}}],
                **head,
                "object": "chat.completion.chunk",
            }
        )
        return chunks

    def _final(self, gen: Generation) -> Any:
        text = "" if gen.stream else detokenize(gen.generated)
        timings = gen.timings()
        finish_reason = "length"
        head = {"created": int(time.time()), "model": self.args.model_name, "system_fingerprint": BUILD_INFO}
        if gen.kind == "native":
            return {
                "index": 0,
                "content": text,
                "tokens": list(gen.generated) if gen.return_tokens and not gen.stream else [],
                "id_slot": gen.slot.id,
                "stop": True,
                "model": self.args.model_name,
                "tokens_predicted": len(gen.generated),
                "tokens_evaluated": len(gen.prompt),
                "generation_settings": gen.params,
                "prompt": detokenize(gen.prompt),
                "has_new_line": False,
                "truncated": False,
                "stop_type": "limit" if gen.generated else "none",
                "stopping_word": "",
                "tokens_cached": len(gen.slot.tokens),
                "timings": timings,
            }
        if gen.kind == "oai_cmpl":
            return {
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
                **head,
                "object": "text_completion",
                "usage": gen.usage(),
                "id": gen.completion_id,
                "timings": timings,
            }
        if not gen.stream:
            return {
                "choices": [
                    {"finish_reason": finish_reason, "index": 0, "message": {"role": "assistant", "content": text}}
                ],
                **head,
                "object": "chat.completion",
                "usage": gen.usage(),
                "id": gen.completion_id,
                "timings": timings,
            }
        chunks = [
            {
                "choices": [{"finish_reason": finish_reason, "index": 0, "delta": {}}],
                **head,
                "id": gen.completion_id,
                "object": "chat.completion.chunk",
            }
        ]
        if gen.include_usage:
            chunks.append(
                {
                    "choices": [],
                    **head,
                    "id": gen.completion_id,
                    "object": "chat.completion.chunk",
                    "usage": gen.usage(),
                }
            )
        chunks[-1]["timings"] = timings
        return chunks


def chat_prompt(messages: list[Any]) -> str:
    """The stub's chat template: the message contents concatenated (text parts of a content list too)."""
    out: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "".join(out)


def bind_socket(host: str, port: int) -> tuple[socket.socket, str]:
    """Bind like cpp-httplib: a ``*.sock`` host is a unix socket, never unlinked first (an existing file
    makes the bind fail) nor removed at exit; otherwise TCP with SO_REUSEADDR, port 0 meaning any."""
    if host.endswith(".sock"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(host)
            sock.listen(512)
        except OSError:
            sock.close()
            raise
        return sock, f"unix://{host}"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    bound_port = sock.getsockname()[1]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    return sock, f"http://{shown}:{bound_port}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse like llama-server (exit 1 on a bad command line), then serve."""
    argv = list(sys.argv[1:] if argv is None else argv)
    knobs = Knobs.from_env(os.environ)
    # llama-server installs its SIGTERM/SIGINT handler only after the model is loaded; until then the
    # default action (death by the signal) applies. SIGINT would otherwise be Python's KeyboardInterrupt.
    signal.signal(signal.SIGTERM, signal.SIG_IGN if knobs.ignore_sigterm else signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    log = EventLog(knobs.log_path)
    try:
        args = parse_args(argv, os.environ)
    except UsageError as exc:
        eprint(str(exc))
        return 1
    log.write("start", argv=argv)
    eprint(f"stub: pid {os.getpid()}, argv {argv}")
    return asyncio.run(StubServer(args, knobs, log).serve())


if __name__ == "__main__":
    sys.exit(main())
