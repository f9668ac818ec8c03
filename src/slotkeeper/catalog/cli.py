"""The command lines of `slotkeeper ls` and `slotkeeper prune`: arguments in, one-line errors, exit codes.

Bad input is one line on stderr and exit 2 (never argparse's usage dump, never a traceback); a shared tier
that fails is one line and exit 1. Everything else is the other modules' work.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from ..store.layout import cache_root
from .dirs import resolve_dirs
from .formats import CatalogError, RemoteFailure, display_path, parse_duration, parse_size, say
from .jsontext import dumps_indented
from .listing import render_listing, render_remote
from .match import expectation_from_args
from .prune import prune_dirs, report_removals
from .records import json_records, remote_json
from .remote_prune import prune_remote
from .scan import scan_dir
from .shared import ENV_REMOTE_STORE, list_remote, remote_config, remote_rows, remote_url

if TYPE_CHECKING:
    from ..remote.s3config import RemoteConfig

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
FLAG = argparse.BooleanOptionalAction  # --json / --no-json: the last one given wins


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input as one line (the caller prints it) instead of usage plus exit."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _split_dashdash(argv: list[str]) -> tuple[list[str], list[str] | None]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return list(argv), None


def _parse(parser: _Parser, argv: list[str]) -> argparse.Namespace | int:
    try:
        return parser.parse_args(argv)
    except _UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return int(exc.code or 0)


def _parser(prog: str, description: str, env: Mapping[str, str]) -> _Parser:
    parser = _Parser(prog=prog, description=description)
    parser.add_argument(
        "dirs",
        nargs="*",
        metavar="DIR",
        help=f"save directories (default: every one under {display_path(cache_root(env))})",
    )
    return parser


def _add_remote_arguments(parser: _Parser, what: str) -> None:
    parser.add_argument(
        "--remote", action=FLAG, default=False, help=f"{what} the shared tier instead of save directories"
    )
    parser.add_argument(
        "--remote-store",
        metavar="URL",
        help=f"the shared tier for --remote: s3://bucket/prefix (default: ${ENV_REMOTE_STORE}; "
        "credentials and endpoint from the AWS_* variables and profiles)",
    )


def _resolve_remote(parsed: argparse.Namespace, env: Mapping[str, str]) -> RemoteConfig | None:
    """The RemoteConfig for --remote (None without it); bad combinations are CatalogErrors."""
    if not parsed.remote:
        if parsed.remote_store:
            raise CatalogError("--remote-store is used with --remote")
        return None
    if parsed.dirs:
        raise CatalogError("give DIR or --remote, not both")
    return remote_config(remote_url(parsed.remote_store, env), env)


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Without the cyclic garbage collector for the command's length: a listing builds some ten objects per
    entry and frees none of them before it ends, so the collector's passes only walk a growing heap again and
    again (at 20,000 entries they took a second of ls's 2.6 s). Reference counting still frees everything."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _main(parser: _Parser, argv: list[str], command: Callable[[argparse.Namespace, list[str] | None], int]) -> int:
    """Parse `argv` (llama-server's arguments after `--` aside) and run `command`; its complaints are one line:
    bad input exits 2, a shared tier that failed exits 1."""
    own, llama_argv = _split_dashdash(argv)
    parsed = _parse(parser, own)
    if isinstance(parsed, int):
        return parsed
    try:
        with _no_cyclic_gc():
            return command(parsed, llama_argv)
    except CatalogError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED if isinstance(exc, RemoteFailure) else EXIT_USAGE


def ls_main(argv: list[str], env: Mapping[str, str] | None = None, now: float | None = None) -> int:
    """`slotkeeper ls [DIR... | --remote [--remote-store URL]] [--json] [-- LLAMA-SERVER ARGS]`."""
    env = os.environ if env is None else env
    parser = _parser(
        "slotkeeper ls",
        (
            "List the conversation store: one table per save directory, one row per entry (and per "
            "quarantined entry, and per slot file a next start takes over). The status is judged against the "
            "configuration of the directory's most recently used entry (the last run's). With llama-server "
            "arguments after --, a match column tells whether each entry fits them (what is known without starting "
            "llama-server: the model file, KV flags, and the slot count and context size when -np / -c are given). "
            "With --remote: the shared tier's entries, one table per namespace."
        ),
        env,
    )
    parser.add_argument(
        "--json", action=FLAG, default=False, help="one JSON object per directory and per row, for scripts"
    )
    _add_remote_arguments(parser, "list")
    return _main(parser, argv, lambda parsed, llama_argv: _ls(parsed, llama_argv, env, now))


def _ls(parsed: argparse.Namespace, llama_argv: list[str] | None, env: Mapping[str, str], now: float | None) -> int:
    expectation = expectation_from_args(llama_argv, env) if llama_argv else None
    remote = _resolve_remote(parsed, env)
    dirs = [] if remote else [scan_dir(d) for d in resolve_dirs(parsed.dirs, env)]
    now = time.time() if now is None else now
    if remote is not None:
        by_namespace = remote_rows(remote.url, list_remote(remote))
        say(
            dumps_indented(remote_json(remote.url, by_namespace, now, expectation))
            if parsed.json
            else render_remote(remote.url, by_namespace, now, expectation)
        )
    elif parsed.json:
        say(dumps_indented(json_records(dirs, now, expectation)))
    elif not dirs:
        say(f"no slotkeeper save directories under {display_path(cache_root(env))}")
    else:
        say(render_listing(dirs, now, expectation))
    return EXIT_OK


def _prune_parser(env: Mapping[str, str]) -> _Parser:
    parser = _parser(
        "slotkeeper prune",
        (
            "Delete entries of the conversation store (each manifest, then its .bin, or the blocks no remaining "
            "manifest uses), quarantined entries, and slot files of the slot-file layout; and blocks no manifest "
            "uses. No block is removed while a manifest in entries/ cannot be read, nor under --force. snapshots/ "
            "(clients' own files) and partial files are never touched, nor a directory a running slotkeeper holds "
            "(unless --force). With --remote: entries of the shared tier (--older-than, --max-total, "
            "--other-configs with llama-server arguments)."
        ),
        env,
    )
    parser.add_argument(
        "--older-than", metavar="AGE", help="remove entries last used longer ago than AGE (30min, 12h, 7d, 2w)"
    )
    parser.add_argument(
        "--max-total",
        metavar="SIZE",
        help="then remove the least recently used entries until those of all DIRs take at most SIZE on disk "
        "(each block once; 500MB, 20GB)",
    )
    for flag, text in (
        ("--quarantine", "remove everything in quarantine/"),
        ("--missing-models", "remove entries whose manifest names a model file that no longer exists"),
        (
            "--other-configs",
            "remove entries saved for another configuration: than the llama-server arguments "
            "after --, or without them, than the directory's most recently used entry (ls's status column)",
        ),
        ("--force", "prune a directory even while a slotkeeper uses it"),
        ("--dry-run", "only list what would be removed"),
    ):
        parser.add_argument(flag, action=FLAG, default=False, help=text)
    _add_remote_arguments(parser, "prune")
    return parser


def _prune_criteria(parsed: argparse.Namespace, llama_argv: list[str] | None, env: Mapping[str, str]) -> dict[str, Any]:
    """The criteria plan_rows takes, from the arguments; bad input is a CatalogError."""
    if not (
        parsed.older_than or parsed.max_total or parsed.quarantine or parsed.missing_models or parsed.other_configs
    ):
        raise CatalogError(
            "nothing to prune: give --older-than, --max-total, --quarantine, --missing-models or --other-configs"
        )
    if llama_argv is not None and not parsed.other_configs:
        raise CatalogError("llama-server arguments after -- are only used with --other-configs")
    criteria = {
        "older_than": parse_duration(parsed.older_than) if parsed.older_than else None,
        "max_total": parse_size(parsed.max_total) if parsed.max_total else None,
        "other_configs": parsed.other_configs,
        "expectation": expectation_from_args(llama_argv, env) if llama_argv else None,
    }
    if parsed.remote:
        for given, flag in (
            (parsed.quarantine, "--quarantine"),
            (parsed.missing_models, "--missing-models"),
            (parsed.force, "--force"),
        ):
            if given:
                raise CatalogError(f"{flag} applies to save directories, not to --remote")
        if parsed.other_configs and criteria["expectation"] is None:
            raise CatalogError("--other-configs with --remote needs llama-server arguments after --")
    return criteria


def prune_main(argv: list[str], env: Mapping[str, str] | None = None, now: float | None = None) -> int:
    """`slotkeeper prune [DIR... | --remote [--remote-store URL]] [--older-than 7d] [--max-total 20GB] [--quarantine]
    [--missing-models] [--other-configs] [--force] [--dry-run] [-- LLAMA-SERVER ARGS]`."""
    env = os.environ if env is None else env
    return _main(_prune_parser(env), argv, lambda parsed, llama_argv: _prune(parsed, llama_argv, env, now))


def _prune(parsed: argparse.Namespace, llama_argv: list[str] | None, env: Mapping[str, str], now: float | None) -> int:
    criteria = _prune_criteria(parsed, llama_argv, env)
    remote = _resolve_remote(parsed, env)
    paths = [] if remote else resolve_dirs(parsed.dirs, env)
    now = time.time() if now is None else now
    if remote is not None:
        outcomes, then = prune_remote(remote, now, parsed.dry_run, **criteria)
        failed = report_removals(outcomes, parsed.dry_run, then)
    else:
        failed = prune_dirs(
            paths,
            now,
            dry_run=parsed.dry_run,
            force=parsed.force,
            quarantine=parsed.quarantine,
            missing_models=parsed.missing_models,
            **criteria,
        )
    return EXIT_FAILED if failed else EXIT_OK
