"""The conversation store: saved KV states of conversations, found by prefix, never lost to a crash.

An *entry* is one llama-server slot file (`entries/<id>.bin`) and its manifest (`entries/<id>.json`): the
fingerprint of the configuration that can use it, token count, bytes, last use, llama-server's identity and
the file's format version, and the prefix keys of its tokens (`prefix.block_keys`). Entries are keyed by
content, not by slot: the placement policy restores one into whichever slot it chooses. The pair, its manifest
and the rule for what an entry found on disk is good for are entries.py's (`slotkeeper ls` reads them there too).

The mechanism lives here; what to save, restore or evict, and when, is the caller's (placement, daemon).

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
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import manifestcache
from .entries import (
    BIN_SUFFIX,
    MANIFEST_SUFFIX,
    PARTIAL_SUFFIX,
    TRANSIENT_NAME,
    TRANSIENT_PREFIX,
    Entry,
    Status,
    compatible_format,
    discard,
    file_checksum,
    file_size,
    fsync_path,
    is_link,
    is_slot_name,
    is_state_file,
    judge,
    pair_paths,
    read_json,
    read_manifest,
    remove_pair,
    write_json_atomic,
)
from .layout import ENTRIES_DIR, LOCK_NAME, QUARANTINE_DIR, SNAPSHOTS_DIR, prepare_layout
from .log import fmt_bytes, log
from .metrics import Metrics
from .prefix import KeyChain, block_keys, common_keys, exact_key, extends_exactly
from .prefixtree import PrefixTree
from .statefile import StateFileError, read_header

if TYPE_CHECKING:  # `slotkeeper ls` reads a store without the client
    from .llama_client import LlamaClient

# Entries and their files are entries.py's; these stay importable from here for the store's callers.
__all__ = [
    "BIN_SUFFIX",
    "MANIFEST_SUFFIX",
    "TRANSIENT_PREFIX",
    "ConversationStore",
    "Entry",
    "RestoreResult",
    "SaveFailure",
    "SaveResult",
    "compatible_format",
    "default_cap",
    "extends",
    "format_entry",
    "fsync_path",
    "read_json",
    "remove_pair",
    "server_identity",
    "write_json_atomic",
]

QUARANTINE_KEEP = 8  # newest pairs kept in quarantine/
FREE_SPACE_HEADROOM = 1.1  # a save needs the expected size plus 10% free
SUPERSEDE_SLACK_BLOCKS = 1  # an entry whose blocks but this many a new save repeats is superseded by it
DEFAULT_CAP_SHARE = 0.5  # without --max-cache-bytes: half of what the store could use when it opened
PROGRESS_INTERVAL_S = 2.0


def server_identity(binary: str | None) -> dict[str, Any]:
    """Which llama-server wrote a file: its path, size and mtime (build_info says `b0-unknown` when built
    from the sdist, so it cannot tell builds apart)."""
    if not binary:
        return {}
    with contextlib.suppress(OSError):
        st = os.stat(binary)
        return {"path": str(Path(binary).resolve()), "size": st.st_size, "mtime": int(st.st_mtime)}
    return {"path": binary}


class SaveFailure(enum.StrEnum):
    """Why a save made no entry (the values label slotkeeper_save_failures; EMPTY counts as an outcome)."""

    EMPTY = "empty"  # the slot held no tokens: nothing to keep
    DISK_SPACE = "disk_space"
    LLAMA_SERVER_ERROR = "llama_server_error"
    SIZE_MISMATCH = "size_mismatch"
    COMMIT_FAILED = "commit_failed"
    REQUEST_FAILED = "request_failed"
    BUDGET = "budget"  # the caller's time ran out


@dataclass
class SaveResult:
    entry: Entry | None
    failure: SaveFailure | None = None  # when entry is None
    reason: str = ""  # the failure in words
    seconds: float = 0.0
    superseded: int = 0


@dataclass
class RestoreResult:
    ok: bool
    reason: str = ""
    quarantined: bool = False  # the entry was bad and is gone (the store said so in its own line)
    tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0


class ConversationStore:
    """The entries of one save directory, indexed by prefix key, and the save/restore protocol around them."""

    def __init__(
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
    ) -> None:
        self.root = root
        self.entries_dir = root / ENTRIES_DIR
        self.snapshots_dir = root / SNAPSHOTS_DIR
        self.client = client
        self.fingerprint = fingerprint
        self.server = server or {}
        self.fsync = fsync
        self.restore_unverified = restore_unverified
        self.metrics = metrics or Metrics()
        self.cap_bytes = cap_bytes
        self.current_format: tuple[int, str] | None = None  # (seq version, layout) this llama-server writes
        self.entries: dict[str, Entry] = {}  # usable by this configuration
        self.skipped: dict[str, str] = {}  # entry id -> why it is kept but not used
        self._kept: dict[str, Entry] = {}  # those entries (they count against the cap, and can be evicted)
        # Indexes, kept by _index/_unindex alone, so that no request or save scans the store (tens of thousands
        # of entries after a few weeks of agent sessions).
        self._tree = PrefixTree()  # entries by their block keys
        # ... and by their request units (chained too: a chat's turns are a path), built when first asked (only
        # hybrid and sliding-window models keep a chat's boundaries, and ask)
        self._units: PrefixTree | None = None
        self._keyless: set[str] = set()  # entries without a full block
        self._by_exact: dict[str, list[str]] = {}  # exact key -> entry ids
        self._opening_ids: set[str] = set()
        self._totals = _Totals()  # running sums over self.entries
        self._kept_bytes = 0  # ... and over self._kept
        self._pending: set[asyncio.Future[Any]] = set()  # manifest updates (last use) written in the background
        self.cache_changes = 0  # manifests written or read since the manifest cache was (manifestcache.py)
        self._cache_lock = asyncio.Lock()
        self.bytes_per_s: float | None = None  # measured save speed
        self.restore_bytes_per_s: float | None = None  # measured restore speed (the last restore's)
        self._warned_copy = False
        self.on_commit: Callable[[Entry, Path], None] | None = None  # told of each new local save (the remote tier)

    # ---- opening ------------------------------------------------------------------------------------------

    def open(self) -> None:
        """Finish what a killed run left, take over a directory of the slot-file layout, read the manifests.

        The cyclic garbage collector is off meanwhile: building tens of thousands of entries, it would walk the
        growing heap again and again (a third of the time at 20,000), and none of this makes cycles."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._open()
        finally:
            if collecting:
                gc.enable()

    def _open(self) -> None:
        prepare_layout(self.root)
        self._remove_transients()
        self._take_over_slot_files()
        bins: dict[str, os.DirEntry[str]] = {}
        manifests: dict[str, os.DirEntry[str]] = {}
        with os.scandir(self.entries_dir) as listing:  # one pass; lstat answers, links never followed
            for item in listing:
                if item.name.endswith(PARTIAL_SUFFIX):  # manifests, downloads
                    if item.is_file(follow_symlinks=False):
                        discard(Path(item.path))
                elif item.name.endswith(BIN_SUFFIX):
                    bins[item.name.removesuffix(BIN_SUFFIX)] = item
                elif item.name.endswith(MANIFEST_SUFFIX):
                    manifests[item.name.removesuffix(MANIFEST_SUFFIX)] = item
        links = 0
        for entry_id, item in bins.items():
            if not item.is_file(follow_symlinks=False):
                links += 1
            elif entry_id not in manifests:  # saved, never committed: an interrupted save
                discard(Path(item.path))
                log.info("removed entry %s left by an interrupted save", entry_id[:4])
        unreadable = 0
        stamps = {
            entry_id: manifestcache.stamp_of(item.stat(follow_symlinks=False))
            for entry_id, item in manifests.items()
            if item.is_file(follow_symlinks=False)
        }
        cached = manifestcache.read(self.root, stamps)  # what the manifests held when last seen: most need no reading
        self.cache_changes = 0
        for entry_id, item in manifests.items():
            bin_item = bins.get(entry_id)
            if not item.is_file(follow_symlinks=False):
                links += bin_item is None or bin_item.is_file(follow_symlinks=False)  # a link pair counts once
                continue
            if bin_item is not None and not bin_item.is_file(follow_symlinks=False):
                continue  # counted with the bins
            data: dict[str, Any] | Entry | None = cached.pop(entry_id, None)
            if data is None:
                data = read_manifest(item.path)
                self.cache_changes += 1
            if data is None:
                unreadable += 1  # another slotkeeper version's, or damaged: kept as it is, not used
            else:
                self._admit(entry_id, data, None if bin_item is None else bin_item.stat(follow_symlinks=False).st_size)
        if links:
            log.warning(
                "%d entr%s in %s %s a link or not a file: never followed, left as %s",
                links,
                "y" if links == 1 else "ies",
                self.entries_dir,
                "is" if links == 1 else "are",
                "it is" if links == 1 else "they are",
            )
        if unreadable:
            log.warning(
                "%d entr%s with a manifest this slotkeeper cannot read: kept, not used",
                unreadable,
                "y" if unreadable == 1 else "ies",
            )
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
                self._index(entry)
            case Status.WRONG_SIZE, Entry() as entry:
                self._quarantine(entry, verdict.reason)
            case _, Entry() as entry:  # another configuration's
                self._keep_unused(entry, verdict.reason)
            case _:
                log.warning("entry %s: %s; kept, not used", entry_id[:4], verdict.reason)

    def _keep_unused(self, entry: Entry, reason: str) -> None:
        self.skipped[entry.id] = reason
        if entry.id not in self._kept:
            self._kept_bytes += entry.nbytes
        self._kept[entry.id] = entry

    def _index(self, entry: Entry) -> None:
        if entry.id in self.entries:
            return
        # What most entries repeat is shared, not copied (this configuration's fingerprint and server), and
        # their keys are packed (prefix.KeyChain): a store of 20,000 entries is then tens of MB, not hundreds.
        if entry.fingerprint == self.fingerprint:
            entry.fingerprint = self.fingerprint
        if entry.server == self.server:
            entry.server = self.server
        entry.keys = KeyChain(entry.keys) if not isinstance(entry.keys, KeyChain) else entry.keys
        entry.units = KeyChain(entry.units) if not isinstance(entry.units, KeyChain) else entry.units
        self.entries[entry.id] = entry
        if entry.keys:
            self._tree.add(entry.id, entry.keys)
        else:
            self._keyless.add(entry.id)
        if entry.units and self._units is not None:
            self._units.add(entry.id, entry.units)
        if entry.exact:
            self._by_exact.setdefault(entry.exact, []).append(entry.id)
        if entry.opening:
            self._opening_ids.add(entry.id)
        self._totals.add(entry, 1)

    def _unindex(self, entry: Entry) -> None:
        if self.entries.pop(entry.id, None) is None:
            return
        if entry.keys:
            self._tree.remove(entry.id)
        else:
            self._keyless.discard(entry.id)
        if entry.units and self._units is not None:
            self._units.remove(entry.id)
        if entry.exact:
            _drop(self._by_exact, entry.exact, entry.id)
        self._opening_ids.discard(entry.id)
        self._totals.add(entry, -1)

    def _remove_transients(self) -> None:
        for leftover in self.snapshots_dir.glob(f"{TRANSIENT_PREFIX}*"):
            if TRANSIENT_NAME.fullmatch(leftover.name):  # a client's own `slotkeeper-notes.bin` stays
                leftover.unlink(missing_ok=True)

    def _take_over_slot_files(self) -> None:
        """`<slot>.bin` + `<slot>.json` from the slot-file layout become entries; clients' own files move to snapshots/.

        So an upgrade loses no cache. A slot file without a manifest is taken over only with --restore-unverified
        (it is then trusted to match the running configuration).
        """
        for manifest_path in sorted(self.root.glob(f"*{MANIFEST_SUFFIX}{PARTIAL_SUFFIX}")):
            final = manifest_path.with_name(manifest_path.name.removesuffix(PARTIAL_SUFFIX))
            data = read_json(manifest_path)
            bin_path = final.with_suffix(BIN_SUFFIX)
            if data and bin_path.is_file() and bin_path.stat().st_size == data.get("bytes"):
                os.replace(manifest_path, final)  # a save that completed its file before the stop
            else:
                manifest_path.unlink(missing_ok=True)
        for partial in self.root.glob(f"*{BIN_SUFFIX}{PARTIAL_SUFFIX}"):
            partial.unlink(missing_ok=True)
        for path in sorted(self.root.iterdir()):
            if not path.is_file() or path.name == LOCK_NAME:
                continue
            stem = path.name.removesuffix(BIN_SUFFIX)
            if path.suffix == BIN_SUFFIX and is_slot_name(stem):
                self._take_over_one(path, read_json(path.with_suffix(MANIFEST_SUFFIX)))
            elif path.suffix != MANIFEST_SUFFIX and is_state_file(path):
                os.replace(path, self.snapshots_dir / path.name)
                log.info("moved %s (a client's own slot file) to %s/", path.name, SNAPSHOTS_DIR)

    def _take_over_one(self, bin_path: Path, old: dict[str, Any] | None) -> None:
        manifest_path = bin_path.with_suffix(MANIFEST_SUFFIX)
        if old is None and not self.restore_unverified:
            log.warning(
                "%s has no slotkeeper manifest; left as it is (--restore-unverified takes it over)", bin_path.name
            )
            return
        try:
            header = read_header(bin_path)
        except (OSError, StateFileError) as exc:
            log.warning("%s is not a slot file slotkeeper can read (%s); left as it is", bin_path.name, exc)
            return
        now = time.time()
        saved_at = float((old or {}).get("saved_at", bin_path.stat().st_mtime))
        entry = Entry(
            id=secrets.token_hex(8),
            tokens=header.n_tokens,
            nbytes=bin_path.stat().st_size,
            keys=block_keys(header.tokens),
            saved_at=saved_at,
            last_used=saved_at,
            fingerprint=(old or {}).get("fingerprint") or self.fingerprint,
            seq_version=header.version,
            layout=header.layout,
            server={},
            save_ms=(old or {}).get("save_ms"),
            exact=exact_key(header.tokens),
        )
        os.replace(bin_path, self.entries_dir / f"{entry.id}{BIN_SUFFIX}")
        write_json_atomic(self.entries_dir / f"{entry.id}{MANIFEST_SUFFIX}", entry.manifest(), self.fsync)
        manifest_path.unlink(missing_ok=True)
        log.info(
            "slot file %s taken over as entry %s: %s tokens, %s (%.0f s old)",
            bin_path.name,
            entry.short,
            f"{entry.tokens:,}",
            fmt_bytes(entry.nbytes),
            now - saved_at,
        )

    # ---- finding ------------------------------------------------------------------------------------------

    def lookup(self, keys: list[str]) -> tuple[Entry | None, int]:
        """The usable entry sharing the longest prefix with `keys`, and how many keys it shares.

        Of the entries that share that many, the smallest: it gives llama-server the same prefix for the fewest
        bytes read (a new chat gets its opening, not a long chat that happens to start with it). Those that end
        there are smaller than any that goes on, so only they are compared when there are any.
        """
        found = self._tree.deepest(keys)
        if not found.depth:
            return None, 0
        best = min((self.entries[i] for i in found.ends or found.holders), key=lambda e: (e.tokens, -e.last_used))
        return best, found.depth

    def lookup_extended(self, tokens: list[int], keys: list[str]) -> Entry | None:
        """The deepest boundary entry that `tokens` extend exactly (all of its tokens, and more): the only kind
        of entry llama-server reuses on a hybrid or sliding-window model."""
        best: Entry | None = None
        for entry_id in (*self._keyless, *self._tree.within(keys)):  # the entries whose blocks the request's open
            entry = self.entries[entry_id]
            if (
                entry.boundary
                and entry.exact
                and (best is None or entry.tokens > best.tokens)
                and extends_exactly(tokens, entry.tokens, entry.exact)
            ):
                best = entry
        return best

    def _units_tree(self) -> PrefixTree:
        if self._units is None:
            self._units = PrefixTree()
            for entry in self.entries.values():
                if entry.units:
                    self._units.add(entry.id, entry.units)
        return self._units

    def units_within(self, units: Sequence[str]) -> list[Entry]:
        """The entries whose request units `units` open with (a chat's earlier saves, its opening)."""
        return [self.entries[i] for i in self._units_tree().within(units)]

    def units_extended(self, units: Sequence[str]) -> bool:
        """Whether some entry's request units go on past all of `units` (a later save of the same chat)."""
        found = self._units_tree().deepest(units)
        return found.depth == len(units) > 0 and len(found.holders) > len(found.ends)

    def find_exact(self, key: str) -> Entry | None:
        """The entry holding exactly these tokens (by `prefix.exact_key`), if one is saved."""
        ids = self._by_exact.get(key)
        return self.entries[ids[0]] if ids else None

    def openings(self) -> list[Entry]:
        return [self.entries[i] for i in self._opening_ids]

    def started_from(self, entry: Entry) -> None:
        """A new chat started from this entry, an opening (it is marked one if it was a chat's first boundary)."""
        entry.opening = True
        entry.uses += 1
        if entry.id in self.entries:
            self._opening_ids.add(entry.id)
        self.touch(entry)

    def restore_seconds(self, entry: Entry) -> float | None:
        """How long restoring this entry is expected to take (None before any restore or save was timed)."""
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

    @property
    def total_bytes(self) -> int:
        return self._totals.nbytes

    def bytes_per_token(self) -> float | None:
        """What a token of cache costs on disk here, from the entries (None before the first one)."""
        totals = self._totals
        return totals.nbytes / totals.tokens if totals.tokens else None

    def save_rate(self) -> float | None:
        """Bytes per second the saves achieved, from llama-server's own save times in the manifests."""
        totals = self._totals
        seconds = totals.save_ms / 1000
        return totals.timed_bytes / seconds if seconds > 0 else self.bytes_per_s

    def needs_format_probe(self) -> bool:
        """True when some entry was written by another llama-server than this one (its format may differ)."""
        return any(e.server != self.server for e in self.entries.values())

    def check_formats(self) -> None:
        """Set aside entries this llama-server cannot read (one line), instead of trying and quarantining them."""
        current = self.current_format
        if current is None:
            return
        unreadable = [e for e in self.entries.values() if not compatible_format(e, current)]
        for entry in unreadable:
            self._unindex(entry)
            self._keep_unused(
                entry,
                f"format v{entry.seq_version} ({entry.layout}); this llama-server writes v{current[0]} ({current[1]})",
            )
        if unreadable:
            versions = sorted({f"v{e.seq_version}" for e in unreadable})
            log.warning(
                "%d entr%s saved by a llama-server with another state format (%s; this one writes v%d): kept, not used",
                len(unreadable),
                "y" if len(unreadable) == 1 else "ies",
                ", ".join(versions),
                current[0],
            )

    # ---- the slot-action protocol -------------------------------------------------------------------------

    def _transient(self) -> Path:
        return self.snapshots_dir / f"{TRANSIENT_PREFIX}{secrets.token_hex(16)}{BIN_SUFFIX}"

    async def probe_format(self, slot_id: int) -> tuple[int, str] | None:
        """Save an (empty) slot to learn the state format this llama-server writes; None if it cannot say."""
        assert self.client is not None
        transient = self._transient()
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

    def _check_free_space(self, expected: int) -> str | None:
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return None  # the save itself will say what is wrong
        if free < expected * FREE_SPACE_HEADROOM:
            return f"only {fmt_bytes(free)} free in {self.root}, ~{fmt_bytes(expected)} needed"
        return None

    async def _report_progress(self, label: str, path: Path, expected: int) -> None:
        """For long saves: `slot 0 saving: 1.2 GB of ~3.4 GB` every couple of seconds."""
        of_expected = f" of ~{fmt_bytes(expected)}" if expected else ""
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            with contextlib.suppress(OSError):
                log.info("%s saving: %s%s", label, fmt_bytes(path.stat().st_size), of_expected)

    async def save_slot(
        self,
        slot_id: int,
        expected_bytes: int = 0,
        units: list[str] | None = None,
        *,
        boundary: list[int] | None = None,
        supersedes: Callable[[Entry, Entry], bool] | None = None,
        opening: bool = False,
    ) -> SaveResult:
        """Save what slot `slot_id` holds as a new entry; the entries it supersedes are then removed (by
        default those it extends, `extends`; the caller's policy otherwise).

        With `boundary`, the slot must hold exactly those tokens (a turn boundary): a file holding anything
        else is not committed. Cancellation (a budget) at any point leaves no partial file and every previous
        entry intact.
        """
        assert self.client is not None
        started = time.monotonic()
        low_space = self._check_free_space(expected_bytes)
        if low_space:
            self.metrics.save_failed(SaveFailure.DISK_SPACE.value)
            return SaveResult(None, SaveFailure.DISK_SPACE, low_space)
        transient = self._transient()
        progress = asyncio.ensure_future(self._report_progress(f"slot {slot_id}", transient, expected_bytes))
        committed = False
        try:
            reply = await self.client.slot_action(slot_id, "save", transient.name)
            if not reply.ok:
                self.metrics.save_failed(SaveFailure.LLAMA_SERVER_ERROR.value)
                return SaveResult(
                    None, SaveFailure.LLAMA_SERVER_ERROR, f"llama-server answered {reply.status}: {reply.error}"
                )
            tokens = int(reply.body.get("n_saved", 0))
            written = int(reply.body.get("n_written", -1))
            if tokens == 0:
                self.metrics.saves[SaveFailure.EMPTY.value] += 1
                return SaveResult(None, SaveFailure.EMPTY, "0 tokens")
            size = transient.stat().st_size if transient.exists() else -1
            if size != written:
                self.metrics.save_failed(SaveFailure.SIZE_MISMATCH.value)
                return SaveResult(
                    None, SaveFailure.SIZE_MISMATCH, f"file has {size} bytes, llama-server reported {written}"
                )
            progress.cancel()
            entry = Entry(
                id=secrets.token_hex(8),
                tokens=tokens,
                nbytes=written,
                keys=[],
                saved_at=time.time(),
                last_used=time.time(),
                fingerprint=self.fingerprint,
                seq_version=0,
                layout="",
                server=self.server,
                units=list(units or []),
                save_ms=reply.body.get("timings", {}).get("save_ms"),
                boundary=boundary is not None,
                opening=opening,
                uses=int(opening),
            )
            expected_key = None if boundary is None else exact_key(boundary)
            commit = asyncio.ensure_future(asyncio.to_thread(self._commit, transient, entry, expected_key))
            try:
                await asyncio.shield(commit)
            except asyncio.CancelledError:  # a budget ran out during the commit: it completes all the same
                committed = True
                commit.add_done_callback(
                    lambda f: f.cancelled() or f.exception() or self._admit_saved(entry, supersedes)
                )
                raise
            committed = True
        except (OSError, StateFileError) as exc:
            self.metrics.save_failed(SaveFailure.COMMIT_FAILED.value)
            return SaveResult(None, SaveFailure.COMMIT_FAILED, str(getattr(exc, "strerror", None) or exc))
        except ConnectionError as exc:
            self.metrics.save_failed(SaveFailure.REQUEST_FAILED.value)
            return SaveResult(None, SaveFailure.REQUEST_FAILED, str(exc))
        finally:
            progress.cancel()
            if not committed:
                discard(transient)
        superseded = self._admit_saved(entry, supersedes)
        if self.on_commit is not None:
            self.on_commit(entry, self.entries_dir / f"{entry.id}{BIN_SUFFIX}")
        elapsed = time.monotonic() - started
        self.bytes_per_s = entry.nbytes / elapsed if elapsed > 0 else self.bytes_per_s
        self.metrics.saved(elapsed, entry.nbytes, entry.tokens)
        return SaveResult(entry, seconds=elapsed, superseded=superseded)

    def _admit_saved(self, entry: Entry, supersedes: Callable[[Entry, Entry], bool] | None = None) -> int:
        """A committed save joins the index; the entries it supersedes go. Returns how many went."""
        self.current_format = (entry.seq_version, entry.layout)
        rule = supersedes or extends
        # An entry a save supersedes shares all its blocks with the save, or all but its last (the slack of
        # `extends`), or has none: only those are asked, not every chat that shares a system prompt.
        candidates = {*self._keyless, *self._tree.near(entry.keys)}
        superseded = [old for i in candidates if i != entry.id and rule(entry, old := self.entries[i])]
        self._index(entry)
        for old in superseded:
            self._remove(old)
        return len(superseded)

    def _commit(self, transient: Path, entry: Entry, expected_key: str | None = None) -> None:
        """In a thread: read the tokens from the file, checksum and fsync it, rename it into entries/, write its
        manifest last. Whatever fails, nothing it made is left: not the file, not a partial manifest (the
        caller may have stopped waiting: a budget ran out)."""
        bin_path, manifest_path = pair_paths(self.entries_dir, entry.id)
        renamed = False
        try:
            header = read_header(transient)
            entry.exact = exact_key(header.tokens)
            if expected_key is not None and entry.exact != expected_key:
                raise StateFileError(f"the slot holds {header.n_tokens:,} tokens that are not its turn boundary")
            entry.keys = block_keys(header.tokens)
            entry.tokens = header.n_tokens
            entry.seq_version, entry.layout = header.version, header.layout
            entry.checksum = file_checksum(transient)
            if self.fsync:
                fsync_path(transient)
            os.replace(transient, bin_path)
            renamed = True
            write_json_atomic(manifest_path, entry.manifest(), self.fsync)
            self.cache_changes += 1
        except BaseException:
            discard(transient)
            if renamed:
                discard(manifest_path)  # manifest first, as remove_pair: never a manifest without its file
                discard(bin_path)
            raise

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
            self._index(entry)
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
        link = self._transient()
        source = pair_paths(self.entries_dir, entry.id)[0]
        started = time.monotonic()
        check: asyncio.Future[str] | None = None
        try:
            if is_link(source):
                raise OSError(errno.ELOOP, "it became a link: never followed")
            if entry.checksum:
                check = asyncio.ensure_future(asyncio.to_thread(file_checksum, source))
            await self._expose(source, link)
            reply = await self.client.slot_action(slot_id, "restore", link.name)
            if check is not None:
                try:
                    actual: str | None = await check
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
                        self.metrics.restores["failed"] += 1
                        return RestoreResult(False, f"its file could not be checked: {unread.strerror or unread}")
                    reason = "its file changed on disk: the content checksum does not match"
                    self._quarantine(entry, reason)
                    return RestoreResult(False, reason, quarantined=True)
        except (OSError, ConnectionError) as exc:
            self.metrics.restores["failed"] += 1
            return RestoreResult(False, f"restore failed: {getattr(exc, 'strerror', None) or exc}")
        finally:
            if check is not None and not check.done():
                check.cancel()
            discard(link)
        elapsed = time.monotonic() - started
        if not reply.ok:
            self._quarantine(entry, f"llama-server refused it: {reply.error}")
            return RestoreResult(False, f"llama-server refused it: {reply.error}", quarantined=True)
        tokens = int(reply.body.get("n_restored", 0))
        nbytes = int(reply.body.get("n_read", entry.nbytes))
        self.metrics.restored(elapsed, nbytes, tokens)
        if elapsed > 0:
            self.restore_bytes_per_s = nbytes / elapsed
        self.touch(entry)
        return RestoreResult(True, tokens=tokens, nbytes=nbytes, seconds=elapsed)

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
        future = asyncio.ensure_future(asyncio.to_thread(self._rewrite_manifest, entry))
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

    def _rewrite_manifest(self, entry: Entry) -> None:
        with contextlib.suppress(OSError):
            if (self.entries_dir / f"{entry.id}{BIN_SUFFIX}").exists():
                write_json_atomic(self.entries_dir / f"{entry.id}{MANIFEST_SUFFIX}", entry.manifest(), False)
                self.cache_changes += 1

    async def flush(self) -> None:
        """Wait for background manifest updates."""
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

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
        self._unindex(entry)
        if self._kept.pop(entry.id, None) is not None:
            self._kept_bytes -= entry.nbytes
        self.skipped.pop(entry.id, None)
        try:
            remove_pair(self.entries_dir, entry.id)
        except OSError as exc:
            log.warning(
                "entry %s not removed (%s): left on disk, not used in this run", entry.short, exc.strerror or exc
            )

    def evict_over_cap(self, protect: Iterable[str] = ()) -> list[Entry]:
        """Remove least recently used entries until the store fits its cap. Entries kept for other configurations
        count too; entries in `protect` (held by a slot and saved nowhere else) stay."""
        if self.cap_bytes is None:
            return []
        total = self.total_bytes + self._kept_bytes
        if total <= self.cap_bytes:
            return []
        keep = set(protect)
        evicted = []
        for entry in sorted([*self.entries.values(), *self._kept.values()], key=lambda e: e.last_used):
            if total <= self.cap_bytes:
                break
            if entry.id in keep:
                continue
            self._remove(entry)
            total -= entry.nbytes
            evicted.append(entry)
            log.info(
                "entry %s evicted (%s tokens, %s, unused for %.0f s): the store is over its cap %s",
                entry.short,
                f"{entry.tokens:,}",
                fmt_bytes(entry.nbytes),
                time.time() - entry.last_used,
                fmt_bytes(self.cap_bytes),
            )
        return evicted

    def _quarantine(self, entry: Entry, reason: str) -> None:
        """Move a bad pair aside (never delete it outright) and keep only the newest few."""
        self._unindex(entry)
        self.metrics.quarantines += 1
        self.metrics.restores["quarantined"] += 1
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
        log.warning("entry %s quarantined (%s)", entry.short, reason)


