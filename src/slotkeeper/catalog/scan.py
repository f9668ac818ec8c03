"""Reading a save directory without a running server: every pair of files slotkeeper owns in it, as a row.

An entry's status is entries.judge()'s, the very rule ConversationStore.open applies at the next start, asked
against the configuration and state format of the directory's most recently used entry (the last run's).
Slot files of the old layout are judged as the store's take-over treats them. Entries kept as blocks are counted
as the store counts them (blockuse): each entry's own blocks, the directory's bytes on disk with each block once,
and the blocks no manifest names. Nothing is changed here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..store import manifestcache
from ..store.entries import (
    BIN_SUFFIX,
    MANIFEST_SUFFIX,
    PARTIAL_SUFFIX,
    TRANSIENT_NAME,
    Entry,
    Status,
    Verdict,
    is_link,
    is_slot_name,
    is_state_file,
    judge,
    parse_entry,
    read_json,
    read_manifest,
)
from ..store.fit import same_tensors
from ..store.layout import BLOCKS_DIR, ENTRIES_DIR, LOCK_NAME, QUARANTINE_DIR, SNAPSHOTS_DIR
from ..store.statefile import StateFileError, read_header
from .blockuse import BlockUse
from .dirs import LockState, list_names, lock_state
from .formats import CatalogError
from .listed import Kind
from .local_rows import FileStat, Row
from .short_ids import assign_short_ids

Pair = tuple[FileStat | None, FileStat | None]  # (the .bin, the manifest)


@dataclass
class SaveDir:
    path: Path
    rows: list[Row] = field(default_factory=list)  # entries (most recently used first), quarantined, slot files
    partials: list[FileStat] = field(default_factory=list)  # interrupted manifest writes: finished at next start
    client_files: list[FileStat] = field(default_factory=list)  # clients' own slot files (snapshots/)
    clients_in_root: int = 0  # of those, still in the directory itself: moved to snapshots/ at the next start
    reference: Row | None = None  # the most recently used entry: the last run's configuration
    lock: LockState = field(default_factory=LockState)
    blocks: BlockUse = field(default_factory=BlockUse)  # the blocks its entries are made of, and those unused

    def of_kind(self, kind: Kind) -> list[Row]:
        return [r for r in self.rows if r.kind is kind]

    @property
    def entries(self) -> list[Row]:
        return self.of_kind(Kind.ENTRY)

    @property
    def entry_bytes(self) -> int:
        """What the entries hold on disk: their files, and each block they use once."""
        return sum(r.file_bytes for r in self.entries) + self.blocks.disk_bytes


def scan_dir(path: Path) -> SaveDir:
    """Everything slotkeeper owns in one save directory (nothing is changed, nothing else is looked at)."""
    result = SaveDir(path)
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise CatalogError(f"cannot read {path}: {exc.strerror or exc}") from None
    _scan_entries(result)
    _count_blocks(result)
    result.rows.sort(key=lambda r: (-r.last_used, r.name))
    _scan_quarantine(result)
    _scan_slot_files(result, names)
    snapshots = path / SNAPSHOTS_DIR
    if snapshots.is_dir() and not snapshots.is_symlink():
        for name in list_names(snapshots):
            if not TRANSIENT_NAME.fullmatch(name) and (stat := FileStat.maybe(snapshots / name)):
                result.client_files.append(stat)
    assign_short_ids(result.rows)
    result.lock = lock_state(path)
    return result


def _pairs(folder: Path, names: Iterable[str]) -> dict[str, Pair]:
    """`<stem>.bin` / `<stem>.json` files of a folder, by stem: (bin, manifest)."""
    found: dict[str, list[FileStat | None]] = {}
    for name in names:
        if name.endswith(BIN_SUFFIX):
            slot, stem = 0, name[: -len(BIN_SUFFIX)]
        elif name.endswith(MANIFEST_SUFFIX):
            slot, stem = 1, name[: -len(MANIFEST_SUFFIX)]
        else:
            continue
        if stem and (stat := FileStat.maybe_in(folder, name)) is not None:
            found.setdefault(stem, [None, None])[slot] = stat
    return {stem: (pair[0], pair[1]) for stem, pair in found.items()}


def _links(folder: Path, names: Iterable[str]) -> set[str]:
    """The stems of entry names that are a link or not a regular file."""
    return {
        name.rsplit(".", 1)[0]
        for name in names
        if name.endswith((BIN_SUFFIX, MANIFEST_SUFFIX)) and is_link(folder / name)
    }


def _scan_entries(save_dir: SaveDir) -> None:
    """entries/, judged twice: alone, to find the reference (the most recently used usable entry), then against
    the reference's fingerprint and state format, as the next start judges against its own."""
    folder = save_dir.path / ENTRIES_DIR
    names = list_names(folder)
    save_dir.partials += [s for n in names if n.endswith(PARTIAL_SUFFIX) and (s := FileStat.maybe_in(folder, n))]
    found = _pairs(folder, names)
    # What the manifests held when the last run stopped (the manifest cache, as a start reads it): a manifest
    # whose stamp is the cached one is not read again, and a store of 20,000 is one file read, not 20,000.
    cached = manifestcache.read(save_dir.path, {stem: pair[1].identity for stem, pair in found.items() if pair[1]})
    pairs: dict[str, tuple[Pair, dict[str, Any] | Entry | None]] = {
        stem: (pair, cached.pop(stem, None) or (read_manifest(pair[1].path) if pair[1] else None))
        for stem, pair in found.items()
    }
    seen = {stat.name for pair in found.values() for stat in pair if stat is not None}
    # never followed, as the store never follows them (entries.is_link); only the names _pairs found no regular
    # file under are looked at again
    links = _links(folder, (name for name in names if name not in seen))
    for stem in links - pairs.keys():
        pairs[stem] = ((None, None), None)

    def judged(stem: str, against: Entry | None) -> Verdict:
        (bin_stat, manifest_stat), manifest = pairs[stem]
        return judge(
            manifest,
            bin_stat.size if bin_stat else None,
            against.fingerprint if against else None,
            (against.seq_version, against.layout) if against else None,
            committed=manifest_stat is not None,
            link=stem in links,
        )

    last, reference, newest = None, None, (0.0, 0.0)  # the first of the most recently used usable entries
    for stem, ((bin_stat, manifest_stat), manifest) in pairs.items():
        alone = judged(stem, None)
        if alone.entry is not None and isinstance(manifest, dict):  # parsed once: judged again as the Entry
            pairs[stem] = ((bin_stat, manifest_stat), alone.entry)
        if (
            alone.status is Status.USABLE
            and (entry := alone.entry) is not None
            and (reference is None or (entry.last_used, entry.saved_at) > newest)
        ):
            last, reference, newest = stem, entry, (entry.last_used, entry.saved_at)
    for stem in list(pairs):  # judge() is pure: without a reference, each verdict is the one judged alone
        verdict = judged(stem, reference)
        pair, manifest = pairs.pop(stem)  # its manifest's data goes as soon as its row is made: less held
        if pair[1] is not None:
            _claim_blocks(save_dir.blocks, stem, verdict, manifest)
        row = Row(Kind.ENTRY, save_dir.path, folder, stem, *pair, verdict.entry, verdict.status)
        row.reason, row.note = _described(verdict, reference)
        other = verdict.status in (Status.OTHER_CONFIGURATION, Status.OTHER_FORMAT)
        if other and verdict.entry is not None:
            loads_maybe = verdict.status is Status.OTHER_CONFIGURATION
            row.next_start = _next_start(verdict.entry, reference, loads_maybe=loads_maybe)
        save_dir.rows.append(row)
        if stem == last:
            save_dir.reference = row


