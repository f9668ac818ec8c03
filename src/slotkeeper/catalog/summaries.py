"""The summary lines of `slotkeeper ls`: what a save directory (or a namespace of the shared tier) holds, under
its table, and the total over all of them.

Apart from the tables because they count what the rows do not show one by one (client files, partials, the
lock) and say it in words; the table text only places them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..log import fmt_bytes
from ..store.entries import Status
from ..store.layout import BLOCKS_DIR, SNAPSHOTS_DIR
from .formats import count
from .listed import Kind
from .local_rows import Row
from .remote_rows import RemoteRow
from .scan import SaveDir


def dir_summary(save_dir: SaveDir) -> str:
    """A directory's entries (their bytes on disk: each block once), blocks, slot files, quarantine, client files,
    partials and lock, in one line."""

    def counted(rows: list[Row], word: str, plural: str) -> str:
        return count(len(rows), word, plural) + (f", {fmt_bytes(sum(r.disk_bytes for r in rows))}" if rows else "")

    entries = save_dir.entries
    usable = sum(r.status is Status.USABLE for r in entries)
    parts = [
        f"{count(len(entries), 'entry', 'entries')}, {fmt_bytes(save_dir.entry_bytes)}"
        + (f" ({usable:,} usable)" if usable != len(entries) else "")
    ]
    marks = [r.next_start for r in entries if r.next_start]
    if marks:
        said = {"tried": "tried (loaded, else recomputed)", "recomputed": "recomputed", "kept": "kept as they are"}
        parts.append(
            "at the next start, of other configurations: "
            + ", ".join(f"{marks.count(mark):,} {words}" for mark, words in said.items() if mark in marks)
        )
    blocks = _blocks_summary(save_dir)
    if blocks:
        parts.append(blocks)
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


def _blocks_summary(save_dir: SaveDir) -> str:
    """The blocks the entries share (counted once in the entries' bytes), and those no manifest names; "" for a
    directory without blocks."""
    blocks = save_dir.blocks
    if not len(blocks.pool) and not blocks.unused:
        return ""
    text = f"{BLOCKS_DIR}/: {count(len(blocks.pool), 'block')}, {fmt_bytes(blocks.disk_bytes)}"
    state = sum(r.size or 0 for r in save_dir.entries if r.block_parts is not None)
    if state > blocks.disk_bytes:  # blocks shared between entries (or repeated within one) are kept once
        text += f" for {fmt_bytes(state)} of state"
    if blocks.unused:
        text += f", {len(blocks.unused):,} unused ({fmt_bytes(blocks.unused_bytes)}: prune removes them)"
    return text


def dirs_total(dirs: Sequence[SaveDir]) -> str | None:
    """The entries of all directories together; None for one directory (its summary says it all)."""
    if len(dirs) <= 1:
        return None
    return (
        f"total: {count(sum(len(d.entries) for d in dirs), 'entry', 'entries')}, "
        f"{fmt_bytes(sum(d.entry_bytes for d in dirs))} in {count(len(dirs), 'directory', 'directories')}"
    )


def namespace_summary(rows: Sequence[RemoteRow]) -> str:
    """A namespace's entries and their size, and how many of them no fetch would use."""
    unusable = sum(r.status is not Status.SHARED for r in rows)
    return f"{count(len(rows), 'entry', 'entries')}, {fmt_bytes(sum(r.disk_bytes for r in rows))}" + (
        f" ({unusable:,} never used)" if unusable else ""
    )


def namespaces_total(by_namespace: Mapping[str, Sequence[RemoteRow]]) -> str | None:
    """The entries of all namespaces together; None for one namespace."""
    if len(by_namespace) <= 1:
        return None
    rows_all = [r for rows in by_namespace.values() for r in rows]
    return (
        f"total: {count(len(rows_all), 'entry', 'entries')}, {fmt_bytes(sum(r.disk_bytes for r in rows_all))}"
        f" in {count(len(by_namespace), 'namespace')}"
    )
