"""`slotkeeper ls` and `slotkeeper prune`: look at and clean up save directories without a running server.

A save directory holds pairs: `<id>.bin` (llama-server's slot file) and `<id>.json` (slotkeeper's manifest,
written last), `*.partial` files of an interrupted save, and `quarantine/` (bad pairs moved aside). These tools
only ever read or delete those names; any other file in the directory is left alone.

Nothing here talks to llama-server: what needs a running server (the slot count, the per-slot context) is read
from the manifests, and compared with llama-server's arguments only where those arguments decide it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
import time
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cmdline import ConfigError, parse_llama_args
from .fingerprint import KV_FLAGS, kv_flags, model_identity
from .log import fmt_bytes
from .slots import QUARANTINE_DIR, read_manifest

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

# Only canonical slot names (`0.bin`, `12.json`, never `007.bin`): those are the only ones slotkeeper writes.
CACHE_NAME = re.compile(r"^(0|[1-9][0-9]*)\.(bin|json)(\.partial)?$")
MODEL_KEYS = ("model", "model_size", "model_sha256")
CTX_FLAGS = ("-c", "--ctx-size")
ENV_CTX_SIZE = "LLAMA_ARG_CTX_SIZE"
UNIFIED_FLAGS = {"-kvu": True, "--kv-unified": True, "-no-kvu": False, "--no-kv-unified": False}
CTX_PAD = 256  # llama.cpp rounds a slot's context up to a multiple of this
TABLE_WIDTH = 100  # the model column is shortened (not below MODEL_COLUMN_MIN) to keep lines within this
MODEL_COLUMN_MIN = 20
MATCH_COLUMN_BUDGET = 40  # a longer match text (a model path) overflows instead
STATUS_OK = "ok"


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


@dataclass
class CacheEntry:
    """One slot's files: `<id>.bin` and/or `<id>.json`."""

    directory: Path
    slot: int
    bin: FileStat | None = None
    manifest_file: FileStat | None = None
    manifest: dict[str, Any] | None = None

    @property
    def status(self) -> str:
        if self.bin is None:
            return "no .bin"
        if self.manifest_file is None:
            return "no manifest"  # saved by llama-server directly: never restored without --restore-unverified
        if self.manifest is None:
            return "bad manifest"
        if self.manifest.get("bytes") != self.bin.size:
            return "size mismatch"
        return STATUS_OK

    @property
    def fingerprint(self) -> dict[str, Any]:
        fp = (self.manifest or {}).get("fingerprint")
        return fp if isinstance(fp, dict) else {}

    @property
    def tokens(self) -> int | None:
        value = (self.manifest or {}).get("tokens")
        return value if isinstance(value, int) else None

    @property
    def model(self) -> str | None:
        value = self.fingerprint.get("model")
        return value if isinstance(value, str) and value else None

    @property
    def saved_at(self) -> float:
        """When the pair was written: the manifest's time, else the newest file's mtime."""
        value = (self.manifest or {}).get("saved_at")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return max(f.mtime for f in self.files)

    @property
    def files(self) -> list[FileStat]:
        """Deletion order: the manifest first, so an interrupted removal never leaves a restorable half-pair."""
        return [f for f in (self.manifest_file, self.bin) if f is not None]

    @property
    def disk_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass
class SaveDir:
    path: Path
    entries: list[CacheEntry] = field(default_factory=list)
    partials: list[FileStat] = field(default_factory=list)
    quarantine: list[FileStat] = field(default_factory=list)

    @property
    def cache_bytes(self) -> int:
        return sum(e.disk_bytes for e in self.entries)


def is_cache_name(name: str) -> bool:
    return CACHE_NAME.match(name) is not None


def scan_dir(path: Path) -> SaveDir:
    """Everything slotkeeper owns in one save directory (nothing else is looked at)."""
    result = SaveDir(path)
    entries: dict[int, CacheEntry] = {}
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise CatalogError(f"cannot read {path}: {exc.strerror or exc}") from None
    for name in names:
        match = CACHE_NAME.match(name)
        file = path / name
        if not match or not file.is_file():
            continue
        try:
            stat = FileStat.of(file)
        except OSError:
            continue  # removed while we looked
        if match.group(3):
            result.partials.append(stat)
            continue
        slot = int(match.group(1))
        entry = entries.setdefault(slot, CacheEntry(path, slot))
        if match.group(2) == "bin":
            entry.bin = stat
        else:
            entry.manifest_file = stat
            entry.manifest = read_manifest(file)
    result.entries = [entries[slot] for slot in sorted(entries)]
    qdir = path / QUARANTINE_DIR
    if qdir.is_dir() and not qdir.is_symlink():
        for name in sorted(os.listdir(qdir)):
            file = qdir / name
            if file.is_file() and not file.is_symlink():
                try:
                    result.quarantine.append(FileStat.of(file))
                except OSError:
                    continue
    return result


