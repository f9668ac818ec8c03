"""The rows of the shared tier: one per entry of a namespace, described by its manifest alone (its .bin is
never read to list it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..store.entries import Entry, Status
from .listed import Kind, Listed, record_fields


@dataclass
class RemoteRow(Listed):
    """One entry of the shared tier: `<prefix>/<namespace>/<id>.json` (and its .bin)."""

    FIELDS: ClassVar[tuple[str, ...]] = record_fields(where=("url", "namespace"), sizes=("sha256",))
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

    def own_fields(self) -> dict[str, Any]:
        return {"url": self.url, "namespace": self.namespace, "bytes": self.size, "sha256": self.manifest.get("sha256")}
