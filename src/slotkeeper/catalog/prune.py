"""`slotkeeper prune`: what to delete (the criteria, over local rows or the shared tier's) and deleting it.

A pair goes manifest first (entries.remove_pair; remotely Bucket.delete), so an interruption never leaves a
manifest naming a file that is gone. A directory is pruned under the store's own lock, so no slotkeeper starts
on it meanwhile; one that a running slotkeeper holds is skipped unless --force, and a pair that changed since
it was listed (that slotkeeper used it) is kept.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..log import fmt_bytes
from ..store.entries import Status, pair_paths, remove_pair
from ..store.layout import StoreLockedError, lock_store
from .dirs import LockState, lock_pid, lock_state
from .formats import CatalogError, count, display_path, format_age, say
from .listed import Kind, Listed
from .local_rows import FileStat, Row
from .match import Expectation
from .remote_rows import RemoteRow
from .scan import SaveDir, scan_dir
from .shared import open_bucket, remote_rows, run_remote
from .statuses import COMPARABLE

if TYPE_CHECKING:
    from ..remote.s3config import RemoteConfig


@dataclass(frozen=True, kw_only=True)
class Removal:
    """One pair prune deletes."""

    row: Listed
    reason: str
    age: float

    @property
    def nbytes(self) -> int:
        return self.row.disk_bytes

    @property
    def label(self) -> str:
        return self.row.label


Outcome = tuple[Removal, str | None]  # a removal, and why it did not happen (None: done)


def model_missing(row: Listed) -> bool:
    """The manifest names a model file that existed when the entry was saved and is gone now."""
    model = row.model
    return bool(model and os.path.isabs(model) and "model_sha256" in row.fingerprint and not os.path.exists(model))


def plan_prune(  # noqa: PLR0913 - one keyword per `slotkeeper prune` option
    dirs: Sequence[SaveDir],
    now: float,
    *,
    older_than: float | None = None,
    max_total: int | None = None,
    quarantine: bool = False,
    missing_models: bool = False,
    other_configs: bool = False,
    expectation: Expectation | None = None,
) -> list[Removal]:
    """What prune removes, in order. --max-total counts the entries (and slot files) of all `dirs` together and
    removes the least recently used first."""
    rows = [row for save_dir in dirs for row in save_dir.rows if row.kind is not Kind.QUARANTINED]
    removals = plan_rows(
        rows,
        now,
        older_than=older_than,
        max_total=max_total,
        missing_models=missing_models,
        other_configs=other_configs,
        expectation=expectation,
    )
    if quarantine:
        for save_dir in dirs:
            for row in save_dir.of_kind(Kind.QUARANTINED):
                removals.append(Removal(row=row, reason="quarantined", age=now - row.last_used))
    return removals


def plan_rows(  # noqa: PLR0913 - one keyword per `slotkeeper prune` option
    rows: Iterable[Listed],
    now: float,
    *,
    older_than: float | None = None,
    max_total: int | None = None,
    missing_models: bool = False,
    other_configs: bool = False,
    expectation: Expectation | None = None,
) -> list[Removal]:
    """The criteria, over local rows or the shared tier's."""
    removals: list[Removal] = []
    kept: list[Listed] = []
    for row in rows:
        if row.status is Status.LINK:
            continue  # not slotkeeper's: never followed, never removed
        age = now - row.last_used
        reason = None
        if missing_models and model_missing(row):
            reason = f"model gone: {row.model}"
        elif (
            other_configs
            and expectation is not None
            and row.status in COMPARABLE
            and (differences := expectation.differences(row.fingerprint))
        ):
            reason = f"not for these llama-server arguments: {differences[0]}"
        elif other_configs and expectation is None and row.status is Status.OTHER_CONFIGURATION:
            reason = row.reason
        elif older_than is not None and age > older_than:
            reason = f"unused for over {format_age(older_than)}"
        if reason:
            removals.append(Removal(row=row, reason=reason, age=age))
        else:
            kept.append(row)
    if max_total is not None:
        total = sum(r.disk_bytes for r in kept)
        for row in sorted(kept, key=lambda r: (r.last_used, r.sort_key)):
            if total <= max_total:
                break
            total -= row.disk_bytes
            reason = f"over --max-total {fmt_bytes(max_total)} (least recently used)"
            removals.append(Removal(row=row, reason=reason, age=now - row.last_used))
    return removals


def describe_removal(removal: Removal) -> str:
    tokens = removal.row.tokens
    details = [f"{tokens:,} tokens"] if tokens is not None else []
    details += [fmt_bytes(removal.nbytes), f"last used {format_age(removal.age)} ago"]
    return f"{removal.label} ({', '.join(details)}): {removal.reason}"


