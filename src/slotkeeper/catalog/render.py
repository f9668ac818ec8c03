"""`slotkeeper ls`'s output: one table per save directory (or per namespace of the shared tier), all on the
same columns so that they read as one listing, and `--json`'s records (one per directory and per row).
"""

from __future__ import annotations

import functools
import json
import math
import textwrap
from collections.abc import Callable, Mapping, Sequence
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any

from ..log import fmt_bytes
from ..store.entries import Status
from ..store.layout import SNAPSHOTS_DIR
from .formats import count, display_path, format_age
from .listed import Kind, Listed
from .local_rows import Row
from .match import Expectation, match_differences
from .remote_rows import RemoteRow
from .scan import SaveDir
from .statuses import COMPARABLE
from .table import WIDTH, fit, format_row

HEADERS = ("entry", "tokens", "size", "last used", "model", "status", "match")
RIGHT_ALIGNED = (1, 2, 3)
MODEL_COLUMN = 4
BUDGETS = {"status": 38, "match": 40}  # longer texts in the last columns overflow instead of squeezing the model

Section = tuple[str, Sequence[Listed], str]  # title, rows, summary line


# ---- tables -----------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def file_name(path: str) -> str:
    """The model file's name (a store holds a few models and thousands of rows: pathlib once per model)."""
    return Path(path).name


def table_row(row: Listed, now: float, expectation: Expectation | None) -> list[str]:
    tokens, size = row.tokens, row.size
    cells = [
        row.label_id,
        f"{tokens:,}" if tokens is not None else "-",
        fmt_bytes(size) if size is not None else "-",
        format_age(now - row.last_used) + " ago",
        file_name(row.model) if row.model else "-",
        row.detail,
    ]
    if expectation:
        if row.status not in COMPARABLE:
            cells.append("-")  # the status column says why it is never used
        else:
            differences = expectation.differences(row.fingerprint)
            cells.append("no: " + differences[0] if differences else "yes")
    return cells


