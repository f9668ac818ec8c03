"""The conversation store: saved KV states of conversations, found by prefix, never lost to a crash.

An *entry* is one llama-server slot file (`entries/<id>.bin`) and its manifest (`entries/<id>.json`): the
fingerprint of the configuration that can use it, token count, bytes, last use, llama-server's identity and
the file's format version, and the prefix keys of its tokens (`prefix.block_keys`). Entries are keyed by
content, not by slot: the placement policy restores one into whichever slot it chooses. The pair, its manifest
and the rule for what an entry found on disk is good for are entries.py's (`slotkeeper ls` reads them there too).

The mechanism lives here; what to save, restore or evict, and when, is the caller's (placement, daemon). Of
its parts, how entries are found in memory is index.py's (`EntryIndex`, which the store extends), what a
start finds on disk is scan.py's, and the slot files' transient names and their commit are slotfiles.py's.

Nothing lost, by construction:
* llama-server never sees the store. Its `--slot-save-path` is `snapshots/` (clients' own save and restore
  names land there); slotkeeper saves into it under a random transient name and renames the file into
  `entries/`, and restores through a transient hard link. No request can name an entry.
* A save never overwrites: every save is a new entry, committed by its manifest (fsync, rename, fsync the
  directory), and only then are the entries it extends removed. A crash at any step leaves the previous
  entries whole; an entry file without a manifest is an interrupted save and is removed at the next start.
* A save that fails, whatever the error (a full disk, a read-only remount), removes everything it made before
  it returns: a file left behind would hold the space the next save needs.
* Every entry carries a checksum of its file, checked while llama-server restores it and known before any
  request may use the slot: a file that rotted on disk is quarantined and the slot erased, so the model never
  answers from a state it never had.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import gc
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..chat.media import Learnt, MediaBook, MediaBoundary, Wrap
from ..chat.prefix import exact_key
from ..log import fmt_bytes, log
from ..metrics import Metrics
from . import blockfiles, manifestcache, slotfiles
from .entries import (
    BIN_SUFFIX,
    MANIFEST_SUFFIX,
    Entry,
    Status,
    compatible_format,
    discard,
    file_checksum,
    file_size,
    is_link,
    judge,
    pair_paths,
    remove_pair,
    write_json_atomic,
)
from .fit import UNFIT_WORDS, Fit, Running, Unfit, fit, group_of, same_tensors
from .holdings import Holdings
from .index import EntryIndex, extends
from .layout import BLOCKS_DIR, ENTRIES_DIR, QUARANTINE_DIR, SNAPSHOTS_DIR, prepare_layout
from .prescan import Prescan
from .scan import remove_transients, scan_entries, take_over_slot_files
from .slotfiles import SavedFile, low_space, read_saved, report_progress, transient_path
from .staging import Staged, Staging
from .statefile import StateFileError, StateHeader, read_header

if TYPE_CHECKING:  # `slotkeeper ls` reads a store without the client
    from ..llama.client import LlamaClient

__all__ = [
    "ConversationStore",
    "RestoreOutcome",
    "RestoreResult",
    "SaveFailure",
    "SaveResult",
    "default_cap",
    "format_entry",
]

QUARANTINE_KEEP = 8  # newest pairs kept in quarantine/
DEFAULT_CAP_SHARE = 0.5  # without --max-cache-bytes: half of what the store could use when it opened


class SaveFailure(enum.StrEnum):
    """Why a save made no entry (the values label slotkeeper_save_failures; EMPTY counts as an outcome)."""

    EMPTY = "empty"  # the slot held no tokens: nothing to keep
    DISK_SPACE = "disk_space"
    LLAMA_SERVER_ERROR = "llama_server_error"
    SIZE_MISMATCH = "size_mismatch"
    COMMIT_FAILED = "commit_failed"
    REQUEST_FAILED = "request_failed"
    BUDGET = "budget"  # the caller's time ran out


@dataclass(frozen=True, kw_only=True)
class SaveResult:
    """How a save ended: the entry it wrote, or why none."""

    entry: Entry | None = None
    failure: SaveFailure | None = None  # when entry is None
    reason: str = ""  # the failure in words
    seconds: float = 0.0
    superseded: int = 0
    written: int = 0  # the bytes it wrote to the store: its new blocks (kept as blocks) or its file

    @property
    def size_text(self) -> str:
        """The entry's size for a log line, with what reached the store when that is less (blocks it shares)."""
        if self.entry is None:
            return ""
        if self.written >= self.entry.nbytes:
            return fmt_bytes(self.entry.nbytes)
        return f"{fmt_bytes(self.entry.nbytes)} ({fmt_bytes(self.written)} new)"


