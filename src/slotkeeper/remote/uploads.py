"""Write-behind uploads to the shared tier, journaled so that a stop or a dead link loses none.

Each upload is recorded in the journal (`<journal>/<entry_id>.json`, written atomically) before it starts and
forgotten only once its manifest, the remote commit marker, is up; an upload cut off is resumed at the next
start. An entry kept as blocks sends only the blocks the bucket lacks: those this run has not seen there lately
(sent, or found by a HEAD, in the last KNOWN_BLOCK_MAX_AGE_S), each read from the store's blocks/ and checked
against its name on the way. A block the bucket has that is over BLOCK_RENEW_AGE_S old is sent again (same name,
same bytes): a lifecycle rule that expires objects by age then never takes a block from a newer entry before it
has taken that entry's own blocks, but for their last day. A local file or block that is gone or changed
meanwhile (evicted, superseded) drops the upload, never uploaded half. Every failure here leaves the local store
working: the remote tier is an optimisation.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from ..log import fmt_bytes, log
from ..store.blockfiles import block_path
from ..store.entries import BIN_SUFFIX, MANIFEST_SUFFIX, PARTIAL_SUFFIX, write_json_atomic
from .bucket import Bucket, RemoteStats, age_s, block_parts, reason
from .s3config import NAME_RE

PART_BYTES = 8 * 1024 * 1024  # multipart part size for uploads
PART_CONCURRENCY = 2  # parts in flight per upload: PART_BYTES * this must cross the link within the timeout
READ_BYTES = 1024 * 1024  # an upload reads and hashes the local file in pieces of this size, off the loop
LEFTOVER_SUFFIXES = (PARTIAL_SUFFIX, ".tmp")  # journal records being written when a run stopped (.tmp: older runs)
BLOCK_CONCURRENCY = 4  # blocks of one entry looked up or sent at a time
# A block seen in the bucket this long ago is looked up again before an entry counts on it: a `prune --remote`
# elsewhere may have removed it since.
KNOWN_BLOCK_MAX_AGE_S = 600.0
BLOCK_RENEW_AGE_S = 86400.0  # a block in the bucket older than this is written again when an upload counts on it


@dataclass
class _Upload:
    """One entry to upload: `source` is its .bin, or for an entry kept as blocks (its manifest has "parts"),
    the store's blocks/ folder."""

    entry_id: str
    source: Path
    manifest: dict[str, Any]
    nbytes: int = 0

    @property
    def as_blocks(self) -> bool:
        return "parts" in self.manifest

    def record(self) -> dict[str, Any]:
        where = "blocks_dir" if self.as_blocks else "bin_path"
        return {"entry_id": self.entry_id, where: str(self.source), "manifest": self.manifest}

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> _Upload:
        """KeyError, TypeError, ValueError for a record this slotkeeper did not write."""
        manifest = dict(data["manifest"])
        source = Path(data["blocks_dir"] if "parts" in manifest else data["bin_path"])
        return cls(str(data["entry_id"]), source, manifest)


