"""`slotkeeper prune`: what to delete (the criteria, over local rows or the shared tier's) and deleting it.

A pair goes manifest first (entries.remove_pair; remotely Bucket.delete), so an interruption never leaves a
manifest naming a file that is gone. A directory is pruned under the store's own lock, so no slotkeeper starts
on it meanwhile; one that a running slotkeeper holds is skipped unless --force, and a pair that changed since
it was listed (that slotkeeper used it) is kept.

An entry kept as blocks is its manifest: once the manifests went, the blocks no remaining manifest of the
directory names go too, with those no manifest named at all (a crash's). No block is removed while a manifest in
entries/ cannot be read (it may name any block), nor in a directory a running slotkeeper holds (--force: its
saves count on the blocks it knows): then only manifests go, and one line says so. Sizes and --max-total count
bytes on disk, each block once (blockuse.DiskUse). The shared tier's deletions are remote_prune.py's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..log import fmt_bytes
from ..store import blockfiles
from ..store.entries import Status, discard, pair_paths, remove_pair
from ..store.layout import BLOCKS_DIR, ENTRIES_DIR, StoreLockedError, lock_store
from .blockuse import DiskUse
from .dirs import LockState, lock_pid, lock_state
from .formats import CatalogError, count, display_path, format_age, say
from .listed import Kind, Listed
from .local_rows import FileStat, Row
from .match import Expectation
from .scan import SaveDir, scan_dir
from .statuses import COMPARABLE


@dataclass(frozen=True, kw_only=True)
class Removal:
    """One pair prune deletes."""

    row: Listed
    reason: str
    age: float
    freed: int | None = None  # what it frees on disk, after the removals before it (None: its disk_bytes)

    @property
    def nbytes(self) -> int:
        return self.row.disk_bytes if self.freed is None else self.freed

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
    """What prune removes, in order. --max-total counts the entries (and slot files) of all `dirs` together, on
    disk (each block once in its directory), and removes the least recently used first."""
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
    """The criteria, over local rows or the shared tier's. Each removal frees what it holds alone once those
    before it went (a block shared by two entries goes with the second)."""
    removals: list[Removal] = []
    kept: list[Listed] = []
    rows = [row for row in rows if row.status is not Status.LINK]  # not slotkeeper's: never followed or removed
    use = DiskUse(rows)
    for row in rows:
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
            removals.append(Removal(row=row, reason=reason, age=age, freed=use.remove(row)))
        else:
            kept.append(row)
    if max_total is not None:
        for row in sorted(kept, key=lambda r: (r.last_used, r.sort_key)):
            if use.total <= max_total:
                break
            freed = use.remove(row)
            reason = f"over --max-total {fmt_bytes(max_total)} (least recently used)"
            removals.append(Removal(row=row, reason=reason, age=now - row.last_used, freed=freed))
    return removals


def describe_removal(removal: Removal) -> str:
    row = removal.row
    tokens = row.tokens
    details = [f"{tokens:,} tokens"] if tokens is not None else []
    if row.in_blocks and row.size is not None:  # its state's size, and what goes with it (blocks it shares stay)
        details += [fmt_bytes(row.size), f"frees {fmt_bytes(removal.nbytes)}"]
    else:
        details.append(fmt_bytes(removal.nbytes))
    details.append(f"last used {format_age(removal.age)} ago")
    return f"{removal.label} ({', '.join(details)}): {removal.reason}"


def report_removals(
    outcomes: Iterable[Outcome], dry_run: bool, then: Callable[[], tuple[int, bool]] | None = None
) -> bool:
    """One line per removal as it happens (or why it did not), then what `then` does and says (the blocks:
    lines said, and whether something failed), then the totals; True when one failed."""
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
    said, then_failed = then() if then is not None else (0, False)
    failed = failed or then_failed
    if not seen:
        if not said:
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
    """Claim, scan, plan over all `paths` together, remove (then the blocks no manifest names) and report; True
    when something failed."""
    failed = False
    held: list[int] = []
    try:
        dirs: list[SaveDir] = []
        in_use: dict[Path, str] = {}  # pruned under --force: who holds it
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
                in_use[path] = state.describe()
            try:
                dirs.append(scan_dir(path))
            except CatalogError as exc:
                failed = True
                print(f"slotkeeper prune: skipped {display_path(path)}: {exc}", file=sys.stderr)
        sweep = BlockSweep(dirs, in_use, dry_run)
        removals = sweep.planned(plan_prune(dirs, now, **criteria))
        outcomes = ((r, sweep.remove(r)) for r in removals)
        failed = report_removals(outcomes, dry_run, sweep.settle) or failed
    finally:
        for fd in held:
            os.close(fd)
    return failed


class BlockSweep:
    """The blocks of the directories prune removes entries from.

    Once every removal is done (`settle`), the blocks no remaining manifest names go, and those no manifest
    named at all. Unless a manifest in entries/ cannot be read, or a running slotkeeper holds the directory
    (--force): then no block goes, one line says so, and a later prune removes them. Where blocks go, blocks/ is
    marked unclean before the first manifest of an entry kept as blocks goes (blockfiles.mark_unclean, as a save
    does: a crash before the end leaves the store's next start a sweep to do), and the marker goes once they
    went, the blocks being as the manifests say.
    """

    def __init__(self, dirs: Sequence[SaveDir], in_use: dict[Path, str], dry_run: bool) -> None:
        self.dirs = dirs
        self.in_use = in_use  # directories pruned under --force: who holds them (blocks/ is theirs)
        self.dry_run = dry_run
        self.gone: dict[Path, list[Row]] = {}  # the entries removed (in a dry run: that would be)
        self.stay: set[Path] = set()  # the directories whose blocks stay, as planned
        self.marked: set[Path] = set()

    def kept_because(self, save_dir: SaveDir, gone: Iterable[Row]) -> str:
        """Why no block of this directory may be removed once `gone` went ("" when they may): a running
        slotkeeper holds it (its saves count on the blocks it knows), or a manifest left in entries/ cannot be
        read (it may name any block)."""
        if save_dir.path in self.in_use:
            return f"it is {self.in_use[save_dir.path]}"
        left = save_dir.blocks.unreadable - {row.name for row in gone}
        return f"{count(len(left), 'manifest')} in {ENTRIES_DIR}/ cannot be read and may use them" if left else ""

    def planned(self, removals: list[Removal]) -> list[Removal]:
        """`removals` as they will free: an entry kept as blocks frees only its manifest where the blocks stay."""
        gone: dict[Path, list[Row]] = {}
        for removal in removals:
            if isinstance(removal.row, Row) and removal.row.kind is Kind.ENTRY:
                gone.setdefault(removal.row.directory, []).append(removal.row)
        self.stay = {d.path for d in self.dirs if self.kept_because(d, gone.get(d.path, []))}
        return [
            replace(r, freed=r.row.file_bytes)
            if isinstance(r.row, Row) and r.row.directory in self.stay and r.row.block_parts is not None
            else r
            for r in removals
        ]

    def remove(self, removal: Removal) -> str | None:
        """remove_files (blocks/ marked first, for an entry kept as blocks); None when done, or in a dry run."""
        row = removal.row
        assert isinstance(row, Row)
        problem = None if self.dry_run else self._mark(row) or remove_files(removal)
        if problem is None and row.kind is Kind.ENTRY:
            self.gone.setdefault(row.directory, []).append(row)
        return problem

    def _mark(self, row: Row) -> str | None:
        if row.block_parts is None or row.directory in self.marked or row.directory in self.stay:
            return None
        try:
            blockfiles.mark_unclean(row.directory / BLOCKS_DIR)
        except OSError as exc:
            return f"{BLOCKS_DIR}/{blockfiles.UNCLEAN_NAME}: {exc.strerror or exc}"
        self.marked.add(row.directory)
        return None

    def settle(self) -> tuple[int, bool]:
        """Each directory's blocks, once its manifests went: the lines said, and whether a removal failed."""
        said, failed = 0, False
        for save_dir in self.dirs:
            lines, problem = self._settle(save_dir)
            said += lines
            failed = failed or problem
        return said, failed

    def _settle(self, save_dir: SaveDir) -> tuple[int, bool]:
        blocks, where, folder = save_dir.blocks, display_path(save_dir.path), save_dir.path / BLOCKS_DIR
        gone = self.gone.get(save_dir.path, [])
        doomed: dict[str, int] = {}  # the blocks only the removed entries used
        for row in gone:
            if (parts := row.block_parts) is not None:
                sizes = parts.block_sizes()
                doomed.update((name, sizes[name]) for name in blocks.pool.release(parts) if name not in blocks.claimed)
        why = self.kept_because(save_dir, gone)
        if why:
            if not doomed and not blocks.unused:
                return 0, False
            stay = sum(doomed.values()) + blocks.unused_bytes
            say(f"blocks kept in {where} ({fmt_bytes(stay)} that no remaining entry uses): {why}")
            return 1, False
        unused, failures = blocks.unused, 0
        if not self.dry_run:
            failures = blockfiles.remove_blocks(folder, doomed)
            unused = [f for f in blocks.unused if discard(f.path)]
            failures += len(blocks.unused) - len(unused)
            if not failures and blocks.listed and blockfiles.is_unclean(folder):
                blockfiles.mark_clean(folder)
        if failures:
            print(
                f"slotkeeper prune: not removed: {count(failures, 'unused block')} in {where} "
                "(a later prune removes them)",
                file=sys.stderr,
            )
        if not unused:
            return 0, bool(failures)
        verb = "would remove" if self.dry_run else "removed"
        say(
            f"{verb} {count(len(unused), 'unused block')} in {where}, {fmt_bytes(sum(f.size for f in unused))} "
            "(no manifest uses them)"
        )
        return 1, bool(failures)