def _claim_blocks(blocks: BlockUse, stem: str, verdict: Verdict, manifest: dict[str, Any] | Entry | None) -> None:
    """What a regular manifest file in entries/ says of the blocks (blockuse says which manifests count): an
    entry the store keeps joins the pool (in _count_blocks, with its row); a manifest that does not read counts
    as unreadable; one beside a link, never used, still keeps the blocks it names."""
    if verdict.entry is not None:
        return
    if verdict.status is not Status.LINK or manifest is None:
        blocks.unreadable.add(stem)
        return
    entry, _ = (manifest, "") if isinstance(manifest, Entry) else parse_entry(manifest)
    if entry is None:
        blocks.unreadable.add(stem)
    elif entry.parts is not None:
        blocks.claimed.update(entry.parts.block_sizes())


def _count_blocks(save_dir: SaveDir) -> None:
    """The pool of the entries kept as blocks (every status: all are on disk), each entry's own bytes, and the
    files in blocks/ no manifest names."""
    blocks = save_dir.blocks
    rows = [(row, parts) for row in save_dir.rows if (parts := row.block_parts) is not None]
    for _, parts in rows:
        blocks.pool.acquire(parts)
    for row, parts in rows:
        row.block_bytes = blocks.pool.own_bytes(parts)
    folder = save_dir.path / BLOCKS_DIR
    if folder.is_dir() and not folder.is_symlink():
        blocks.find_unused(folder)