def report_removals(outcomes: Iterable[Outcome], dry_run: bool) -> bool:
    """One line per removal as it happens (or why it did not), then the totals; True when one failed."""
    verb = "would remove" if dry_run else "removed"
    counts = dict.fromkeys(Kind, 0)
    freed = seen = 0
    failed = False
    for removal, problem in outcomes:
        seen += 1
        if problem:
            failed = True
            print(f"slotkeeper prune: not removed: {removal.label}: {problem}", file=sys.stderr)
            continue
        say(f"{verb} {describe_removal(removal)}")
        freed += removal.nbytes
        counts[removal.row.kind] += 1
    if not seen:
        say("nothing to remove")
        return failed
    if counts[Kind.REMOTE]:
        parts = [count(counts[Kind.REMOTE], "remote entry", "remote entries")]
    else:
        parts = [count(counts[Kind.ENTRY], "entry", "entries")]
        if counts[Kind.SLOT_FILE]:
            parts.append(count(counts[Kind.SLOT_FILE], "slot file"))
        if counts[Kind.QUARANTINED]:
            parts.append(count(counts[Kind.QUARANTINED], "quarantined entry", "quarantined entries"))
    listed = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
    say(f"{verb} {listed}: {fmt_bytes(freed)}" + (" (dry run)" if dry_run else ""))
    return failed


# ---- save directories -------------------------------------------------------------------------------------------


def claim_dir(path: Path, dry_run: bool) -> tuple[int | None, LockState]:
    """prune's hold on a directory: the store's own lock (layout.lock_store, non-blocking) for the time it
    prunes, so no slotkeeper starts on it meanwhile. Only a directory that has a .lock is locked (nothing is
    created in one that never had a slotkeeper of the store's layout); a dry run only looks."""
    state = lock_state(path)
    if dry_run or not state.exists or state.held:
        return None, state
    try:
        return lock_store(path), state
    except StoreLockedError as exc:  # a slotkeeper started since we looked
        return None, LockState(exists=True, held=True, pid=lock_pid(str(exc)))


def remove_files(removal: Removal) -> str | None:
    """Delete a pair (entries.remove_pair: the manifest first); None when done, else why it stopped.

    A pair that changed since the scan (a running slotkeeper used it, under --force) is kept. Stopping after
    the manifest went leaves a .bin that the next start removes (or, for a slot file, never takes over
    without --restore-unverified).
    """
    row = removal.row
    assert isinstance(row, Row)
    bin_path, manifest_path = pair_paths(row.folder, row.name)
    for scanned, path in ((row.manifest_file, manifest_path), (row.bin, bin_path)):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue  # gone already: nothing of it to keep
        except OSError as exc:
            return f"{path.name}: {exc.strerror or exc}"
        if scanned is None or FileStat.identity_of(st) != scanned.identity:
            return f"{path.name} changed since it was listed (a running slotkeeper used it?); kept"
    try:
        remove_pair(row.folder, row.name)
    except OSError as exc:
        name = Path(exc.filename).name if exc.filename else row.name
        return f"{name}: {exc.strerror or exc}"
    return None


def prune_dirs(paths: Sequence[Path], now: float, *, dry_run: bool, force: bool, **criteria: Any) -> bool:
    """Claim, scan, plan over all `paths` together, remove and report; True when something failed."""
    failed = False
    held: list[int] = []
    try:
        dirs: list[SaveDir] = []
        for path in paths:
            fd, state = claim_dir(path, dry_run)
            if fd is not None:
                held.append(fd)
            if state.held:
                if not force:
                    failed = True
                    print(
                        f"slotkeeper prune: skipped {display_path(path)}: {state.describe()} "
                        "(--force prunes it anyway)",
                        file=sys.stderr,
                    )
                    continue
                say(f"pruning {display_path(path)} although it is {state.describe()} (--force)")
            try:
                dirs.append(scan_dir(path))
            except CatalogError as exc:
                failed = True
                print(f"slotkeeper prune: skipped {display_path(path)}: {exc}", file=sys.stderr)
        removals = plan_prune(dirs, now, **criteria)
        outcomes = ((r, None if dry_run else remove_files(r)) for r in removals)
        failed = report_removals(outcomes, dry_run) or failed
    finally:
        for fd in held:
            os.close(fd)
    return failed


# ---- the shared tier --------------------------------------------------------------------------------------------


def prune_remote(config: RemoteConfig, now: float, dry_run: bool, **criteria: Any) -> list[Outcome]:
    """List the shared tier, plan, and delete (each manifest first: Bucket.delete)."""
    from ..remote.bucket import RemoteError

    async def go() -> list[Outcome]:
        bucket = open_bucket(config)
        by_namespace = remote_rows(config.url, await bucket.list_all())
        outcomes: list[Outcome] = []
        for removal in plan_rows([row for rows in by_namespace.values() for row in rows], now, **criteria):
            problem = None
            if not dry_run:
                row = removal.row
                assert isinstance(row, RemoteRow)
                try:
                    await bucket.delete(row.namespace, row.id)
                except RemoteError as exc:
                    problem = str(exc)
            outcomes.append((removal, problem))
        return outcomes

    return run_remote(go)
