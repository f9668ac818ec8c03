"""Saving and restoring slot caches without ever losing the last good one.

llama-server writes a save file in place, so an interrupted save would destroy the previous file. slotkeeper
asks it to save under a temporary name, checks the result, fsyncs, renames over `<id>.bin`, and only then
renames the manifest (`<id>.json`) into place. A crash between the two renames is rolled forward at the next
start. A file whose manifest does not match the running model and settings is never restored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from .fingerprint import first_difference
from .log import fmt_bytes, fmt_ms, log
from .metrics import Metrics

if TYPE_CHECKING:  # `slotkeeper ls` reads the save directory without importing aiohttp
    from .llama_client import LlamaClient

BIN_SUFFIX = ".bin"
MANIFEST_SUFFIX = ".json"
PARTIAL_SUFFIX = ".partial"
QUARANTINE_DIR = "quarantine"
QUARANTINE_KEEP = 8  # newest pairs kept in quarantine/
MANIFEST_VERSION = 1
FREE_SPACE_HEADROOM = 1.1  # a save needs the previous size of this slot plus 10% free
PROGRESS_INTERVAL_S = 2.0


def bin_name(slot_id: int) -> str:
    return f"{slot_id}{BIN_SUFFIX}"


def manifest_name(slot_id: int) -> str:
    return f"{slot_id}{MANIFEST_SUFFIX}"


def is_slot_id(text: str) -> bool:
    """`0`, `12`: ASCII digits only (str.isdigit() also accepts `²`)."""
    return text.isascii() and text.isdigit()


def is_reserved_filename(name: str) -> bool:
    """Names slotkeeper owns in the save directory: `<id>.bin`, `<id>.json` and their partials."""
    stem = name.removesuffix(PARTIAL_SUFFIX)
    for suffix in (BIN_SUFFIX, MANIFEST_SUFFIX):
        if stem.endswith(suffix) and is_slot_id(stem[: -len(suffix)]):
            return True
    return False


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class SlotInfo:
    """What is known about one slot, for logs and /slotkeeper/status."""

    slot_id: int
    restored_tokens: int | None = None
    restored_bytes: int | None = None
    restore_ms: float | None = None
    not_restored: str | None = None
    saved_task: int | None = None  # llama-server's id_task when the file was last written
    last_save: dict[str, Any] | None = None


@dataclass
class SaveOutcome:
    slot_id: int
    saved: bool
    reason: str = ""
    tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    save_ms: float | None = None  # llama-server's own time for the save


@dataclass
class SlotStore:
    """The save directory and the protocol around llama-server's slot save/restore actions."""

    save_dir: Path
    client: LlamaClient
    fingerprint: dict[str, Any]
    fsync: bool = True
    restore_unverified: bool = False
    slots: dict[int, SlotInfo] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    metrics: Metrics = field(default_factory=Metrics)
    _commits: list[asyncio.Future[SaveOutcome]] = field(default_factory=list)

    # ---- start --------------------------------------------------------------------------------------------

    def recover(self) -> None:
        """Finish or discard what a killed run left: roll a complete save forward, remove partial files."""
        for partial in sorted(self.save_dir.glob(f"*{MANIFEST_SUFFIX}{PARTIAL_SUFFIX}")):
            final = partial.with_name(partial.name.removesuffix(PARTIAL_SUFFIX))
            bin_path = final.with_suffix(BIN_SUFFIX)
            manifest = read_manifest(partial)
            if manifest and bin_path.is_file() and bin_path.stat().st_size == manifest.get("bytes"):
                os.replace(partial, final)
                log.info("recovered %s: the save before the last stop completed its file", final.name)
            else:
                partial.unlink(missing_ok=True)
        for partial in self.save_dir.glob(f"*{BIN_SUFFIX}{PARTIAL_SUFFIX}"):
            partial.unlink(missing_ok=True)
            log.info("removed %s left by an interrupted save", partial.name)

    async def restore_all(self, total_slots: int) -> None:
        """Restore every slot that has a verified file; a failure leaves that slot cold and never stops startup."""
        for slot_id in range(total_slots):
            self.slots[slot_id] = info = SlotInfo(slot_id)
            await self._restore_one(info)

    async def _restore_one(self, info: SlotInfo) -> None:
        slot_id = info.slot_id
        bin_path = self.save_dir / bin_name(slot_id)
        if not bin_path.is_file():
            info.not_restored = "no cache file"
            self.metrics.restores["no_file"] += 1
            log.info("slot %d: no cache file", slot_id)
            return
        manifest = read_manifest(self.save_dir / manifest_name(slot_id))
        size = bin_path.stat().st_size
        if manifest is None:
            if not self.restore_unverified:
                info.not_restored = "no manifest"
                self.metrics.restores["no_manifest"] += 1
                log.warning(
                    "slot %d: %s has no slotkeeper manifest; skipped (--restore-unverified restores such files)",
                    slot_id, bin_path.name,
                )
                return
        else:
            difference = first_difference(manifest.get("fingerprint", {}), self.fingerprint)
            if difference:
                info.not_restored = f"fingerprint differs ({difference})"
                self.metrics.restores["fingerprint_differs"] += 1
                log.warning("slot %d: cache skipped, saved for another configuration: %s", slot_id, difference)
                return
            if manifest.get("bytes") != size:
                self.quarantine(slot_id, f"size {size} differs from manifest {manifest.get('bytes')}")
                info.not_restored = "size differs from manifest"
                return
        started = time.monotonic()
        try:
            reply = await self.client.slot_action(slot_id, "restore", bin_path.name)
        except Exception as exc:  # noqa: BLE001 - any failure to talk to the child leaves the slot cold
            info.not_restored = f"restore request failed: {exc!r}"
            self.metrics.restores["failed"] += 1
            log.warning("slot %d restore failed: %r; starting cold", slot_id, exc)
            return
        elapsed = time.monotonic() - started
        if not reply.ok:
            info.not_restored = f"llama-server refused: {reply.error}"
            self.quarantine(slot_id, f"llama-server refused it: {reply.error}")
            return
        tokens = int(reply.body.get("n_restored", 0))
        nbytes = int(reply.body.get("n_read", size))
        info.restored_tokens, info.restored_bytes = tokens, nbytes
        info.restore_ms = float(reply.body.get("timings", {}).get("restore_ms", elapsed * 1000))
        self.metrics.restored(elapsed, nbytes, tokens)
        log.info("slot %d restored: %s tokens, %s in %s", slot_id, f"{tokens:,}", fmt_bytes(nbytes), fmt_ms(elapsed))

    def quarantine(self, slot_id: int, reason: str) -> None:
        """Move a bad pair aside (never delete it outright) and keep only the newest few."""
        qdir = self.save_dir / QUARANTINE_DIR
        qdir.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for name in (bin_name(slot_id), manifest_name(slot_id)):
            source = self.save_dir / name
            if source.exists():
                os.replace(source, qdir / f"{stamp}-{name}")
        self.metrics.quarantines += 1
        self.metrics.restores["quarantined"] += 1
        log.warning("slot %d: cache quarantined (%s); starting cold", slot_id, reason)
        entries = sorted(qdir.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[QUARANTINE_KEEP * 2 :]:
            old.unlink(missing_ok=True)

    # ---- save ---------------------------------------------------------------------------------------------

    async def dirty_slots(self, total_slots: int, slots_endpoint: bool) -> list[tuple[int, int | None]]:
        """(slot id, id_task) of slots changed since their file was written, most recently used first.

        A slot that was only restored has no task in llama-server's /slots, so it is not written again. When
        /slots is disabled (`--no-slots`), every slot is tried; empty ones are refused by the save protocol.
        """
        if slots_endpoint:
            try:
                reply = await self.client.slots()
            except Exception as exc:  # noqa: BLE001
                log.warning("GET /slots failed (%r); trying every slot", exc)
                reply = None
            if reply is not None and reply.ok and isinstance(reply.body, list):
                changed = []
                for entry in reply.body:
                    slot_id, task_id = int(entry["id"]), entry.get("id_task")
                    if slot_id >= total_slots or task_id is None or entry.get("n_prompt_tokens", 0) <= 0:
                        continue  # never used since start (only restored, or empty)
                    info = self.slots.get(slot_id)
                    if info is None or info.saved_task != task_id:
                        changed.append((slot_id, int(task_id)))
                return sorted(changed, key=lambda pair: pair[1], reverse=True)
            if reply is not None and not reply.ok:
                log.warning("GET /slots answered %d (%s); trying every slot", reply.status, reply.error)
        return [(slot_id, None) for slot_id in range(total_slots)]

    async def save_dirty(
        self, total_slots: int, slots_endpoint: bool, deadline: float | None, overlap_commits: bool = False
    ) -> list[SaveOutcome]:
        """Save the slots that changed, most recently used first, until the deadline (monotonic).

        Holds the store's lock, so an idle autosave and the stop-time save never interleave: a save that
        starts after an autosave finds those slots clean. Commits (fsync + rename) may still be pending when
        this returns when `overlap_commits` is set: `flush()` waits for them, so they can overlap stopping
        the child.
        """
        async with self.lock:
            targets = await self.dirty_slots(total_slots, slots_endpoint)
            outcomes = []
            for slot_id, task_id in targets:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    outcomes.append(SaveOutcome(slot_id, False, "no time left"))
                    self.metrics.save_failed("budget")
                    log.warning("slot %d not saved: the save budget ran out; its previous file is kept", slot_id)
                    continue
                try:
                    outcome = await asyncio.wait_for(self._save_one(slot_id, task_id), remaining)
                except TimeoutError:
                    self._discard_partials(slot_id)
                    outcome = SaveOutcome(slot_id, False, "timed out")
                    self.metrics.save_failed("budget")
                    log.warning(
                        "slot %d save abandoned after %.1f s: the save budget (--save-timeout) ran out; "
                        "its previous file is kept", slot_id, remaining or 0.0,
                    )
                outcomes.append(outcome)
            if not overlap_commits:
                return await self.flush()
            return outcomes

    async def flush(self) -> list[SaveOutcome]:
        """Wait for the pending commits of saved slots; their outcomes say which reached their final name."""
        pending, self._commits = self._commits, []
        return list(await asyncio.gather(*pending)) if pending else []

    def _discard_partials(self, slot_id: int) -> None:
        for name in (bin_name(slot_id), manifest_name(slot_id)):
            (self.save_dir / (name + PARTIAL_SUFFIX)).unlink(missing_ok=True)

    def _previous_size(self, slot_id: int) -> int:
        """The size of the slot's last good file, from its manifest (0 when unknown)."""
        previous = read_manifest(self.save_dir / manifest_name(slot_id))
        return int(previous.get("bytes", 0)) if previous else 0

    def _check_free_space(self, expected: int) -> str | None:
        free = shutil.disk_usage(self.save_dir).free
        if free < expected * FREE_SPACE_HEADROOM:
            return f"only {fmt_bytes(free)} free in {self.save_dir}, ~{fmt_bytes(expected)} needed"
        return None

    async def _report_progress(self, slot_id: int, partial: Path, expected: int) -> None:
        """For long saves: `slot 0 saving: 1.2 GB of ~3.4 GB` every couple of seconds."""
        of_expected = f" of ~{fmt_bytes(expected)}" if expected else ""
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            with contextlib.suppress(OSError):
                log.info("slot %d saving: %s%s", slot_id, fmt_bytes(partial.stat().st_size), of_expected)

    async def _save_one(self, slot_id: int, task_id: int | None) -> SaveOutcome:
        """Ask llama-server to save to a partial name and check its work; the commit happens in `_commit_async`."""
        partial = self.save_dir / (bin_name(slot_id) + PARTIAL_SUFFIX)
        started = time.monotonic()
        expected = self._previous_size(slot_id)
        progress = asyncio.ensure_future(self._report_progress(slot_id, partial, expected))
        outcome = SaveOutcome(slot_id, False)
        try:
            outcome = await self._request_save(slot_id, partial, expected)
        except Exception as exc:  # noqa: BLE001 - a dead or confused child must not stop the rest of the stop
            outcome.reason = repr(exc)
            self.metrics.save_failed("request_failed")
            log.warning("slot %d save failed: %r; its previous file is kept", slot_id, exc)
        finally:  # also on cancellation (budget): never leave a partial file behind
            progress.cancel()
            if not outcome.saved:
                self._discard_partials(slot_id)
        if not outcome.saved:
            return outcome
        outcome.seconds = time.monotonic() - started
        self._commits.append(asyncio.ensure_future(self._commit_async(slot_id, task_id, outcome)))
        return outcome

    async def _request_save(self, slot_id: int, partial: Path, expected: int) -> SaveOutcome:
        low_space = self._check_free_space(expected)
        if low_space:
            log.warning("slot %d not saved: %s; its previous file is kept", slot_id, low_space)
            self.metrics.save_failed("disk_space")
            return SaveOutcome(slot_id, False, low_space)
        reply = await self.client.slot_action(slot_id, "save", partial.name)
        if not reply.ok:
            reason = f"llama-server answered {reply.status}: {reply.error}"
            log.warning("slot %d save failed: %s; its previous file is kept", slot_id, reason)
            self.metrics.save_failed("llama_server_error")
            return SaveOutcome(slot_id, False, reason)
        tokens = int(reply.body.get("n_saved", 0))
        written = int(reply.body.get("n_written", -1))
        if tokens == 0:
            log.info("slot %d: nothing to save (0 tokens)", slot_id)
            self.metrics.saves["empty"] += 1
            return SaveOutcome(slot_id, False, "0 tokens")
        size = partial.stat().st_size if partial.exists() else -1
        if size != written:
            reason = f"file has {size} bytes, llama-server reported {written}"
            log.warning("slot %d save failed: %s; its previous file is kept", slot_id, reason)
            self.metrics.save_failed("size_mismatch")
            return SaveOutcome(slot_id, False, reason)
        save_ms = reply.body.get("timings", {}).get("save_ms")
        return SaveOutcome(slot_id, True, tokens=tokens, nbytes=written, save_ms=save_ms)

    async def _commit_async(self, slot_id: int, task_id: int | None, saved: SaveOutcome) -> SaveOutcome:
        partial = self.save_dir / (bin_name(slot_id) + PARTIAL_SUFFIX)
        started = time.monotonic()
        try:
            await asyncio.to_thread(self._commit, slot_id, partial, saved)
        except OSError as exc:
            self._discard_partials(slot_id)
            log.warning("slot %d save failed: %s; its previous file is kept", slot_id, exc.strerror or exc)
            self.metrics.save_failed("commit_failed")
            return SaveOutcome(slot_id, False, str(exc))
        elapsed = saved.seconds + time.monotonic() - started
        info = self.slots.setdefault(slot_id, SlotInfo(slot_id))
        info.saved_task = task_id
        info.last_save = {"tokens": saved.tokens, "bytes": saved.nbytes, "ms": round(elapsed * 1000, 1), "at": time.time()}
        self.metrics.saved(elapsed, saved.nbytes, saved.tokens)
        log.info("slot %d saved: %s tokens, %s in %s", slot_id, f"{saved.tokens:,}", fmt_bytes(saved.nbytes), fmt_ms(elapsed))
        return SaveOutcome(slot_id, True, tokens=saved.tokens, nbytes=saved.nbytes, seconds=elapsed)

    def _commit(self, slot_id: int, partial: Path, saved: SaveOutcome) -> None:
        """fsync the new file, rename it over the old one, then put its manifest in place (manifest last)."""
        final = self.save_dir / bin_name(slot_id)
        manifest = {
            "version": MANIFEST_VERSION,
            "slot": slot_id,
            "tokens": saved.tokens,
            "bytes": saved.nbytes,
            "saved_at": time.time(),
            "save_ms": saved.save_ms,
            "fingerprint": self.fingerprint,
        }
        manifest_partial = self.save_dir / (manifest_name(slot_id) + PARTIAL_SUFFIX)
        with open(manifest_partial, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        if self.fsync:
            fsync_path(partial)
        os.replace(partial, final)
        if self.fsync:
            fsync_path(self.save_dir)
        os.replace(manifest_partial, self.save_dir / manifest_name(slot_id))
        if self.fsync:
            fsync_path(self.save_dir)


def evict_over_cap(save_dir: Path, cap: int) -> list[int]:
    """Remove the oldest cache pairs (manifest first) until the directory's cache files fit in `cap` bytes."""
    pairs = []
    for bin_path in save_dir.glob(f"*{BIN_SUFFIX}"):
        stem = bin_path.name.removesuffix(BIN_SUFFIX)
        if is_slot_id(stem) and str(int(stem)) == stem:
            manifest = read_manifest(save_dir / manifest_name(int(stem))) or {}
            pairs.append((manifest.get("saved_at", bin_path.stat().st_mtime), int(stem), bin_path.stat().st_size))
    total = sum(size for _, _, size in pairs)
    evicted = []
    for _, slot_id, size in sorted(pairs):
        if total <= cap:
            break
        (save_dir / manifest_name(slot_id)).unlink(missing_ok=True)
        (save_dir / bin_name(slot_id)).unlink(missing_ok=True)
        total -= size
        evicted.append(slot_id)
        log.info("slot %d cache evicted (%s): the directory is over --max-cache-bytes %s", slot_id, fmt_bytes(size), fmt_bytes(cap))
    return evicted


def read_manifest(path: Path) -> dict[str, Any] | None:
    """A manifest, or None when it is missing or unreadable (treated as no manifest)."""
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            return data
    return None
