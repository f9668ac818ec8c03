"""What a start finds in a save directory: what a killed run left, the slot-file layout's files, the pairs.

Why apart from conversations.py: this is the file handling of the store's `open()`, done once, before anything is
indexed. It finishes or removes what a killed run left (transient names in snapshots/, partial files, an entry
file whose save never committed), takes a directory of the older slot-file layout over (`<slot>.bin` +
`<slot>.json` become entries, clients' own files move to snapshots/), and lists the committed pairs of
entries/ with their manifests, most from the manifest cache (manifestcache.py). What each pair is good for is
then the store's to judge (`entries.judge`).
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..chat.prefix import block_keys, exact_key
from ..log import fmt_bytes, log
from . import manifestcache
from .entries import (
    BIN_SUFFIX,
    MANIFEST_SUFFIX,
    PARTIAL_SUFFIX,
    TRANSIENT_NAME,
    TRANSIENT_PREFIX,
    Entry,
    discard,
    is_slot_name,
    is_state_file,
    read_json,
    read_manifest,
    write_json_atomic,
)
from .layout import ENTRIES_DIR, LOCK_NAME, SNAPSHOTS_DIR
from .statefile import StateFileError, read_header


def remove_transients(snapshots_dir: Path) -> None:
    """Remove the transient files (saves, restore links) a killed run left in snapshots/."""
    for leftover in snapshots_dir.glob(f"{TRANSIENT_PREFIX}*"):
        if TRANSIENT_NAME.fullmatch(leftover.name):  # a client's own `slotkeeper-notes.bin` stays
            leftover.unlink(missing_ok=True)


def take_over_slot_files(root: Path, fingerprint: dict[str, Any], *, restore_unverified: bool, fsync: bool) -> int:
    """`<slot>.bin` + `<slot>.json` from the slot-file layout become entries; clients' own files move to snapshots/.

    So an upgrade loses no cache. A slot file without a manifest is taken over only with --restore-unverified
    (it is then trusted to match the running configuration, `fingerprint`). Returns how many became entries.
    """
    taken = 0
    for manifest_path in sorted(root.glob(f"*{MANIFEST_SUFFIX}{PARTIAL_SUFFIX}")):
        final = manifest_path.with_name(manifest_path.name.removesuffix(PARTIAL_SUFFIX))
        data = read_json(manifest_path)
        bin_path = final.with_suffix(BIN_SUFFIX)
        if data and bin_path.is_file() and bin_path.stat().st_size == data.get("bytes"):
            os.replace(manifest_path, final)  # a save that completed its file before the stop
        else:
            manifest_path.unlink(missing_ok=True)
    for partial in root.glob(f"*{BIN_SUFFIX}{PARTIAL_SUFFIX}"):
        partial.unlink(missing_ok=True)
    for path in sorted(root.iterdir()):
        if not path.is_file() or path.name == LOCK_NAME:
            continue
        stem = path.name.removesuffix(BIN_SUFFIX)
        if path.suffix == BIN_SUFFIX and is_slot_name(stem):
            old = read_json(path.with_suffix(MANIFEST_SUFFIX))
            if old is None and not restore_unverified:
                log.warning(
                    "%s has no slotkeeper manifest; left as it is (--restore-unverified takes it over)", path.name
                )
                continue
            taken += _take_over_one(path, old, root / ENTRIES_DIR, fingerprint, fsync)
        elif path.suffix != MANIFEST_SUFFIX and is_state_file(path):
            os.replace(path, root / SNAPSHOTS_DIR / path.name)
            log.info("moved %s (a client's own slot file) to %s/", path.name, SNAPSHOTS_DIR)
    return taken


def _take_over_one(
    bin_path: Path, old: dict[str, Any] | None, entries_dir: Path, fingerprint: dict[str, Any], fsync: bool
) -> bool:
    manifest_path = bin_path.with_suffix(MANIFEST_SUFFIX)
    try:
        header = read_header(bin_path)
    except (OSError, StateFileError) as exc:
        log.warning("%s is not a slot file slotkeeper can read (%s); left as it is", bin_path.name, exc)
        return False
    now = time.time()
    saved_at = float((old or {}).get("saved_at", bin_path.stat().st_mtime))
    entry = Entry(
        id=secrets.token_hex(8),
        n_tokens=header.n_tokens,
        nbytes=bin_path.stat().st_size,
        keys=block_keys(header.view),
        saved_at=saved_at,
        last_used=saved_at,
        fingerprint=(old or {}).get("fingerprint") or fingerprint,
        seq_version=header.version,
        layout=header.layout,
        server={},
        save_ms=(old or {}).get("save_ms"),
        exact=exact_key(header.view),
        images=header.image_positions,
    )
    os.replace(bin_path, entries_dir / f"{entry.id}{BIN_SUFFIX}")
    write_json_atomic(entries_dir / f"{entry.id}{MANIFEST_SUFFIX}", entry.manifest(), fsync)
    manifest_path.unlink(missing_ok=True)
    log.info(
        "slot file %s taken over as entry %s: %s tokens, %s (%.0f s old)",
        bin_path.name,
        entry.short,
        f"{entry.n_tokens:,}",
        fmt_bytes(entry.nbytes),
        now - saved_at,
    )
    return True


@dataclass
class Found:
    """The committed pairs `scan_entries` found, and what it counted on the way."""

    #: (entry id, its manifest or the Entry the manifest cache holds for it, its regular .bin's size or None)
    pairs: list[tuple[str, dict[str, Any] | Entry, int | None]] = field(default_factory=list)
    manifests_read: int = 0  # from their files, not from the manifest cache
    links: int = 0  # pairs with a link, or anything but a regular file: never followed
    unreadable: int = 0  # manifests another slotkeeper version wrote, or damaged

    def warn(self, entries_dir: Path) -> None:
        """One line each for the pairs left as they are."""
        if self.links:
            log.warning(
                "%d entr%s in %s %s a link or not a file: never followed, left as %s",
                self.links,
                "y" if self.links == 1 else "ies",
                entries_dir,
                "is" if self.links == 1 else "are",
                "it is" if self.links == 1 else "they are",
            )
        if self.unreadable:
            log.warning(
                "%d entr%s with a manifest this slotkeeper cannot read: kept, not used",
                self.unreadable,
                "y" if self.unreadable == 1 else "ies",
            )


def scan_entries(root: Path) -> Found:  # noqa: C901 - one pass over entries/, one branch per kind of file
    """List entries/ in one pass (the listing's file types, links never followed): remove partial files and the
    files of interrupted saves, and read each committed pair's manifest, from the manifest cache when it is
    current (one lstat per manifest; an entry's file is looked at only when its manifest was read).

    Only names and file types are kept from the listing (not its DirEntry objects: at 20,000 entries, megabytes
    freed among the entries that stay, which the process then never gives back)."""
    entries_dir = root / ENTRIES_DIR
    folder = str(entries_dir)
    bins: dict[str, bool] = {}  # entry id -> a regular file (else a link, or anything else)
    manifests: dict[str, bool] = {}
    with os.scandir(entries_dir) as listing:
        for item in listing:
            name = item.name
            if name.endswith(PARTIAL_SUFFIX):  # manifests, downloads
                if item.is_file(follow_symlinks=False):
                    discard(entries_dir / name)
            elif name.endswith(BIN_SUFFIX):
                bins[name[: -len(BIN_SUFFIX)]] = item.is_file(follow_symlinks=False)
            elif name.endswith(MANIFEST_SUFFIX):
                manifests[name[: -len(MANIFEST_SUFFIX)]] = item.is_file(follow_symlinks=False)
    found = Found()
    for entry_id, regular in bins.items():
        if not regular:
            found.links += 1
        elif entry_id not in manifests:  # saved, never committed: an interrupted save
            discard(entries_dir / f"{entry_id}{BIN_SUFFIX}")
            log.info("removed entry %s left by an interrupted save", entry_id[:4])

    stamps: dict[str, manifestcache.Stamp] = {}
    stamp_of, lstat = manifestcache.stamp_of, os.lstat
    directory = os.open(entries_dir, os.O_RDONLY | os.O_DIRECTORY)  # names looked up in it, not paths walked
    try:
        for entry_id, regular in manifests.items():
            if regular:
                try:
                    stamps[entry_id] = stamp_of(lstat(entry_id + MANIFEST_SUFFIX, dir_fd=directory))
                except OSError:  # gone since: read as such below
                    pass
    finally:
        os.close(directory)
    cached = manifestcache.read(root, stamps)  # what the manifests held when last seen: most need no reading
    for entry_id, regular in manifests.items():
        bin_regular = bins.get(entry_id)
        if not regular:
            found.links += bin_regular is None or bin_regular  # a link pair counts once
            continue
        if bin_regular is False:
            continue  # counted with the bins
        data: dict[str, Any] | Entry | None = cached.pop(entry_id, None)
        if data is None:
            data = read_manifest(f"{folder}/{entry_id}{MANIFEST_SUFFIX}")
            found.manifests_read += 1
        if data is None:
            found.unreadable += 1  # another slotkeeper version's, or damaged: kept as it is, not used
        elif bin_regular is None:
            found.pairs.append((entry_id, data, None))
        elif isinstance(data, Entry):  # its manifest is as cached, so its file as saved: its size is looked at
            found.pairs.append((entry_id, data, data.nbytes))  # before a restore (conversations.file_differs)
        else:
            found.pairs.append((entry_id, data, _size(f"{folder}/{entry_id}{BIN_SUFFIX}")))
    return found


def _size(path: str) -> int | None:
    """A listed regular file's size (None: gone since)."""
    try:
        return os.lstat(path).st_size
    except OSError:
        return None
