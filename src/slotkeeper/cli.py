"""`slotkeeper <llama-server args...>`: the entry point.

Run mode reads its command line, spawns llama-server, and only then validates it and imports uvloop and the
daemon, so those imports overlap the model load instead of adding to it (pydantic only when slotkeeper's own
options were given: config.py says why).
"""

from __future__ import annotations

import gc
import os
import signal
import sys

from .cmdline import ConfigError, info_command, lock_save_dir, plan_launch, raw_flag

EXIT_USAGE = 2
EXIT_INTERNAL = 70
SUBCOMMANDS = ("demo", "ls", "prune", "help", "version")

USAGE = """\
usage: slotkeeper [SLOTKEEPER OPTIONS --] LLAMA-SERVER ARGS...
       slotkeeper demo                      several chats and a model swap on a real llama-server, cold vs warm
       slotkeeper ls [DIR...] [--json]      the conversations on disk (slotkeeper ls --help; --remote too)
       slotkeeper prune [DIR...] ...        remove old, oversized, quarantined or orphaned conversations

Runs llama-server as a private child and keeps every conversation's KV cache across restarts: places each
chat on the slot that holds it (restoring it from the store first if need be), saves a slot only when it is
about to be reused, when idle and at stop, and restores the most recent chats before /health turns 200.
Every argument goes to llama-server, except --host/--port (the public address slotkeeper listens on) and
--slot-save-path (where conversations live; default: a per-model directory under ~/.cache/slotkeeper).

slotkeeper options (before --, or as SLOTKEEPER_<NAME> environment variables; .env is read):
"""


