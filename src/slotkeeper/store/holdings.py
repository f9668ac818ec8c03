"""What the store's entries hold on disk, and when the blocks no entry uses may go.

Why apart from conversations.py: an entry kept as blocks shares them (blocks.py), so removing it frees only
what no other entry uses, and only once nothing still counts on those blocks. A save's thread writes the
blocks the store lacked when it started and counts on the others being there until its manifest commits; a
restore reads an entry's blocks. So blocks are removed only while no save or restore runs: removals that
come meanwhile wait (`doomed`) and are done by the last one to end. The store calls this on the event loop,
its one thread; the files are blockfiles.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

from ..log import fmt_bytes, log
from . import blockfiles
from .blockpool import BlockPool
from .entries import Entry


class Holdings:
    """The entries on disk (usable or kept for another configuration), their blocks' users and bytes."""

    def __init__(self, blocks_dir: Path) -> None:
        self._blocks_dir = blocks_dir
        self._pool = BlockPool()
        self._held: set[str] = set()  # entry ids, counted in _pool or _file_bytes
        self._file_bytes = 0  # of the entries kept as one file
        self._users = 0  # saves writing blocks and restores reading them
        self._doomed: set[str] = set()  # blocks to remove once none runs (if still unused then)
        self._marked = False  # blocks/.unclean made in this run

    @property
    def disk_bytes(self) -> int:
        """What the entries hold on disk: each block once, each file once."""
        return self._pool.disk_bytes + self._file_bytes

    @property
    def marked(self) -> bool:
        """Whether this run has marked the blocks unclean (its first block write)."""
        return self._marked

    def holds(self, entry: Entry) -> bool:
        return entry.id in self._held

    def in_use(self) -> frozenset[str]:
        """The blocks some entry uses (a save writes only the others)."""
        return self._pool.names()

    def hold(self, entry: Entry) -> None:
        """An entry is on disk (once per entry)."""
        if entry.id in self._held:
            return
        self._held.add(entry.id)
        if entry.parts is None:
            self._file_bytes += entry.nbytes
        else:
            self._pool.acquire(entry.parts)

    def let_go(self, entry: Entry) -> None:
        """An entry left the disk (removed, quarantined): the blocks no other entry uses go too."""
        if entry.id not in self._held:
            return
        self._held.discard(entry.id)
        if entry.parts is None:
            self._file_bytes -= entry.nbytes
        else:
            self._doomed.update(self._pool.release(entry.parts))
            self._remove_doomed()

    def begin(self) -> None:
        """A save or restore that counts on blocks starts."""
        self._users += 1

    def end(self, *, unused: Iterable[str] = (), committed: Entry | None = None) -> None:
        """It ended: `committed`, the entry a save made (held before anything is removed: its blocks are in use
        from now on); `unused`, blocks it wrote that no entry may use (a failed save's)."""
        self._users -= 1
        if committed is not None:
            self._marked = True
            self.hold(committed)
        self._doomed.update(unused)
        self._remove_doomed()

    def _remove_doomed(self) -> None:
        if self._users or not self._doomed:
            return
        doomed = self._pool.unused(self._doomed)
        self._doomed.clear()
        if blockfiles.remove_blocks(self._blocks_dir, doomed):
            log.warning("some unused blocks could not be removed; the next start removes them")

    def sweep(self, *, unreadable: int) -> None:
        """At open, after a run that did not stop cleanly: remove the blocks no entry uses (what a save it was
        killed in wrote). Not when `unreadable` manifests could not be read or made sense of, or lie beside a
        link (a newer slotkeeper's, or a damaged one, may use any block)."""
        if not blockfiles.is_unclean(self._blocks_dir):
            return
        if unreadable:
            log.warning("blocks not checked for what an interrupted save left: %d manifest(s) not read", unreadable)
            return
        removed, freed = blockfiles.sweep(self._blocks_dir, self._pool.__contains__)
        if removed:
            log.info("removed %d block(s) left by an interrupted save (%s)", removed, fmt_bytes(freed))
        blockfiles.mark_clean(self._blocks_dir)

    def settled(self) -> bool:
        """Whether the blocks are as the manifests say, with nothing under way: the unclean mark may go."""
        return self._marked and not self._users and not self._doomed

    def mark_clean(self) -> None:
        """Once `settled` (at a stop): the next start need not look for leftovers. One unlink."""
        with contextlib.suppress(OSError):
            blockfiles.mark_clean(self._blocks_dir)
            self._marked = False

    @property
    def busy(self) -> bool:
        return bool(self._users)
