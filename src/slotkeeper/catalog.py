"""`slotkeeper ls` and `slotkeeper prune`: look at and clean up save directories without a running server.

A save directory (layout.py) holds the conversation store: `entries/<id>.bin` (llama-server's slot file) and
`entries/<id>.json` (its manifest, written last), `quarantine/` (entries llama-server refused, moved aside) and
`snapshots/` (llama-server's --slot-save-path: clients' own save names; counted here, never touched). A directory
of the slot-file layout (`<n>.bin` + `<n>.json` in the directory itself) is listed too: the next slotkeeper
start takes those files over as entries.

Nothing here talks to llama-server. An entry's status is what the next start would make of it
(ConversationStore.open), judged against the configuration of the directory's most recently used entry, i.e.
the last run's; with llama-server's arguments after `--`, a match column compares each entry with those
arguments (as far as they decide it offline).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import re
import sys
import tempfile
import textwrap
import time
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cmdline import ConfigError, parse_llama_args
from .fingerprint import KV_FLAGS, first_difference, kv_flags, model_identity, shareable
from .layout import ENTRIES_DIR, LOCK_NAME, QUARANTINE_DIR, SNAPSHOTS_DIR, StoreLockedError, lock_store
from .log import fmt_bytes
from .statefile import SEQ_MAGIC, StateFileError, read_header
from .store import (
    BIN_SUFFIX, MANIFEST_SUFFIX, MANIFEST_VERSION, PARTIAL_SUFFIX, TRANSIENT_NAME, Entry, compatible_format,
    read_json, remove_pair,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

MODEL_KEYS = ("model", "model_size", "model_sha256")
CTX_FLAGS = ("-c", "--ctx-size")
ENV_CTX_SIZE = "LLAMA_ARG_CTX_SIZE"
UNIFIED_FLAGS = {"-kvu": True, "--kv-unified": True, "-no-kvu": False, "--no-kv-unified": False}
CTX_PAD = 256  # llama.cpp rounds a slot's context up to a multiple of this
TABLE_WIDTH = 100  # the model column is shortened (not below MODEL_COLUMN_MIN) to keep lines within this
MODEL_COLUMN_MIN = 20
STATUS_COLUMN_BUDGET = 38  # longer texts in the last columns overflow instead of squeezing the model column
MATCH_COLUMN_BUDGET = 40
SHORT_ID_MIN = 4

# What a row is, and its status codes (--json); the table shows `Row.detail`.
KIND_ENTRY, KIND_QUARANTINED, KIND_SLOT_FILE = "entry", "quarantined", "slot_file"
USABLE = "usable"
OTHER_CONFIGURATION = "other_configuration"
OTHER_FORMAT = "other_format"
QUARANTINED = "quarantined"
INTERRUPTED_SAVE = "interrupted_save"  # entries/<id>.bin without a manifest
BAD_MANIFEST = "bad_manifest"
SIZE_MISMATCH = "size_mismatch"
NO_BIN = "no_bin"
SLOT_FILE = "slot_file"  # <n>.bin + <n>.json of the slot-file layout: taken over at the next start
SLOT_FILE_UNVERIFIED = "slot_file_unverified"  # <n>.bin without a manifest: taken over only with --restore-unverified
SLOT_FILE_UNREADABLE = "slot_file_unreadable"
SLOT_MANIFEST_ONLY = "slot_manifest_only"
SLOT_FILE_SUFFIXES = ("bin", "json", "bin.partial", "json.partial")
INTACT = (USABLE, OTHER_CONFIGURATION, OTHER_FORMAT)  # would be kept by the next start
COMPARABLE = (*INTACT, SLOT_FILE, "shared")  # has a fingerprint the next start (or a fetch) would use


class CatalogError(Exception):
    """Bad input: its text is the whole one-line message."""


# ---- small formats --------------------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|secs|m|min|mins|h|hr|hrs|d|day|days|w|wk|weeks?)\s*$", re.I)
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)b?|(b))?\s*$", re.I)
_SIZE_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def parse_duration(text: str) -> float:
    """Seconds from `90s`, `30m`/`30min`, `12h`, `7d`, `2w` (a unit is required)."""
    match = _DURATION.match(text)
    if not match:
        raise CatalogError(f"invalid duration {text!r}: use a number and a unit, e.g. 30min, 12h, 7d, 2w")
    unit = match.group(2).lower()
    unit = "m" if unit.startswith("m") else unit[0]
    return float(match.group(1)) * _DURATION_UNITS[unit]


def parse_size(text: str) -> int:
    """Bytes from `20GB`, `500MB`, `1.5G`, `20GiB`, `4096` (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise CatalogError(f"invalid size {text!r}: use e.g. 500MB, 20GB, 1.5TB, 8GiB or a byte count")
    number = float(match.group(1))
    if match.group(2):
        number *= (1024 if match.group(3) else 1000) ** _SIZE_POWERS[match.group(2).lower()]
    return int(number)


def format_age(seconds: float) -> str:
    """`12 s`, `3 min`, `2 h`, `5 d` (whole units, rounded down)."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min"
    if seconds < 86400:
        return f"{seconds // 3600} h"
    return f"{seconds // 86400} d"


def display_path(path: Path) -> str:
    """A path as people type it: the home directory as `~`."""
    text = str(path)
    home = str(Path.home())
    if home not in ("", "/") and (text == home or text.startswith(home + os.sep)):
        return "~" + text[len(home):]
    return text


def shorten(text: str, width: int) -> str:
    """Cut the middle out of a long name, keeping its end (the quantization and extension) readable."""
    if len(text) <= width:
        return text
    keep_end = (width - 1) // 2
    return text[: width - 1 - keep_end] + "…" + text[len(text) - keep_end :]


def column_widths(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[int]:
    return [max(len(cell) for cell in column) for column in zip(headers, *rows)]


def format_row(row: Sequence[str], widths: Sequence[int], right: Container[int], indent: str = "  ") -> str:
    """Cells padded to their column (numbers right-aligned), two spaces apart, no trailing blanks."""
    cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
    return (indent + "  ".join(cells)).rstrip()


def _count(n: int, word: str, plural: str | None = None) -> str:
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


# ---- reading a save directory ---------------------------------------------------------------------------------


@dataclass
class FileStat:
    path: Path
    size: int
    mtime: float
    identity: tuple[int, int, int]  # (inode, mtime_ns, size): to notice a file replaced since the scan

    @classmethod
    def of(cls, path: Path) -> FileStat:
        st = path.stat()
        return cls(path, st.st_size, st.st_mtime, (st.st_ino, st.st_mtime_ns, st.st_size))

    @classmethod
    def maybe(cls, path: Path) -> FileStat | None:
        try:
            return cls.of(path) if path.is_file() and not path.is_symlink() else None
        except OSError:
            return None  # removed while we looked


class EntryFields:
    """What a listed row reads from its entry's manifest (local and remote rows alike)."""

    entry: Entry | None

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.entry.fingerprint if self.entry else {}

    @property
    def model(self) -> str | None:
        value = self.fingerprint.get("model")
        return value if isinstance(value, str) and value else None


@dataclass
class Row(EntryFields):
    """One listed thing: an entry, a quarantined entry, or a slot file of the old layout; its two files are
    `<folder>/<name>.json` and `<folder>/<name>.bin`."""

    kind: str
    directory: Path  # the save directory
    folder: Path  # entries/, quarantine/, or the save directory itself (slot files)
    name: str  # the entry id, `<stamp>-<id>` in quarantine/, or the slot number
    bin: FileStat | None
    manifest_file: FileStat | None
    entry: Entry | None  # what the manifest says (for a slot file: what taking it over would record)
    status: str = ""
    reason: str = ""  # the status in words, in full
    note: str = ""  # the status column, when it says more than the status's usual text
    short: str = ""

    @property
    def id(self) -> str:
        return self.name.rsplit("-", 1)[-1] if self.kind == KIND_QUARANTINED else self.name

    @property
    def label_id(self) -> str:
        return f"{self.name}{BIN_SUFFIX}" if self.kind == KIND_SLOT_FILE else self.short

    @property
    def label(self) -> str:
        """How prune names it: `entry 1a2b in DIR`, `slot file DIR/0.bin`."""
        where = display_path(self.directory)
        if self.kind == KIND_SLOT_FILE:
            return f"slot file {where}/{self.name}{BIN_SUFFIX}"
        return f"{'quarantined entry' if self.kind == KIND_QUARANTINED else 'entry'} {self.short} in {where}"

    @property
    def sort_key(self) -> tuple[str, str]:
        return str(self.directory), self.name

    @property
    def size(self) -> int | None:
        """The size column: the .bin's (the state's) size."""
        return self.bin.size if self.bin else (self.entry.nbytes if self.entry else None)

    @property
    def files(self) -> list[FileStat]:
        return [f for f in (self.manifest_file, self.bin) if f is not None]

    @property
    def disk_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def tokens(self) -> int | None:
        return self.entry.tokens if self.entry else None

    @property
    def last_used(self) -> float:
        """The manifest's last use, else the newest file's mtime."""
        if self.entry and self.entry.last_used:
            return self.entry.last_used
        return max((f.mtime for f in self.files), default=0.0)

    @property
    def detail(self) -> str:
        """The status column."""
        return self.note or _STATUS_TEXT.get(self.status, self.status)


_STATUS_TEXT = {
    USABLE: "usable",
    QUARANTINED: "quarantined",
    INTERRUPTED_SAVE: "interrupted save (removed at start)",
    BAD_MANIFEST: "bad manifest (never used)",
    SIZE_MISMATCH: "size mismatch (quarantined at start)",
    NO_BIN: "no .bin (manifest dropped at start)",
    SLOT_FILE: "slot file (taken over at next start)",
    SLOT_FILE_UNVERIFIED: "no manifest (--restore-unverified)",
    SLOT_FILE_UNREADABLE: "unreadable slot file (left as it is)",
    SLOT_MANIFEST_ONLY: "manifest without its .bin",
}


@dataclass
class LockState:
    """Whether a slotkeeper holds the directory's .lock (an flock: the kernel drops it when its holder exits)."""

    exists: bool = False
    held: bool = False
    pid: int | None = None  # what the .lock says: the last process that took it

    def describe(self) -> str:
        if not self.held:
            return ""
        if self.pid is None:
            return "in use by another slotkeeper"
        if not _pid_alive(self.pid):
            return f"locked by pid {self.pid}, which is not running here (another container or host?)"
        return f"in use by slotkeeper pid {self.pid}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, not ours
    return True


def _lock_pid(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def lock_state(root: Path) -> LockState:
    """A non-blocking shared flock attempt on `.lock`, released at once (nothing is created or written)."""
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return LockState()
    try:
        pid = _lock_pid(os.pread(fd, 32, 0).decode(errors="replace"))
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return LockState(True, True, pid)
        except OSError:
            return LockState(True, False, pid)  # a file system without flock: cannot tell
        return LockState(True, False, pid)
    finally:
        os.close(fd)


@dataclass
class SaveDir:
    path: Path
    rows: list[Row] = field(default_factory=list)  # entries (most recently used first), quarantined, slot files
    partials: list[FileStat] = field(default_factory=list)  # interrupted manifest writes: finished at next start
    client_files: list[FileStat] = field(default_factory=list)  # clients' own slot files (snapshots/)
    clients_in_root: int = 0  # of those, still in the directory itself: moved to snapshots/ at the next start
    reference: Row | None = None  # the most recently used entry: the last run's configuration
    lock: LockState = field(default_factory=LockState)

    def of_kind(self, kind: str) -> list[Row]:
        return [r for r in self.rows if r.kind == kind]

    @property
    def entries(self) -> list[Row]:
        return self.of_kind(KIND_ENTRY)

    @property
    def entry_bytes(self) -> int:
        return sum(r.disk_bytes for r in self.entries)


def is_slot_name(stem: str) -> bool:
    """The slot-file layout's names, as ConversationStore takes them over: `<digits>.bin` / `<digits>.json`."""
    return stem.isascii() and stem.isdigit()


def _has_state_magic(path: Path) -> bool:
    """What the store's take-over moves to snapshots/ as a client's own slot file: llama.cpp's magic."""
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return int.from_bytes(f.read(4), "little") == SEQ_MAGIC
    return False


def _list(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CatalogError(f"cannot read {path}: {exc.strerror or exc}") from None


def _pairs(folder: Path, names: Iterable[str]) -> dict[str, tuple[FileStat | None, FileStat | None]]:
    """`<stem>.bin` / `<stem>.json` files of a folder, by stem: (bin, manifest)."""
    found: dict[str, list[FileStat | None]] = {}
    for name in names:
        for slot, suffix in ((0, BIN_SUFFIX), (1, MANIFEST_SUFFIX)):
            if name.endswith(suffix) and len(name) > len(suffix):
                stat = FileStat.maybe(folder / name)
                if stat is not None:
                    found.setdefault(name.removesuffix(suffix), [None, None])[slot] = stat
    return {stem: (pair[0], pair[1]) for stem, pair in found.items()}


def _entry_from(manifest: FileStat | None) -> Entry | None:
    data = read_json(manifest.path) if manifest else None
    if data is None or data.get("version") != MANIFEST_VERSION:
        return None
    try:
        return Entry.from_manifest(data)
    except (KeyError, TypeError, ValueError):
        return None


def _scan_entries(save_dir: SaveDir) -> None:
    """entries/: judged as ConversationStore.open and _admit would."""
    folder = save_dir.path / ENTRIES_DIR
    names = _list(folder)
    save_dir.partials += [s for n in names if n.endswith(PARTIAL_SUFFIX) and (s := FileStat.maybe(folder / n))]
    for stem, (bin_stat, manifest_stat) in _pairs(folder, names).items():
        row = Row(KIND_ENTRY, save_dir.path, folder, stem, bin_stat, manifest_stat, _entry_from(manifest_stat))
        if manifest_stat is None:
            row.status, row.reason = INTERRUPTED_SAVE, "a file without a manifest: an interrupted save, removed at the next start"
        elif row.entry is None:
            row.status, row.reason = BAD_MANIFEST, "a manifest slotkeeper cannot read: its entry is never used"
        elif bin_stat is None:
            row.status, row.reason = NO_BIN, "a manifest without its file: dropped at the next start"
        elif bin_stat.size != row.entry.nbytes:
            row.status = SIZE_MISMATCH
            row.reason = f"size {bin_stat.size} differs from its manifest's {row.entry.nbytes}: quarantined at the next start"
        else:
            row.status = USABLE
        save_dir.rows.append(row)


def _judge_against_reference(save_dir: SaveDir) -> None:
    """The most recently used intact entry stands for the last run's configuration and state format."""
    intact = [r for r in save_dir.entries if r.status == USABLE and r.entry]
    if not intact:
        return
    ref = max(intact, key=lambda r: (r.entry.last_used, r.entry.saved_at))  # type: ignore[union-attr]
    save_dir.reference = ref
    assert ref.entry is not None
    for row in intact:
        assert row.entry is not None
        difference = first_difference(shareable(row.entry.fingerprint), shareable(ref.entry.fingerprint))
        if difference:
            row.status, row.reason = OTHER_CONFIGURATION, f"saved for another configuration: {difference}"
            row.note = f"other configuration ({difference.split(':', 1)[0]})"
        elif not compatible_format(row.entry, (ref.entry.seq_version, ref.entry.layout)):
            row.status, row.note = OTHER_FORMAT, f"other state format (v{row.entry.seq_version})"
            row.reason = (f"state format v{row.entry.seq_version} ({row.entry.layout}); the last run's is "
                          f"v{ref.entry.seq_version} ({ref.entry.layout})")


def _scan_quarantine(save_dir: SaveDir) -> None:
    folder = save_dir.path / QUARANTINE_DIR
    if not folder.is_dir() or folder.is_symlink():
        return
    quarantined = []
    for stem, (bin_stat, manifest_stat) in _pairs(folder, _list(folder)).items():
        row = Row(KIND_QUARANTINED, save_dir.path, folder, stem, bin_stat, manifest_stat, _entry_from(manifest_stat))
        row.status, row.reason = QUARANTINED, "moved aside: llama-server refused it or its size was wrong"
        quarantined.append(row)
    save_dir.rows += sorted(quarantined, key=lambda r: r.name, reverse=True)  # newest first (by its stamp)


def _scan_slot_files(save_dir: SaveDir, names: list[str]) -> None:
    """The slot-file layout in the directory itself, judged as ConversationStore._take_over_slot_files would."""
    root = save_dir.path
    save_dir.partials += [s for n in names if n.endswith(PARTIAL_SUFFIX) and is_slot_name(n.split(".", 1)[0])
                          and (s := FileStat.maybe(root / n))]
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
                id=stem, tokens=header.n_tokens, nbytes=bin_stat.size, keys=[], saved_at=saved_at,
                last_used=saved_at, fingerprint=fingerprint if isinstance(fingerprint, dict) else {},
                seq_version=header.version, layout=header.layout, save_ms=(old or {}).get("save_ms"),
            )
        row = Row(KIND_SLOT_FILE, root, root, stem, bin_stat, manifest_stat, entry)
        if bin_stat is None:
            row.status, row.reason = SLOT_MANIFEST_ONLY, "a slot-file manifest without its .bin: left as it is"
        elif old is None:
            if header is None:
                continue  # a file with a slot's name that is neither a slot file nor described: not ours
            row.status = SLOT_FILE_UNVERIFIED
            row.reason = "a slot file without a manifest: taken over only with --restore-unverified"
        elif header is None:
            row.status, row.reason = SLOT_FILE_UNREADABLE, "not a slot file slotkeeper can read: left as it is"
        else:
            row.status, row.reason = SLOT_FILE, "a slot file of the slot-file layout: taken over at the next start"
        save_dir.rows.append(row)
    for name in names:  # clients' own slot files, moved to snapshots/ at the next start
        path = root / name
        stem = name.removesuffix(BIN_SUFFIX)
        if name == LOCK_NAME or name.endswith(MANIFEST_SUFFIX) or (name.endswith(BIN_SUFFIX) and is_slot_name(stem)):
            continue
        stat = FileStat.maybe(path)
        if stat is not None and _has_state_magic(path):
            save_dir.client_files.append(stat)
            save_dir.clients_in_root += 1


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _short_ids(rows: Sequence[Row | RemoteRow]) -> None:
    """The shortest prefix of at least 4 hex digits (as the daemon's log lines name entries) that tells the
    directory's entries apart; 8 suffice in practice."""
    ids = [r.id for r in rows if r.kind != KIND_SLOT_FILE]
    for row in rows:
        if row.kind == KIND_SLOT_FILE:
            row.short = row.name
            continue
        n = SHORT_ID_MIN
        while n < len(row.id) and sum(i.startswith(row.id[:n]) for i in ids if i != row.id) > 0:
            n += 1  # beyond 8 digits only for a one-in-4-billion collision
        row.short = row.id[:n]


def scan_dir(path: Path) -> SaveDir:
    """Everything slotkeeper owns in one save directory (nothing is changed, nothing else is looked at)."""
    result = SaveDir(path)
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise CatalogError(f"cannot read {path}: {exc.strerror or exc}") from None
    _scan_entries(result)
    _judge_against_reference(result)
    result.rows.sort(key=lambda r: (-r.last_used, r.name))
    _scan_quarantine(result)
    _scan_slot_files(result, names)
    snapshots = path / SNAPSHOTS_DIR
    if snapshots.is_dir() and not snapshots.is_symlink():
        for name in _list(snapshots):
            if not TRANSIENT_NAME.fullmatch(name) and (stat := FileStat.maybe(snapshots / name)):
                result.client_files.append(stat)
    _short_ids(result.rows)
    result.lock = lock_state(path)
    return result


def holds_caches(path: Path) -> bool:
    """Whether a directory is a save directory: the store's layout or lock, slot files, or quarantined files."""
    if (path / ENTRIES_DIR).is_dir() or (path / LOCK_NAME).is_file():
        return True
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if any(is_slot_name(n.split(".", 1)[0]) and n.split(".", 1)[-1] in SLOT_FILE_SUFFIXES for n in names):
        return True
    qdir = path / QUARANTINE_DIR
    return qdir.is_dir() and any((qdir / n).is_file() for n in os.listdir(qdir))


def cache_root(env: Mapping[str, str]) -> Path:
    """Where the per-model default directories live (cmdline.default_save_dir)."""
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotkeeper"


def save_dirs_under(root: Path) -> list[Path]:
    """The directories just below `root` that are save directories (`demo`/`bench` holding only a model: skipped)."""
    try:
        children = sorted(root.iterdir())
    except OSError:
        return []
    return [p for p in children if p.is_dir() and not p.is_symlink() and holds_caches(p)]


def find_save_dirs(env: Mapping[str, str]) -> list[Path]:
    """Every default (per-model) save directory under $XDG_CACHE_HOME/slotkeeper or ~/.cache/slotkeeper."""
    return save_dirs_under(cache_root(env))


def resolve_dirs(given: Sequence[str], env: Mapping[str, str]) -> list[Path]:
    """The directories named on the command line (each must exist), or every default one.

    A named directory that is no save directory itself but has save directories below it (the cache root,
    typically) stands for those.
    """
    if not given:
        return find_save_dirs(env)
    dirs: list[Path] = []
    seen: set[Path] = set()
    for text in given:
        path = Path(text).expanduser().absolute()
        if not path.exists():
            raise CatalogError(f"no such directory: {text}")
        if not path.is_dir():
            raise CatalogError(f"not a directory: {text}")
        for found in ([path] if holds_caches(path) else save_dirs_under(path) or [path]):
            if found.resolve() not in seen:
                seen.add(found.resolve())
                dirs.append(found)
    return dirs


# ---- matching against llama-server arguments (what can be known without starting it) -------------------------


@dataclass
class Expectation:
    """The fingerprint fields that llama-server's arguments decide offline, and how to compare them."""

    fields: dict[str, Any]  # model identity (when -m is given) and the KV flags, as build_fingerprint has them
    model_given: bool
    total_slots: int | None  # from an explicit -np N (N >= 1)
    ctx_size: int | None  # from an explicit -c N (N >= 1)
    unified: bool

    @property
    def ctx_range(self) -> tuple[int, int] | None:
        """The per-slot context llama-server derives from -c: -c itself with a unified KV cache, else -c / -np,
        rounded up to a multiple of 256 by recent llama.cpp (older builds do not round)."""
        if self.ctx_size is None or not (self.unified or self.total_slots):
            return None  # split over an unknown number of slots: cannot tell
        per_slot = self.ctx_size if self.unified else self.ctx_size // (self.total_slots or 1)
        return per_slot, -(-per_slot // CTX_PAD) * CTX_PAD

    def checked(self) -> str:
        """What the match column compares, for the line above the tables."""
        parts = [f"model {Path(self.fields['model']).name}" if self.model_given else "model not checked (no -m)"]
        parts.append("KV flags (" + (", ".join(f"{k}={v}" for k, v in sorted(self.kv_fields().items())) or "defaults") + ")")
        parts.append(f"total_slots (-np {self.total_slots})" if self.total_slots else "total_slots not checked (no -np)")
        if self.ctx_range:
            parts.append(f"n_ctx_slot (-c {self.ctx_size})")
        else:
            parts.append("n_ctx_slot not checked (" + ("no -c" if not self.ctx_size else "-np unknown") + ")")
        return "; ".join(parts)

    def kv_fields(self) -> dict[str, Any]:
        return {k: v for k, v in self.fields.items() if k not in MODEL_KEYS}

    def differences(self, saved: Mapping[str, Any]) -> list[str]:
        """Every offline-knowable field that differs, most important first; empty when they match."""
        found: list[str] = []
        if self.model_given:
            model_diff = _model_difference(saved, self.fields)
            if model_diff:
                found.append(model_diff)
        for key in sorted(KV_FLAGS):
            if saved.get(key) != self.fields.get(key):
                found.append(f"{key} {_flag_value(saved.get(key))} -> {_flag_value(self.fields.get(key))}")
        if self.total_slots is not None and saved.get("total_slots") != self.total_slots:
            found.append(f"total_slots {saved.get('total_slots')} -> {self.total_slots} (-np)")
        ctx_range = self.ctx_range
        n_ctx = saved.get("n_ctx_slot")
        if ctx_range and isinstance(n_ctx, int) and not ctx_range[0] <= n_ctx <= ctx_range[1]:
            low, high = ctx_range
            expected = f"{low:,}" if low == high else f"{low:,}..{high:,}"
            found.append(f"n_ctx_slot {n_ctx:,} -> {expected} (-c)")
        return found


def _flag_value(value: Any) -> str:
    return "default" if value is None else str(value)


def _model_difference(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """As the store compares models (shareable: by content when its hash is known, so a moved or copied model
    file is the same model). Short on purpose: the model column names the saved model, the `match:` line the
    one in the arguments."""
    saved_model, current_model = shareable(dict(saved)), shareable(dict(current))
    if all(saved_model.get(k) == current_model.get(k) for k in MODEL_KEYS):
        return None
    if saved.get("model") == current.get("model"):
        return "model file changed"  # same path, other size or content
    return "model differs"


def _int_arg(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise CatalogError(f"llama-server argument {name} needs an integer (got {value!r})") from None


def expectation_from_args(argv: Sequence[str], env: Mapping[str, str]) -> Expectation:
    """Read llama-server's argv the way slotkeeper does (cmdline.parse_llama_args) and hash the model file."""
    try:
        llama = parse_llama_args(list(argv), env)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise CatalogError(str(exc)) from None
    fields: dict[str, Any] = {}
    if llama.model:
        if not os.path.isfile(llama.model):
            raise CatalogError(f"model file not found: {llama.model}")
        fields.update(model_identity(llama.model))
    fields.update(kv_flags(llama.passthrough))

    parallel = _int_arg("-np", llama.parallel) if llama.parallel is not None else None
    ctx_text = env.get(ENV_CTX_SIZE) or None
    unified: bool | None = None
    tokens = llama.passthrough
    for i, token in enumerate(tokens):
        name, has_inline, inline = token.partition("=")
        if name in CTX_FLAGS:
            if has_inline:
                ctx_text = inline
            elif i + 1 < len(tokens):
                ctx_text = tokens[i + 1]
            else:
                raise CatalogError(f"llama-server argument {name} needs a value")
        elif token in UNIFIED_FLAGS:
            unified = UNIFIED_FLAGS[token]
    ctx = _int_arg("-c", ctx_text) if ctx_text is not None else None
    explicit_slots = parallel if parallel is not None and parallel >= 1 else None
    if unified is None:
        unified = explicit_slots is None  # llama-server: -np auto means 4 slots sharing one unified KV cache
    return Expectation(
        fields=fields,
        model_given=bool(llama.model),
        total_slots=explicit_slots,
        ctx_size=ctx if ctx is not None and ctx >= 1 else None,  # -c 0: the model's training context
        unified=unified,
    )


def match_differences(row: Row | RemoteRow, expectation: Expectation) -> list[str]:
    """Why `row` would not be used under those arguments; empty when it would (or, for a slot file, would be
    after the next start takes it over)."""
    if row.status not in COMPARABLE:
        return [row.detail]
    return expectation.differences(row.fingerprint)


# ---- ls -------------------------------------------------------------------------------------------------------


def row_record(row: Row, now: float, expectation: Expectation | None) -> dict[str, Any]:
    """Everything known about one row, for --json."""
    entry = row.entry
    record: dict[str, Any] = {
        "kind": row.kind,
        "dir": str(row.directory),
        "id": row.id,
        "short": row.short,
        "status": row.status,
        "detail": row.detail,
        "reason": row.reason or row.detail,
        "tokens": row.tokens,
        "bytes": entry.nbytes if entry else None,
        "bin_size": row.bin.size if row.bin else None,
        "disk_bytes": row.disk_bytes,
        "saved_at": entry.saved_at if entry else None,
        "last_used": row.last_used,
        "age_s": round(max(0.0, now - row.last_used), 1),
        "save_ms": entry.save_ms if entry else None,
        "boundary": entry.boundary if entry else None,  # saved at a turn boundary (hybrid, sliding-window)
        "model": row.model,
        "model_name": Path(row.model).name if row.model else None,
        "fingerprint": (entry.fingerprint or None) if entry else None,
        "format": {"seq_version": entry.seq_version, "layout": entry.layout} if entry else None,
        "llama_server": (entry.server or None) if entry else None,
        "bin": str(row.bin.path) if row.bin else None,
        "manifest": str(row.manifest_file.path) if row.manifest_file else None,
    }
    if expectation is not None:
        differences = match_differences(row, expectation)
        record["match"] = not differences
        record["differences"] = differences
    return record


def dir_record(save_dir: SaveDir) -> dict[str, Any]:
    quarantined, slot_files = save_dir.of_kind(KIND_QUARANTINED), save_dir.of_kind(KIND_SLOT_FILE)
    return {
        "kind": "directory", "dir": str(save_dir.path),
        "entries": len(save_dir.entries), "bytes": save_dir.entry_bytes,
        "usable": sum(r.status == USABLE for r in save_dir.entries),
        "reference": save_dir.reference.id if save_dir.reference else None,
        "slot_files": len(slot_files), "slot_file_bytes": sum(r.disk_bytes for r in slot_files),
        "quarantined": len(quarantined), "quarantine_bytes": sum(r.disk_bytes for r in quarantined),
        "client_files": len(save_dir.client_files), "client_bytes": sum(f.size for f in save_dir.client_files),
        "partials": len(save_dir.partials),
        "in_use": save_dir.lock.held, "lock_pid": save_dir.lock.pid,
    }


def json_records(dirs: Sequence[SaveDir], now: float, expectation: Expectation | None) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for save_dir in dirs:
        records.append(dir_record(save_dir))
        records += [row_record(r, now, expectation) for r in save_dir.rows]
    return records


HEADERS = ("entry", "tokens", "size", "last used", "model", "status", "match")
RIGHT_ALIGNED = (1, 2, 3)
MODEL_COLUMN = 4
BUDGETS = {"status": STATUS_COLUMN_BUDGET, "match": MATCH_COLUMN_BUDGET}


def table_row(row: Row | RemoteRow, now: float, expectation: Expectation | None) -> list[str]:
    tokens = row.tokens
    size = row.size
    cells = [
        row.label_id,
        f"{tokens:,}" if tokens is not None else "-",
        fmt_bytes(size) if size is not None else "-",
        format_age(now - row.last_used) + " ago",
        Path(row.model).name if row.model else "-",
        row.detail,
    ]
    if expectation:
        if row.status not in COMPARABLE:
            cells.append("-")  # the status column says why it is never used
        else:
            differences = expectation.differences(row.fingerprint)
            cells.append("no: " + differences[0] if differences else "yes")
    return cells


def dir_summary(save_dir: SaveDir) -> str:
    def counted(rows: list[Row], word: str, plural: str) -> str:
        return _count(len(rows), word, plural) + (f", {fmt_bytes(sum(r.disk_bytes for r in rows))}" if rows else "")

    entries = save_dir.entries
    usable = sum(r.status == USABLE for r in entries)
    parts = [f"{_count(len(entries), 'entry', 'entries')}, {fmt_bytes(save_dir.entry_bytes)}"
             + (f" ({usable:,} usable)" if usable != len(entries) else "")]
    slot_files = save_dir.of_kind(KIND_SLOT_FILE)
    if slot_files:
        parts.append(_count(len(slot_files), "slot file") + f" to take over, {fmt_bytes(sum(r.disk_bytes for r in slot_files))}")
    parts.append("quarantine: " + counted(save_dir.of_kind(KIND_QUARANTINED), "entry", "entries"))
    clients = save_dir.client_files
    text = f"{SNAPSHOTS_DIR}/: {_count(len(clients), 'client file')}"
    if clients:
        text += f", {fmt_bytes(sum(f.size for f in clients))}"
        if save_dir.clients_in_root:
            text += f" ({save_dir.clients_in_root:,} still in the directory itself)"
    parts.append(text)
    if save_dir.partials:
        parts.append(_count(len(save_dir.partials), "partial") + " (finished or removed at next start)")
    if save_dir.lock.held:
        parts.append(save_dir.lock.describe())
    return "; ".join(parts)


def render_listing(dirs: Sequence[SaveDir], now: float, expectation: Expectation | None) -> str:
    """One table per directory, all with the same columns, so the directories read as one listing."""
    sections = [(display_path(d.path), d.rows, dir_summary(d)) for d in dirs]
    total = None
    if len(dirs) > 1:
        total = (f"total: {_count(sum(len(d.entries) for d in dirs), 'entry', 'entries')}, "
                 f"{fmt_bytes(sum(d.entry_bytes for d in dirs))} in {_count(len(dirs), 'directory', 'directories')}")
    return render_sections(sections, total, now, expectation)


def render_sections(sections: Sequence[tuple[str, Sequence[Row | RemoteRow], str]], total: str | None, now: float,
                    expectation: Expectation | None) -> str:
    """Tables (title, rows, summary line) sharing their columns, then the total line."""
    headers = list(HEADERS if expectation else HEADERS[:-1])
    tables = [[table_row(r, now, expectation) for r in rows] for _, rows, _ in sections]
    rows_all = [row for rows in tables for row in rows]
    widths = column_widths(headers, rows_all)

    # Keep lines within TABLE_WIDTH by shortening model names: first without `.gguf`, then from the middle. A
    # long status or match text may still overflow (they are the last columns) but does not squeeze the model
    # column further.
    def overflow() -> int:
        budget = [min(w, BUDGETS[h]) if h in BUDGETS else w for h, w in zip(headers, widths)]
        return 2 + sum(budget) + 2 * (len(budget) - 1) - TABLE_WIDTH

    if overflow() > 0:
        for row in rows_all:
            row[MODEL_COLUMN] = row[MODEL_COLUMN].removesuffix(".gguf")
        widths = column_widths(headers, rows_all)
    if overflow() > 0 and widths[MODEL_COLUMN] > MODEL_COLUMN_MIN:
        widths[MODEL_COLUMN] = max(MODEL_COLUMN_MIN, widths[MODEL_COLUMN] - overflow())
        for row in rows_all:
            row[MODEL_COLUMN] = shorten(row[MODEL_COLUMN], widths[MODEL_COLUMN])
    lines: list[str] = []
    if expectation:
        lines += textwrap.wrap(f"match: {expectation.checked()}", TABLE_WIDTH, subsequent_indent="       ",
                               break_long_words=False, break_on_hyphens=False) + [""]
    for i, ((title, _, summary), rows) in enumerate(zip(sections, tables)):
        if i:
            lines.append("")
        lines.append(title)
        if rows:
            lines += [format_row(row, widths, RIGHT_ALIGNED) for row in [headers, *rows]]
        else:
            lines.append("  (no entries)")
        lines += textwrap.wrap(summary, TABLE_WIDTH, initial_indent="  ", subsequent_indent="    ",
                               break_long_words=False, break_on_hyphens=False)
    if total:
        lines += ["", total]
    return "\n".join(lines)


# ---- the shared tier (--remote) ----------------------------------------------------------------------------------

ENV_REMOTE_STORE = "SLOTKEEPER_REMOTE_STORE"
KIND_REMOTE = "remote"
SHARED = "shared"  # a valid remote entry, in the namespace its fingerprint names
REMOTE_BAD_MANIFEST = "remote_bad_manifest"
OTHER_NAMESPACE = "other_namespace"  # its fingerprint names another namespace: a daemon never uses it
CLI_NAMESPACE = "slotkeeper-cli"  # the tier object's own namespace; listing and deleting name theirs
_REMOTE_TEXT = {SHARED: "shared", REMOTE_BAD_MANIFEST: "bad manifest (never used)",
                OTHER_NAMESPACE: "other namespace (never used)"}


@dataclass
class RemoteRow(EntryFields):
    """One entry of the shared tier: `<prefix>/<namespace>/<id>.json` (and its .bin)."""

    url: str
    namespace: str
    id: str
    manifest: dict[str, Any]
    entry: Entry | None
    status: str = SHARED
    reason: str = ""
    short: str = ""
    kind: str = KIND_REMOTE

    @classmethod
    def of(cls, url: str, namespace: str, manifest: dict[str, Any]) -> RemoteRow:
        from .fingerprint import namespace_key

        entry_id = str(manifest.get("entry_id", ""))
        try:
            entry: Entry | None = Entry.from_manifest(manifest)
        except (KeyError, TypeError, ValueError):
            entry = None
        row = cls(url, namespace, entry_id, manifest, entry)
        if entry is None:
            row.status, row.reason = REMOTE_BAD_MANIFEST, "a manifest slotkeeper cannot read: never fetched"
        elif namespace_key(entry.fingerprint) != namespace:
            row.status = OTHER_NAMESPACE
            row.reason = "its fingerprint belongs to another namespace: a fetch rejects it"
        return row

    @property
    def label_id(self) -> str:
        return self.short

    @property
    def label(self) -> str:
        return f"remote entry {self.short} in {self.url}/{self.namespace}"

    @property
    def sort_key(self) -> tuple[str, str]:
        return self.namespace, self.id

    @property
    def tokens(self) -> int | None:
        return self.entry.tokens if self.entry else None

    @property
    def size(self) -> int | None:
        value = self.manifest.get("bytes")
        return value if isinstance(value, int) else None

    @property
    def disk_bytes(self) -> int:
        return self.size or 0

    @property
    def last_used(self) -> float:
        """As recorded in the uploaded manifest (the uploading host's last use; fetches do not update it)."""
        return self.entry.last_used if self.entry else 0.0

    @property
    def detail(self) -> str:
        return _REMOTE_TEXT.get(self.status, self.status)


def remote_url(given: str | None, env: Mapping[str, str]) -> str:
    url = given or env.get(ENV_REMOTE_STORE)
    if not url:
        raise CatalogError(f"--remote needs --remote-store s3://bucket/prefix or {ENV_REMOTE_STORE}")
    return url


def remote_config(url: str, env: Mapping[str, str]) -> Any:
    """RemoteConfig.from_url, its complaints as one line (imported here: obstore is needed only for --remote)."""
    from .remote import RemoteConfig

    try:
        return RemoteConfig.from_url(url, env)
    except ValueError as exc:
        raise CatalogError(str(exc)) from None


class RemoteSession:
    """A RemoteTier for the command's lifetime, with a throwaway upload journal (the CLI uploads nothing)."""

    def __init__(self, config: Any) -> None:
        self.config = config

    async def __aenter__(self) -> Any:
        from .remote import RemoteError, RemoteTier

        self._journal = tempfile.TemporaryDirectory(prefix="slotkeeper-cli-")
        try:
            self.tier = RemoteTier(self.config, CLI_NAMESPACE, Path(self._journal.name))
        except Exception as exc:  # noqa: BLE001 - the client refused its configuration: one line
            self._journal.cleanup()
            raise RemoteError(f"remote store {self.config.url}: {exc}") from None
        return self.tier

    async def __aexit__(self, *exc: object) -> None:
        await self.tier.close(time.monotonic())
        self._journal.cleanup()


def remote_rows(url: str, listing: Mapping[str, list[dict[str, Any]]]) -> dict[str, list[RemoteRow]]:
    """namespace -> its rows, most recently used first, with short ids told apart within the namespace."""
    out: dict[str, list[RemoteRow]] = {}
    for namespace, manifests in sorted(listing.items()):
        rows = sorted((RemoteRow.of(url, namespace, m) for m in manifests), key=lambda r: (-r.last_used, r.id))
        _short_ids(rows)
        out[namespace] = rows
    return out


def remote_record(row: RemoteRow, now: float, expectation: Expectation | None) -> dict[str, Any]:
    entry = row.entry
    record: dict[str, Any] = {
        "kind": KIND_REMOTE, "url": row.url, "namespace": row.namespace, "id": row.id, "short": row.short,
        "status": row.status, "detail": row.detail, "reason": row.reason or row.detail, "tokens": row.tokens,
        "bytes": row.size, "sha256": row.manifest.get("sha256"),
        "saved_at": entry.saved_at if entry else None, "last_used": row.last_used,
        "age_s": round(max(0.0, now - row.last_used), 1), "model": row.model,
        "model_name": Path(row.model).name if row.model else None,
        "fingerprint": (entry.fingerprint or None) if entry else None,
        "format": {"seq_version": entry.seq_version, "layout": entry.layout} if entry else None,
    }
    if expectation is not None:
        differences = match_differences(row, expectation)
        record["match"] = not differences
        record["differences"] = differences
    return record


def remote_json(url: str, by_namespace: Mapping[str, list[RemoteRow]], now: float,
                expectation: Expectation | None) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for namespace, rows in by_namespace.items():
        records.append({"kind": "remote_namespace", "url": url, "namespace": namespace, "entries": len(rows),
                        "bytes": sum(r.disk_bytes for r in rows)})
        records += [remote_record(r, now, expectation) for r in rows]
    return records


def render_remote(url: str, by_namespace: Mapping[str, list[RemoteRow]], now: float,
                  expectation: Expectation | None) -> str:
    if not by_namespace:
        return f"no entries in {url}"
    sections = []
    for namespace, rows in by_namespace.items():
        unusable = sum(r.status != SHARED for r in rows)
        summary = (f"{_count(len(rows), 'entry', 'entries')}, {fmt_bytes(sum(r.disk_bytes for r in rows))}"
                   + (f" ({unusable:,} never used)" if unusable else ""))
        sections.append((f"{url}/{namespace}", rows, summary))
    total = None
    if len(by_namespace) > 1:
        rows_all = [r for rows in by_namespace.values() for r in rows]
        total = (f"total: {_count(len(rows_all), 'entry', 'entries')}, {fmt_bytes(sum(r.disk_bytes for r in rows_all))} "
                 f"in {_count(len(by_namespace), 'namespace')}")
    return render_sections(sections, total, now, expectation)


# ---- prune ----------------------------------------------------------------------------------------------------


@dataclass
class Removal:
    """One pair prune deletes (manifest first, then the .bin: store.remove_pair)."""

    row: Row | RemoteRow
    reason: str
    age: float

    @property
    def nbytes(self) -> int:
        return self.row.disk_bytes

    @property
    def label(self) -> str:
        return self.row.label


def model_missing(row: Row | RemoteRow) -> bool:
    """The manifest names a model file that existed when the entry was saved and is gone now."""
    fp = row.fingerprint
    model = row.model
    return bool(model and os.path.isabs(model) and "model_sha256" in fp and not os.path.exists(model))


def plan_prune(
    dirs: Sequence[SaveDir], now: float, *, older_than: float | None = None, max_total: int | None = None,
    quarantine: bool = False, missing_models: bool = False, other_configs: bool = False,
    expectation: Expectation | None = None,
) -> list[Removal]:
    """What prune removes, in order. --max-total counts the entries (and slot files) of all `dirs` together and
    removes the least recently used first."""
    rows = [row for save_dir in dirs for row in save_dir.rows if row.kind != KIND_QUARANTINED]
    removals = plan_rows(rows, now, older_than=older_than, max_total=max_total, missing_models=missing_models,
                         other_configs=other_configs, expectation=expectation)
    if quarantine:
        for save_dir in dirs:
            for row in save_dir.of_kind(KIND_QUARANTINED):
                removals.append(Removal(row, "quarantined", now - row.last_used))
    return removals


def plan_rows(
    rows: Iterable[Row | RemoteRow], now: float, *, older_than: float | None = None, max_total: int | None = None,
    missing_models: bool = False, other_configs: bool = False, expectation: Expectation | None = None,
) -> list[Removal]:
    """The criteria, over local rows or the shared tier's."""
    removals: list[Removal] = []
    kept: list[Row | RemoteRow] = []
    for row in rows:
        age = now - row.last_used
        reason = None
        if missing_models and model_missing(row):
            reason = f"model gone: {row.model}"
        elif other_configs and expectation is not None and row.status in COMPARABLE and (
                differences := expectation.differences(row.fingerprint)):
            reason = f"not for these llama-server arguments: {differences[0]}"
        elif other_configs and expectation is None and row.status == OTHER_CONFIGURATION:
            reason = row.reason
        elif older_than is not None and age > older_than:
            reason = f"unused for over {format_age(older_than)}"
        if reason:
            removals.append(Removal(row, reason, age))
        else:
            kept.append(row)
    if max_total is not None:
        total = sum(r.disk_bytes for r in kept)
        for row in sorted(kept, key=lambda r: (r.last_used, r.sort_key)):
            if total <= max_total:
                break
            total -= row.disk_bytes
            removals.append(Removal(row, f"over --max-total {fmt_bytes(max_total)} (least recently used)",
                                    now - row.last_used))
    return removals


def remove_files(removal: Removal) -> str | None:
    """Delete a pair (store.remove_pair: the manifest first); None when done, else why it stopped.

    A pair that changed since the scan (a running slotkeeper used it, under --force) is kept. Stopping after
    the manifest went leaves a .bin that the next start removes (or, for a slot file, never takes over
    without --restore-unverified).
    """
    row = removal.row
    assert isinstance(row, Row)
    for scanned, suffix in ((row.manifest_file, MANIFEST_SUFFIX), (row.bin, BIN_SUFFIX)):
        path = row.folder / f"{row.name}{suffix}"
        try:
            current: FileStat | None = FileStat.of(path)
        except FileNotFoundError:
            current = None
        except OSError as exc:
            return f"{path.name}: {exc.strerror or exc}"
        if current is not None and (scanned is None or current.identity != scanned.identity):
            return f"{path.name} changed since it was listed (a running slotkeeper used it?); kept"
    try:
        remove_pair(row.folder, row.name)
    except OSError as exc:
        name = Path(exc.filename).name if exc.filename else row.name
        return f"{name}: {exc.strerror or exc}"
    return None


def describe_removal(removal: Removal) -> str:
    tokens = removal.row.tokens
    details = [f"{tokens:,} tokens"] if tokens is not None else []
    details += [fmt_bytes(removal.nbytes), f"last used {format_age(removal.age)} ago"]
    return f"{removal.label} ({', '.join(details)}): {removal.reason}"


# ---- command lines --------------------------------------------------------------------------------------------


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input as one line (the caller prints it) instead of usage plus exit."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise _UsageError(message)


def say(text: str) -> None:
    """print() that survives a closed pipe (`slotkeeper ls | head`): the rest of the output is dropped."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python's recipe: point stdout at devnull so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _split_dashdash(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    if "--" in argv:
        cut = list(argv).index("--")
        return list(argv[:cut]), list(argv[cut + 1 :])
    return list(argv), None


def _parse(parser: _Parser, argv: list[str]) -> argparse.Namespace | int:
    try:
        return parser.parse_args(argv)
    except _UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return int(exc.code or 0)


def add_dirs_argument(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    parser.add_argument("dirs", nargs="*", metavar="DIR",
                        help=f"save directories (default: every one under {display_path(cache_root(env))})")


def add_remote_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--remote", action="store_true", help=f"{what} the shared tier instead of save directories")
    parser.add_argument("--remote-store", metavar="URL",
                        help=f"the shared tier for --remote: s3://bucket/prefix (default: ${ENV_REMOTE_STORE}; "
                        "credentials and endpoint from the AWS_* variables and profiles)")


def resolve_remote(parsed: argparse.Namespace, env: Mapping[str, str]) -> Any:
    """The RemoteConfig for --remote (None without it); bad combinations are CatalogErrors."""
    if not parsed.remote:
        if parsed.remote_store:
            raise CatalogError("--remote-store is used with --remote")
        return None
    if parsed.dirs:
        raise CatalogError("give DIR or --remote, not both")
    return remote_config(remote_url(parsed.remote_store, env), env)


def list_remote(config: Any) -> dict[str, list[dict[str, Any]]]:
    async def go() -> dict[str, list[dict[str, Any]]]:
        async with RemoteSession(config) as tier:
            return await tier.list_all()  # type: ignore[no-any-return]

    return asyncio.run(go())


def ls_main(argv: list[str], env: Mapping[str, str] | None = None, now: float | None = None) -> int:
    """`slotkeeper ls [DIR... | --remote [--remote-store URL]] [--json] [-- LLAMA-SERVER ARGS]`."""
    env = os.environ if env is None else env
    parser = _Parser(
        prog="slotkeeper ls",
        description="List the conversation store: one table per save directory, one row per entry (and per "
        "quarantined entry, and per slot file a next start takes over). The status is judged against the "
        "configuration of the directory's most recently used entry (the last run's). With llama-server "
        "arguments after --, a match column tells whether each entry fits them (what is known without starting "
        "llama-server: the model file, KV flags, and the slot count and context size when -np / -c are given). "
        "With --remote: the shared tier's entries, one table per namespace.",
    )
    add_dirs_argument(parser, env)
    parser.add_argument("--json", action="store_true", help="one JSON object per directory and per row, for scripts")
    add_remote_arguments(parser, "list")
    own, llama_argv = _split_dashdash(argv)
    parsed = _parse(parser, own)
    if isinstance(parsed, int):
        return parsed
    try:
        expectation = expectation_from_args(llama_argv, env) if llama_argv else None
        remote = resolve_remote(parsed, env)
        dirs = [] if remote else [scan_dir(d) for d in resolve_dirs(parsed.dirs, env)]
    except CatalogError as exc:
        print(f"slotkeeper ls: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    now = time.time() if now is None else now
    if remote is not None:
        from .remote import RemoteError

        try:
            by_namespace = remote_rows(remote.url, list_remote(remote))
        except RemoteError as exc:
            print(f"slotkeeper ls: error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        if parsed.json:
            say(json.dumps(remote_json(remote.url, by_namespace, now, expectation), indent=1))
        else:
            say(render_remote(remote.url, by_namespace, now, expectation))
        return EXIT_OK
    if parsed.json:
        say(json.dumps(json_records(dirs, now, expectation), indent=1))
    elif not dirs:
        say(f"no slotkeeper save directories under {display_path(cache_root(env))}")
    else:
        say(render_listing(dirs, now, expectation))
    return EXIT_OK


def claim_dir(path: Path, dry_run: bool) -> tuple[int | None, LockState]:
    """prune's hold on a directory: the store's own lock (layout.lock_store, non-blocking) for the time it
    prunes, so no slotkeeper starts on it meanwhile. Only a directory that has a .lock is locked (nothing is
    created in one that never had a slotkeeper of the store's layout); a dry run only looks."""
    state = lock_state(path)
    if dry_run or not state.exists or state.held:
        return None, state
    try:
        return lock_store(path), state
    except StoreLockedError as exc:  # a slotkeeper started since we looked
        return None, LockState(True, True, _lock_pid(str(exc)))


def report_removals(outcomes: Iterable[tuple[Removal, str | None]], dry_run: bool) -> bool:
    """One line per removal as it happens (or why it did not), then the totals; True when one failed."""
    verb = "would remove" if dry_run else "removed"
    counts = {KIND_ENTRY: 0, KIND_SLOT_FILE: 0, KIND_QUARANTINED: 0, KIND_REMOTE: 0}
    freed = seen = 0
    failed = False
    for removal, problem in outcomes:
        seen += 1
        if problem:
            failed = True
            print(f"slotkeeper prune: not removed: {removal.label}: {problem}", file=sys.stderr)
            continue
        say(f"{verb} {describe_removal(removal)}")
        freed += removal.nbytes
        counts[removal.row.kind] += 1
    if not seen:
        say("nothing to remove")
        return failed
    if counts[KIND_REMOTE]:
        parts = [_count(counts[KIND_REMOTE], "remote entry", "remote entries")]
    else:
        parts = [_count(counts[KIND_ENTRY], "entry", "entries")]
        if counts[KIND_SLOT_FILE]:
            parts.append(_count(counts[KIND_SLOT_FILE], "slot file"))
        if counts[KIND_QUARANTINED]:
            parts.append(_count(counts[KIND_QUARANTINED], "quarantined entry", "quarantined entries"))
    listed = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
    say(f"{verb} {listed}: {fmt_bytes(freed)}" + (" (dry run)" if dry_run else ""))
    return failed


def prune_remote(config: Any, now: float, dry_run: bool, **criteria: Any) -> list[tuple[Removal, str | None]]:
    """List the shared tier, plan, and delete (each manifest first: RemoteTier.delete)."""
    from .remote import RemoteError

    async def go() -> list[tuple[Removal, str | None]]:
        async with RemoteSession(config) as tier:
            by_namespace = remote_rows(config.url, await tier.list_all())
            rows = [row for rows in by_namespace.values() for row in rows]
            outcomes: list[tuple[Removal, str | None]] = []
            for removal in plan_rows(rows, now, **criteria):
                problem = None
                if not dry_run:
                    row = removal.row
                    assert isinstance(row, RemoteRow)
                    try:
                        await tier.delete(row.namespace, row.id)
                    except RemoteError as exc:
                        problem = str(exc)
                outcomes.append((removal, problem))
            return outcomes

    return asyncio.run(go())


def prune_main(argv: list[str], env: Mapping[str, str] | None = None, now: float | None = None) -> int:
    """`slotkeeper prune [DIR... | --remote [--remote-store URL]] [--older-than 7d] [--max-total 20GB] [--quarantine]
    [--missing-models] [--other-configs] [--force] [--dry-run] [-- LLAMA-SERVER ARGS]`."""
    env = os.environ if env is None else env
    parser = _Parser(
        prog="slotkeeper prune",
        description="Delete entries of the conversation store (each manifest, then its .bin), quarantined "
        "entries, and slot files of the slot-file layout. snapshots/ (clients' own files) and partial files are "
        "never touched, nor a directory a running slotkeeper holds (unless --force). With --remote: entries of "
        "the shared tier (--older-than, --max-total, --other-configs with llama-server arguments).",
    )
    add_dirs_argument(parser, env)
    parser.add_argument("--older-than", metavar="AGE", help="remove entries last used longer ago than AGE (30min, 12h, 7d, 2w)")
    parser.add_argument("--max-total", metavar="SIZE",
                        help="then remove the least recently used entries until those of all DIRs take at most SIZE "
                        "(500MB, 20GB)")
    parser.add_argument("--quarantine", action="store_true", help="remove everything in quarantine/")
    parser.add_argument("--missing-models", action="store_true",
                        help="remove entries whose manifest names a model file that no longer exists")
    parser.add_argument("--other-configs", action="store_true",
                        help="remove entries saved for another configuration: than the llama-server arguments after "
                        "--, or without them, than the directory's most recently used entry (ls's status column)")
    parser.add_argument("--force", action="store_true", help="prune a directory even while a slotkeeper uses it")
    parser.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    add_remote_arguments(parser, "prune")
    own, llama_argv = _split_dashdash(argv)
    parsed = _parse(parser, own)
    if isinstance(parsed, int):
        return parsed
    try:
        if not (parsed.older_than or parsed.max_total or parsed.quarantine or parsed.missing_models
                or parsed.other_configs):
            raise CatalogError("nothing to prune: give --older-than, --max-total, --quarantine, --missing-models "
                               "or --other-configs")
        if llama_argv is not None and not parsed.other_configs:
            raise CatalogError("llama-server arguments after -- are only used with --other-configs")
        older_than = parse_duration(parsed.older_than) if parsed.older_than else None
        max_total = parse_size(parsed.max_total) if parsed.max_total else None
        expectation = expectation_from_args(llama_argv, env) if llama_argv else None
        if parsed.remote:
            for given, flag in ((parsed.quarantine, "--quarantine"), (parsed.missing_models, "--missing-models"),
                                (parsed.force, "--force")):
                if given:
                    raise CatalogError(f"{flag} applies to save directories, not to --remote")
            if parsed.other_configs and expectation is None:
                raise CatalogError("--other-configs with --remote needs llama-server arguments after --")
        remote = resolve_remote(parsed, env)
        paths = [] if remote else resolve_dirs(parsed.dirs, env)
    except CatalogError as exc:
        print(f"slotkeeper prune: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    now = time.time() if now is None else now
    if remote is not None:
        from .remote import RemoteError

        try:
            outcomes = prune_remote(remote, now, parsed.dry_run, older_than=older_than, max_total=max_total,
                                    other_configs=parsed.other_configs, expectation=expectation)
        except RemoteError as exc:
            print(f"slotkeeper prune: error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        return EXIT_FAILED if report_removals(outcomes, parsed.dry_run) else EXIT_OK
    failed = False
    held: list[int] = []
    try:
        dirs: list[SaveDir] = []
        for path in paths:
            fd, state = claim_dir(path, parsed.dry_run)
            if fd is not None:
                held.append(fd)
            if state.held:
                if not parsed.force:
                    failed = True
                    print(f"slotkeeper prune: skipped {display_path(path)}: {state.describe()} "
                          "(--force prunes it anyway)", file=sys.stderr)
                    continue
                say(f"pruning {display_path(path)} although it is {state.describe()} (--force)")
            try:
                dirs.append(scan_dir(path))
            except CatalogError as exc:
                failed = True
                print(f"slotkeeper prune: skipped {display_path(path)}: {exc}", file=sys.stderr)
        removals = plan_prune(dirs, now, older_than=older_than, max_total=max_total, quarantine=parsed.quarantine,
                              missing_models=parsed.missing_models, other_configs=parsed.other_configs,
                              expectation=expectation)
        outcomes_local = ((r, None if parsed.dry_run else remove_files(r)) for r in removals)
        failed = report_removals(outcomes_local, parsed.dry_run) or failed
    finally:
        for fd in held:
            os.close(fd)
    return EXIT_FAILED if failed else EXIT_OK


__all__ = [
    "CatalogError", "Expectation", "RemoteRow", "Row", "SaveDir", "expectation_from_args", "find_save_dirs", "format_age",
    "ls_main", "parse_duration", "parse_size", "plan_prune", "prune_main", "scan_dir",
]