def usage() -> str:
    import dataclasses

    from .config import Options

    lines = [USAGE]
    for spec in dataclasses.fields(Options):
        flag = "--" + spec.name.replace("_", "-")
        if isinstance(spec.default, bool):
            default = f" (on; --no-{flag[2:]} turns it off)" if spec.default else ""
        else:
            default = "" if spec.default is None else f" (default {spec.default})"
        lines.append(f"  {flag:<28} {spec.metadata['description']}{default}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        return run_subcommand(argv[0], argv[1:])
    if argv in (["--help"], ["-h"]):
        print(usage())
        return 0
    return run(argv)


def run_subcommand(name: str, args: list[str]) -> int:
    if name == "demo":
        from .demo import main as demo_main

        return demo_main(args)
    if name == "ls":
        from .catalog.cli import ls_main

        return ls_main(args)
    if name == "prune":
        from .catalog.cli import prune_main

        return prune_main(args)
    if name == "version":
        from importlib.metadata import version

        print(f"slotkeeper {version('slotkeeper')}")
        return 0
    print(usage())
    return 0


def run(argv: list[str]) -> int:
    early_signals: list[int] = []
    # Until the event loop installs its handlers, a signal is only recorded (the daemon acts on it first thing).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: early_signals.append(signum))

    try:
        load_dotenv_file()
        if (command := info_command(argv, os.environ)) is not None:
            # Straight to llama-server, which prints and exits 0: run as a daemon, it would listen on the public
            # port and create and lock a save directory (either may clash with a slotkeeper already serving), then
            # report the exit during startup as a failure.
            try:
                os.execv(command[0], command)
            except OSError as exc:
                return cannot_start(command[0], exc)
        plan = plan_launch(argv, os.environ)
        lock_save_dir(plan.save_dir)  # held until the process exits
    except ConfigError as exc:
        print(f"slotkeeper: error: {exc}", file=sys.stderr)
        return exc.exit_code

    from .llama.supervisor import (
        ChildProcess,
        SocketPathTooLongError,
        make_endpoint,
        remove_runtime_dir,
        remove_stale_runtime_dirs,
    )

    try:
        endpoint = make_endpoint(raw_flag(plan.own, "child_tcp"))
    except SocketPathTooLongError as exc:  # a long $TMPDIR, and no /tmp
        print(f"slotkeeper: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # a read-only or full temporary directory
        reason = exc.strerror or exc
        print(
            f"slotkeeper: error: cannot create llama-server's socket directory in {exc.filename}: {reason} "
            "(set TMPDIR to a writable directory)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        try:
            child = ChildProcess(plan.child_command(endpoint.host_arg), endpoint, plan.child_env(os.environ))
        except OSError as exc:
            return cannot_start(plan.binary[0], exc)
        # The child is loading now; the heavy imports below overlap its load instead of adding to it.
        remove_stale_runtime_dirs()
        try:
            from .config import validate

            config = validate(plan)
        except ConfigError as exc:
            child.kill_now()
            print(f"slotkeeper: error: {exc}", file=sys.stderr)
            return exc.exit_code
        from .log import log, setup_logging

        setup_logging(config.options.log_level, config.options.log_format)
        if (hint := uncached_bytecode_hint()) is not None:
            log.info("%s", hint)
        try:
            # Neither the early reads (the store's prescan) nor importing the daemon makes garbage cycles, only
            # objects that live as long as the process: the collector stays off until the prescan is done, then
            # what they built is frozen and it is turned on; its passes over them (~15 ms of the imports, and a
            # collection of the whole store at the prescan's end, 26-46 ms at 20,000 entries) are saved. The
            # reads start first: at 20,000 entries the prescan is what a start waits for.
            gc.disable()
            from .early import start_early_reads

            reads = start_early_reads(config)
            reads.scanned.add_done_callback(lambda _: collect_from_now_on())
            import uvloop

            from .daemon import Daemon

            try:
                child.confirm_started()  # the exec, long done by now (supervisor.py says why it was not awaited)
            except OSError as exc:
                return cannot_start(plan.binary[0], exc)
            return uvloop.run(Daemon(config, child, early_signals, reads).run())
        except Exception as exc:  # noqa: BLE001 - one line, never a traceback; the child must not outlive us
            child.kill_now()
            log.error("internal error: %r", exc, exc_info=config.options.log_level == "debug")
            return EXIT_INTERNAL
    finally:
        remove_runtime_dir(endpoint.runtime_dir)


def load_dotenv_file() -> None:
    """The current directory's .env, when there is one (none when that directory has been removed)."""
    try:
        dotenv_file = os.path.join(os.getcwd(), ".env")
    except OSError:  # the current directory deleted: llama-server runs there, and so does slotkeeper
        return
    if not os.path.isfile(dotenv_file):  # python-dotenv costs ~50 ms to import: only when there is a .env to read
        return
    from dotenv import load_dotenv

    try:
        load_dotenv(dotenv_file, override=False)
    except OSError as exc:
        raise ConfigError(f"cannot read .env: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError("cannot read .env: not UTF-8 text") from None
    except ValueError as exc:  # a value os.environ refuses (a NUL byte)
        raise ConfigError(f"cannot read .env: {exc}") from None


def cannot_start(binary: str, exc: OSError) -> int:
    """The one line for a llama-server that could not be started (forked, or exec'd), and the exit code."""
    print(f"slotkeeper: error: cannot start {binary}: {exc.strerror or exc}", file=sys.stderr)
    return EXIT_USAGE


def uncached_bytecode_hint() -> str | None:
    """One line when slotkeeper's modules were compiled from source at this start, not read from cached bytecode
    (PYTHONDONTWRITEBYTECODE, as container images often set, or a read-only install): that costs every start
    ~0.1 s, inside llama-swap's health check budget, and one compileall saves it."""
    from . import cmdline  # imported before this (not run as __main__): Python wrote its bytecode if it could

    cached = getattr(cmdline, "__cached__", None)
    if not cached or os.path.exists(cached):
        return None
    package = os.path.dirname(cmdline.__file__ or "")
    return (
        "slotkeeper's modules have no cached bytecode, so every start compiles them (~0.1 s): "
        f"python -m compileall -q {package} once (or install with uv tool install --compile-bytecode)"
    )


def collect_from_now_on() -> None:
    """Turn the collector on, after freezing what start-up built (modules, the store's entries and index: all
    live as long as the process), so that no collection walks it again."""
    gc.freeze()
    gc.enable()


def entry() -> None:
    """The console script: exit without tearing down the interpreter (~80 ms that llama-swap's budget pays for)."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