class _Dropped(Exception):
    """The local file (or a block) of a journaled upload is gone or changed: that upload no longer makes sense.
    `warn`: not in the ordinary course of things (a damaged block), said as a warning."""

    def __init__(self, why: str, *, warn: bool = False) -> None:
        super().__init__(why)
        self.warn = warn


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
        # block -> when it was last seen in the bucket, written less than BLOCK_RENEW_AGE_S before (monotonic)
        self._known: dict[str, float] = {}
        self._sending: dict[str, asyncio.Future[None]] = {}  # block -> done when its look-up or PUT ends
        self._damaged: set[str] = set()  # blocks a fetch found damaged in the bucket: sent again when needed

    def damaged(self, name: str) -> None:
        """A fetch found this block's object in the bucket damaged (not the bytes its name says): the next upload
        that counts on it writes it again, from the local store's, instead of taking its object's word for it."""
        self._damaged.add(name)
        self._known.pop(name, None)

    def _seen(self, name: str) -> bool:
        seen = self._known.get(name)
        return seen is not None and time.monotonic() - seen < KNOWN_BLOCK_MAX_AGE_S

    def schedule(self, entry_id: str, source: Path, manifest: dict[str, Any]) -> None:
        """Queue an upload and return at once; the journal record is written (off the loop) before it starts.
        `source`: the entry's .bin, or the store's blocks/ for an entry kept as blocks."""
        if not NAME_RE.fullmatch(entry_id):
            raise ValueError(f"remote entry id {entry_id!r} must be a short name of A-Z a-z 0-9 . _ -")
        job = _Upload(entry_id, source, dict(manifest))
        if self._closed:  # stopping: record it for the next start, upload nothing now
            self._write_journal(job)
            return
        self._enqueue(job, journal=True)

    def resume(self) -> int:
        """Queue again every journaled upload whose local file is still there; drop the others."""
        count = 0
        for record in sorted(self.journal_dir.glob(f"*{MANIFEST_SUFFIX}")):
            try:
                job = _Upload.from_record(json.loads(record.read_text(encoding="utf-8")))
                missing = _missing_locally(job)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                record.unlink(missing_ok=True)
                log.warning("remote: unreadable upload journal %s removed (%r)", record.name, exc)
                continue
            if job.entry_id in self._uploads:
                continue
            if missing:
                record.unlink(missing_ok=True)
                log.info("remote: upload of entry %s dropped: %s is gone", job.entry_id, missing)
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
        if job.as_blocks:
            job.nbytes = int(job.manifest.get("bytes") or 0)
        else:
            with contextlib.suppress(OSError):
                job.nbytes = job.source.stat().st_size
        task = asyncio.ensure_future(self._upload(job, journal))
        self._uploads[job.entry_id] = (job, task)
        self.stats.uploads_pending += 1

    def _journal_path(self, entry_id: str) -> Path:
        return self.journal_dir / f"{entry_id}{MANIFEST_SUFFIX}"

    def _write_journal(self, job: _Upload) -> None:
        write_json_atomic(self._journal_path(job.entry_id), job.record(), fsync=True)

    async def _upload(self, job: _Upload, journal: bool) -> None:
        """Journal, wait for a slot, then the .bin or the blocks the bucket lacks, then the .json; the journal
        record goes only once all are up."""
        if journal:
            await asyncio.to_thread(self._write_journal, job)
        async with self._slots:
            started = time.monotonic()
            try:
                nbytes, detail = await (self._upload_blocks(job) if job.as_blocks else self._upload_entry(job))
            except _Dropped as exc:
                self._journal_path(job.entry_id).unlink(missing_ok=True)
                (log.warning if exc.warn else log.info)("remote: upload of entry %s dropped: %s", job.entry_id, exc)
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
            log.info("remote: entry %s uploaded: %s in %.1f s%s", job.entry_id, fmt_bytes(nbytes), elapsed, detail)

    def _finish(self, job: _Upload) -> None:
        current = self._uploads.get(job.entry_id)
        if current is not None and current[0] is job:
            del self._uploads[job.entry_id]
            self.stats.uploads_pending -= 1

    async def _upload_entry(self, job: _Upload) -> tuple[int, str]:
        """An entry kept whole: read the file once (off the loop), hashing what is sent; then the manifest with
        that hash. Returns the bytes sent (and nothing more to say of them).

        Written through obstore's buffered writer rather than `put_async(path)`: cancelling a `put_async`
        does not stop its upload (it runs to completion inside obstore's runtime), while an unclosed writer
        never completes its object, and at most PART_CONCURRENCY parts are still in flight when it is dropped.
        """
        before = _stat_or_drop(job)
        hasher = hashlib.sha256()
        sent = 0
        writer = self.bucket.writer(self.namespace, job.entry_id, BIN_SUFFIX, PART_BYTES, PART_CONCURRENCY)
        with open(job.source, "rb") as f:
            while chunk := await asyncio.to_thread(_read_hashed, f, hasher):
                await writer.write(chunk)
                sent += len(chunk)
        changed = _Dropped(f"{job.source.name} changed while it was uploaded")
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
        return sent, ""

    async def _upload_blocks(self, job: _Upload) -> tuple[int, str]:
        """An entry kept as blocks: each block the bucket lacks (BLOCK_CONCURRENCY at a time), then the manifest.
        Returns the bytes sent, and how many of its blocks that was."""
        try:
            parts = block_parts(job.manifest)
        except (KeyError, TypeError, ValueError) as exc:
            raise _Dropped(f"its manifest's parts are not usable ({exc})", warn=True) from None
        assert parts is not None
        sizes = parts.block_sizes()
        missing = await asyncio.to_thread(_missing_locally, job)
        if missing:
            raise _Dropped(f"{missing} is gone (superseded or evicted?)")
        limit = asyncio.Semaphore(BLOCK_CONCURRENCY)
        tasks = [asyncio.ensure_future(self._send_block(job, name, size, limit)) for name, size in sizes.items()]
        try:
            sent = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        await self.bucket.put_manifest(self.namespace, job.entry_id, job.manifest)
        new = [n for n in sent if n is not None]
        return sum(new), f" ({len(new)} of its {len(sizes)} blocks, of {fmt_bytes(parts.nbytes)})"

    async def _send_block(self, job: _Upload, name: str, size: int, limit: asyncio.Semaphore) -> int | None:
        """Make sure the bucket has this block: seen there lately, being sent by another upload (then looked at
        again once that ends), found by a HEAD (its size, written less than BLOCK_RENEW_AGE_S ago, and not found
        damaged by a fetch), or sent now. Returns the bytes sent (None: none sent)."""
        while not self._seen(name):
            sending = self._sending.get(name)
            if sending is not None:
                await asyncio.shield(sending)  # (always ends in a result: its own failure is its upload's)
                continue
            done = asyncio.get_running_loop().create_future()
            self._sending[name] = done
            try:
                async with limit:
                    there = None if name in self._damaged else await self.bucket.head_block(self.namespace, name)
                    if there is not None and there["size"] == size and age_s(there) < BLOCK_RENEW_AGE_S:
                        self._known[name] = time.monotonic()
                        return None
                    await self._put_block(job, name, size)
                self._known[name] = time.monotonic()
                self._damaged.discard(name)
                return size
            finally:
                if self._sending.get(name) is done:
                    del self._sending[name]
                done.set_result(None)
        return None

    async def _put_block(self, job: _Upload, name: str, size: int) -> None:
        """Read the local block (off the loop, a piece at a time), checking its bytes against its name and size
        before the object is made: a block that does not match is never sent (its writer is never closed)."""
        try:  # (a link is never followed, as nowhere in the store)
            fd = await asyncio.to_thread(os.open, block_path(job.source, name), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise _Dropped(f"block {name} is gone (superseded or evicted?)") from None
        except OSError as exc:
            raise _Dropped(f"its local block {name} cannot be read ({exc.strerror or exc})", warn=True) from None
        hasher = xxhash.xxh3_128()
        read = 0
        writer = self.bucket.block_writer(self.namespace, name, PART_BYTES, PART_CONCURRENCY)
        with os.fdopen(fd, "rb") as f:
            while chunk := await asyncio.to_thread(_read_hashed, f, hasher):
                read += len(chunk)
                if read > size:
                    break
                await writer.write(chunk)
        if read != size or hasher.hexdigest() != name:
            raise _Dropped(f"its local block {name} does not match its name and size (damaged?); not sent", warn=True)
        await writer.close()


def _missing_locally(job: _Upload) -> str:
    """What of the entry's local files is gone ("" when nothing is): its .bin, or one of its blocks."""
    if not job.as_blocks:
        return "" if job.source.is_file() else str(job.source)
    parts = block_parts(job.manifest)
    assert parts is not None
    for name in parts.block_sizes():
        if not block_path(job.source, name).is_file():
            return f"block {name}"
    return ""


def _stat_or_drop(job: _Upload) -> tuple[int, int]:
    """(size, mtime_ns) of the local file; _Dropped when it is gone or its size is not the manifest's."""
    try:
        st = job.source.stat()
    except FileNotFoundError:
        raise _Dropped(f"{job.source} is gone (evicted?)") from None
    declared = job.manifest.get("bytes")
    if declared is not None and declared != st.st_size:
        raise _Dropped(f"{job.source.name} has {st.st_size} bytes, its manifest says {declared}")
    return st.st_size, st.st_mtime_ns


def _read_hashed(f: BinaryIO, hasher: Any) -> bytes:
    chunk = f.read(READ_BYTES)
    hasher.update(chunk)
    return chunk
