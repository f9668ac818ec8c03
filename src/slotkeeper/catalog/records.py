"""`slotkeeper ls --json`'s records: one per save directory (or namespace of the shared tier), then one per row,
each a dict in a fixed field order.

The records are data for scripts, apart from how they are written out as text (jsontext).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..store.entries import Status
from .formats import file_name
from .listed import Kind, Listed
from .match import Expectation, match_differences
from .remote_rows import RemoteRow
from .scan import SaveDir


def record(row: Listed, now: float, expectation: Expectation | None) -> dict[str, Any]:
    """Everything known about one row, local or remote, in the order of its `FIELDS`."""
    entry = row.entry
    values: dict[str, Any] = {
        "kind": row.kind.value,
        "id": row.id,
        "short": row.short,
        "status": row.status.value,
        "detail": row.detail,
        "reason": row.why,
        "tokens": row.tokens,
        "saved_at": entry.saved_at if entry else None,
        "last_used": row.last_used,
        "age_s": round(max(0.0, now - row.last_used), 1),
        "model": row.model,
        "model_name": file_name(row.model) if row.model else None,
        "fingerprint": (entry.fingerprint or None) if entry else None,
        "format": {"seq_version": entry.seq_version, "layout": entry.layout} if entry else None,
        **row.own_fields(),
    }
    out = {name: values[name] for name in row.FIELDS}
    if expectation is not None:
        differences = match_differences(row, expectation)
        out["match"] = not differences
        out["differences"] = differences
    return out


def dir_record(save_dir: SaveDir) -> dict[str, Any]:
    quarantined, slot_files = save_dir.of_kind(Kind.QUARANTINED), save_dir.of_kind(Kind.SLOT_FILE)
    return {
        "kind": "directory",
        "dir": str(save_dir.path),
        "entries": len(save_dir.entries),
        "bytes": save_dir.entry_bytes,  # on disk: the entries' files, and each block they use once
        "usable": sum(r.status is Status.USABLE for r in save_dir.entries),
        "blocks": len(save_dir.blocks.pool),  # the blocks the entries use
        "block_bytes": save_dir.blocks.disk_bytes,
        "unused_blocks": len(save_dir.blocks.unused),  # files in blocks/ no manifest names: prune removes them
        "unused_block_bytes": save_dir.blocks.unused_bytes,
        "reference": save_dir.reference.id if save_dir.reference else None,
        "slot_files": len(slot_files),
        "slot_file_bytes": sum(r.disk_bytes for r in slot_files),
        "quarantined": len(quarantined),
        "quarantine_bytes": sum(r.disk_bytes for r in quarantined),
        "client_files": len(save_dir.client_files),
        "client_bytes": sum(f.size for f in save_dir.client_files),
        "partials": len(save_dir.partials),
        "in_use": save_dir.lock.held,
        "lock_pid": save_dir.lock.pid,
    }


def json_records(dirs: Sequence[SaveDir], now: float, expectation: Expectation | None) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for save_dir in dirs:
        records.append(dir_record(save_dir))
        records += [record(r, now, expectation) for r in save_dir.rows]
    return records


def remote_json(
    url: str, by_namespace: Mapping[str, list[RemoteRow]], now: float, expectation: Expectation | None
) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for namespace, rows in by_namespace.items():
        records.append(
            {
                "kind": "remote_namespace",
                "url": url,
                "namespace": namespace,
                "entries": len(rows),
                "bytes": sum(r.disk_bytes for r in rows),
            }
        )
        records += [record(r, now, expectation) for r in rows]
    return records