class RestoreOutcome(enum.StrEnum):
    """How a restore ended (the values label slotkeeper_restores)."""

    RESTORED = "restored"
    FAILED = "failed"  # not restored, the entry kept: llama-server unreachable, or its file unreadable now
    QUARANTINED = "quarantined"  # the entry was bad and is gone (the store said so in its own line)


@dataclass(frozen=True, kw_only=True)
class RestoreResult:
    """How a restore ended, and what it read."""

    outcome: RestoreOutcome
    reason: str = ""  # why it was not restored, in words
    n_tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome is RestoreOutcome.RESTORED


class ConversationStore(EntryIndex):
    """The entries of one save directory, indexed by prefix key (EntryIndex), and the save/restore protocol
    around them."""

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
        self.on_commit = on_commit  # told of each new local save (the remote tier's uploads)
        self.vocabulary = vocabulary  # the model's vocabulary key, recorded in every entry saved here
        # entries of other configurations that the running llama-server can recompute from their tokens (fit.py),
        # and why each of the others cannot be (told once at start, counted in the status)
        self.recomputable: dict[str, Entry] = {}
        self.unfit: dict[str, Unfit] = {}
        # Saves are kept as blocks (blocks.py), each written once; False: as one file each, as before blocks
        # (the shared tier, which uploads an entry's file, asks for that).
        self.keeps_blocks = blocks
        self.blocks_dir = root / BLOCKS_DIR
        self.holdings = Holdings(self.blocks_dir)  # what the entries hold on disk (the one writer of blocks' lives)
        # where llama-server writes saves and reads restores: RAM when it has room (a file kept whole is renamed
        # into entries/, which RAM cannot be)
        self.staging = Staging(self.snapshots_dir, root, ram=ram_staging and blocks)

    # ---- opening ------------------------------------------------------------------------------------------

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
        for entry_id, data, size in pairs:
            self._admit(entry_id, data, size)
        if scanned.index is not None:
            for entry in self.entries.values():
                self.holdings.hold(entry)
        # consumed: the manifests read are not held by the prescan, which the daemon's start keeps to its end
        found.pairs, scanned.rest, scanned.index = [], [], None
        found.warn(self.entries_dir)
        self.holdings.sweep(unreadable=found.unreadable)

    def say_kept(self) -> None:
        """One line per reason for the entries kept but not used."""
        reasons: dict[str, int] = {}
        for reason in self.skipped.values():
            reasons[reason] = reasons.get(reason, 0) + 1
        for reason, count in reasons.items():
            log.warning("%d entr%s kept but not used: %s", count, "y" if count == 1 else "ies", reason)

    def _admit(self, entry_id: str, data: dict[str, Any] | Entry, size: int | None) -> None:
        """Index a committed entry, or set it aside, as entries.judge() says (`slotkeeper ls` asks it too).
        `size` is its regular .bin file's (None: missing)."""
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

    @property
    def disk_bytes(self) -> int:
        """What the entries hold on disk: each block once, each file once (the cap counts this)."""
        return self.holdings.disk_bytes

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

    # ---- finding (the lookups are EntryIndex's) -----------------------------------------------------------

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

    async def check_format(self) -> None:
        """When some entry was written by another llama-server than this one, learn the state format this one
        writes (a save of slot 0, empty at start) and set aside the entries it cannot read."""
        if not self.needs_format_probe():
            return
        self.current_format = await self.probe_format(0)
        if self.current_format is not None:
            self.check_formats()

    def needs_format_probe(self) -> bool:
        """True when some entry was written by another llama-server than this one (its format may differ)."""
        return any(e.server != self.server for e in self.entries.values())

    def check_formats(self) -> None:
        """Set aside entries this llama-server cannot read, instead of trying and quarantining them (what is
        done with them is check_fit's, and its line)."""
        current = self.current_format
        if current is None:
            return
        unreadable = [e for e in self.entries.values() if not compatible_format(e, current)]
        for entry in unreadable:
            self.unindex(entry)
            self._keep_unused(
                entry,
                f"format v{entry.seq_version} ({entry.layout}); this llama-server writes v{current[0]} ({current[1]})",
            )

    @property
    def running(self) -> Running:
        return Running(
            fingerprint=self.fingerprint, vocabulary=self.vocabulary, n_ctx_slot=self.fingerprint.get("n_ctx_slot")
        )

    async def check_fit(self, probe_slot: int = 0) -> None:
        """At start, once the format is known: what each entry set aside for another configuration is good for
        here (fit.py). One file of each group computed by these tensors is loaded into `probe_slot` (then
        erased): llama-server's answer, not the flags, says whether its group loads. The entries that load join
        the index; those whose tokens this model can recompute wait for it (`recomputable`); one line each."""
        running = self.running
        kept = sorted(self._kept.values(), key=lambda e: e.last_used, reverse=True)
        if not kept:
            self.say_kept()
            return
        groups: dict[str, list[Entry]] = {}
        for entry in kept:
            if same_tensors(entry.fingerprint, running.fingerprint) and not entry.images:
                groups.setdefault(group_of(entry), []).append(entry)
        loads: dict[str, bool] = {}
        for name, members in groups.items():
            loads[name] = await self._group_loads(members, probe_slot)
        loaded = 0
        for entry in kept:
            verdict = fit(entry, running, loads=loads.get(group_of(entry)))
            if verdict.fit is Fit.LOADS:
                self._unkeep(entry)
                self.index(entry)
                loaded += 1
            elif verdict.fit is Fit.RECOMPUTE:
                self.recomputable[entry.id] = entry
            elif verdict.unfit is not None:
                self.unfit[entry.id] = verdict.unfit
                self.skipped[entry.id] = f"{self.skipped[entry.id]}; not recomputed: {UNFIT_WORDS[verdict.unfit]}"
        if loaded:
            log.info(
                "%d entr%s saved by another configuration used as saved: this llama-server loads %s",
                loaded,
                "y" if loaded == 1 else "ies",
                "it" if loaded == 1 else "them",
            )
        self.say_kept()

    async def _group_loads(self, members: list[Entry], slot_id: int) -> bool:
        """Whether the running llama-server loads a file of this group: its smallest whose checksum holds is
        loaded into the slot, which is then erased. A file refused is never quarantined: it is another
        configuration's, and that configuration loads it."""
        assert self.client is not None
        for entry in sorted(members, key=lambda e: e.nbytes):
            if entry.parts is not None:
                staged = await self._assembled(entry)
                if isinstance(staged, RestoreResult):  # unreadable (one line), or quarantined with its blocks
                    continue
                try:
                    reply = await self.client.slot_action(slot_id, "restore", staged.name.name)
                    if reply.ok:
                        await self.client.slot_action(slot_id, "erase")
                    return reply.ok
                except (OSError, ConnectionError) as exc:
                    log.debug("entry %s not tried (%s)", entry.short, exc)
                    return False
                finally:
                    staged.remove()
            source = pair_paths(self.entries_dir, entry.id)[0]
            try:
                if entry.checksum and await asyncio.to_thread(file_checksum, source) != entry.checksum:
                    self._unkeep(entry)
                    self._quarantine(entry, "its file changed on disk: the content checksum does not match")
                    continue
            except OSError:
                continue
            link = transient_path(self.snapshots_dir)
            try:
                await self._expose(source, link)
                reply = await self.client.slot_action(slot_id, "restore", link.name)
                if reply.ok:
                    await self.client.slot_action(slot_id, "erase")
                return reply.ok
            except (OSError, ConnectionError) as exc:
                log.debug("entry %s not tried (%s)", entry.short, exc)
                return False
            finally:
                discard(link)
        return False

    def _unkeep(self, entry: Entry) -> None:
        if self._kept.pop(entry.id, None) is not None:
            self._kept_bytes -= entry.nbytes
        self.skipped.pop(entry.id, None)

    def recomputed(self, old: Entry, new: Entry) -> None:
        """`old` (another configuration's) was recomputed as `new`: it stays kept (a downgrade uses it) until the
        cap removes it, and is not recomputed again."""
        self.recomputable.pop(old.id, None)
        self.skipped[old.id] = f"recomputed as entry {new.short}"

    # ---- the slot-action protocol -------------------------------------------------------------------------

    async def probe_format(self, slot_id: int) -> tuple[int, str] | None:
        """Save an (empty) slot to learn the state format this llama-server writes; None if it cannot say."""
        assert self.client is not None
        transient = transient_path(self.snapshots_dir)
        try:
            reply = await self.client.slot_action(slot_id, "save", transient.name)
            if not reply.ok:
                return None
            header = await asyncio.to_thread(read_header, transient)
            return header.version, header.layout
        except (OSError, StateFileError, ConnectionError):
            return None
        finally:
            transient.unlink(missing_ok=True)

    async def save_slot(  # noqa: PLR0913 - what the entry is, each keyword-only
        self,
        slot_id: int,
        *,
        expected_bytes: int = 0,
        message_keys: Sequence[str] = (),
        boundary: list[int] | MediaBoundary | None = None,
        supersedes: Callable[[Entry, Entry], bool] | None = None,
        opening: bool = False,
        marks_boundary: bool = True,
    ) -> SaveResult:
        """Save what slot `slot_id` holds as a new entry; the entries it supersedes are then removed (by
        default those it extends, `extends`; the caller's policy otherwise).

        With `boundary`, the slot must hold exactly those tokens (a turn boundary; a whole chat recomputed when
        not `marks_boundary`): a file holding anything else is not committed. A boundary with pictures not known
        yet (`media.MediaBoundary`) is checked once the file has shown them. Cancellation (a budget) at any point
        leaves no partial file and every previous entry intact.
        """
        assert self.client is not None
        started = time.monotonic()
        no_room = low_space(self.root, expected_bytes)
        if no_room:
            self.metrics.save_failed(SaveFailure.DISK_SPACE.value)
            return SaveResult(failure=SaveFailure.DISK_SPACE, reason=no_room)
        staged = self.staging.stage(expected_bytes)
        progress = asyncio.ensure_future(report_progress(f"slot {slot_id}", staged.real, expected_bytes))
        committed = False
        try:
            reply = await self.client.slot_action(slot_id, "save", staged.name.name)
            if not reply.ok and staged.in_ram:  # the RAM filesystem filled up since it was looked at
                staged.remove()
                self.staging.fell_back(f"llama-server could not save into it: {reply.error}")
                staged = self.staging.stage(0)
                reply = await self.client.slot_action(slot_id, "save", staged.name.name)
            transient = staged.real
            if not reply.ok:
                self.metrics.save_failed(SaveFailure.LLAMA_SERVER_ERROR.value)
                return SaveResult(
                    failure=SaveFailure.LLAMA_SERVER_ERROR,
                    reason=f"llama-server answered {reply.status}: {reply.error}",
                )
            tokens = int(reply.body.get("n_saved", 0))
            written = int(reply.body.get("n_written", -1))
            if tokens == 0:
                self.metrics.saves[SaveFailure.EMPTY.value] += 1
                return SaveResult(failure=SaveFailure.EMPTY, reason="0 tokens")
            size = transient.stat().st_size if transient.exists() else -1
            if size != written:
                self.metrics.save_failed(SaveFailure.SIZE_MISMATCH.value)
                return SaveResult(
                    failure=SaveFailure.SIZE_MISMATCH, reason=f"file has {size} bytes, llama-server reported {written}"
                )
            progress.cancel()
            saved = await asyncio.to_thread(read_saved, transient)
            save_ms = reply.body.get("timings", {}).get("save_ms")
            entry = self._new_entry(
                saved,
                written,
                message_keys,
                boundary=boundary,
                marks_boundary=marks_boundary,
                opening=opening,
                save_ms=save_ms,
            )
            commit = self._commit(transient, entry)
            try:
                entry, written = await asyncio.shield(commit)
            except asyncio.CancelledError:  # a budget ran out during the commit: it completes all the same
                committed = True
                commit.add_done_callback(
                    lambda f: f.cancelled() or f.exception() or self._admit_saved(f.result()[0], supersedes)
                )
                raise
            committed = True
        except (OSError, StateFileError) as exc:
            self.metrics.save_failed(SaveFailure.COMMIT_FAILED.value)
            return SaveResult(failure=SaveFailure.COMMIT_FAILED, reason=str(getattr(exc, "strerror", None) or exc))
        except ConnectionError as exc:
            self.metrics.save_failed(SaveFailure.REQUEST_FAILED.value)
            return SaveResult(failure=SaveFailure.REQUEST_FAILED, reason=str(exc))
        finally:
            progress.cancel()
            if not committed:
                staged.remove()
            elif staged.in_ram:
                discard(staged.name)  # (the commit removes the file itself)
        superseded = self._admit_saved(entry, supersedes)
        if self.on_commit is not None and entry.parts is None:
            self.on_commit(entry, self.entries_dir / f"{entry.id}{BIN_SUFFIX}")
        elapsed = time.monotonic() - started
        self.bytes_per_s = entry.nbytes / elapsed if elapsed > 0 else self.bytes_per_s
        self.metrics.saved(elapsed, entry.nbytes, entry.n_tokens, written)
        return SaveResult(entry=entry, seconds=elapsed, superseded=superseded, written=written)

    def _commit(self, transient: Path, entry: Entry) -> asyncio.Future[tuple[Entry, int]]:
        """The commit of a saved file as `entry`, in a thread: as blocks, each written once (the committed
        entry says its parts), or as one file; then the entry and the bytes written. The blocks it counts on stay
        until it ends, however it ends; a commit that fails leaves the blocks it wrote to be removed, and a
        transient file never stays."""
        if not self.keeps_blocks:
            return asyncio.ensure_future(
                asyncio.to_thread(slotfiles.commit_file, transient, entry, self.entries_dir, fsync=self.fsync)
            )
        writer = blockfiles.BlockWriter(self.blocks_dir, self.holdings.in_use(), fsync=self.fsync)
        mark = not self.holdings.marked
        self.holdings.begin()
        commit = asyncio.ensure_future(
            asyncio.to_thread(
                slotfiles.commit_blocks, transient, entry, self.entries_dir, writer, fsync=self.fsync, mark=mark
            )
        )

        def done(future: asyncio.Future[tuple[Entry, int]]) -> None:
            if future.cancelled() or future.exception() is not None:
                self.holdings.end(unused=writer.written)
            else:
                self.holdings.end(committed=future.result()[0])

        commit.add_done_callback(done)
        return commit

    def _new_entry(  # noqa: PLR0913 - what the entry is, each keyword-only
        self,
        saved: SavedFile,
        nbytes: int,
        message_keys: Sequence[str],
        *,
        boundary: list[int] | MediaBoundary | None,
        marks_boundary: bool = True,
        opening: bool,
        save_ms: float | None,
    ) -> Entry:
        """The complete entry a saved file makes, before its commit; StateFileError when it is not the boundary
        it must be. Its pictures teach the media book first (here, on the event loop), so that a boundary with
        pictures is checked against what they take."""
        header = saved.header
        if header.images:
            self._learn_pictures(header)
        if boundary is not None:
            tokens = boundary if isinstance(boundary, list) else boundary.token_ids(self.media)
            if tokens is None or exact_key(tokens) != saved.exact:
                raise StateFileError(f"the slot holds {header.n_tokens:,} tokens that are not its turn boundary")
        wrap = self.media.wrap
        now = time.time()
        return Entry(
            id=secrets.token_hex(8),
            n_tokens=header.n_tokens,
            nbytes=nbytes,
            keys=saved.keys,
            saved_at=now,
            last_used=now,
            fingerprint=self.fingerprint,
            seq_version=header.version,
            layout=header.layout,
            server=self.server,
            message_keys=list(message_keys),
            save_ms=save_ms,
            exact=saved.exact,
            boundary=boundary is not None and marks_boundary,
            opening=opening,
            uses=int(opening),
            checksum=saved.checksum,
            images=header.image_positions,
            image_wrap=(wrap.begin, wrap.end) if header.images and wrap is not None else None,
            vocabulary=self.vocabulary,
        )

    def _learn_pictures(self, header: StateHeader) -> None:
        """What a saved file shows of its pictures joins the media book (one line when it teaches the wrap)."""
        learnt = self.media.learn_file(header.token_ids, header.images)
        wrap = self.media.wrap
        if learnt is Learnt.WRAP and wrap is not None:
            log.info(
                "pictures: llama-server puts %d token(s) before each and %d after; image chats are now "
                "placed by their pictures",
                len(wrap.begin),
                len(wrap.end),
            )
        elif learnt is Learnt.UNFIT:
            log.warning(
                "pictures: a slot file does not hold its prompt's pictures the way slotkeeper reads them (a "
                "tiling projector?); image chats are placed by what comes before their first picture"
            )

    def _admit_saved(self, entry: Entry, supersedes: Callable[[Entry, Entry], bool] | None = None) -> int:
        """A committed save joins the index; the entries it supersedes go. Returns how many went."""
        self.holdings.hold(entry)
        self.cache_changes += 1
        self.current_format = (entry.seq_version, entry.layout)
        rule = supersedes or extends
        superseded = [old for i in self.near(entry.keys) if i != entry.id and rule(entry, old := self.entries[i])]
        self.index(entry)
        for old in superseded:
            self._remove(old)
        return len(superseded)

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
        """Take in an entry whose file was just downloaded to entries/<id>.bin (the shared tier): it joins the
        index only if its manifest is whole, its size right, and it was saved for this configuration and format;
        else the file is removed (one line) and None returned. Judged as open() judges what it finds."""
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

    async def restore(self, entry: Entry, slot_id: int) -> RestoreResult:
        """Load `entry` into slot `slot_id` through a transient hard link (the entry itself stays out of reach).

        Its file is checked against its checksum while llama-server reads it (in a thread, on the other core:
        checked first, the check cost 63% of a restore of a 123 MB entry; alongside, nothing measurable), and the
        result is known before this returns, that is before any request may run in the slot. A file that
        changed on disk is quarantined and the slot erased: no request ever runs on that state.
        """
        assert self.client is not None
        if entry.parts is not None:
            return await self._restore_blocks(entry, slot_id)
        link = transient_path(self.snapshots_dir)
        source = pair_paths(self.entries_dir, entry.id)[0]
        started = time.monotonic()
        check: asyncio.Future[tuple[str, float]] | None = None
        check_s = 0.0
        try:
            if reason := file_differs(entry, source):  # never handed to llama-server
                self._quarantine(entry, reason)
                return RestoreResult(outcome=RestoreOutcome.QUARANTINED, reason=reason)
            if entry.checksum:
                check = asyncio.ensure_future(asyncio.to_thread(_timed_checksum, source))
            await self._expose(source, link)
            reply = await self.client.slot_action(slot_id, "restore", link.name)
            if check is not None:
                try:
                    actual: str | None
                    actual, check_s = await check
                except OSError as exc:  # unread, so unchecked: what llama-server read is not kept either
                    actual, unread = None, exc
                self.metrics.checksum_seconds += time.monotonic() - started
                if actual != entry.checksum:
                    if reply.ok and not (erased := await self.client.slot_action(slot_id, "erase")).ok:
                        log.error(
                            "slot %d holds an unchecked entry's state and could not be erased (%s)",
                            slot_id,
                            erased.error,
                        )
                    if actual is None:
                        return self._restore_failed(f"its file could not be checked: {unread.strerror or unread}")
                    reason = "its file changed on disk: the content checksum does not match"
                    self._quarantine(entry, reason)
                    return RestoreResult(outcome=RestoreOutcome.QUARANTINED, reason=reason)
        except (OSError, ConnectionError) as exc:
            return self._restore_failed(f"restore failed: {getattr(exc, 'strerror', None) or exc}")
        finally:
            if check is not None and not check.done():
                check.cancel()
            discard(link)
        elapsed = time.monotonic() - started
        if not reply.ok:
            return self._refused(entry, f"llama-server refused it: {reply.error}")
        return self._restored(entry, reply.body, elapsed, _reading_seconds(reply.body, check_s) or elapsed)

    async def _restore_blocks(self, entry: Entry, slot_id: int) -> RestoreResult:
        """Restore an entry kept as blocks: put together under a transient name and checked first (only a
        whole, unchanged state is ever handed to llama-server), restored, removed."""
        assert self.client is not None
        started = time.monotonic()
        staged = await self._assembled(entry)
        if isinstance(staged, RestoreResult):
            return staged
        assembled_s = time.monotonic() - started
        try:
            reply = await self.client.slot_action(slot_id, "restore", staged.name.name)
        except (OSError, ConnectionError) as exc:
            return self._restore_failed(f"restore failed: {getattr(exc, 'strerror', None) or exc}")
        finally:
            staged.remove()
        elapsed = time.monotonic() - started
        if not reply.ok:
            return self._refused(entry, f"llama-server refused it: {reply.error}")
        return self._restored(entry, reply.body, elapsed, assembled_s + _reading_seconds(reply.body, 0.0))

    def _restored(self, entry: Entry, reply: dict[str, Any], elapsed: float, reading: float) -> RestoreResult:
        """A restore llama-server accepted: counted, its reading speed learnt (`reading`: its seconds)."""
        tokens = int(reply.get("n_restored", 0))
        nbytes = int(reply.get("n_read", entry.nbytes))
        self.metrics.restores[RestoreOutcome.RESTORED.value] += 1
        self.metrics.restored(elapsed, nbytes, tokens)
        if reading > 0:
            self.restore_bytes_per_s = nbytes / reading
        self.touch(entry)
        return RestoreResult(outcome=RestoreOutcome.RESTORED, n_tokens=tokens, nbytes=nbytes, seconds=elapsed)

    async def _assembled(self, entry: Entry) -> Staged | RestoreResult:
        """An entry's file put together from its blocks, staged (staging.py), its checksum checked; else why
        not. Blocks missing or changed on disk quarantine every entry that uses them."""
        assert entry.parts is not None
        staged = self.staging.stage(entry.nbytes)
        self.holdings.begin()  # no block removed while it is read
        try:
            try:
                actual = await asyncio.to_thread(blockfiles.assemble, self.blocks_dir, entry.parts, staged.real)
            except OSError as exc:
                if not staged.in_ram or exc.errno != errno.ENOSPC:
                    raise
                staged.remove()
                self.staging.fell_back(exc.strerror or str(exc))
                staged = self.staging.stage(0)
                actual = await asyncio.to_thread(blockfiles.assemble, self.blocks_dir, entry.parts, staged.real)
        except (FileNotFoundError, ValueError) as exc:
            actual = f"unreadable ({getattr(exc, 'strerror', None) or exc})"
        except OSError as exc:
            staged.remove()
            return self._restore_failed(f"its blocks could not be read: {exc.strerror or exc}")
        finally:
            self.holdings.end()
        if actual == entry.checksum or (not entry.checksum and not actual.startswith("unreadable")):
            return staged
        staged.remove()
        if not self.holdings.holds(entry):  # removed meanwhile: its blocks went with it
            return self._restore_failed("removed while it was restored")
        bad = await asyncio.to_thread(blockfiles.bad_blocks, self.blocks_dir, entry.parts.block_sizes())
        reason = "its file changed on disk: " + (
            f"{len(bad)} of its blocks no longer {'holds' if len(bad) == 1 else 'hold'} what it was saved with"
            if bad
            else "the content checksum does not match"
        )
        for user in self._users_of(bad) if bad else [entry]:
            self._unkeep(user)
            self._quarantine(user, reason)
        return RestoreResult(outcome=RestoreOutcome.QUARANTINED, reason=reason)

    def _users_of(self, blocks: list[str]) -> list[Entry]:
        """The entries (usable or kept) that use any of these blocks (a scan: only when blocks went bad)."""
        wanted = set(blocks)
        return [
            e
            for e in [*self.entries.values(), *self._kept.values()]
            if e.parts is not None and not wanted.isdisjoint(e.parts.block_sizes())
        ]

    def _refused(self, entry: Entry, reason: str) -> RestoreResult:
        """llama-server refused the entry. Saved by this configuration, it is bad: quarantined. Saved by another
        (its group loaded at start, this one did not), that configuration loads it again: it is set aside, and
        recomputed if it can be, never quarantined."""
        if entry.fingerprint == self.fingerprint and entry.server in (self.server, {}):  # ({}: writer unknown)
            self._quarantine(entry, reason)
            return RestoreResult(outcome=RestoreOutcome.QUARANTINED, reason=reason)
        self.unindex(entry)
        self._keep_unused(entry, reason)
        if fit(entry, self.running, loads=False).fit is Fit.RECOMPUTE:
            self.recomputable[entry.id] = entry
        return self._restore_failed(reason)

    def _restore_failed(self, reason: str) -> RestoreResult:
        self.metrics.restores[RestoreOutcome.FAILED.value] += 1
        return RestoreResult(outcome=RestoreOutcome.FAILED, reason=reason)

    async def _expose(self, source: Path, link: Path) -> None:
        """Make an entry readable by llama-server under a transient name: a hard link (free), or a copy on a
        filesystem without hard links."""
        try:
            os.link(source, link)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EMLINK, errno.EOPNOTSUPP):
                raise
            if not self._warned_copy:
                self._warned_copy = True
                log.warning("%s allows no hard links (%s): restores copy each entry first", self.root, exc.strerror)
            await asyncio.to_thread(shutil.copyfile, source, link)

    def touch(self, entry: Entry) -> None:
        """Mark an entry used now (for LRU eviction); its manifest is rewritten in the background."""
        entry.last_used = time.time()
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

    # ---- removal ------------------------------------------------------------------------------------------

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