def render_sections(sections: Sequence[Section], total: str | None, now: float, expectation: Expectation | None) -> str:
    """Tables (title, rows, summary line) sharing their columns, then the total line."""
    headers = list(HEADERS if expectation else HEADERS[:-1])
    tables = [[table_row(r, now, expectation) for r in rows] for _, rows, _ in sections]
    widths = fit(headers, [row for rows in tables for row in rows], MODEL_COLUMN, BUDGETS)
    lines: list[str] = []
    if expectation:
        lines += textwrap.wrap(
            f"match: {expectation.checked()}",
            WIDTH,
            subsequent_indent="       ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        lines.append("")
    for i, ((title, _, summary), rows) in enumerate(zip(sections, tables)):
        if i:
            lines.append("")
        lines.append(title)
        if rows:
            lines += [format_row(row, widths, RIGHT_ALIGNED) for row in [headers, *rows]]
        else:
            lines.append("  (no entries)")
        lines += textwrap.wrap(
            summary,
            WIDTH,
            initial_indent="  ",
            subsequent_indent="    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    if total:
        lines += ["", total]
    return "\n".join(lines)


def dir_summary(save_dir: SaveDir) -> str:
    def counted(rows: list[Row], word: str, plural: str) -> str:
        return count(len(rows), word, plural) + (f", {fmt_bytes(sum(r.disk_bytes for r in rows))}" if rows else "")

    entries = save_dir.entries
    usable = sum(r.status is Status.USABLE for r in entries)
    parts = [
        f"{count(len(entries), 'entry', 'entries')}, {fmt_bytes(save_dir.entry_bytes)}"
        + (f" ({usable:,} usable)" if usable != len(entries) else "")
    ]
    slot_files = save_dir.of_kind(Kind.SLOT_FILE)
    if slot_files:
        parts.append(
            count(len(slot_files), "slot file") + f" to take over, {fmt_bytes(sum(r.disk_bytes for r in slot_files))}"
        )
    parts.append("quarantine: " + counted(save_dir.of_kind(Kind.QUARANTINED), "entry", "entries"))
    clients = save_dir.client_files
    text = f"{SNAPSHOTS_DIR}/: {count(len(clients), 'client file')}"
    if clients:
        text += f", {fmt_bytes(sum(f.size for f in clients))}"
        if save_dir.clients_in_root:
            text += f" ({save_dir.clients_in_root:,} still in the directory itself)"
    parts.append(text)
    if save_dir.partials:
        parts.append(count(len(save_dir.partials), "partial") + " (finished or removed at next start)")
    if save_dir.lock.held:
        parts.append(save_dir.lock.describe())
    return "; ".join(parts)


def render_listing(dirs: Sequence[SaveDir], now: float, expectation: Expectation | None) -> str:
    """One table per directory, all with the same columns, so the directories read as one listing."""
    sections = [(display_path(d.path), d.rows, dir_summary(d)) for d in dirs]
    total = None
    if len(dirs) > 1:
        total = (
            f"total: {count(sum(len(d.entries) for d in dirs), 'entry', 'entries')}, "
            f"{fmt_bytes(sum(d.entry_bytes for d in dirs))} in {count(len(dirs), 'directory', 'directories')}"
        )
    return render_sections(sections, total, now, expectation)


def render_remote(
    url: str, by_namespace: Mapping[str, list[RemoteRow]], now: float, expectation: Expectation | None
) -> str:
    if not by_namespace:
        return f"no entries in {url}"
    sections: list[Section] = []
    for namespace, rows in by_namespace.items():
        unusable = sum(r.status is not Status.SHARED for r in rows)
        summary = f"{count(len(rows), 'entry', 'entries')}, {fmt_bytes(sum(r.disk_bytes for r in rows))}" + (
            f" ({unusable:,} never used)" if unusable else ""
        )
        sections.append((f"{url}/{namespace}", rows, summary))
    total = None
    if len(by_namespace) > 1:
        rows_all = [r for rows in by_namespace.values() for r in rows]
        total = (
            f"total: {count(len(rows_all), 'entry', 'entries')}, {fmt_bytes(sum(r.disk_bytes for r in rows_all))}"
            f" in {count(len(by_namespace), 'namespace')}"
        )
    return render_sections(sections, total, now, expectation)


# ---- --json -----------------------------------------------------------------------------------------------------


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
        "bytes": save_dir.entry_bytes,
        "usable": sum(r.status is Status.USABLE for r in save_dir.entries),
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


# ---- JSON text --------------------------------------------------------------------------------------------------


class _Unusual(Exception):
    """A value dumps_indented leaves to the json module (a subclass, a non-string key, an unknown type)."""


def dumps_indented(value: Any) -> str:
    """`json.dumps(value, indent=1)`, byte for byte, in about two thirds of its time.

    The json module encodes in C only without `indent`; with it, its Python encoder spends a generator and a
    few calls per value: at 20,000 entries a third of `ls --json`. This one knows only what records hold (dicts
    with string keys, lists, and the plain scalars) and leaves anything else, whole, to the json module.
    """
    parts: list[str] = []
    try:
        _encode(value, "", parts.append)
    except _Unusual:
        return json.dumps(value, indent=1)
    return "".join(parts)


def _scalar(value: Any) -> str | None:
    """A plain scalar as json.dumps writes it (ensure_ascii, NaN and Infinity allowed); None for containers."""
    kind = type(value)
    if kind is str:
        return encode_basestring_ascii(value)
    if kind is int:
        return int.__repr__(value)
    if kind is float:
        if math.isfinite(value):
            return float.__repr__(value)
        return "NaN" if value != value else "Infinity" if value > 0 else "-Infinity"
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    if kind is dict or kind is list:
        return None
    raise _Unusual


def _encode(value: Any, indent: str, out: Callable[[str], object]) -> None:
    text = _scalar(value)
    if text is not None:
        out(text)
        return
    if not value:
        out("{}" if type(value) is dict else "[]")
        return
    inner = indent + " "
    separator, following = ("{\n" if type(value) is dict else "[\n") + inner, ",\n" + inner
    if type(value) is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise _Unusual
            name = encode_basestring_ascii(key)
            text = _scalar(item)
            if text is None:
                out(f"{separator}{name}: ")
                _encode(item, inner, out)
            else:
                out(f"{separator}{name}: {text}")
            separator = following
        out(f"\n{indent}}}")
    else:
        for item in value:
            text = _scalar(item)
            if text is None:
                out(separator)
                _encode(item, inner, out)
            else:
                out(separator + text)
            separator = following
        out(f"\n{indent}]")
