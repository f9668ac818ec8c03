"""The blocks of a save directory (store/blocks.py): which its entries use, what each entry holds on its own,
the blocks no manifest names, and what removing entries frees.

Why apart from the rows: a block is shared by every entry whose file repeats it (a chat's successive saves,
chats that share a system prompt), so what an entry costs the disk, what a directory holds and what prune may
remove are properties of the whole directory, counted as the store counts them (store.blockpool.BlockPool: each
block once, each entry's claim once).

Which manifests hold a claim on blocks: every manifest in entries/ that reads, whatever its status (the store
keeps entries of other configurations on disk, and a manifest beside a linked .bin is never used but is read
here all the same). A quarantined manifest holds none: the store drops an entry's blocks when it quarantines
it. A manifest that cannot be read (damaged, or another slotkeeper version's) may name any block: while one is
there, no block is removed. A manifest that is itself a link is never followed, by the store or here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..store.blockpool import BlockPool
from ..store.blocks import is_block_name
from ..store.entries import PARTIAL_SUFFIX
from .listed import Listed
from .local_rows import FileStat


@dataclass
class BlockUse:
    """What a save directory's manifests say of its blocks, and the files in blocks/ none of them names."""

    pool: BlockPool = field(default_factory=BlockPool)  # the blocks of the entries the store keeps, by users
    claimed: set[str] = field(default_factory=set)  # named by other manifests that read (beside a linked .bin)
    unreadable: set[str] = field(default_factory=set)  # entries whose manifest cannot be read: no block removed
    unused: list[FileStat] = field(default_factory=list)  # files in blocks/ no manifest names (and partial ones)
    listed: bool = True  # blocks/ was listed in full (or is not there): `unused` is all of them

    def in_use(self, name: str) -> bool:
        return name in self.pool or name in self.claimed

    @property
    def disk_bytes(self) -> int:
        """The bytes of the blocks the entries use, each block once."""
        return self.pool.disk_bytes

    @property
    def unused_bytes(self) -> int:
        return sum(f.size for f in self.unused)

    def find_unused(self, blocks_dir: Path) -> None:
        """The files in `blocks/<2 hex>/` that are blocks no manifest names, or partial blocks (what a crash in a
        save left, or a manifest removed by hand). Names only, from the listing; only those are looked at. Links
        and anything else are left out (never removed), as the store's sweep leaves them."""
        try:
            folders = [item.path for item in os.scandir(blocks_dir) if item.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return
        except OSError:
            self.listed = False
            return
        for folder in sorted(folders):
            try:
                items = sorted(os.scandir(folder), key=lambda item: item.name)
            except OSError:
                self.listed = False
                continue
            for item in items:
                name = item.name
                if not (name.endswith(PARTIAL_SUFFIX) or (is_block_name(name) and not self.in_use(name))):
                    continue
                if item.is_file(follow_symlinks=False) and (stat := FileStat.maybe_in(Path(folder), name)):
                    self.unused.append(stat)


class DiskUse:
    """What rows hold on disk together, as the store counts it (their files, and each block once in its
    directory), and what removing each of them frees, in the order they go: a block shared by two entries is
    freed with the second one. For --max-total and prune's lines."""

    def __init__(self, rows: Iterable[Listed]) -> None:
        self._pools: dict[object, BlockPool] = {}
        self.total = 0
        for row in rows:
            self.total += row.file_bytes
            if (claim := row.block_claim) is not None:
                scope, parts = claim
                pool = self._pools.setdefault(scope, BlockPool())
                before = pool.disk_bytes
                pool.acquire(parts)
                self.total += pool.disk_bytes - before

    def remove(self, row: Listed) -> int:
        """`row` goes (it must be one of the rows counted, each removed once): the bytes that frees."""
        freed = row.file_bytes
        if (claim := row.block_claim) is not None:
            scope, parts = claim
            pool = self._pools[scope]
            before = pool.disk_bytes
            pool.release(parts)
            freed += before - pool.disk_bytes
        self.total -= freed
        return freed