@dataclass
class _Totals:
    """Running sums over the usable entries (kept by _index/_unindex): a save asks for them, and summing
    20,000 entries each time cost more than the save's own bookkeeping."""

    nbytes: int = 0
    tokens: int = 0
    timed_bytes: int = 0  # of the entries with llama-server's save time ...
    save_ms: float = 0.0  # ... and those times

    def add(self, entry: Entry, sign: int) -> None:
        self.nbytes += sign * entry.nbytes
        self.tokens += sign * entry.tokens
        if entry.save_ms:
            self.timed_bytes += sign * entry.nbytes
            self.save_ms += sign * entry.save_ms


def _drop(index: dict[str, list[str]], key: str, entry_id: str) -> None:
    ids = index.get(key)
    if ids is not None:
        with contextlib.suppress(ValueError):
            ids.remove(entry_id)
        if not ids:
            del index[key]


def extends(new: Entry, old: Entry) -> bool:
    """`new` holds `old`'s conversation and more (a chat that grew): `old` is superseded.

    All of it but at most the last SUPERSEDE_SLACK_BLOCKS: the end of the answer `old` generated, which the
    next prompt carries re-templated (a longer answer's blocks differ further back, and the older entry stays
    until the cap evicts it: the slack is kept small because a chat sharing only a system prompt must never
    supersede another).
    An opening is never superseded: the chats that start from it all extend it. Nor is another chat: when both
    were saved from chat requests, `old`'s request units (its settings and messages) must open `new`'s, or a new
    chat whose opening is all but the last block of a short chat (an agent session after its tools) would
    supersede it.
    """
    if old.id == new.id or old.opening or not old.keys or old.tokens > new.tokens:
        return False
    if old.units and new.units and new.units[: len(old.units)] != old.units:
        return False
    shared = common_keys(old.keys, new.keys)
    return shared >= len(old.keys) - SUPERSEDE_SLACK_BLOCKS and shared * 2 >= len(old.keys)


def default_cap(root: Path, store_bytes: int) -> int:
    """Without --max-cache-bytes: half of what the store could use when it opened (its files plus free space)."""
    return int((shutil.disk_usage(root).free + store_bytes) * DEFAULT_CAP_SHARE)


def format_entry(entry: Entry) -> str:
    return f"entry {entry.short} ({entry.tokens:,} tokens, {fmt_bytes(entry.nbytes)})"
