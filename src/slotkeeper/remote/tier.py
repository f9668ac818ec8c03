"""The shared tier: the local store's entries in S3-compatible object storage, so a chat saved on one host
resumes warm on another.

One namespace (the model+KV fingerprint's folder, bucket.py) per tier. Nothing remote is trusted: an entry kept
as blocks downloads only the blocks the local store lacks, each checked against its size and name (the xxh3_128
of its bytes) before it is renamed into blocks/, and the store checks the whole file against the manifest's
checksum at restore; an entry kept whole (uploaded before blocks) is checked against the manifest's size and
sha256. Uploads are write-behind and journaled (uploads.py). Every failure here leaves the local store working;
the remote tier is an optimisation.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import os
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

import xxhash

from ..log import fmt_bytes, log
from ..store import blockfiles
from ..store.entries import BIN_SUFFIX, PARTIAL_SUFFIX, Entry, fsync_path
from .bucket import INDEX_TIMEOUT_S, Bucket, Listed, RemoteError, RemoteStats, block_parts, reason
from .s3config import NAME_RE, RemoteConfig
from .uploads import UploadQueue

if TYPE_CHECKING:
    from obstore import GetResult

__all__ = [
    "CANCEL_GRACE_S",
    "INDEX_MAX_AGE_S",
    "AdoptingStore",
    "Fetched",
    "RemoteConfig",
    "RemoteError",
    "RemoteMatch",
    "RemoteStats",
    "RemoteTier",
]

INDEX_MAX_AGE_S = 30.0  # find() re-lists the namespace at most this often
FIND_WAIT_S = 5.0  # a request waits at most this long for a refresh; it then continues in the background
DOWNLOAD_CHUNK_BYTES = 256 * 1024  # a download's unit of progress: a stall is no chunk within request_timeout_s
PROGRESS_INTERVAL_S = 2.0
CANCEL_GRACE_S = 1.0  # close(): how long cancelled uploads get to unwind after the deadline
SPEED_WEIGHT = 0.5  # weight of the newest download in the measured speed
BLOCK_CONCURRENCY = 4  # blocks of one entry downloaded at a time


class Fetched(enum.Enum):
    """What became of a remote entry a request asked for (`RemoteTier.fetch_into`)."""

    ADOPTED = "adopted"  # downloaded, verified and taken into the local store
    LATER = "later"  # still downloading when the request stopped waiting: taken in once it completes
    FAILED = "failed"  # not had (its own line said why) or not taken in


class BlockHoldings(Protocol):
    """The store's count of what counts on its blocks (store.holdings.Holdings): no block is removed between a
    `begin` and its `end`."""

    def begin(self) -> None: ...

    def end(self, *, unused: Iterable[str] = (), committed: Any = None) -> None: ...


class AdoptingStore(Protocol):
    """What the local store offers a download: its entries' and blocks' folders, its entries, the count of what
    counts on its blocks, and taking an entry in."""

    entries_dir: Path
    blocks_dir: Path

    @property
    def holdings(self) -> BlockHoldings: ...

    @property
    def entries(self) -> Mapping[str, Any]: ...

    def adopt(self, manifest: dict[str, Any]) -> Any: ...


@dataclass
class _Download:
    """One entry's download, shared by the requests that want it."""

    task: asyncio.Task[tuple[Path, dict[str, Any]] | None]
    written: list[str] = field(default_factory=list)  # blocks it put into blocks/ (each checked), as it goes


class _Rejected(Exception):
    """A remote entry that must not be used (tampered, truncated, incomplete); the message says why, and
    `damaged` names the block whose object is not what its name says."""

    def __init__(self, why: str, damaged: str | None = None) -> None:
        super().__init__(why)
        self.damaged = damaged


@dataclass(frozen=True)
class RemoteMatch:
    """A remote entry whose first `matched_blocks` block hashes are the request's."""

    entry_id: str
    manifest: dict[str, Any]
    matched_blocks: int