def _described(verdict: Verdict, reference: Entry | None) -> tuple[str, str]:
    """The row's reason and status column for a verdict: what the next start does about it."""
    entry = verdict.entry
    if verdict.status is Status.OTHER_CONFIGURATION:
        return verdict.reason, f"other configuration ({verdict.difference.split(':', 1)[0]})"
    if verdict.status is Status.OTHER_FORMAT and entry is not None and reference is not None:
        return (
            f"state format v{entry.seq_version} ({entry.layout}); the last run's is "
            f"v{reference.seq_version} ({reference.layout})",
            f"other state format (v{entry.seq_version})",
        )
    if verdict.status is Status.WRONG_SIZE:
        return f"{verdict.reason}: quarantined at the next start", ""
    return "", ""


def _next_start(entry: Entry, reference: Entry | None, *, loads_maybe: bool) -> str:
    """What the next start of the last run's configuration (`reference`) does with an entry of another one
    (store/fit.py decides it there): `tried` (loaded if llama-server takes it, else recomputed), `recomputed`
    (from its tokens, while idle), or `kept` (as it is: pictures, another model).
    `loads_maybe`: llama-server may load it as saved (another state format never loads)."""
    if entry.images or reference is None:
        return "kept"
    if same_tensors(entry.fingerprint, reference.fingerprint):
        return "tried" if loads_maybe else "recomputed"
    return "recomputed" if entry.vocabulary and entry.vocabulary == reference.vocabulary else "kept"


def _scan_quarantine(save_dir: SaveDir) -> None:
    folder = save_dir.path / QUARANTINE_DIR
    if not folder.is_dir() or folder.is_symlink():
        return
    quarantined = []
    for stem, (bin_stat, manifest_stat) in _pairs(folder, list_names(folder)).items():
        manifest = read_manifest(manifest_stat.path) if manifest_stat else None
        entry = parse_entry(manifest)[0] if manifest is not None else None
        quarantined.append(
            Row(Kind.QUARANTINED, save_dir.path, folder, stem, bin_stat, manifest_stat, entry, Status.QUARANTINED)
        )
    save_dir.rows += sorted(quarantined, key=lambda r: r.name, reverse=True)  # newest first (by its stamp)


def _scan_slot_files(save_dir: SaveDir, names: list[str]) -> None:
    """The slot-file layout in the directory itself, judged as ConversationStore._take_over_slot_files would."""
    root = save_dir.path
    save_dir.partials += [
        s
        for n in names
        if n.endswith(PARTIAL_SUFFIX) and is_slot_name(n.split(".", 1)[0]) and (s := FileStat.maybe(root / n))
    ]
    pairs = {stem: pair for stem, pair in _pairs(root, names).items() if is_slot_name(stem)}
    for stem, (bin_stat, manifest_stat) in sorted(pairs.items(), key=lambda p: (int(p[0]), p[0])):
        old = read_json(manifest_stat.path) if manifest_stat else None
        header = None
        if bin_stat is not None:
            with contextlib.suppress(OSError, StateFileError):
                header = read_header(bin_stat.path)
        entry = None
        if header is not None and bin_stat is not None:
            saved_at = _number((old or {}).get("saved_at"), bin_stat.mtime)
            fingerprint = (old or {}).get("fingerprint")
            entry = Entry(
                id=stem,
                n_tokens=header.n_tokens,
                nbytes=bin_stat.size,
                keys=[],
                saved_at=saved_at,
                last_used=saved_at,
                fingerprint=fingerprint if isinstance(fingerprint, dict) else {},
                seq_version=header.version,
                layout=header.layout,
                save_ms=(old or {}).get("save_ms"),
            )
        if bin_stat is None:
            status = Status.SLOT_MANIFEST_ONLY
        elif old is None:
            if header is None:
                continue  # a file with a slot's name that is neither a slot file nor described: not ours
            status = Status.SLOT_FILE_UNVERIFIED
        else:
            status = Status.SLOT_FILE_UNREADABLE if header is None else Status.SLOT_FILE
        save_dir.rows.append(Row(Kind.SLOT_FILE, root, root, stem, bin_stat, manifest_stat, entry, status))
    for name in names:  # clients' own slot files, moved to snapshots/ at the next start
        path = root / name
        stem = name.removesuffix(BIN_SUFFIX)
        if name == LOCK_NAME or name.endswith(MANIFEST_SUFFIX) or (name.endswith(BIN_SUFFIX) and is_slot_name(stem)):
            continue
        stat = FileStat.maybe(path)
        if stat is not None and is_state_file(path):
            save_dir.client_files.append(stat)
            save_dir.clients_in_root += 1


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default
