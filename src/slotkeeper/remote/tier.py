"""The shared tier: the local store's entries in S3-compatible object storage, so a chat saved on one host
resumes warm on another.

One namespace (the model+KV fingerprint's folder, bucket.py) per tier. Nothing remote is trusted: a download
is checked against the manifest's size and sha256 before it is handed over. Uploads are write-behind and
journaled (uploads.py). Every failure here leaves the local store working; the remote tier is an optimisation.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import os
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from ..log import fmt_bytes, log
from ..store.entries import BIN_SUFFIX, PARTIAL_SUFFIX, Entry, fsync_path
from .bucket import INDEX_TIMEOUT_S, Bucket, Listed, RemoteError, RemoteStats, reason
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


class Fetched(enum.Enum):
    """What became of a remote entry a request asked for (`RemoteTier.fetch_into`)."""

    ADOPTED = "adopted"  # downloaded, verified and taken into the local store
    LATER = "later"  # still downloading when the request stopped waiting: taken in once it completes
    FAILED = "failed"  # not had (its own line said why) or not taken in


class AdoptingStore(Protocol):
    """What the local store offers a download: its entries' folder, its entries, and taking one in."""

    entries_dir: Path

    @property
    def entries(self) -> Mapping[str, Any]: ...

    def adopt(self, manifest: dict[str, Any]) -> Any: ...


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
        self._fetches: dict[str, asyncio.Task[tuple[Path, dict[str, Any]] | None]] = {}
        self._probe: asyncio.Future[bool] | None = None
        self._background: set[asyncio.Future[None]] = set()  # downloads outlasting their request, taken in after
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

    def upload_committed(self, entry: Entry, bin_path: Path) -> None:
        """The local store committed a new entry: upload it, write-behind (the store's `on_commit`)."""
        self.schedule_upload(entry.id, bin_path, entry.manifest())

    def schedule_upload(self, entry_id: str, bin_path: Path, manifest: dict[str, Any]) -> None:
        """Queue an upload and return at once; the journal record is written (off the loop) before it starts."""
        self._uploads.schedule(entry_id, bin_path, manifest)

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
            self._reject(entry_id, "its manifest is not valid JSON with sha256 and bytes")

    def _reject(self, entry_id: str, why: str) -> None:
        self._rejected.add(entry_id)
        self._index.pop(entry_id, None)
        self.stats.rejected += 1
        log.warning("remote: entry %s rejected: %s", entry_id, why)

    # ---- fetching -------------------------------------------------------------------------------------------

    async def fetch(self, match: RemoteMatch, dest_dir: Path) -> tuple[Path, dict[str, Any]] | None:
        """Download and verify an entry into dest_dir/<entry_id>.bin, or None (logged) when it cannot be had.

        Callers fetching one entry at the same time share one download (and the first caller's dest_dir).
        """
        task = self._fetches.get(match.entry_id)
        if task is None:
            task = asyncio.ensure_future(self._fetch(match, dest_dir))
            self._fetches[match.entry_id] = task
            task.add_done_callback(
                lambda done: (
                    self._fetches.pop(match.entry_id, None) if self._fetches.get(match.entry_id) is done else None
                )
            )
        result: tuple[Path, dict[str, Any]] | None = await _shared(task)
        return result

    async def fetch_into(self, match: RemoteMatch, store: AdoptingStore, wait_s: float | None) -> Fetched:
        """Download an entry into the local store and take it in there. A request waits at most `wait_s` (None:
        until it is done); past that the download goes on, and the entry is taken in once it completes, for
        the chat's next turn."""
        try:
            fetched = await asyncio.wait_for(self.fetch(match, store.entries_dir), wait_s)
        except TimeoutError:
            self._in_background(self._adopt_later(match, store))
            return Fetched.LATER
        if fetched is not None and store.adopt(fetched[1]) is not None:
            return Fetched.ADOPTED
        return Fetched.FAILED

    async def _adopt_later(self, match: RemoteMatch, store: AdoptingStore) -> None:
        fetched = await self.fetch(match, store.entries_dir)  # (the download already under way, shared)
        if fetched is not None and match.entry_id not in store.entries:
            store.adopt(fetched[1])

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background_ended)

    def _background_ended(self, task: asyncio.Future[None]) -> None:
        """A background task's error is its one line: nobody awaits it (a later miss fetches the entry again),
        and unseen it would end as a traceback when the task is collected."""
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("remote: taking in a downloaded entry failed (%r)", exc)

    async def _fetch(self, match: RemoteMatch, dest_dir: Path) -> tuple[Path, dict[str, Any]] | None:
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
            if not await self._download(entry_id, result, partial, expected, str(manifest["sha256"])):
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
        elapsed = time.monotonic() - started
        self.stats.download_bytes += expected
        self.stats.download_seconds += elapsed
        speed = expected / max(elapsed, 1e-6)
        self._speed = speed if self._speed is None else SPEED_WEIGHT * speed + (1 - SPEED_WEIGHT) * self._speed
        log.info(
            "remote: entry %s fetched: %s in %.1f s (%s/s)",
            entry_id,
            fmt_bytes(expected),
            elapsed,
            fmt_bytes(int(speed)),
        )
        return final, manifest

    async def _download(self, entry_id: str, result: GetResult, partial: Path, expected: int, sha256: str) -> bool:
        """Stream to `partial`, hashing as it goes (a chunk at a time in memory); True when size and hash match.

        The GET has no overall timeout (a big file on a slow link takes long); each chunk must arrive within
        request_timeout_s instead, so a stalled transfer gives up.
        """
        hasher = hashlib.sha256()
        received = 0
        last_report = time.monotonic()
        stream = result.stream(min_chunk_size=DOWNLOAD_CHUNK_BYTES)
        with open(partial, "wb") as f:
            while True:
                try:
                    chunk = await asyncio.wait_for(anext(stream), self.request_timeout_s)
                except StopAsyncIteration:
                    break
                received += len(chunk)
                if received > expected:
                    return False
                await asyncio.to_thread(_write_hashed, f, hasher, chunk)
                if time.monotonic() - last_report >= PROGRESS_INTERVAL_S:
                    last_report = time.monotonic()
                    log.info("remote: entry %s fetching: %s of %s", entry_id, fmt_bytes(received), fmt_bytes(expected))
        return received == expected and hasher.hexdigest() == sha256

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
        for task in [*self._fetches.values(), *([self._refresh] if self._refresh else [])]:
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


def _write_hashed(f: BinaryIO, hasher: Any, chunk: bytes) -> None:
    f.write(chunk)
    hasher.update(chunk)


def _commit_download(partial: Path, final: Path) -> None:
    """fsync the download, rename it into place, fsync the directory: a crash leaves all of it or none."""
    fsync_path(partial)
    os.replace(partial, final)
    fsync_path(final.parent)