def default_cap(root: Path, store_bytes: int) -> int:
    """Without --max-cache-bytes: half of what the store could use when it opened (its files plus free space)."""
    return int((shutil.disk_usage(root).free + store_bytes) * DEFAULT_CAP_SHARE)


def format_entry(entry: Entry) -> str:
    return f"entry {entry.short} ({entry.n_tokens:,} tokens, {fmt_bytes(entry.nbytes)})"


def file_differs(entry: Entry, source: Path) -> str:
    """Why an entry's file is not the one its manifest describes ("" when it is), looked at just before a restore;
    raises OSError for a file gone or become a link (never followed). Why here: a start does not look at the files
    of the entries its manifest cache holds (at 20,000 entries, 20,000 lstat calls), and a file rewritten in place
    after its save changes nothing else."""
    st = os.lstat(source)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.ELOOP, "it became a link: never followed")
    return "" if st.st_size == entry.nbytes else f"size {st.st_size} differs from its manifest's {entry.nbytes}"


def _timed_checksum(path: Path) -> tuple[str, float]:
    """A file's checksum and the seconds reading it took (in its thread: the wait for the thread is not reading)."""
    started = time.monotonic()
    digest = file_checksum(path)
    return digest, time.monotonic() - started


def _reading_seconds(reply: dict[str, Any], check_s: float) -> float:
    """How long a restore's reading took: llama-server's own load time (its `restore_ms`), or the checksum's
    read beside it when that was slower (the restore waits for both); 0 when neither was timed. Why not the
    restore's wall time: that adds the hand-offs between slotkeeper, llama-server's HTTP thread and its task
    loop, a cost that does not grow with the file. On a busy machine each hand-off waits for a core (a 68 KB
    restore took 15 ms), and counted as reading it made a 2,000-token opening look slower to restore than to
    prefill, so new chats started cold (restored, it took 1-4 ms)."""
    timings = reply.get("timings")
    restore_ms = timings.get("restore_ms") if isinstance(timings, dict) else None
    load_s = restore_ms / 1000 if isinstance(restore_ms, (int, float)) and restore_ms > 0 else 0.0
    return max(load_s, check_s)