class RemoteTier:
    """One namespace of the shared tier: write-behind uploads, an index of remote manifests, verified fetches."""

    def __init__(
        self,
        config: RemoteConfig,
        namespace: str,
        journal_dir: Path,
        *,
        concurrency: int = 2,
        request_timeout_s: float = 30.0,
    ) -> None:
        if not NAME_RE.fullmatch(namespace):
            raise ValueError(f"remote namespace {namespace!r} must be a short name of A-Z a-z 0-9 . _ -")
        self.config = config
        self.namespace = namespace
        self.request_timeout_s = request_timeout_s
        self.stats = RemoteStats()
        self.bucket = Bucket(config, request_timeout_s)
        self._uploads = UploadQueue(self.bucket, namespace, journal_dir, self.stats, concurrency=concurrency)
        self._fetches: dict[str, _Download] = {}
        self._intakes: dict[str, asyncio.Task[bool]] = {}  # downloads taken into the local store (fetch_into)
        self._probe: asyncio.Future[bool] | None = None
        self._index: dict[str, Listed] = {}  # entry_id -> (e_tag of its .json, manifest)
        self._index_at: float | None = None  # monotonic time of the last complete listing
        self._refresh: asyncio.Task[None] | None = None
        self._refresh_failing = False
        self._rejected: set[str] = set()  # entries that failed verification: not offered again
        self._speed: float | None = None  # bytes/s of recent downloads

    @property
    def journal_dir(self) -> Path:
        return self._uploads.journal_dir

    async def probe(self, timeout_s: float) -> bool:
        """Whether the bucket answers a listing of this namespace within `timeout_s`; one log line either way."""
        return await self.bucket.probe(self.namespace, timeout_s)

    def probe_in_background(self, timeout_s: float) -> None:
        """Probe reachability without making anyone wait: its outcome is its log line and the stats."""
        self._probe = asyncio.ensure_future(self.probe(timeout_s))

    def upload_committed(self, entry: Entry, where: Path) -> None:
        """The local store committed a new entry: upload it, write-behind (the store's `on_commit`). `where`: its
        .bin, or the store's blocks/ for an entry kept as blocks."""
        self.schedule_upload(entry.id, where, entry.manifest())

    def schedule_upload(self, entry_id: str, where: Path, manifest: dict[str, Any]) -> None:
        """Queue an upload and return at once; the journal record is written (off the loop) before it starts."""
        self._uploads.schedule(entry_id, where, manifest)

    def resume(self) -> int:
        """Queue again every journaled upload whose local file is still there; drop the others."""
        return self._uploads.resume()

    # ---- finding --------------------------------------------------------------------------------------------

    async def find(self, blocks: list[str], block_tokens: int) -> RemoteMatch | None:
        """The remote entry sharing the longest block prefix with `blocks`, from an index at most
        INDEX_MAX_AGE_S old (a refresh longer than FIND_WAIT_S continues in the background)."""
        if self._index_at is None or time.monotonic() - self._index_at >= INDEX_MAX_AGE_S:
            if self._refresh is None or self._refresh.done():
                self._refresh = asyncio.ensure_future(self._refresh_index())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_shared(self._refresh), FIND_WAIT_S)
        best: RemoteMatch | None = None
        for entry_id, (_, manifest) in self._index.items():
            their = manifest.get("blocks")
            if manifest.get("block_tokens") != block_tokens or not isinstance(their, list):
                continue
            matched = 0
            for mine, other in zip(blocks, their):
                if mine != other:
                    break
                matched += 1
            if matched and (
                best is None
                or matched > best.matched_blocks
                or (
                    matched == best.matched_blocks
                    and int(manifest.get("bytes", 0)) < int(best.manifest.get("bytes", 0))
                )
            ):
                best = RemoteMatch(entry_id, manifest, matched)  # of equals, the smallest: an opening, not a chat
        if best is None:
            self.stats.remote_misses += 1
        else:
            self.stats.remote_hits += 1
        return best

    async def _refresh_index(self) -> None:
        """Re-list the namespace; only manifests that are new or changed (by e_tag) are downloaded."""
        known = {f"{self.namespace}/{entry_id}": listed for entry_id, listed in self._index.items()}
        try:
            found = await asyncio.wait_for(
                self.bucket.list_manifests(f"{self.namespace}/", known, skip=self._skipped(), on_invalid=self._invalid),
                INDEX_TIMEOUT_S,
            )
        except Exception as exc:  # noqa: BLE001 - keep the index we have
            if not self._refresh_failing:
                log.warning(
                    "remote: listing %s failed (%s); using the %d entries known",
                    self.config.url,
                    reason(exc, INDEX_TIMEOUT_S),
                    len(self._index),
                )
            self._refresh_failing = True
            self._index_at = time.monotonic()  # retried after INDEX_MAX_AGE_S, not on every request
            return
        if self._refresh_failing:
            log.info("remote: listing %s works again (%d entries)", self.config.url, len(found))
        self._refresh_failing = False
        self._index = {key.rpartition("/")[2]: value for key, value in found.items()}
        self._index_at = time.monotonic()

    def _skipped(self) -> set[str]:
        return {f"{self.namespace}/{entry_id}" for entry_id in self._rejected}

    def _invalid(self, key: str) -> None:
        namespace, _, entry_id = key.rpartition("/")
        if namespace == self.namespace:
            self._reject(entry_id, "its manifest is not an entry's (bytes, and parts and checksum, or sha256)")

    def _reject(self, entry_id: str, why: str) -> None:
        self._rejected.add(entry_id)
        self._index.pop(entry_id, None)
        self.stats.rejected += 1
        log.warning("remote: entry %s rejected: %s", entry_id, why)

    # ---- fetching -------------------------------------------------------------------------------------------

    async def fetch(
        self, match: RemoteMatch, dest_dir: Path, *, blocks_dir: Path | None = None
    ) -> tuple[Path, dict[str, Any]] | None:
        """Download and verify an entry, or None (logged) when it cannot be had: an entry kept whole into
        dest_dir/<entry_id>.bin (-> that file and the manifest); an entry kept as blocks, the blocks `blocks_dir`
        (default: dest_dir) lacks, into it as the store keeps them (-> blocks_dir and the manifest).

        Callers fetching one entry at the same time share one download (and the first caller's folders).
        """
        result: tuple[Path, dict[str, Any]] | None = await _shared(self._download(match, dest_dir, blocks_dir).task)
        return result

    def _download(self, match: RemoteMatch, dest_dir: Path, blocks_dir: Path | None) -> _Download:
        download = self._fetches.get(match.entry_id)
        if download is None:
            written: list[str] = []
            task = asyncio.ensure_future(self._fetch(match, dest_dir, blocks_dir or dest_dir, written))
            download = self._fetches[match.entry_id] = _Download(task, written)
            task.add_done_callback(
                lambda done: (
                    self._fetches.pop(match.entry_id, None)
                    if (current := self._fetches.get(match.entry_id)) is not None and current.task is done
                    else None
                )
            )
        return download

    async def fetch_into(self, match: RemoteMatch, store: AdoptingStore, wait_s: float | None) -> Fetched:
        """Download an entry into the local store and take it in there. A request waits at most `wait_s` (None:
        until it is done); past that the download goes on, and the entry is taken in once it completes, for
        the chat's next turn. Requests for one entry share one download and one taking in."""
        intake = self._intakes.get(match.entry_id)
        if intake is None:
            intake = asyncio.ensure_future(self._take_in(match, store))
            self._intakes[match.entry_id] = intake
            intake.add_done_callback(self._intake_ended)
        try:
            adopted = await asyncio.wait_for(_shared(intake), wait_s)
        except TimeoutError:
            return Fetched.LATER
        return Fetched.ADOPTED if adopted else Fetched.FAILED

    def _intake_ended(self, task: asyncio.Task[bool]) -> None:
        """Forget an intake; its error is its one line: once its requests stopped waiting nobody awaits it, and
        unseen it would end as a traceback when the task is collected."""
        for entry_id, intake in list(self._intakes.items()):
            if intake is task:
                del self._intakes[entry_id]
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("remote: taking in a downloaded entry failed (%r)", exc)

    async def _take_in(self, match: RemoteMatch, store: AdoptingStore) -> bool:
        """Download an entry and hand it to the store's `adopt`; whether it was taken in. An entry kept as
        blocks counts on the blocks the store has from the moment it is found to lack the others until it is
        taken in, as a save does: the store removes none meanwhile (`holdings`), and the blocks downloaded for
        an entry that is not taken in go as soon as nothing else counts on them."""
        if "parts" not in match.manifest:
            fetched = await self.fetch(match, store.entries_dir)
            return fetched is not None and self._adopt(store, match, fetched[1]) is not None
        adopted: Any = None
        written: list[str] = []
        store.holdings.begin()
        try:
            download = self._download(match, store.entries_dir, store.blocks_dir)
            written = download.written
            fetched = await _shared(download.task)
            if fetched is not None:
                adopted = self._adopt(store, match, fetched[1])
        finally:
            store.holdings.end(committed=adopted, unused=() if adopted is not None else list(written))
        return adopted is not None

    def _adopt(self, store: AdoptingStore, match: RemoteMatch, manifest: dict[str, Any]) -> Any:
        """store.adopt, once per entry; None (one line) when it was not taken in."""
        if (entry := store.entries.get(match.entry_id)) is not None:
            return entry
        try:
            return store.adopt(manifest)
        except Exception as exc:  # noqa: BLE001 - a failed intake is a cold start, never a failed request
            log.warning("remote: entry %s not taken in (%r)", match.entry_id, exc)
            return None

    async def _fetch(
        self, match: RemoteMatch, dest_dir: Path, blocks_dir: Path, written: list[str]
    ) -> tuple[Path, dict[str, Any]] | None:
        if "parts" in match.manifest:
            return await self._fetch_blocks(match, blocks_dir, written)
        return await self._fetch_file(match, dest_dir)

    async def _fetch_file(self, match: RemoteMatch, dest_dir: Path) -> tuple[Path, dict[str, Any]] | None:
        """An entry kept whole: its .bin, checked against the manifest's size and sha256."""
        entry_id, manifest = match.entry_id, match.manifest
        final = dest_dir / f"{entry_id}{BIN_SUFFIX}"
        partial = dest_dir / f"{entry_id}{BIN_SUFFIX}{PARTIAL_SUFFIX}"
        expected = int(manifest["bytes"])
        started = time.monotonic()
        committed = False
        try:
            dest_dir.mkdir(parents=True, exist_ok=True)
            result = await self.bucket.get(self.namespace, entry_id, BIN_SUFFIX)
            if result.meta["size"] != expected:
                self._reject(entry_id, f"its object has {result.meta['size']} bytes, its manifest says {expected}")
                return None
            progress = _Progress(entry_id, expected)
            if await self._download_to(result, partial, expected, hashlib.sha256(), progress) != manifest["sha256"]:
                self._reject(entry_id, "the downloaded bytes do not match its manifest's sha256; nothing was kept")
                return None
            await asyncio.to_thread(_commit_download, partial, final)
            committed = True
        except FileNotFoundError:
            self._index.pop(entry_id, None)
            self.stats.fetches_failed += 1
            log.warning("remote: entry %s is gone from %s", entry_id, self.config.url)
            return None
        except Exception as exc:  # noqa: BLE001 - a failed fetch is a cold start, never a failed request
            self.stats.fetches_failed += 1
            log.warning("remote: entry %s fetch failed (%s)", entry_id, reason(exc, self.request_timeout_s))
            return None
        finally:  # also when cancelled: never leave a partial download behind
            if not committed:
                partial.unlink(missing_ok=True)
        self._downloaded(entry_id, expected, time.monotonic() - started)
        return final, manifest

    async def _fetch_blocks(
        self, match: RemoteMatch, blocks_dir: Path, written: list[str]
    ) -> tuple[Path, dict[str, Any]] | None:
        """An entry kept as blocks: the blocks `blocks_dir` lacks, BLOCK_CONCURRENCY at a time, each checked
        against its size and name before it is renamed into place (`written` lists them as they are)."""
        entry_id, manifest = match.entry_id, match.manifest
        try:
            parts = block_parts(manifest)
        except (KeyError, TypeError, ValueError) as exc:
            self._reject(entry_id, f"its manifest's parts are not usable ({exc})")
            return None
        assert parts is not None
        sizes = parts.block_sizes()
        started = time.monotonic()
        try:
            lacking = await asyncio.to_thread(_lacking, blocks_dir, sizes)
            progress = _Progress(entry_id, sum(sizes[name] for name in lacking))
            limit = asyncio.Semaphore(BLOCK_CONCURRENCY)
            tasks = [
                asyncio.ensure_future(self._fetch_block(name, sizes[name], blocks_dir, limit, progress, written))
                for name in lacking
            ]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        except _Rejected as exc:
            self._reject(entry_id, str(exc))
            if exc.damaged is not None:
                self._uploads.damaged(exc.damaged)  # (an upload that counts on it repairs it)
            return None
        except Exception as exc:  # noqa: BLE001 - a failed fetch is a cold start, never a failed request
            self.stats.fetches_failed += 1
            log.warning("remote: entry %s fetch failed (%s)", entry_id, reason(exc, self.request_timeout_s))
            return None
        nbytes = sum(sizes[name] for name in lacking)
        if not lacking:
            log.info("remote: entry %s fetched: its %d blocks were all here already", entry_id, len(sizes))
        else:
            said = f"; {len(lacking)} of its {len(sizes)} blocks, of {fmt_bytes(parts.nbytes)}"
            self._downloaded(entry_id, nbytes, time.monotonic() - started, said)
        return blocks_dir, manifest

    async def _fetch_block(
        self,
        name: str,
        size: int,
        blocks_dir: Path,
        limit: asyncio.Semaphore,
        progress: _Progress,
        written: list[str],
    ) -> None:
        """One block: streamed to a partial file beside its place, checked, fsynced and renamed into place."""
        final = blockfiles.block_path(blocks_dir, name)
        partial = final.with_name(f"{name}.{secrets.token_hex(4)}{PARTIAL_SUFFIX}")
        async with limit:
            try:
                result = await self.bucket.get_block(self.namespace, name)
            except FileNotFoundError:
                raise _Rejected(f"its block {name} is not in {self.config.url} (pruned?)") from None
            if result.meta["size"] != size:
                raise _Rejected(f"its block {name} has {result.meta['size']} bytes, its manifest says {size}", name)
            committed = False
            try:
                await asyncio.to_thread(_prepare_block_folder, blocks_dir, final.parent)
                if await self._download_to(result, partial, size, xxhash.xxh3_128(), progress) != name:
                    raise _Rejected(f"its block {name} does not match its name (the xxh3_128 of its bytes)", name)
                await asyncio.to_thread(_commit_download, partial, final)
                committed = True
            finally:  # also when cancelled: never leave a partial download behind
                if not committed:
                    partial.unlink(missing_ok=True)
        written.append(name)

    def _downloaded(self, entry_id: str, nbytes: int, elapsed: float, said: str = "") -> None:
        """Count a completed download (`nbytes` actually transferred) and measure the speed from it."""
        self.stats.download_bytes += nbytes
        self.stats.download_seconds += elapsed
        speed = nbytes / max(elapsed, 1e-6)
        self._speed = speed if self._speed is None else SPEED_WEIGHT * speed + (1 - SPEED_WEIGHT) * self._speed
        log.info(
            "remote: entry %s fetched: %s in %.1f s (%s/s%s)",
            entry_id,
            fmt_bytes(nbytes),
            elapsed,
            fmt_bytes(int(speed)),
            said,
        )

    async def _download_to(
        self, result: GetResult, partial: Path, expected: int, hasher: Any, progress: _Progress
    ) -> str | None:
        """Stream to `partial`, hashing as it goes (a chunk at a time in memory); the hex digest, or None when
        more or fewer than `expected` bytes came.

        The GET has no overall timeout (a big file on a slow link takes long); each chunk must arrive within
        request_timeout_s instead, so a stalled transfer gives up.
        """
        received = 0
        stream = result.stream(min_chunk_size=DOWNLOAD_CHUNK_BYTES)
        with open(partial, "wb") as f:
            while True:
                try:
                    chunk = await asyncio.wait_for(anext(stream), self.request_timeout_s)
                except StopAsyncIteration:
                    break
                received += len(chunk)
                if received > expected:
                    return None
                await asyncio.to_thread(_write_hashed, f, hasher, chunk)
                progress.add(len(chunk))
        return str(hasher.hexdigest()) if received == expected else None

    def estimated_fetch_seconds(self, nbytes: int) -> float | None:
        """From the measured speed of recent downloads; None until one was measured."""
        return None if self._speed is None else nbytes / self._speed

    # ---- listing and deleting ----------------------------------------------------------------------------------

    async def list_entries(self) -> list[dict[str, Any]]:
        """This namespace's manifests, each with its "entry_id"."""
        return (await self.list_all(namespace=self.namespace)).get(self.namespace, [])

    async def list_all(self, namespace: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """namespace -> manifests (each with its "entry_id") under the whole prefix."""
        return await self.bucket.list_all(namespace, skip=self._skipped(), on_invalid=self._invalid)

    async def delete(self, namespace: str, entry_id: str) -> None:
        """Remove an entry: its manifest first, so no reader ever sees a manifest without its data."""
        await self.bucket.delete(namespace, entry_id)
        if namespace == self.namespace:
            self._index.pop(entry_id, None)

    # ---- stop -----------------------------------------------------------------------------------------------

    async def close(self, deadline: float) -> None:
        """Let running uploads go on until `deadline` (monotonic), then cancel them; the journal keeps them."""
        downloads = [download.task for download in self._fetches.values()]
        for task in [*downloads, *self._intakes.values(), *([self._refresh] if self._refresh else [])]:
            task.cancel()
        await self._uploads.close(deadline, CANCEL_GRACE_S)


async def _shared(task: asyncio.Task[Any]) -> Any:
    """Await a task several callers share: one caller's cancellation is not the task's, and the task's
    cancellation (by close()) reads as None to callers that were not themselves cancelled."""
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if task.cancelled() and me is not None and not me.cancelling():
            return None
        raise


class _Progress:
    """A download's progress lines (one every PROGRESS_INTERVAL_S), over all of an entry's blocks."""

    def __init__(self, entry_id: str, expected: int) -> None:
        self.entry_id = entry_id
        self.expected = expected
        self.received = 0
        self._said = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.received += nbytes
        if time.monotonic() - self._said >= PROGRESS_INTERVAL_S:
            self._said = time.monotonic()
            log.info(
                "remote: entry %s fetching: %s of %s",
                self.entry_id,
                fmt_bytes(self.received),
                fmt_bytes(self.expected),
            )


def bytes_to_fetch(manifest: Mapping[str, Any], blocks_dir: Path) -> int:
    """What downloading an entry would move: the blocks `blocks_dir` lacks (a chat whose opening is here
    already downloads the rest), or its whole file; its whole size when its parts are not usable (its
    download then says why)."""
    whole = int(manifest.get("bytes", 0))
    try:
        parts = block_parts(manifest)
    except (KeyError, TypeError, ValueError):
        return whole
    if parts is None:
        return whole
    sizes = parts.block_sizes()
    return sum(sizes[name] for name in _lacking(blocks_dir, sizes))


def _lacking(blocks_dir: Path, sizes: Mapping[str, int]) -> list[str]:
    """The blocks not in `blocks_dir` (the store never removes a block an entry uses while one counts on it)."""
    return [name for name in sizes if not blockfiles.block_path(blocks_dir, name).exists()]


def _prepare_block_folder(blocks_dir: Path, folder: Path) -> None:
    """blocks/<2 hex>/ made, and blocks/ marked unclean first: a crash before the entry is taken in leaves blocks
    no manifest names, which the next start sweeps (as after a save's)."""
    blocks_dir.mkdir(parents=True, exist_ok=True)
    blockfiles.mark_unclean(blocks_dir)
    folder.mkdir(exist_ok=True)


def _write_hashed(f: BinaryIO, hasher: Any, chunk: bytes) -> None:
    f.write(chunk)
    hasher.update(chunk)


def _commit_download(partial: Path, final: Path) -> None:
    """fsync the download, rename it into place, fsync the directory: a crash leaves all of it or none."""
    fsync_path(partial)
    os.replace(partial, final)
    fsync_path(final.parent)
