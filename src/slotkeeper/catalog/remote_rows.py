"""The rows of the shared tier: one per entry of a namespace, described by its manifest alone (its .bin or its
blocks are never read to list it). An entry kept as blocks shares them with the namespace's other entries: its
size is its state's (the manifest's "bytes"), and what only it holds there is `held` (shared.remote_rows counts
it, as the store counts its own blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..store.blocks import Parts
from ..store.entries import Entry, Status
from .listed import Kind, Listed, record_fields


@dataclass
class RemoteRow(Listed):
    """One entry of the shared tier: `<prefix>/<namespace>/<id>.json` (and its .bin, or its blocks)."""

    FIELDS: ClassVar[tuple[str, ...]] = record_fields(
        where=("url", "namespace"), sizes=("sha256", "blocks", "own_bytes")
    )
    url: str
    namespace: str
    entry_id: str
    manifest: dict[str, Any]
    entry: Entry | None
    status: Status
    reason: str = ""
    note: str = ""
    short: str = ""
    kind: Kind = Kind.REMOTE
    held: int | None = None  # kept as blocks: the bytes of those no other entry of its namespace uses

    @property
    def id(self) -> str:
        return self.entry_id

    @property
    def label(self) -> str:
        return f"remote entry {self.short} in {self.url}/{self.namespace}"

    @property
    def sort_key(self) -> tuple[str, str]:
        return self.namespace, self.id

    @property
    def size(self) -> int | None:
        value = self.manifest.get("bytes")
        return value if isinstance(value, int) else None

    @property
    def own_bytes(self) -> int | None:
        return self.size if self.held is None else self.held

    @property
    def file_bytes(self) -> int:
        """Its .bin's bytes; none for an entry kept as blocks (they are counted in its namespace, each once)."""
        return 0 if self.remote_parts is not None else self.size or 0

    @property
    def block_claim(self) -> tuple[object, Parts] | None:
        parts = self.remote_parts
        return None if parts is None else ((self.url, self.namespace), parts)

    @property
    def remote_parts(self) -> Parts | None:
        """The blocks it uses in its namespace (None: kept whole, or its parts cannot be read, which the listing
        does not let through: bucket.valid_manifest)."""
        if self.entry is not None:
            return self.entry.parts
        try:
            return Parts.from_json(self.manifest["parts"]) if "parts" in self.manifest else None
        except (KeyError, TypeError, ValueError):
            return None

    def own_fields(self) -> dict[str, Any]:
        parts = self.remote_parts
        return {
            "url": self.url,
            "namespace": self.namespace,
            "bytes": self.size,
            "sha256": self.manifest.get("sha256"),  # kept whole: its .bin's
            "blocks": len(parts.block_sizes()) if parts else None,  # kept as blocks: how many
            "own_bytes": self.own_bytes,  # what only it holds in the bucket (its .bin, or the blocks no other uses)
        }
