"""The entries of one save directory on disk: opened, judged, kept, touched, removed and quarantined.

Why apart from the restores and saves built on it (restores.py, saves.py, fitcheck.py): this is the store's
state and the lifetime of its entries, the one writer of both, on the event loop. What an entry found on disk
is good for is entries.judge's; what a start finds, scan.py's; what the entries hold on disk and when unused
blocks go, holdings.py's. How entries are found in memory is index.py's (`EntryIndex`, which this extends).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..chat.media import MediaBook, Wrap
from ..log import fmt_bytes, log
from ..metrics import Metrics
from . import blockfiles, manifestcache
from .entries import (
    BIN_SUFFIX,
    MANIFEST_SUFFIX,
    Entry,
    Status,
    compatible_format,
    discard,
    file_size,
    is_link,
    judge,
    pair_paths,
    remove_pair,
    write_json_atomic,
)
from .fit import Running, Unfit
from .holdings import Holdings
from .index import EntryIndex
from .layout import BLOCKS_DIR, ENTRIES_DIR, QUARANTINE_DIR, SNAPSHOTS_DIR, prepare_layout
from .outcomes import RestoreOutcome, RestoreResult
from .prescan import Prescan
from .scan import remove_transients, scan_entries, take_over_slot_files
from .staging import Staging

if TYPE_CHECKING:  # `slotkeeper ls` reads a store without the client
    from ..llama.client import LlamaClient

QUARANTINE_KEEP = 8  # newest pairs kept in quarantine/
DEFAULT_CAP_SHARE = 0.5  # without --max-cache-bytes: half of what the store could use when it opened


class EntryFiles(EntryIndex):
    """The entries of one save directory, indexed by prefix key (EntryIndex): their files and lifetime."""

    def __init__(  # noqa: PLR0913 - the settings are keyword-only, each with the default a test or `ls` wants
        self,
        root: Path,
        client: LlamaClient | None,
        fingerprint: dict[str, Any],
        server: dict[str, Any] | None = None,
        *,
        fsync: bool = True,
        cap_bytes: int | None = None,
        restore_unverified: bool = False,
        metrics: Metrics | None = None,
        on_commit: Callable[[Entry, Path], None] | None = None,
        snapshots: Path | None = None,
        media: MediaBook | None = None,
        vocabulary: str = "",
        blocks: bool = True,
        ram_staging: bool = True,
    ) -> None:
        super().__init__(fingerprint, server or {})
        self.media = media or MediaBook()  # what its slot files show of pictures (learnt at each commit)
        self.root = root
        self.entries_dir = root / ENTRIES_DIR
        # llama-server's --slot-save-path; shared by the models of a router (their stores lie below the save
        # directory), which clears it of transient files once, at start
        self.snapshots_dir = snapshots or root / SNAPSHOTS_DIR
        self._own_snapshots = snapshots is None
        self.client = client
        self.fsync = fsync
        self.restore_unverified = restore_unverified
        self.metrics = metrics or Metrics()
        self.cap_bytes = cap_bytes
        self.current_format: tuple[int, str] | None = None  # (seq version, layout) this llama-server writes
        self.skipped: dict[str, str] = {}  # entry id -> why it is kept but not used
        self._kept: dict[str, Entry] = {}  # those entries (they count against the cap, and can be evicted)
        self._kept_bytes = 0  # their bytes (the usable entries' sums are EntryIndex's)
        self._pending: set[asyncio.Future[Any]] = set()  # manifest updates (last use) written in the background
        self.cache_changes = 0  # manifests written or read since the manifest cache was (manifestcache.py)
        self._cache_lock = asyncio.Lock()
        self.bytes_per_s: float | None = None  # measured save speed
        # measured restore speed (the last restore's, over its reading work: `_reading_seconds`)
        self.restore_bytes_per_s: float | None = None
        self._warned_copy = False
        # told of each new local save (the remote tier's uploads), with where its bytes are: its .bin, or for an
        # entry kept as blocks, blocks/ (its parts name them)
        self.on_commit = on_commit
        self.vocabulary = vocabulary  # the model's vocabulary key, recorded in every entry saved here
        # entries of other configurations that the running llama-server can recompute from their tokens (fit.py),
        # and why each of the others cannot be (told once at start, counted in the status)
        self.recomputable: dict[str, Entry] = {}
        self.unfit: dict[str, Unfit] = {}
        # Saves are kept as blocks (blocks.py), each written once; False: as one file each, as before blocks
        # (tests of that layout, which stores written before blocks still have, ask for it).
        self.keeps_blocks = blocks
        self.blocks_dir = root / BLOCKS_DIR
        self.holdings = Holdings(self.blocks_dir)  # what the entries hold on disk (the one writer of blocks' lives)
        # where llama-server writes saves and reads restores: RAM when it has room (a file kept whole is renamed
        # into entries/, which RAM cannot be)
        self.staging = Staging(self.snapshots_dir, root, ram=ram_staging and blocks)

    async def load(self, scanned: Prescan | None = None) -> None:
        """Open the store in a thread (`open`), then teach the media book what its entries show of pictures,
        here on the event loop. `scanned`: what `prescan.prescan` read of it while llama-server loaded."""
        await asyncio.to_thread(self.open, scanned)
        for entry in self.entries.values():
            self._remember_pictures(entry)

    def open(self, scanned: Prescan | None = None) -> None:
        """Finish what a killed run left, take over a directory of the slot-file layout, read the manifests
        (`scanned`: already read, by `prescan.prescan` at the spawn, its index taken when it guessed this
        configuration; read again when a slot file was taken over).

        The cyclic garbage collector is off meanwhile: building tens of thousands of entries, it would walk the
        growing heap again and again (a third of the time at 20,000), and none of this makes cycles."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._open(scanned)
        finally:
            if collecting:
                gc.enable()

    def _open(self, scanned: Prescan | None) -> None:
        prepare_layout(self.root)
        if self._own_snapshots:
            remove_transients(self.snapshots_dir)
        self.staging.clean()
        taken = take_over_slot_files(
            self.root, self.fingerprint, restore_unverified=self.restore_unverified, fsync=self.fsync
        )
        if scanned is None or taken:  # (a slot file taken over is a new entry: listed again)
            scanned = Prescan(scan_entries(self.root))
        found = scanned.found
        self.cache_changes = found.manifests_read
        pairs = found.pairs
        if scanned.index is not None and self.take_index(scanned.index):  # the guess was this configuration
            pairs = scanned.rest
        unknown = found.unreadable + found.links  # manifests whose blocks are not known: the sweep must not run
        for entry_id, data, size in pairs:
            unknown += not self._admit(entry_id, data, size)
        if scanned.index is not None:
            for entry in self.entries.values():
                self.holdings.hold(entry)
        # consumed: the manifests read are not held by the prescan, which the daemon's start keeps to its end
        found.pairs, scanned.rest, scanned.index = [], [], None
        found.warn(self.entries_dir)
        self.holdings.sweep(unreadable=unknown)

    def say_kept(self) -> None:
        """One line per reason for the entries kept but not used."""
        reasons: dict[str, int] = {}
        for reason in self.skipped.values():
            reasons[reason] = reasons.get(reason, 0) + 1
        for reason, count in reasons.items():
            log.warning("%d entr%s kept but not used: %s", count, "y" if count == 1 else "ies", reason)

    def _admit(self, entry_id: str, data: dict[str, Any] | Entry, size: int | None) -> bool:
        """Index a committed entry, or set it aside, as entries.judge() says (`slotkeeper ls` asks it too).
        `size` is its regular .bin file's (None: missing). False for a manifest it could not make sense of
        (kept as it is: the blocks it may use are not known)."""
        verdict = judge(data, size, self.fingerprint)
        match verdict.status, verdict.entry:
            case Status.NO_BIN, _:  # a manifest whose file is gone (removed by hand): nothing to keep
                discard(pair_paths(self.entries_dir, entry_id)[1])
            case Status.USABLE, Entry() as entry:
                self.holdings.hold(entry)
                self.index(entry)
            case Status.WRONG_SIZE, Entry() as entry:
                self._quarantine(entry, verdict.reason)
            case _, Entry() as entry:  # another configuration's
                self.holdings.hold(entry)
                self._keep_unused(entry, verdict.reason)
            case _:
                log.warning("entry %s: %s; kept, not used", entry_id[:4], verdict.reason)
                return False
        return True

    @property
    def disk_bytes(self) -> int:
        """What the entries hold on disk: each block once, each file once (the cap counts this)."""
        return self.holdings.disk_bytes

    @property
    def running(self) -> Running:
        return Running(
            fingerprint=self.fingerprint, vocabulary=self.vocabulary, n_ctx_slot=self.fingerprint.get("n_ctx_slot")
        )

    def header_path(self, entry: Entry) -> Path:
        """A file that starts as the entry's file does, up to its tokens (statefile.read_header reads it): its
        own, or its skeleton block (the header and tokens come before any cell's data)."""
        if entry.parts is None:
            return pair_paths(self.entries_dir, entry.id)[0]
        return blockfiles.block_path(self.blocks_dir, entry.parts.skeleton)

    def _keep_unused(self, entry: Entry, reason: str) -> None:
        self.skipped[entry.id] = reason
        if entry.id not in self._kept:
            self._kept_bytes += entry.nbytes
        self._kept[entry.id] = entry

    def _unkeep(self, entry: Entry) -> None:
        if self._kept.pop(entry.id, None) is not None:
            self._kept_bytes -= entry.nbytes
        self.skipped.pop(entry.id, None)

    def started_from(self, entry: Entry) -> None:
        """A new chat started from this entry, an opening (it is marked one if it was a chat's first boundary)."""
        self.mark_opening(entry)
        entry.uses += 1
        self.touch(entry)

    def restore_seconds(self, entry: Entry) -> float | None:
        """How long restoring this entry is expected to take (None before any restore or save was timed): its
        bytes at the speed restores (else saves) read (wrote) them, timed over that work alone."""
        rate = self.restore_bytes_per_s or self.save_rate()
        return entry.nbytes / rate if rate else None

    def most_recent(self, n: int, skip: Callable[[Entry], bool] = lambda e: False) -> list[Entry]:
        chosen: list[Entry] = []
        for entry in sorted(self.entries.values(), key=lambda e: e.last_used, reverse=True):
            if len(chosen) == n:
                break
            if compatible_format(entry, self.current_format) and not skip(entry):
                chosen.append(entry)
        return chosen

    def save_rate(self) -> float | None:
        """Bytes per second the saves achieved, from llama-server's own save times in the manifests."""
        rate = self.timed_save_rate()
        return self.bytes_per_s if rate is None else rate

    def image_counts(self) -> dict[str, int]:
        """How many entries hold pictures, and how many pictures they hold (status, metrics)."""
        with_images = [len(e.images) for e in self.entries.values() if e.images]
        return {"entries_with_images": len(with_images), "images": sum(with_images)}

    def _remember_pictures(self, entry: Entry) -> None:
        """What an entry's manifest says of its pictures joins the media book (on the event loop: its one
        writer's thread)."""
        if entry.images:
            self.media.remember(entry.images, Wrap(*entry.image_wrap) if entry.image_wrap else None)

    def adopt(self, manifest: dict[str, Any]) -> Entry | None:
        """Take in an entry just downloaded (the shared tier): its file to entries/<id>.bin, or, kept as blocks,
        its blocks to blocks/ (each checked against its name on the way). It joins the index only if its manifest
        is whole, its size right, and it was saved for this configuration and format; else its file is removed
        (one line: blocks no entry uses go with the next sweep or prune) and None returned. Judged as open()
        judges what it finds."""
        name = str(manifest.get("id"))
        bin_path, manifest_path = pair_paths(self.entries_dir, name)
        verdict = judge(
            manifest,
            file_size(bin_path),
            self.fingerprint,
            self.current_format,
            link=is_link(bin_path) or is_link(manifest_path),
        )
        entry = verdict.entry
        if verdict.status is Status.USABLE and entry is not None:
            entry.last_used = time.time()
            write_json_atomic(manifest_path, entry.manifest(), self.fsync)
            self.cache_changes += 1
            self.holdings.hold(entry)
            self.index(entry)
            self._remember_pictures(entry)
            return entry
        if entry is None or verdict.status is Status.NO_BIN:
            log.warning("remote entry not used: %s", verdict.reason)
        else:
            log.warning("remote entry %s not used and removed: %s", entry.short, verdict.reason)
        if "id" in manifest and verdict.status is not Status.LINK:
            with contextlib.suppress(OSError):
                remove_pair(self.entries_dir, name)
        return None

    def touch(self, entry: Entry, at: float | None = None) -> None:
        """Mark an entry used now, or at `at` if that is later than its last use (for LRU eviction); its manifest
        is rewritten in the background."""
        entry.last_used = time.time() if at is None else max(entry.last_used, at)
        if entry.id not in self.entries:
            return
        future = asyncio.ensure_future(
            asyncio.to_thread(self._rewrite_manifest, entry.id, entry.manifest(), entry.parts is None)
        )
        self._pending.add(future)
        future.add_done_callback(self._rewritten)

    def _rewrite_manifest(self, entry_id: str, manifest: dict[str, Any], as_file: bool) -> bool:
        """In a thread: an entry's manifest written again (its file, or its manifest when it is kept as blocks,
        still there: a removed entry's is not made again); whether it was."""
        with contextlib.suppress(OSError):
            if (self.entries_dir / f"{entry_id}{BIN_SUFFIX if as_file else MANIFEST_SUFFIX}").exists():
                write_json_atomic(self.entries_dir / f"{entry_id}{MANIFEST_SUFFIX}", manifest, False)
                return True
        return False

    def _rewritten(self, future: asyncio.Future[bool]) -> None:
        self._pending.discard(future)
        if not future.cancelled() and future.exception() is None and future.result():
            self.cache_changes += 1

    async def flush(self) -> None:
        """Wait for background manifest updates; when no save or restore runs, the blocks are as the manifests
        say (nothing for the next start to sweep)."""
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
        if self.holdings.busy:
            return
        self.staging.close()
        if self.holdings.settled():
            self.holdings.mark_clean()

    async def write_cache(self) -> None:
        """Bring the manifest cache up to date (in a thread), when a manifest changed since it was written: so
        that the next start reads one file. A failure costs the next start its speed, nothing else."""
        async with self._cache_lock:  # one writer of the file at a time
            if not self.cache_changes:
                return
            self.cache_changes = 0
            entries = [*self.entries.values(), *self._kept.values()]
            try:
                await asyncio.to_thread(manifestcache.save, self.root, entries)
            except OSError as exc:
                log.debug("manifest cache not written (%s); the next start reads every manifest", exc)

    def _remove(self, entry: Entry) -> None:
        """Forget an entry and remove its pair; a pair that cannot be removed now (a read-only remount) stays
        on disk, out of the index, and is judged again at the next start: nothing is lost either way."""
        self.unindex(entry)
        if self._kept.pop(entry.id, None) is not None:
            self._kept_bytes -= entry.nbytes
        self.skipped.pop(entry.id, None)
        self.recomputable.pop(entry.id, None)
        self.unfit.pop(entry.id, None)
        try:
            remove_pair(self.entries_dir, entry.id)
        except OSError as exc:
            log.warning(
                "entry %s not removed (%s): left on disk, not used in this run", entry.short, exc.strerror or exc
            )
            return
        self.holdings.let_go(entry)

    def evict_over_cap(self, protect: Iterable[str] = ()) -> list[Entry]:
        """Remove least recently used entries until the store fits its cap. Entries kept for other configurations
        count too; entries in `protect` (held by a slot and saved nowhere else) stay."""
        if self.cap_bytes is None or self.disk_bytes <= self.cap_bytes:
            return []
        keep = set(protect)
        evicted = []
        for entry in sorted([*self.entries.values(), *self._kept.values()], key=lambda e: e.last_used):
            if self.disk_bytes <= self.cap_bytes:
                break
            if entry.id in keep:
                continue
            self._remove(entry)
            evicted.append(entry)
            log.info(
                "entry %s evicted (%s tokens, %s, unused for %.0f s): the store is over its cap %s",
                entry.short,
                f"{entry.n_tokens:,}",
                fmt_bytes(entry.nbytes),
                time.time() - entry.last_used,
                fmt_bytes(self.cap_bytes),
            )
        return evicted

    def _quarantine(self, entry: Entry, reason: str) -> None:
        """Move a bad pair aside (never delete it outright) and keep only the newest few."""
        self.unindex(entry)
        self.metrics.quarantines += 1
        self.metrics.restores[RestoreOutcome.QUARANTINED.value] += 1
        qdir = self.root / QUARANTINE_DIR
        stamp = time.strftime("%Y%m%d-%H%M%S")
        try:
            qdir.mkdir(exist_ok=True)
            for suffix in (BIN_SUFFIX, MANIFEST_SUFFIX):
                source = self.entries_dir / f"{entry.id}{suffix}"
                if os.path.lexists(source):
                    os.replace(source, qdir / f"{stamp}-{entry.id}{suffix}")
            olds = sorted(qdir.iterdir(), key=lambda p: p.lstat().st_mtime, reverse=True)
            for old in olds[QUARANTINE_KEEP * 2 :]:
                discard(old)
        except OSError as exc:
            log.warning(
                "entry %s set aside, not used in this run (%s); it could not be moved to %s/ (%s)",
                entry.short,
                reason,
                QUARANTINE_DIR,
                exc.strerror or exc,
            )
            return
        self.holdings.let_go(entry)
        log.warning("entry %s quarantined (%s)", entry.short, reason)

    def _restore_failed(self, reason: str) -> RestoreResult:
        self.metrics.restores[RestoreOutcome.FAILED.value] += 1
        return RestoreResult(outcome=RestoreOutcome.FAILED, reason=reason)


def default_cap(root: Path, store_bytes: int) -> int:
    """Without --max-cache-bytes: half of what the store could use when it opened (its files plus free space)."""
    return int((shutil.disk_usage(root).free + store_bytes) * DEFAULT_CAP_SHARE)


def format_entry(entry: Entry) -> str:
    return f"entry {entry.short} ({entry.n_tokens:,} tokens, {fmt_bytes(entry.nbytes)})"
