"""Write-behind uploads to the shared tier, journaled so that a stop or a dead link loses none.

Each upload is recorded in the journal (`<journal>/<entry_id>.json`, written atomically) before it starts and
forgotten only once its manifest, the remote commit marker, is up; an upload cut off is resumed at the next
start. A local file that is gone or changed meanwhile (evicted, superseded) is dropped, never uploaded half.
Every failure here leaves the local store working: the remote tier is an optimisation.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..log import fmt_bytes, log
from ..store.entries import BIN_SUFFIX, MANIFEST_SUFFIX, PARTIAL_SUFFIX, write_json_atomic
from .bucket import Bucket, RemoteStats, reason
from .s3config import NAME_RE

PART_BYTES = 8 * 1024 * 1024  # multipart part size for uploads
PART_CONCURRENCY = 2  # parts in flight per upload: PART_BYTES * this must cross the link within the timeout
READ_BYTES = 1024 * 1024  # an upload reads and hashes the local file in pieces of this size, off the loop
LEFTOVER_SUFFIXES = (PARTIAL_SUFFIX, ".tmp")  # journal records being written when a run stopped (.tmp: older runs)


@dataclass
class _Upload:
    entry_id: str
    bin_path: Path
    manifest: dict[str, Any]
    nbytes: int = 0

    def record(self) -> dict[str, Any]:
        return {"entry_id": self.entry_id, "bin_path": str(self.bin_path), "manifest": self.manifest}


class _Dropped(Exception):
    """The local file of a journaled upload is gone or changed: that upload no longer makes sense."""


class UploadQueue:
    """One namespace's uploads: at most `concurrency` at a time, each journaled until it is committed."""

    def __init__(
        self, bucket: Bucket, namespace: str, journal_dir: Path, stats: RemoteStats, *, concurrency: int = 2
    ) -> None:
        self.bucket = bucket
        self.namespace = namespace
        self.journal_dir = journal_dir
        self.stats = stats
        journal_dir.mkdir(parents=True, exist_ok=True)
        self._slots = asyncio.Semaphore(concurrency)
        self._uploads: dict[str, tuple[_Upload, asyncio.Task[None]]] = {}
        self._closed = False

    def schedule(self, entry_id: str, bin_path: Path, manifest: dict[str, Any]) -> None:
        """Queue an upload and return at once; the journal record is written (off the loop) before it starts."""
        if not NAME_RE.fullmatch(entry_id):
            raise ValueError(f"remote entry id {entry_id!r} must be a short name of A-Z a-z 0-9 . _ -")
        job = _Upload(entry_id, bin_path, dict(manifest))
        if self._closed:  # stopping: record it for the next start, upload nothing now
            self._write_journal(job)
            return
        self._enqueue(job, journal=True)

    def resume(self) -> int:
        """Queue again every journaled upload whose local file is still there; drop the others."""
        count = 0
        for record in sorted(self.journal_dir.glob(f"*{MANIFEST_SUFFIX}")):
            try:
                data = json.loads(record.read_text(encoding="utf-8"))
                job = _Upload(str(data["entry_id"]), Path(data["bin_path"]), dict(data["manifest"]))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                record.unlink(missing_ok=True)
                log.warning("remote: unreadable upload journal %s removed (%s)", record.name, exc)
                continue
            if job.entry_id in self._uploads:
                continue
            if not job.bin_path.is_file():
                record.unlink(missing_ok=True)
                log.info("remote: upload of entry %s dropped: %s is gone", job.entry_id, job.bin_path)
                continue
            self._enqueue(job, journal=False)
            count += 1
        for suffix in LEFTOVER_SUFFIXES:
            for stale in self.journal_dir.glob(f"*{suffix}"):
                stale.unlink(missing_ok=True)
        if count:
            log.info("remote: %d upload(s) from the journal resumed", count)
        return count

    async def close(self, deadline: float, grace_s: float) -> None:
        """Let running uploads go on until `deadline` (monotonic), then cancel them (giving them `grace_s` to
        unwind); the journal keeps them for the next start."""
        self._closed = True
        tasks = [task for _, task in self._uploads.values()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=grace_s)
        if self._uploads:
            left = sum(job.nbytes for job, _ in self._uploads.values())
            log.info(
                "remote: %d upload(s) pending (%s); they resume at the next start", len(self._uploads), fmt_bytes(left)
            )

    # ---- one upload ---------------------------------------------------------------------------------------------

    def _enqueue(self, job: _Upload, journal: bool) -> None:
        previous = self._uploads.pop(job.entry_id, None)
        if previous is not None:
            previous[1].cancel()  # a newer save of the same entry replaces it
            self.stats.uploads_pending -= 1
        with contextlib.suppress(OSError):
            job.nbytes = job.bin_path.stat().st_size
        task = asyncio.ensure_future(self._upload(job, journal))
        self._uploads[job.entry_id] = (job, task)
        self.stats.uploads_pending += 1

    def _journal_path(self, entry_id: str) -> Path:
        return self.journal_dir / f"{entry_id}{MANIFEST_SUFFIX}"

    def _write_journal(self, job: _Upload) -> None:
        write_json_atomic(self._journal_path(job.entry_id), job.record(), fsync=True)

    async def _upload(self, job: _Upload, journal: bool) -> None:
        """Journal, wait for a slot, then .bin and .json; the journal record goes only once both are up."""
        if journal:
            await asyncio.to_thread(self._write_journal, job)
        async with self._slots:
            started = time.monotonic()
            try:
                nbytes = await self._upload_entry(job)
            except _Dropped as exc:
                self._journal_path(job.entry_id).unlink(missing_ok=True)
                log.info("remote: upload of entry %s dropped: %s", job.entry_id, exc)
                self._finish(job)
                return
            except Exception as exc:  # noqa: BLE001 - kept in the journal for the next start
                self.stats.uploads_failed += 1
                self._finish(job)
                log.warning(
                    "remote: entry %s upload failed (%s); it stays in the journal for the next start",
                    job.entry_id,
                    reason(exc, self.bucket.request_timeout_s),
                )
                return
            elapsed = time.monotonic() - started
            self._journal_path(job.entry_id).unlink(missing_ok=True)
            self.stats.uploads_done += 1
            self.stats.upload_bytes += nbytes
            self.stats.upload_seconds += elapsed
            self._finish(job)
            log.info("remote: entry %s uploaded: %s in %.1f s", job.entry_id, fmt_bytes(nbytes), elapsed)

    def _finish(self, job: _Upload) -> None:
        current = self._uploads.get(job.entry_id)
        if current is not None and current[0] is job:
            del self._uploads[job.entry_id]
            self.stats.uploads_pending -= 1

    async def _upload_entry(self, job: _Upload) -> int:
        """Read the file once (off the loop), hashing what is sent; then the manifest with that hash.

        Written through obstore's buffered writer rather than `put_async(path)`: cancelling a `put_async`
        does not stop its upload (it runs to completion inside obstore's runtime), while an unclosed writer
        never completes its object, and at most PART_CONCURRENCY parts are still in flight when it is dropped.
        """
        before = _stat_or_drop(job)
        hasher = hashlib.sha256()
        sent = 0
        writer = self.bucket.writer(self.namespace, job.entry_id, BIN_SUFFIX, PART_BYTES, PART_CONCURRENCY)
        with open(job.bin_path, "rb") as f:
            while chunk := await asyncio.to_thread(_read_hashed, f, hasher):
                await writer.write(chunk)
                sent += len(chunk)
        changed = _Dropped(f"{job.bin_path.name} changed while it was uploaded")
        if _stat_or_drop(job) != before or sent != before[0]:
            raise changed  # the writer is never closed: no object
        await writer.close()
        if _stat_or_drop(job) != before:  # the object is there, but it is not the local file any more
            with contextlib.suppress(Exception):
                await self.bucket.delete_object(self.namespace, job.entry_id, BIN_SUFFIX)
            raise changed
        await self.bucket.put_manifest(
            self.namespace, job.entry_id, {**job.manifest, "sha256": hasher.hexdigest(), "bytes": sent}
        )
        return sent


def _stat_or_drop(job: _Upload) -> tuple[int, int]:
    """(size, mtime_ns) of the local file; _Dropped when it is gone or its size is not the manifest's."""
    try:
        st = job.bin_path.stat()
    except FileNotFoundError:
        raise _Dropped(f"{job.bin_path} is gone (evicted?)") from None
    declared = job.manifest.get("bytes")
    if declared is not None and declared != st.st_size:
        raise _Dropped(f"{job.bin_path.name} has {st.st_size} bytes, its manifest says {declared}")
    return st.st_size, st.st_mtime_ns


def _read_hashed(f: BinaryIO, hasher: Any) -> bytes:
    chunk = f.read(READ_BYTES)
    hasher.update(chunk)
    return chunk
