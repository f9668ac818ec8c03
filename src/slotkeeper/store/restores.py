"""Restores: an entry handed to llama-server, and known good before any request may use its slot.

An entry kept as blocks is put together into a staged file (staging.py), its checksum taken on the way, and
handed to llama-server only when it matches: blocks that changed on disk quarantine every entry that uses
them. An entry kept as one file goes through a transient hard link, checked against its checksum while
llama-server reads it (on the other core), and its slot is erased if the check fails. Either way the model
never answers from a state it never had.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

from ..log import log
from . import blockfiles
from .entries import (
    Entry,
    discard,
    file_checksum,
    pair_paths,
)
from .entryfiles import EntryFiles
from .fit import Fit, fit
from .outcomes import RestoreOutcome, RestoreResult
from .slotfiles import transient_path
from .staging import Staged


class Restores(EntryFiles):
    """The restore protocol, over the store's entries."""

    async def restore(self, entry: Entry, slot_id: int, *, used: bool = True) -> RestoreResult:
        """Load `entry` into slot `slot_id`: kept as blocks, put together and checked first (`_restore_blocks`);
        kept as one file, through a transient hard link (the entry itself stays out of reach).

        A file is checked against its checksum while llama-server reads it (in a thread, on the other core:
        checked first, the check cost 63% of a restore of a 123 MB entry; alongside, nothing measurable), and the
        result is known before this returns, that is before any request may run in the slot. A file that
        changed on disk is quarantined and the slot erased: no request ever runs on that state. `used`: a
        request wants it (the entry is marked used now); not at start, where recency must stay its chat's.
        """
        assert self.client is not None
        result = await (
            self._restore_blocks(entry, slot_id) if entry.parts is not None else self._restore_file(entry, slot_id)
        )
        if used and result.ok:
            self.touch(entry)
        return result

    async def _restore_file(self, entry: Entry, slot_id: int) -> RestoreResult:
        """An entry kept as one file, through a transient hard link."""
        assert self.client is not None
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