def holds_caches(path: Path) -> bool:
    """Whether a directory holds anything slotkeeper wrote (pairs, partials or quarantined files)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if any(is_cache_name(name) for name in names):
        return True
    qdir = path / QUARANTINE_DIR
    return qdir.is_dir() and any((qdir / n).is_file() for n in os.listdir(qdir))


def cache_root(env: Mapping[str, str]) -> Path:
    """Where the per-model default directories live (cmdline.default_save_dir)."""
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotkeeper"


def save_dirs_under(root: Path) -> list[Path]:
    """The directories just below `root` that hold slotkeeper files (`demo`/`bench` hold only a model: skipped)."""
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

    A named directory that holds no slotkeeper files itself but has save directories below it (the cache root,
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
    """Short on purpose: the model column names the saved model, the `match:` line the one in the arguments."""
    if all(saved.get(k) == current.get(k) for k in MODEL_KEYS):
        return None
    if saved.get("model") == current.get("model"):
        return "model file changed"  # same path, other size or content
    if saved.get("model") and Path(str(saved["model"])).name == Path(str(current.get("model"))).name:
        return f"model path {saved['model']}"
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


# ---- ls -------------------------------------------------------------------------------------------------------


def entry_record(entry: CacheEntry, now: float, expectation: Expectation | None) -> dict[str, Any]:
    """Everything known about one pair, for --json."""
    status = entry.status
    record: dict[str, Any] = {
        "kind": "cache",
        "dir": str(entry.directory),
        "slot": entry.slot,
        "status": status,
        "bin": str(entry.bin.path) if entry.bin else None,
        "manifest": str(entry.manifest_file.path) if entry.manifest_file else None,
        "tokens": entry.tokens,
        "bytes": (entry.manifest or {}).get("bytes"),
        "bin_size": entry.bin.size if entry.bin else None,
        "disk_bytes": entry.disk_bytes,
        "saved_at": entry.saved_at,
        "age_s": round(max(0.0, now - entry.saved_at), 1),
        "save_ms": (entry.manifest or {}).get("save_ms"),
        "manifest_version": (entry.manifest or {}).get("version"),
        "model": entry.model,
        "model_name": Path(entry.model).name if entry.model else None,
        "fingerprint": entry.fingerprint or None,
    }
    if expectation is not None:
        differences = [status] if status != STATUS_OK else expectation.differences(entry.fingerprint)
        record["match"] = not differences
        record["differences"] = differences
    return record


def file_record(kind: str, directory: Path, stat: FileStat, now: float) -> dict[str, Any]:
    return {
        "kind": kind, "dir": str(directory), "path": str(stat.path), "name": stat.path.name, "size": stat.size,
        "mtime": stat.mtime, "age_s": round(max(0.0, now - stat.mtime), 1),
    }


def json_records(dirs: Sequence[SaveDir], now: float, expectation: Expectation | None) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for save_dir in dirs:
        records += [entry_record(e, now, expectation) for e in save_dir.entries]
        records += [file_record("partial", save_dir.path, f, now) for f in save_dir.partials]
        records += [file_record("quarantine", save_dir.path, f, now) for f in save_dir.quarantine]
    return records


def _count(n: int, word: str, plural: str | None = None) -> str:
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


HEADERS = ("slot", "tokens", "size", "age", "model", "status", "match")
RIGHT_ALIGNED = (0, 1, 2, 3)
MODEL_COLUMN = 4


def table_row(entry: CacheEntry, now: float, expectation: Expectation | None) -> list[str]:
    status = entry.status
    tokens = entry.tokens
    size = entry.bin.size if entry.bin else (entry.manifest or {}).get("bytes")
    row = [
        str(entry.slot),
        f"{tokens:,}" if tokens is not None else "-",
        fmt_bytes(size) if isinstance(size, int) else "-",
        format_age(now - entry.saved_at),
        Path(entry.model).name if entry.model else "-",
        status,
    ]
    if expectation:
        if status != STATUS_OK:
            row.append("-")  # the status column says why it cannot be restored
        else:
            differences = expectation.differences(entry.fingerprint)
            row.append("no: " + differences[0] if differences else "yes")
    return row


def dir_summary(save_dir: SaveDir) -> str:
    def counted(files: list[FileStat], word: str) -> str:
        return _count(len(files), word) + (f" ({fmt_bytes(sum(f.size for f in files))})" if files else "")

    return (f"{_count(len(save_dir.entries), 'cache')}, {fmt_bytes(save_dir.cache_bytes)}; "
            f"{counted(save_dir.partials, 'partial')}; quarantine: {counted(save_dir.quarantine, 'file')}")


def render_listing(dirs: Sequence[SaveDir], now: float, expectation: Expectation | None) -> str:
    """One table per directory, all with the same columns, so the directories read as one listing."""
    headers = list(HEADERS if expectation else HEADERS[:-1])
    tables = [[table_row(e, now, expectation) for e in d.entries] for d in dirs]
    widths = column_widths(headers, [row for rows in tables for row in rows])
    # Keep lines within TABLE_WIDTH by shortening model names: first without `.gguf`, then from the middle. A
    # long match text may still overflow (it is the last column) but does not squeeze the model column further.
    def overflow() -> int:
        budget = [min(w, MATCH_COLUMN_BUDGET) if h == "match" else w for h, w in zip(headers, widths)]
        return 2 + sum(budget) + 2 * (len(budget) - 1) - TABLE_WIDTH

    rows_all = [row for rows in tables for row in rows]
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
    for i, (save_dir, rows) in enumerate(zip(dirs, tables)):
        if i:
            lines.append("")
        lines.append(display_path(save_dir.path))
        if rows:
            lines += [format_row(row, widths, RIGHT_ALIGNED) for row in [headers, *rows]]
        else:
            lines.append("  (no cache files)")
        lines.append("  " + dir_summary(save_dir))
    if len(dirs) > 1:
        total = sum(d.cache_bytes for d in dirs)
        caches = sum(len(d.entries) for d in dirs)
        lines += ["", f"total: {_count(caches, 'cache')}, {fmt_bytes(total)} in {_count(len(dirs), 'directory', 'directories')}"]
    return "\n".join(lines)


# ---- prune ----------------------------------------------------------------------------------------------------


@dataclass
class Removal:
    """One thing prune deletes: a cache pair or a quarantined pair, its files in deletion order (manifest first)."""

    files: list[FileStat]
    reason: str
    age: float
    tokens: int | None = None
    quarantined: bool = False

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def label(self) -> str:
        """`DIR/0.json + 0.bin`"""
        first, *rest = self.files
        return display_path(first.path) + "".join(f" + {f.path.name}" for f in rest)


def quarantine_groups(save_dir: SaveDir) -> list[list[FileStat]]:
    """Quarantined files grouped by pair (`<stamp>-<id>.bin` with `<stamp>-<id>.json`), manifest first."""
    groups: dict[str, list[FileStat]] = {}
    for stat in save_dir.quarantine:
        name = stat.path.name
        groups.setdefault(name.removesuffix(".json").removesuffix(".bin"), []).append(stat)
    return [sorted(g, key=lambda f: not f.path.name.endswith(".json")) for _, g in sorted(groups.items())]


def model_missing(entry: CacheEntry) -> bool:
    """The manifest names a model file that existed when the pair was saved and is gone now."""
    fp = entry.fingerprint
    model = entry.model
    return bool(model and os.path.isabs(model) and "model_sha256" in fp and not os.path.exists(model))


def plan_prune(
    dirs: Sequence[SaveDir], now: float, *, older_than: float | None = None, max_total: int | None = None,
    quarantine: bool = False, missing_models: bool = False,
) -> list[Removal]:
    """What prune removes, in order. --max-total counts the pairs of all the given directories together."""
    removals: list[Removal] = []
    kept: list[CacheEntry] = []
    for save_dir in dirs:
        for entry in save_dir.entries:
            age = now - entry.saved_at
            reason = None
            if missing_models and model_missing(entry):
                reason = f"model gone: {entry.model}"
            elif older_than is not None and age > older_than:
                reason = f"older than {format_age(older_than)}"
            if reason:
                removals.append(Removal(entry.files, reason, age, entry.tokens))
            else:
                kept.append(entry)
    if max_total is not None:
        total = sum(e.disk_bytes for e in kept)
        for entry in sorted(kept, key=lambda e: (e.saved_at, str(e.directory), e.slot)):
            if total <= max_total:
                break
            total -= entry.disk_bytes
            removals.append(Removal(entry.files, f"over --max-total {fmt_bytes(max_total)}", now - entry.saved_at,
                                    entry.tokens))
    if quarantine:
        for save_dir in dirs:
            for group in quarantine_groups(save_dir):
                age = now - max(f.mtime for f in group)
                removals.append(Removal(group, "quarantined", age, quarantined=True))
    return removals


def remove_files(removal: Removal) -> str | None:
    """Delete a pair's files in order; None when done, else why it stopped.

    A file that changed since the scan (a running slotkeeper saved that slot again) is kept. Stopping after the
    manifest went leaves a .bin that is never restored without --restore-unverified.
    """
    for stat in removal.files:
        try:
            current = FileStat.of(stat.path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"{stat.path.name}: {exc.strerror or exc}"
        if current.identity != stat.identity:
            return f"{stat.path.name} changed since it was listed (a running slotkeeper saved it?); kept"
        try:
            stat.path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"{stat.path.name}: {exc.strerror or exc}"
    return None


def describe_removal(removal: Removal) -> str:
    details = [f"{removal.tokens:,} tokens"] if removal.tokens is not None else []
    details += [fmt_bytes(removal.nbytes), f"{format_age(removal.age)} old"]
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


def ls_main(argv: list[str], env: Mapping[str, str] | None = None, now: float | None = None) -> int:
    """`slotkeeper ls [DIR...] [--json] [-- LLAMA-SERVER ARGS]`."""
    env = os.environ if env is None else env
    parser = _Parser(
        prog="slotkeeper ls",
        description="List slot caches: one table per save directory. With llama-server arguments after --, "
        "a match column tells whether each cache fits them (what is known without starting llama-server: "
        "the model file, KV flags, and the slot count and context size when -np / -c are given).",
    )
    add_dirs_argument(parser, env)
    parser.add_argument("--json", action="store_true", help="one JSON object per file, for scripts")
    own, llama_argv = _split_dashdash(argv)
    parsed = _parse(parser, own)
    if isinstance(parsed, int):
        return parsed
    try:
        expectation = expectation_from_args(llama_argv, env) if llama_argv else None
        dirs = [scan_dir(d) for d in resolve_dirs(parsed.dirs, env)]
    except CatalogError as exc:
        print(f"slotkeeper ls: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    now = time.time() if now is None else now
    if parsed.json:
        say(json.dumps(json_records(dirs, now, expectation), indent=1))
    elif not dirs:
        say(f"no slotkeeper caches under {display_path(cache_root(env))}")
    else:
        say(render_listing(dirs, now, expectation))
    return EXIT_OK


def prune_main(argv: list[str], env: Mapping[str, str] | None = None, now: float | None = None) -> int:
    """`slotkeeper prune [DIR...] [--older-than 7d] [--max-total 20GB] [--quarantine] [--missing-models] [--dry-run]`."""
    env = os.environ if env is None else env
    parser = _Parser(
        prog="slotkeeper prune",
        description="Delete slot caches (each .bin together with its .json manifest, the manifest first). "
        "Only slotkeeper's files are touched: <id>.bin, <id>.json and quarantine/*; *.partial files are left "
        "to the next slotkeeper start.",
    )
    add_dirs_argument(parser, env)
    parser.add_argument("--older-than", metavar="AGE", help="remove pairs saved longer ago than AGE (30min, 12h, 7d, 2w)")
    parser.add_argument("--max-total", metavar="SIZE",
                        help="then remove the oldest pairs until the pairs of all DIRs take at most SIZE (500MB, 20GB)")
    parser.add_argument("--quarantine", action="store_true", help="remove everything in quarantine/")
    parser.add_argument("--missing-models", action="store_true",
                        help="remove pairs whose manifest names a model file that no longer exists")
    parser.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    parsed = _parse(parser, list(argv))
    if isinstance(parsed, int):
        return parsed
    try:
        if not (parsed.older_than or parsed.max_total or parsed.quarantine or parsed.missing_models):
            raise CatalogError("nothing to prune: give --older-than, --max-total, --quarantine or --missing-models")
        older_than = parse_duration(parsed.older_than) if parsed.older_than else None
        max_total = parse_size(parsed.max_total) if parsed.max_total else None
        dirs = [scan_dir(d) for d in resolve_dirs(parsed.dirs, env)]
    except CatalogError as exc:
        print(f"slotkeeper prune: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    now = time.time() if now is None else now
    removals = plan_prune(dirs, now, older_than=older_than, max_total=max_total,
                          quarantine=parsed.quarantine, missing_models=parsed.missing_models)
    verb = "would remove" if parsed.dry_run else "removed"
    pairs = quarantined = freed = 0
    failed = False
    for removal in removals:
        if not parsed.dry_run:
            problem = remove_files(removal)
            if problem:
                failed = True
                print(f"slotkeeper prune: not removed: {removal.label}: {problem}", file=sys.stderr)
                continue
        say(f"{verb} {describe_removal(removal)}")
        freed += removal.nbytes
        if removal.quarantined:
            quarantined += 1
        else:
            pairs += 1
    if not removals:
        say("nothing to remove")
    else:
        parts = [_count(pairs, "cache pair")] + ([_count(quarantined, "quarantined pair")] if quarantined else [])
        say(f"{verb} {' and '.join(parts)}: {fmt_bytes(freed)}" + (" (dry run)" if parsed.dry_run else ""))
    return EXIT_FAILED if failed else EXIT_OK


__all__ = [
    "CacheEntry", "CatalogError", "Expectation", "SaveDir", "expectation_from_args",
    "find_save_dirs", "format_age", "ls_main", "parse_duration", "parse_size", "plan_prune", "prune_main", "scan_dir",
]
