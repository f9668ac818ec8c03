"""Which blocks the store's entries use, and how often: what a removal frees, what the store holds on disk.

Why apart: a block is shared by every entry whose file repeats it (a chat's earlier saves, chats that share an
opening), so it goes only when its last user goes. This is the count, in memory, rebuilt from the manifests at
every start: it does no I/O and makes no decision (the store removes what `release` hands back, when no save is
under way).
"""

from __future__ import annotations

from collections.abc import Iterable

from .blocks import Parts


class BlockPool:
    """Users per block (each entry counted once per distinct block), and the bytes of the blocks in use."""

    def __init__(self) -> None:
        self._users: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._bytes = 0

    @property
    def disk_bytes(self) -> int:
        """The bytes of every block some entry uses (each block counted once)."""
        return self._bytes

    def __len__(self) -> int:
        """How many blocks some entry uses."""
        return len(self._users)

    def __contains__(self, name: object) -> bool:
        return name in self._users

    def names(self) -> frozenset[str]:
        """The blocks in use now (a save's thread is handed this: it writes only the others)."""
        return frozenset(self._users)

    def acquire(self, parts: Parts) -> None:
        """An entry with these parts joins the store."""
        for name, size in parts.block_sizes().items():
            count = self._users.get(name, 0)
            self._users[name] = count + 1
            if not count:
                self._sizes[name] = size
                self._bytes += size

    def release(self, parts: Parts) -> list[str]:
        """An entry with these parts leaves the store: the blocks no entry uses any more (to be removed)."""
        freed = []
        for name in parts.block_sizes():
            count = self._users.get(name, 0)
            if count > 1:
                self._users[name] = count - 1
            elif count == 1:
                del self._users[name]
                self._bytes -= self._sizes.pop(name)
                freed.append(name)
        return freed

    def own_bytes(self, parts: Parts) -> int:
        """The bytes only this entry's blocks hold (what removing it frees)."""
        return sum(size for name, size in parts.block_sizes().items() if self._users.get(name) == 1)

    def unused(self, names: Iterable[str]) -> list[str]:
        """Those of `names` that no entry uses."""
        return [name for name in names if name not in self._users]
