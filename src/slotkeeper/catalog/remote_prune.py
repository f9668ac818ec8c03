"""`slotkeeper prune --remote`: the shared tier's entries deleted, then the blocks no remaining entry uses.

An entry goes manifest first (Bucket.delete), so no reader ever sees a manifest without its data. An entry kept
as blocks shares them with the other entries of its namespace: once the manifests went, the namespace's
manifests are listed again, and of the blocks the removed entries used, those none of them uses go; so do the
blocks no manifest uses that are over ORPHAN_MIN_AGE_S old (an upload cut off before its manifest, a block a
failed prune left). No block of a namespace goes while one of its manifests cannot be read (it may use any):
one line says so. A host uploading meanwhile may count on a block it saw in the bucket a few minutes before
(uploads.KNOWN_BLOCK_MAX_AGE_S): an entry it commits without that block is rejected when fetched (one line, a
cold start), never used.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..log import fmt_bytes
from .formats import count, say
from .prune import Outcome, Removal, plan_rows
from .remote_rows import RemoteRow
from .shared import open_bucket, remote_rows, run_remote

if TYPE_CHECKING:
    from ..remote.bucket import Bucket
    from ..remote.s3config import RemoteConfig

# Older than this, a block no manifest uses is removed: past the age at which an upload that counts on a block
# writes it again (uploads.BLOCK_RENEW_AGE_S, a day), no upload still counts on it without writing it anew.
ORPHAN_MIN_AGE_S = 2 * 86400.0
DELETE_CONCURRENCY = 8


@dataclass
class _Said:
    """What settling a namespace's blocks has to say: lines for stdout, and problems for stderr."""

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def prune_remote(
    config: RemoteConfig, now: float, dry_run: bool, **criteria: Any
) -> tuple[list[Outcome], Callable[[], tuple[int, bool]]]:
    """List the shared tier, plan, and delete (each manifest first: Bucket.delete), then the blocks no remaining
    entry uses. Returns the removals, and what report_removals says of the blocks after them."""
    from ..remote.bucket import RemoteError

    async def go() -> tuple[list[Outcome], list[_Said]]:
        bucket = open_bucket(config)
        unread: set[str] = set()  # namespaces with a manifest that could not be read, or is not an entry's
        listing = await bucket.list_all(unread=unread, on_invalid=lambda key: unread.add(key.rpartition("/")[0]))
        by_namespace = remote_rows(config.url, listing)
        removals = planned([row for rows in by_namespace.values() for row in rows], now, unread, **criteria)
        outcomes: list[Outcome] = []
        gone: dict[str, list[RemoteRow]] = {}
        for removal in removals:
            row = removal.row
            assert isinstance(row, RemoteRow)
            problem = None
            if not dry_run:
                try:
                    await bucket.delete(row.namespace, row.id)
                except RemoteError as exc:
                    problem = str(exc)
            if problem is None:
                gone.setdefault(row.namespace, []).append(row)
            outcomes.append((removal, problem))
        said = [
            await _settle(bucket, config.url, namespace, rows, gone.get(namespace, []), namespace in unread, dry_run)
            for namespace, rows in by_namespace.items()
        ]
        return outcomes, said

    outcomes, said = run_remote(go)

    def then() -> tuple[int, bool]:
        lines = failed = 0
        for each in said:
            for line in each.lines:
                say(line)
                lines += 1
            for problem in each.problems:
                print(f"slotkeeper prune: not removed: {problem}", file=sys.stderr)
                failed += 1
        return lines, bool(failed)

    return outcomes, then


def planned(rows: list[RemoteRow], now: float, unread: set[str], **criteria: Any) -> list[Removal]:
    """plan_rows (which counts each block once in its namespace, for --max-total and what each removal frees),
    an entry kept as blocks freeing nothing where no block goes: a manifest of its namespace cannot be read."""
    removals = []
    for removal in plan_rows(rows, now, **criteria):
        row = removal.row
        assert isinstance(row, RemoteRow)
        unsure = row.remote_parts is not None and row.namespace in unread
        removals.append(replace(removal, freed=0) if unsure else removal)
    return removals


async def _settle(  # noqa: PLR0913 - one namespace's rows, and what became of them
    bucket: Bucket,
    url: str,
    namespace: str,
    rows: list[RemoteRow],
    gone: list[RemoteRow],
    unread: bool,
    dry_run: bool,
) -> _Said:
    """Remove the blocks of a namespace that no remaining manifest uses: those the removed entries used, and
    those no manifest uses that are over ORPHAN_MIN_AGE_S old."""
    from ..remote.bucket import age_s, block_parts, reason

    where, said = f"{url}/{namespace}", _Said()
    theirs = _blocks_of(row.remote_parts for row in gone)
    if unread:
        if theirs:
            said.lines.append(f"remote blocks kept in {where}: a manifest there cannot be read and may use them")
        return said
    try:
        if gone and not dry_run:  # listed again: what the namespace holds now, with what was uploaded meanwhile
            still: set[str] = set()
            listing = await bucket.list_all(namespace, unread=still, on_invalid=lambda _: still.add(namespace))
            if still:
                if theirs:
                    said.lines.append(
                        f"remote blocks kept in {where}: a manifest there cannot be read and may use them"
                    )
                return said
            used = _blocks_of(block_parts(manifest) for manifest in listing.get(namespace, []))
        else:
            went = {row.id for row in gone}
            used = _blocks_of(row.remote_parts for row in rows if row.id not in went)
        stored = await bucket.list_blocks(namespace)
    except Exception as exc:  # noqa: BLE001 - the manifests went; their blocks stay for a later prune
        said.problems.append(f"the blocks of {where}: listing failed ({reason(exc, bucket.request_timeout_s)})")
        return said
    doomed = {
        name: int(meta["size"])
        for name, meta in stored.items()
        if name not in used and (name in theirs or age_s(meta) > ORPHAN_MIN_AGE_S)
    }
    if not doomed:
        return said
    failed: list[str] = []
    if not dry_run:
        failed = await _delete_blocks(bucket, namespace, doomed)
    removed = {name: size for name, size in doomed.items() if name not in failed}
    if removed:
        verb = "would remove" if dry_run else "removed"
        said.lines.append(
            f"{verb} {count(len(removed), 'remote block')} in {where}, {fmt_bytes(sum(removed.values()))} "
            "(no remaining entry uses them)"
        )
    if failed:
        said.problems.append(f"{count(len(failed), 'remote block')} in {where} (a later prune removes them)")
    return said


def _blocks_of(parts_list: Iterable[Any]) -> set[str]:
    """The blocks these entries' parts name (None: an entry kept whole, naming none)."""
    names: set[str] = set()
    for parts in parts_list:
        if parts is not None:
            names.update(parts.block_sizes())
    return names


async def _delete_blocks(bucket: Bucket, namespace: str, doomed: Mapping[str, int]) -> list[str]:
    """Delete these blocks, DELETE_CONCURRENCY at a time; the names that could not be."""
    limit = asyncio.Semaphore(DELETE_CONCURRENCY)

    async def one(name: str) -> str | None:
        async with limit:
            try:
                await bucket.delete_block(namespace, name)
            except Exception:  # noqa: BLE001 - counted and said once
                return name
            return None

    return [name for name in await asyncio.gather(*(one(n) for n in doomed)) if name is not None]
