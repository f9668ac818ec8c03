"""Saves: what a slot holds, made a new entry without ever overwriting one.

llama-server saves the slot under a transient name (staged in RAM when there is room, staging.py); the file is
read (its tokens, its checksum), checked against the turn boundary it must be, and committed in a thread: as
blocks, each written once (slotfiles.commit_blocks), or as one file. Only then are the entries it supersedes
removed. A save that fails or is cancelled leaves no file behind and every previous entry whole.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..chat.media import Learnt, MediaBoundary
from ..chat.prefix import exact_key
from ..log import log
from . import blockfiles, slotfiles
from .entries import (
    BIN_SUFFIX,
    Entry,
    discard,
)
from .entryfiles import EntryFiles
from .index import extends
from .outcomes import SaveFailure, SaveResult
from .slotfiles import SavedFile, low_space, read_saved, report_progress
from .statefile import StateFileError, StateHeader


class Saves(EntryFiles):
    """The save protocol, over the store's entries."""

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
        used_at: float | None = None,
    ) -> SaveResult:
        """Save what slot `slot_id` holds as a new entry; the entries it supersedes are then removed (by
        default those it extends, `extends`; the caller's policy otherwise).

        With `boundary`, the slot must hold exactly those tokens (a turn boundary; a whole chat recomputed when
        not `marks_boundary`): a file holding anything else is not committed. A boundary with pictures not known
        yet (`media.MediaBoundary`) is checked once the file has shown them. Cancellation (a budget) at any point
        leaves no partial file and every previous entry intact. `used_at`: when the slot's chat was last used
        (wall clock), its entry's place in least-recently-used order; else now.
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
                used_at=used_at,
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
        if self.on_commit is not None:
            self.on_commit(
                entry, self.entries_dir / f"{entry.id}{BIN_SUFFIX}" if entry.parts is None else self.blocks_dir
            )
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
        used_at: float | None,
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
            last_used=now if used_at is None else min(used_at, now),
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
