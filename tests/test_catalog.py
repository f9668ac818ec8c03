"""`slotkeeper ls` and `slotkeeper prune` on save directories of the conversation store.

The directories are built with the store's own mechanism (store.slotfiles.commit renames a slot file from
snapshots/ into entries/ and writes its manifest with Entry.manifest() and write_json_atomic), and one test
runs a real slotkeeper around the stub llama-server and lists and prunes what it left. Entries kept as blocks
that share some (which the stub's saves never do: each is one block) are written as the store writes them: each
block under its hash in blocks/, then a version-3 manifest (Entry.manifest() with its Parts).
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from stub import encode_slot_file

from slotkeeper.catalog import prune as catalog  # prune looks remove_pair up where the tests patch it
from slotkeeper.catalog.cli import ls_main, prune_main
from slotkeeper.catalog.formats import CatalogError, format_age, parse_duration, parse_size
from slotkeeper.catalog.jsontext import dumps_indented
from slotkeeper.catalog.listed import Kind
from slotkeeper.catalog.local_rows import FileStat, Row
from slotkeeper.catalog.match import expectation_from_args
from slotkeeper.catalog.prune import plan_prune
from slotkeeper.catalog.records import json_records
from slotkeeper.catalog.remote_rows import RemoteRow
from slotkeeper.catalog.scan import scan_dir
from slotkeeper.catalog.short_ids import assign_short_ids
from slotkeeper.log import fmt_bytes
from slotkeeper.store import blockfiles
from slotkeeper.store.blockfiles import UNCLEAN_NAME, block_path
from slotkeeper.store.blocks import CellSection, Parts, block_hash
from slotkeeper.store.conversations import ConversationStore
from slotkeeper.store.entries import TRANSIENT_PREFIX, Entry, Status, read_json, remove_pair, write_json_atomic
from slotkeeper.store.fingerprint import build_fingerprint, model_identity, namespace_key
from slotkeeper.store.layout import StoreLockedError, lock_store, prepare_layout
from slotkeeper.store.slotfiles import commit, read_saved
from slotkeeper.store.statelayout import RowRun
from slotkeeper.testing.harness import free_port, wait_until
from slotkeeper.testing.s3server import S3Server

NOW = 1_750_000_000.0
MIN, HOUR, DAY = 60, 3600, 86400
MODEL = "/models/Qwen2.5-7B-Instruct-Q4_K_M.gguf"
FP = {"model": MODEL, "total_slots": 1, "n_ctx_slot": 4096}


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    """Paths are printed with the home directory as `~`: keep the developer's home out of the expected text."""
    monkeypatch.setenv("HOME", str(tmp_path.parent / "no-such-home"))


def fingerprint_for(model: Path | str, child_args: list[str], total_slots: int, n_ctx_slot: int) -> dict[str, Any]:
    """The fingerprint the daemon would store for this model file and llama-server arguments."""
    return build_fingerprint(model_identity(str(model)), child_args, total_slots, n_ctx_slot)


def write_model(path: Path, content: bytes = b"GGUF model A" * 1000) -> Path:
    path.write_bytes(content)
    return path


def write_entry(
    directory: Path,
    *,
    tokens: int = 100,
    bytes_per_token: int = 64,
    age: float = 0.0,
    used_age: float | None = None,
    fingerprint: dict[str, Any] | None = None,
    version: int = 4,
    entry_id: str | None = None,
) -> Entry:
    """An entry as a save leaves it: the slot file lands in snapshots/ under a transient name, is read
    (store.slotfiles.read_saved) and committed into entries/ with its manifest (store.slotfiles.commit), the
    store's own code."""
    directory.mkdir(parents=True, exist_ok=True)
    prepare_layout(directory)
    fp = dict(FP if fingerprint is None else fingerprint)
    transient = directory / "snapshots" / f"{TRANSIENT_PREFIX}{secrets.token_hex(16)}.bin"
    transient.write_bytes(encode_slot_file(list(range(1, tokens + 1)), "m.gguf", bytes_per_token, version=version))
    saved = read_saved(transient)
    entry = Entry(
        id=entry_id or secrets.token_hex(8),
        n_tokens=saved.header.n_tokens,
        nbytes=transient.stat().st_size,
        keys=saved.keys,
        saved_at=NOW - age,
        last_used=NOW - (age if used_age is None else used_age),
        fingerprint=fp,
        seq_version=saved.header.version,
        layout=saved.header.layout,
        save_ms=12.5,
        exact=saved.exact,
        checksum=saved.checksum,
    )
    commit(transient, entry.id, entry.manifest(), directory / "entries", fsync=False)
    return entry


def entry_files(directory: Path, entry: Entry) -> tuple[Path, Path]:
    return directory / "entries" / f"{entry.id}.bin", directory / "entries" / f"{entry.id}.json"


def edit_manifest(directory: Path, entry: Entry, **changes: Any) -> None:
    path = entry_files(directory, entry)[1]
    data = read_json(path)
    assert data is not None
    data.update(changes)
    write_json_atomic(path, data, fsync=False)


def write_slot_file(
    directory: Path,
    slot: int,
    *,
    tokens: int = 50,
    age: float = 0.0,
    manifest: bool = True,
    fingerprint: dict[str, Any] | None = None,
) -> None:
    """A pair of the slot-file layout, as SlotStore wrote it: `<slot>.bin`, then its version-1 `<slot>.json`."""
    directory.mkdir(parents=True, exist_ok=True)
    data = encode_slot_file(list(range(tokens)), "m.gguf", 64)
    (directory / f"{slot}.bin").write_bytes(data)
    os.utime(directory / f"{slot}.bin", (NOW - age, NOW - age))
    if manifest:
        (directory / f"{slot}.json").write_text(
            json.dumps(
                {
                    "version": 1,
                    "slot": slot,
                    "tokens": tokens,
                    "bytes": len(data),
                    "saved_at": NOW - age,
                    "save_ms": 3.0,
                    "fingerprint": FP if fingerprint is None else fingerprint,
                },
                indent=1,
            )
        )


def run(main, capsys, *argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    code = main(list(argv), env=env or {"XDG_CACHE_HOME": "/nonexistent-xdg"}, now=NOW)
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out: str) -> dict[str, list[str]]:
    """Rows of the ls tables keyed by their first cell (a short entry id, or `<n>.bin`), split on runs of two or
    more spaces."""
    rows = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) >= 6 and re.fullmatch(r"[0-9a-f]{4,16}|[0-9]+\.bin", cells[0]):
            rows[cells[0]] = cells
    return rows


def names(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


@pytest.fixture
def mixed_dir(tmp_path: Path) -> dict[str, Any]:
    """Every kind of thing a save directory can hold, plus files that are not slotkeeper's."""
    d = tmp_path / "cache"
    qwen = {**FP, "model": MODEL}
    e = {
        "newest": write_entry(
            d,
            tokens=6222,
            bytes_per_token=2000,
            age=HOUR,
            used_age=3 * MIN + 5,
            fingerprint=qwen,
            entry_id="aaaa0000" + "11" * 4,
        ),
        "older": write_entry(d, tokens=300, age=2 * HOUR + 100, fingerprint=qwen, entry_id="aaaa1111" + "22" * 4),
        "other_config": write_entry(
            d, tokens=500, age=3 * DAY, fingerprint={**qwen, "n_ctx_slot": 8192}, entry_id="bbbb" + "33" * 6
        ),
        "other_format": write_entry(
            d, tokens=100, age=4 * DAY, fingerprint=qwen, version=3, entry_id="cccc" + "44" * 6
        ),
        "size_mismatch": write_entry(d, tokens=12_001, age=5 * HOUR, fingerprint=qwen, entry_id="dddd" + "55" * 6),
        "no_bin": write_entry(d, tokens=50, age=40, fingerprint=qwen, entry_id="eeee" + "66" * 6),
        "bad_manifest": write_entry(d, tokens=70, age=10, fingerprint=qwen, entry_id="ffff" + "77" * 6),
    }
    with open(entry_files(d, e["size_mismatch"])[0], "ab") as f:
        f.write(b"extra")
    entry_files(d, e["no_bin"])[0].unlink()
    entry_files(d, e["bad_manifest"])[1].write_text("{not json", encoding="utf-8")
    for path in entry_files(d, e["bad_manifest"]):
        os.utime(path, (NOW - 10, NOW - 10))  # without a readable manifest, the last use is the files' mtime
    interrupted = d / "entries" / ("9999" + "88" * 6 + ".bin")  # saved, never committed
    interrupted.write_bytes(encode_slot_file(list(range(20)), "m.gguf"))
    os.utime(interrupted, (NOW - 5 * DAY - 7, NOW - 5 * DAY - 7))
    (d / "entries" / ("aaaa0000" + "11" * 4 + ".json.partial")).write_bytes(b"x" * 300)  # a manifest being written
    (d / "quarantine").mkdir()
    quarantined = Entry(
        id="4444" + "99" * 6,
        n_tokens=77,
        nbytes=700,
        keys=[],
        saved_at=NOW - 3 * DAY,
        last_used=NOW - 3 * DAY,
        fingerprint=qwen,
        seq_version=4,
        layout="packed-1",
    )
    (d / "quarantine" / f"20250101-120000-{quarantined.id}.bin").write_bytes(b"x" * 700)
    write_json_atomic(d / "quarantine" / f"20250101-120000-{quarantined.id}.json", quarantined.manifest(), fsync=False)
    write_slot_file(d, 0, tokens=40, age=2 * DAY)  # the slot-file layout, not yet taken over
    (d / "snapshots" / "my-own-save.bin").write_bytes(encode_slot_file([1, 2, 3], "m.gguf"))  # a client's
    (d / "snapshots" / f"{TRANSIENT_PREFIX}{'0' * 32}.bin").write_bytes(b"t")  # slotkeeper's, left by a kill
    (d / "snapshots" / f"{TRANSIENT_PREFIX}notes.bin").write_bytes(b"n")  # a client's, whatever its name
    for name in FOREIGN:
        (d / name).write_bytes(b"not slotkeeper's")
    return {"dir": d, **e}


FOREIGN = ("notes.txt", "007.bin", "1.bin.bak", "foo.json", "model.gguf")


def short(entry: Entry) -> str:
    return entry.id[:4]


# ---- ls ---------------------------------------------------------------------------------------------------------


def test_ls_table_shows_each_entry_with_its_status(capsys, mixed_dir):
    d = mixed_dir["dir"]
    code, out, err = run(ls_main, capsys, str(d))
    assert code == 0 and err == ""
    rows = table_rows(out)
    # the two aaaa entries need 5 digits to be told apart; 007.bin, foo.json, notes.txt are not slotkeeper's
    assert set(rows) == {"aaaa0", "aaaa1", "bbbb", "cccc", "dddd", "eeee", "ffff", "9999", "4444", "0.bin"}
    newest_bin = entry_files(d, mixed_dir["newest"])[0]
    assert rows["aaaa0"][:4] == ["aaaa0", "6,222", fmt_bytes(newest_bin.stat().st_size), "3 min ago"]
    model = rows["aaaa0"][4]  # shortened, so that the long status texts fit in 100 columns
    assert model.startswith("Qwen2.5-7B-I") and model.endswith("-Q4_K_M") and "…" in model
    assert rows["aaaa0"][-1] == "usable"
    assert rows["aaaa1"][-1] == "usable" and rows["aaaa1"][3] == "2 h ago"
    assert rows["bbbb"][-1] == "other configuration (n_ctx_slot)"
    assert rows["cccc"][-1] == "other state format (v3)"
    assert rows["dddd"][1] == "12,001" and rows["dddd"][-1] == "size mismatch (quarantined at start)"
    assert rows["eeee"][-1] == "no .bin (manifest dropped at start)"
    assert rows["ffff"][1:2] == ["-"] and rows["ffff"][-1] == "bad manifest (never used)"
    assert rows["9999"] == [
        "9999",
        "-",
        fmt_bytes((d / "entries" / ("9999" + "88" * 6 + ".bin")).stat().st_size),
        "5 d ago",
        "-",
        "interrupted save (removed at start)",
    ]
    assert rows["4444"][1] == "77" and rows["4444"][-1] == "quarantined"
    assert rows["0.bin"][1] == "40" and rows["0.bin"][3] == "2 d ago"
    assert rows["0.bin"][-1] == "slot file (taken over at next start)"
    # the most recently used first, then quarantine, then slot files
    order = [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in rows]
    assert order == ["ffff", "eeee", "aaaa0", "aaaa1", "dddd", "bbbb", "cccc", "9999", "4444", "0.bin"]
    summary = " ".join(out.split())
    assert "8 entries, " in summary and "(2 usable)" in summary
    assert "1 slot file to take over, " in summary and "quarantine: 1 entry, " in summary
    client = fmt_bytes((d / "snapshots" / "my-own-save.bin").stat().st_size + 1)
    assert f"snapshots/: 2 client files, {client}" in summary  # the transient leftover is not a client's
    assert "1 partial (finished or removed at next start)" in summary
    # bbbb: another -c (tried: loaded if llama-server takes it, else recomputed); cccc: another format
    assert "at the next start, of other configurations: 1 tried (loaded, else recomputed), 1 recomputed" in summary
    assert "in use" not in summary
    assert all(len(line) <= 100 for line in out.splitlines())


def test_ls_status_is_what_the_store_makes_of_each_entry(capsys, mixed_dir):
    """The statuses ls predicts are what ConversationStore.open (the next start) then does."""
    d = mixed_dir["dir"]
    _, out, _ = run(ls_main, capsys, str(d), "--json")
    records = [r for r in json.loads(out) if r["kind"] != "directory"]
    by_status: dict[str, set[str]] = {}
    for r in records:
        by_status.setdefault(r["status"], set()).add(r["id"])
    store = ConversationStore(d, None, dict(FP), fsync=False)
    store.open()
    store.current_format = (4, "packed-1")  # what the stub writes
    store.check_formats()
    assert by_status["usable"] < set(store.entries)  # and the slot file, taken over under a new id:
    assert len(store.entries) == len(by_status["usable"]) + len(by_status["slot_file"]) == 3
    assert [i for i, why in store.skipped.items() if "another configuration" in why] == list(
        by_status["other_configuration"]
    )
    assert [i for i, why in store.skipped.items() if why.startswith("format v3")] == list(by_status["other_format"])
    quarantined = {p.name.split("-", 2)[2].removesuffix(".bin") for p in (d / "quarantine").glob("*.bin")}
    assert quarantined == by_status["quarantined"] | by_status["size_mismatch"]
    gone = by_status["interrupted_save"] | by_status["no_bin"]
    assert not any((d / "entries" / f"{i}{suffix}").exists() for i in gone for suffix in (".bin", ".json"))
    (bad,) = by_status["bad_manifest"]
    assert (d / "entries" / f"{bad}.bin").exists()  # never used, but kept with its file (another version's?)
    # the slot file became one more usable entry of the same tokens
    _, out, _ = run(ls_main, capsys, str(d), "--json")
    after = {r["id"]: r for r in json.loads(out) if r["kind"] == "entry" and r["status"] == "usable"}
    assert len(after) == len(by_status["usable"]) + 1
    assert sorted(r["tokens"] for r in after.values()) == sorted([6222, 300, 40])
    assert not (d / "0.bin").exists()


def test_ls_columns_are_aligned(capsys, mixed_dir):
    _, out, _ = run(ls_main, capsys, str(mixed_dir["dir"]))
    lines = [line for line in out.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    header = next(line for line in lines if line.strip().startswith("entry"))
    body = [line for line in lines if line.split()[0] in table_rows(out)]
    assert len(body) == 10
    # right-aligned numbers end where their header ends; the model column starts where its header starts
    for column in ("tokens", "size", "last used"):
        end = header.index(column) + len(column)
        assert all(line[end - 1] != " " and line[end] == " " for line in body), column
    for column in ("model", "status"):
        start = header.index(column)
        assert all(line[start - 1] == " " and line[start] != " " for line in body), column


def test_ls_shortens_long_model_names_to_fit_100_columns(capsys, tmp_path):
    model = write_model(tmp_path / ("Meta-Llama-3.1-70B-Instruct-abliterated-" + "x" * 40 + "-Q4_K_M.gguf"))
    big = write_entry(tmp_path / "a", tokens=123_456, fingerprint=fingerprint_for(str(model), [], 1, 4096))
    other = write_entry(tmp_path / "b", fingerprint={"model": "/m/short.gguf"})
    _, out, _ = run(ls_main, capsys, str(tmp_path / "a"), str(tmp_path / "b"), "--", "-m", str(model), "-np", "2")
    lines = out.splitlines()
    assert all(len(line) <= 100 for line in lines[2:]), out  # (the `match:` line names the model in full)
    rows = table_rows(out)
    cell = rows[short(big)][4]
    assert cell.startswith("Meta-Llama") and cell.endswith("-Q4_K_M") and "…" in cell
    assert rows[short(big)][-1] == "no: total_slots 1 -> 2 (-np)" and rows[short(other)][-1] == "no: model differs"
    # both directories' tables share their column positions
    headers = [line for line in lines if line.strip().startswith("entry ")]
    assert len(headers) == 2 and headers[0] == headers[1]


def test_ls_json_lists_every_row_with_its_fields(capsys, mixed_dir):
    d = mixed_dir["dir"]
    code, out, _ = run(ls_main, capsys, str(d), "--json")
    assert code == 0
    records = json.loads(out)
    (directory,) = [r for r in records if r["kind"] == "directory"]
    assert directory["dir"] == str(d) and directory["entries"] == 8 and directory["usable"] == 2
    assert directory["reference"] == mixed_dir["newest"].id  # the most recently used: the last run's configuration
    assert directory["quarantined"] == 1 and directory["slot_files"] == 1 and directory["partials"] == 1
    assert directory["client_files"] == 2 and directory["in_use"] is False
    assert directory["bytes"] == sum(
        p.stat().st_size for p in (d / "entries").iterdir() if not p.name.endswith(".partial")
    )
    rows = {r["id"]: r for r in records if r["kind"] != "directory"}
    newest = rows[mixed_dir["newest"].id]
    bin_path, manifest_path = entry_files(d, mixed_dir["newest"])
    assert newest["kind"] == "entry" and newest["short"] == "aaaa0"
    assert newest["tokens"] == 6222 and newest["bytes"] == newest["bin_size"] == bin_path.stat().st_size
    assert newest["status"] == "usable" and newest["model_name"] == "Qwen2.5-7B-Instruct-Q4_K_M.gguf"
    assert newest["age_s"] == 3 * MIN + 5 and newest["saved_at"] == NOW - HOUR and newest["save_ms"] == 12.5
    assert newest["format"] == {"seq_version": 4, "layout": "packed-1"}
    assert newest["bin"] == str(bin_path) and newest["manifest"] == str(manifest_path)
    assert "match" not in newest  # no llama-server arguments given
    other = rows[mixed_dir["other_config"].id]
    assert other["status"] == "other_configuration"
    assert other["reason"] == "saved for another configuration: n_ctx_slot: 8192 -> 4096"
    mismatch = rows[mixed_dir["size_mismatch"].id]
    assert mismatch["status"] == "size_mismatch" and mismatch["bin_size"] == mismatch["bytes"] + 5
    interrupted = rows["9999" + "88" * 6]
    assert (
        interrupted["status"] == "interrupted_save"
        and interrupted["manifest"] is None
        and interrupted["tokens"] is None
    )
    assert rows[mixed_dir["no_bin"].id]["bin"] is None
    quarantined = rows["4444" + "99" * 6]
    assert quarantined["kind"] == "quarantined" and quarantined["tokens"] == 77
    assert quarantined["bin"] == str(d / "quarantine" / f"20250101-120000-{'4444' + '99' * 6}.bin")
    slot = rows["0"]
    assert slot["kind"] == "slot_file" and slot["status"] == "slot_file" and slot["tokens"] == 40
    assert slot["fingerprint"] == FP and slot["bin"] == str(d / "0.bin")


def test_ls_without_dirs_lists_the_default_cache_dirs(capsys, tmp_path):
    root = tmp_path / "xdg" / "slotkeeper"
    write_entry(root / "qwen.gguf-1a2b3c4d")
    write_entry(root / "bench")  # demo/bench are listed when they hold entries
    (root / "demo").mkdir()
    (root / "demo" / "model-e.gguf").write_bytes(b"m")  # a model only: skipped
    (root / "empty").mkdir()
    (root / "only-quarantine" / "quarantine").mkdir(parents=True)  # found, so that prune --quarantine reaches it
    (root / "only-quarantine" / "quarantine" / "20250101-000000-0123456789abcdef.bin").write_bytes(b"x")
    write_slot_file(root / "old-layout", 0)  # found, so that its slot files are not invisible
    (root / "other").mkdir()
    (root / "other" / "config.json").write_text("{}")  # not a slotkeeper name: skipped
    expected = ["bench", "old-layout", "only-quarantine", "qwen.gguf-1a2b3c4d"]
    code, out, _ = run(ls_main, capsys, "--json", env={"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert code == 0
    assert sorted({Path(r["dir"]).name for r in json.loads(out)}) == expected
    code, out, _ = run(ls_main, capsys, env={"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert "total: 2 entries" in out and "in 4 directories" in out
    assert "only-quarantine\n  entry " in out and table_rows(out)["0123"][-1] == "quarantined"
    assert "\n  0 entries, 0 B; quarantine: 1 entry, 1 B; snapshots/: 0 client files\n" in out
    code, out, _ = run(ls_main, capsys, env={"XDG_CACHE_HOME": str(tmp_path / "nothing")})
    assert code == 0 and out.startswith("no slotkeeper save directories under")
    # naming the cache root lists the directories below it, as with no DIR
    code, out, _ = run(ls_main, capsys, str(root), "--json", env={"XDG_CACHE_HOME": str(tmp_path / "nothing")})
    assert sorted({Path(r["dir"]).name for r in json.loads(out)}) == expected
    code, out, _ = run(ls_main, capsys, str(root / "empty"))
    assert out.splitlines()[1:] == [
        "  (no entries)",
        "  0 entries, 0 B; quarantine: 0 entries; snapshots/: 0 client files",
    ]


def test_ls_reads_what_the_store_writes(capsys, tmp_path):
    """The format ls reads is the one the daemon writes (the store's slotfiles.commit and _take_over_slot_files)."""
    d = tmp_path / "cache"
    model = write_model(tmp_path / "a.gguf")
    fp = fingerprint_for(str(model), ["-ctk", "q8_0"], 2, 512)
    entry = write_entry(d, tokens=321, fingerprint=fp)
    write_slot_file(d, 3, tokens=64, fingerprint=fp)
    (row, slot_row) = scan_dir(d).rows
    assert (row.id, row.status, row.tokens, row.model) == (entry.id, "usable", 321, str(model.resolve()))
    assert (slot_row.name, slot_row.status, slot_row.tokens) == ("3", "slot_file", 64)
    ConversationStore(d, None, fp, fsync=False).open()  # takes the slot file over
    _, out, _ = run(ls_main, capsys, str(d), "--", "-m", str(model), "-ctk", "q8_0", "-np", "2")
    rows = table_rows(out)
    assert len(rows) == 2 and [r[-1] for r in rows.values()] == ["yes", "yes"]
    assert sorted(r[1] for r in rows.values()) == ["321", "64"]


# ---- ls: matching llama-server arguments ------------------------------------------------------------------------


@pytest.fixture
def matched(tmp_path: Path) -> tuple[Path, Path, Path, Entry]:
    """An entry saved for model A with -ctk q8_0 -np 2 -c 1024 (512 per slot), and a model B of the same size."""
    model_a = write_model(tmp_path / "a.gguf")
    model_b = write_model(tmp_path / "b.gguf", b"GGUF model B" * 1000)
    d = tmp_path / "cache"
    entry = write_entry(d, fingerprint=fingerprint_for(str(model_a), ["-ctk", "q8_0", "-np", "2"], 2, 512))
    return d, model_a, model_b, entry


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["-m", "{a}", "-ctk", "q8_0"], "yes"),
        (["-m", "{a}", "-ctk", "q8_0", "-np", "2", "-c", "1024", "--port", "9000"], "yes"),
        (["-m", "{a}", "-ctk", "q8_0", "--parallel=2", "-c", "1000"], "yes"),  # 500, padded to 512 by llama.cpp
        (["-m", "{b}", "-ctk", "q8_0"], "no: model differs"),
        (["-m", "{a}"], "no: cache_type_k q8_0 -> default"),
        (["-m", "{a}", "-ctk", "q8_0", "-fa", "on"], "no: flash_attn default -> on"),
        (["-m", "{a}", "-ctk", "q8_0", "-np", "3"], "no: total_slots 2 -> 3 (-np)"),
        (["-m", "{a}", "-ctk", "q8_0", "-np", "2", "-c", "4096"], "no: n_ctx_slot 512 -> 2,048 (-c)"),
        (["-m", "{a}", "-ctk", "q8_0", "-c", "512"], "yes"),  # -np auto: one unified cache of 512
        (["-m", "{a}", "-ctk", "q8_0", "-np", "2", "-c", "512"], "no: n_ctx_slot 512 -> 256 (-c)"),
        (["-m", "{a}", "-ctk", "q8_0", "-c", "4096"], "no: n_ctx_slot 512 -> 4,096 (-c)"),
        (["-ctk", "q8_0"], "yes"),  # no -m: the model is not checked
    ],
)
def test_ls_match_column(capsys, matched, args, expected):
    d, model_a, model_b, entry = matched
    args = [a.format(a=model_a, b=model_b) for a in args]
    code, out, _ = run(ls_main, capsys, str(d), "--", *args)
    assert code == 0
    assert table_rows(out)[short(entry)][-1] == expected
    assert out.startswith("match: ")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["-kvu", "-np", "2", "-c", "512"], "yes"),  # a unified cache: each slot may use all of -c
        (["-kvu", "-np", "2", "-c", "1024"], "no: n_ctx_slot 512 -> 1,024 (-c)"),
        (["-kvu", "-c", "512"], "yes"),
        (["-kvu", "-c", "300"], "yes"),  # rounded up to a multiple of 256 by llama.cpp
        (["-kvu", "-c", "200"], "no: n_ctx_slot 512 -> 200..256 (-c)"),
        (["-np", "2", "-c", "1024"], "no: kv_unified kvu -> default"),
    ],
)
def test_ls_match_context_with_a_unified_cache(capsys, tmp_path, args, expected):
    model = write_model(tmp_path / "a.gguf")
    entry = write_entry(tmp_path / "cache", fingerprint=fingerprint_for(str(model), ["-kvu", "-np", "2"], 2, 512))
    _, out, _ = run(ls_main, capsys, str(tmp_path / "cache"), "--", "-m", str(model), *args)
    assert table_rows(out)[short(entry)][-1] == expected


def test_ls_match_skips_the_context_when_the_slot_count_is_unknown(capsys, tmp_path):
    """-no-kvu without -np: the context is split over llama-server's automatic slot count, unknown offline."""
    model = write_model(tmp_path / "a.gguf")
    entry = write_entry(tmp_path / "cache", fingerprint=fingerprint_for(str(model), ["-no-kvu"], 4, 1024))
    _, out, _ = run(ls_main, capsys, str(tmp_path / "cache"), "--", "-m", str(model), "-no-kvu", "-c", "16384")
    assert table_rows(out)[short(entry)][-1] == "yes"
    assert "n_ctx_slot not checked (-np unknown)" in " ".join(out.split())


def test_ls_match_notices_a_changed_model_file(capsys, matched):
    d, model_a, _, entry = matched
    write_model(model_a, b"GGUF model C" * 1000)  # same path and size, other weights
    _, out, _ = run(ls_main, capsys, str(d), "--", "-m", str(model_a), "-ctk", "q8_0")
    assert table_rows(out)[short(entry)][-1] == "no: model file changed"
    _, out, _ = run(ls_main, capsys, str(d), "--json", "--", "-m", str(model_a), "-ctk", "q8_0", "-np", "3")
    (record,) = [r for r in json.loads(out) if r["kind"] == "entry"]
    assert record["match"] is False
    assert record["differences"] == ["model file changed", "total_slots 2 -> 3 (-np)"]


def test_ls_match_follows_a_moved_model_file_as_the_store_does(capsys, matched, tmp_path):
    """The same bytes under another path are the same model (store.shareable): the daemon restores the entry,
    and ls says so."""
    d, model_a, _, entry = matched
    moved = tmp_path / "elsewhere" / "a.gguf"
    moved.parent.mkdir()
    moved.write_bytes(model_a.read_bytes())
    model_a.unlink()
    _, out, _ = run(ls_main, capsys, str(d), "--", "-m", str(moved), "-ctk", "q8_0")
    assert table_rows(out)[short(entry)][-1] == "yes"
    store = ConversationStore(d, None, fingerprint_for(str(moved), ["-ctk", "q8_0", "-np", "2"], 2, 512), fsync=False)
    store.open()
    assert list(store.entries) == [entry.id]


def test_ls_match_reports_unusable_rows_as_no_match(capsys, matched):
    d, model_a, _, entry = matched
    interrupted = d / "entries" / "0123456789abcdef.bin"
    interrupted.write_bytes(encode_slot_file([1, 2], "m.gguf"))
    _, out, _ = run(ls_main, capsys, str(d), "--json", "--", "-m", str(model_a), "-ctk", "q8_0")
    records = {r["id"]: r for r in json.loads(out) if r["kind"] == "entry"}
    assert records[entry.id]["match"] is True and records[entry.id]["differences"] == []
    assert records["0123456789abcdef"]["match"] is False
    assert records["0123456789abcdef"]["differences"] == ["interrupted save (removed at start)"]
    _, out, _ = run(ls_main, capsys, str(d), "--", "-m", str(model_a), "-ctk", "q8_0")
    assert table_rows(out)["0123"][-1] == "-"


# ---- the lock ---------------------------------------------------------------------------------------------------


def test_ls_and_prune_respect_a_held_lock(capsys, tmp_path):
    """A directory whose .lock a slotkeeper holds is listed as in use and not pruned without --force."""
    d = tmp_path / "cache"
    old = write_entry(d, age=30 * DAY)
    fd = lock_store(d)  # what a running slotkeeper holds (another open file: flock conflicts within a process too)
    try:
        _, out, _ = run(ls_main, capsys, str(d))
        assert f"in use by slotkeeper pid {os.getpid()}" in " ".join(out.split())
        _, out, _ = run(ls_main, capsys, str(d), "--json")
        assert json.loads(out)[0]["in_use"] is True and json.loads(out)[0]["lock_pid"] == os.getpid()
        for dry in ([], ["--dry-run"]):
            code, out, err = run(prune_main, capsys, str(d), "--older-than", "1d", *dry)
            assert code == 1 and out == "nothing to remove\n"
            assert err == (
                f"slotkeeper prune: skipped {d}: in use by slotkeeper pid {os.getpid()} (--force prunes it anyway)\n"
            )
            assert all(p.exists() for p in entry_files(d, old))
        code, out, err = run(prune_main, capsys, str(d), "--older-than", "1d", "--force")
        assert code == 0 and err == ""
        assert out.splitlines()[0] == f"pruning {d} although it is in use by slotkeeper pid {os.getpid()} (--force)"
        assert not any(p.exists() for p in entry_files(d, old))
    finally:
        os.close(fd)
    write_entry(d, age=30 * DAY)
    _, out, _ = run(ls_main, capsys, str(d))
    assert "in use" not in out  # the kernel dropped the lock with its descriptor; the .lock file itself stays
    code, out, _ = run(prune_main, capsys, str(d), "--older-than", "1d")
    assert code == 0 and names(d / "entries") == set()


def test_prune_holds_the_lock_while_it_removes(capsys, tmp_path, monkeypatch):
    """No slotkeeper can start on a directory while prune removes from it."""
    d = tmp_path / "cache"
    write_entry(d, age=30 * DAY)
    (d / ".lock").write_text("12345\n")
    seen: list[str] = []
    real = remove_pair

    def remove_pair_then_try_to_start(folder: Path, name: str) -> None:
        try:
            os.close(lock_store(d))
            seen.append("started")
        except StoreLockedError as exc:
            seen.append(f"refused: pid {exc}")
        real(folder, name)

    monkeypatch.setattr(catalog, "remove_pair", remove_pair_then_try_to_start)
    code, _, _ = run(prune_main, capsys, str(d), "--older-than", "1d")
    assert code == 0 and seen == [f"refused: pid {os.getpid()}"]
    os.close(lock_store(d))  # released afterwards


# ---- prune ------------------------------------------------------------------------------------------------------


def test_prune_older_than_removes_whole_entries(capsys, tmp_path):
    d = tmp_path / "cache"
    old = write_entry(d, age=20 * DAY, used_age=10 * DAY, tokens=6222)
    recent = write_entry(d, age=20 * DAY, used_age=2 * DAY)  # saved long ago, used lately: kept
    interrupted = d / "entries" / "0123456789abcdef.bin"
    interrupted.write_bytes(encode_slot_file([1], "m.gguf"))
    os.utime(interrupted, (NOW - 9 * DAY, NOW - 9 * DAY))
    write_slot_file(d, 0, age=8 * DAY)
    code, out, err = run(prune_main, capsys, str(d), "--older-than", "7d")
    assert code == 0 and err == ""
    assert names(d) == {f"entries/{recent.id}.bin", f"entries/{recent.id}.json"}
    lines = out.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith(f"removed entry 0123 in {d} (")
    assert lines[1].startswith(f"removed entry {short(old)} in {d} (6,222 tokens, ")
    assert lines[1].endswith("last used 10 d ago): unused for over 7 d")
    assert lines[2].startswith(f"removed slot file {d}/0.bin (50 tokens, ")
    assert lines[3].startswith("removed 2 entries and 1 slot file: ")


def test_prune_max_total_removes_the_least_recently_used_first_across_dirs(capsys, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a0 = write_entry(a, bytes_per_token=10_000, age=DAY, used_age=5 * HOUR)
    a1 = write_entry(a, bytes_per_token=10_000, age=5 * DAY, used_age=1 * HOUR)  # oldest save, used last
    b0 = write_entry(b, bytes_per_token=10_000, age=DAY, used_age=3 * HOUR)
    b1 = write_entry(b, bytes_per_token=10_000, age=DAY, used_age=2 * HOUR)
    one = sum(p.stat().st_size for p in entry_files(a, a0))
    assert 1_000_000 < one < 1_100_000
    code, out, _ = run(prune_main, capsys, str(a), str(b), "--max-total", "2.5MB")
    assert code == 0
    assert not any(p.exists() for e, d in ((a0, a), (b0, b)) for p in entry_files(d, e))  # 5 h and 3 h unused
    assert all(p.exists() for e, d in ((a1, a), (b1, b)) for p in entry_files(d, e))
    assert out.splitlines()[-1].startswith("removed 2 entries")
    code, out, _ = run(prune_main, capsys, str(a), str(b), "--max-total", "20GB")
    assert out.strip() == "nothing to remove" and len(names(a / "entries")) == 2


def test_prune_max_total_keeps_a_directory_exactly_at_the_limit(capsys, tmp_path):
    write_entry(tmp_path, age=2 * HOUR)
    newer = write_entry(tmp_path, age=1 * HOUR)
    total = sum(p.stat().st_size for p in (tmp_path / "entries").iterdir())  # both .bin and both .json count
    _, out, _ = run(prune_main, capsys, str(tmp_path), "--max-total", str(total))
    assert out.strip() == "nothing to remove" and len(names(tmp_path / "entries")) == 4
    _, out, _ = run(prune_main, capsys, str(tmp_path), "--max-total", str(total - 1))
    assert names(tmp_path / "entries") == {f"{newer.id}.bin", f"{newer.id}.json"}


def test_prune_quarantine_only_touches_quarantine(capsys, mixed_dir):
    d = mixed_dir["dir"]
    before = names(d)
    code, out, _ = run(prune_main, capsys, str(d), "--quarantine")
    assert code == 0
    qid = "4444" + "99" * 6
    assert names(d) == before - {f"quarantine/20250101-120000-{qid}.bin", f"quarantine/20250101-120000-{qid}.json"}
    assert (d / "quarantine").is_dir()
    assert re.fullmatch(
        rf"removed quarantined entry 4444 in {re.escape(str(d))} \(77 tokens, [\d.]+ KB, "
        r"last used 3 d ago\): quarantined",
        out.splitlines()[0],
    ), out
    assert re.fullmatch(r"removed 0 entries and 1 quarantined entry: [\d.]+ KB", out.splitlines()[-1])


def test_prune_missing_models(capsys, tmp_path):
    present = write_model(tmp_path / "present.gguf")
    gone = write_model(tmp_path / "gone.gguf")
    d = tmp_path / "cache"
    keep = write_entry(d, fingerprint=fingerprint_for(str(present), [], 1, 512))
    lost = write_entry(d, fingerprint=fingerprint_for(str(gone), [], 1, 512))
    unknown = write_entry(d, fingerprint=fingerprint_for("stub-model.gguf", [], 1, 512))  # never was a file
    write_slot_file(d, 4, fingerprint=fingerprint_for(str(gone), [], 1, 512))
    gone.unlink()
    code, out, _ = run(prune_main, capsys, str(d), "--missing-models")
    assert code == 0
    assert names(d) == {*(f"entries/{e.id}{s}" for e in (keep, unknown) for s in (".bin", ".json"))}
    assert not any(p.exists() for p in entry_files(d, lost))
    assert f"model gone: {gone}" in out.splitlines()[0] and f"model gone: {gone}" in out.splitlines()[1]


def test_prune_other_configs(capsys, tmp_path):
    """Without arguments: what ls shows as another configuration than the last run's; with llama-server
    arguments after --: what does not match them."""
    model = write_model(tmp_path / "a.gguf")
    d = tmp_path / "cache"
    last_run = write_entry(d, used_age=MIN, fingerprint=fingerprint_for(str(model), [], 2, 512))
    q8 = write_entry(d, used_age=HOUR, fingerprint=fingerprint_for(str(model), ["-ctk", "q8_0"], 2, 512))
    old_format = write_entry(d, used_age=DAY, version=3, fingerprint=fingerprint_for(str(model), [], 2, 512))
    code, out, _ = run(prune_main, capsys, str(d), "--other-configs", "--dry-run")
    assert code == 0 and len(out.splitlines()) == 2
    assert out.splitlines()[0].startswith(f"would remove entry {short(q8)} ")
    assert out.splitlines()[0].endswith("saved for another configuration: cache_type_k: 'q8_0' -> None")
    code, out, _ = run(prune_main, capsys, str(d), "--other-configs", "--", "-m", str(model), "-ctk", "q8_0")
    assert code == 0
    assert {p.name for p in (d / "entries").iterdir()} == {f"{q8.id}.bin", f"{q8.id}.json"}
    assert "not for these llama-server arguments: cache_type_k default -> q8_0" in out
    assert {short(last_run), short(old_format)} == {line.split()[2] for line in out.splitlines()[:-1]}


@pytest.mark.parametrize(
    "criteria",
    [
        ["--older-than", "1s"],
        ["--max-total", "0"],
        ["--quarantine"],
        ["--missing-models"],
        ["--other-configs"],
        ["--older-than", "0s", "--max-total", "0", "--quarantine", "--missing-models", "--other-configs"],
    ],
)
def test_prune_dry_run_removes_nothing(capsys, mixed_dir, criteria):
    d = mixed_dir["dir"]
    before = names(d)
    code, out, _ = run(prune_main, capsys, str(d), *criteria, "--dry-run")
    assert code == 0 and names(d) == before
    assert out.splitlines()[-1].endswith("(dry run)") or out.strip() == "nothing to remove"
    assert all(line.startswith("would remove") for line in out.splitlines() if line != "nothing to remove")
    assert len(out.splitlines()) > 1 or criteria == ["--missing-models"]  # (no model file is missing there)


def test_prune_everything_leaves_foreign_files_alone(capsys, mixed_dir):
    d = mixed_dir["dir"]
    (d / "quarantine" / "keep").mkdir()
    (d / "quarantine" / "keep" / "x.bin").write_bytes(b"x")
    (d / "entries" / "notes.txt").write_bytes(b"x")
    snapshots = names(d / "snapshots")
    code, out, _ = run(
        prune_main,
        capsys,
        str(d),
        "--older-than",
        "0s",
        "--max-total",
        "0",
        "--quarantine",
        "--missing-models",
        "--other-configs",
    )
    assert code == 0
    # every entry, slot file and quarantined pair went; clients' files, what is not slotkeeper's, the lock and
    # the partial manifest (the next start finishes or removes it) stayed
    assert names(d) == {
        *FOREIGN,
        "quarantine/keep/x.bin",
        "entries/notes.txt",
        "entries/aaaa0000" + "11" * 4 + ".json.partial",
        *(f"snapshots/{n}" for n in snapshots),
    }
    assert out.splitlines()[-1].startswith("removed 8 entries, 1 slot file and 1 quarantined entry: ")


def test_prune_deletes_the_manifest_before_the_bin(capsys, tmp_path, monkeypatch):
    d = tmp_path / "cache"
    entry = write_entry(d, age=DAY)
    bin_path, manifest_path = entry_files(d, entry)
    order: list[str] = []
    real_unlink = Path.unlink

    def recording_unlink(self: Path, missing_ok: bool = False) -> None:
        order.append(self.name)
        if self == bin_path:
            raise PermissionError(13, "Permission denied", str(self))  # interrupted after the manifest went
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", recording_unlink)
    code, _, err = run(prune_main, capsys, str(d), "--older-than", "1h")
    assert order == [manifest_path.name, bin_path.name]
    assert names(d / "entries") == {bin_path.name}  # an entry file without a manifest is removed at the next start
    assert code == 1 and err.count("\n") == 1 and f"{bin_path.name}: Permission denied" in err


def test_prune_keeps_an_entry_used_after_it_was_listed(tmp_path):
    """Under --force a running slotkeeper may restore an entry (its manifest is rewritten with the new last use)
    between the listing and the removal: prune keeps it."""
    d = tmp_path / "cache"
    entry = write_entry(d, age=DAY)
    (removal,) = plan_prune([scan_dir(d)], NOW, older_than=HOUR)
    time.sleep(0.01)
    edit_manifest(d, entry, last_used=NOW)  # what ConversationStore.touch writes
    assert "changed since it was listed" in (catalog.remove_files(removal) or "")
    assert all(p.exists() for p in entry_files(d, entry))


# ---- entries kept as blocks ----------------------------------------------------------------------------------------

CELL = 1000  # bytes per cell of the hand-made entries' one KV stream
BLOCK_CELLS = 4  # cells per cell block: each cell block is 4,000 bytes


def write_block(directory: Path, data: bytes) -> str:
    """A block as the store keeps it: blocks/<2 hex>/<the hash of its bytes>."""
    name = block_hash(data)
    path = block_path(directory / "blocks", name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return name


def write_block_entry(
    directory: Path,
    entry_id: str,
    skeleton: bytes,
    cells: Sequence[bytes],
    *,
    used_age: float,
    manifest: Path | None = None,
    blocks: bool = True,
) -> Entry:
    """An entry kept as blocks, as the store commits one: its blocks (its skeleton, then a cell block per
    BLOCK_CELLS cells of CELL bytes) under their hashes, then its version-3 manifest (by default in entries/).
    `blocks=False`: the manifest alone (a quarantined entry: the store dropped its blocks)."""
    directory.mkdir(parents=True, exist_ok=True)
    prepare_layout(directory)
    name = write_block if blocks else (lambda _, data: block_hash(data))
    parts = Parts(
        nbytes=len(skeleton) + len(cells) * BLOCK_CELLS * CELL,
        block_cells=BLOCK_CELLS,
        skeleton=name(directory, skeleton),
        sections=(
            CellSection.of_runs(
                len(cells) * BLOCK_CELLS, (RowRun(16, CELL),), tuple(name(directory, c) for c in cells)
            ),
        ),
    )
    entry = Entry(
        id=entry_id,
        n_tokens=300,
        nbytes=parts.nbytes,
        keys=[],
        saved_at=NOW - used_age,
        last_used=NOW - used_age,
        fingerprint=dict(FP),
        seq_version=4,
        layout="packed-1",
        parts=parts,
    )
    assert entry.manifest()["version"] == 3
    path = manifest or directory / "entries" / f"{entry_id}.json"
    path.parent.mkdir(exist_ok=True)
    write_json_atomic(path, entry.manifest(), fsync=False)
    return entry


def block_names(directory: Path) -> set[str]:
    """The files in blocks/ (blocks, partial ones), not its marker."""
    return {p.name for p in (directory / "blocks").rglob("*") if p.is_file() and p.name != UNCLEAN_NAME}


def disk_total(directory: Path) -> int:
    """What the entries hold on disk, as du counts it: every file in entries/ and every block, each once."""
    files = [p for p in (directory / "entries").iterdir() if not p.name.endswith(".partial")]
    files += [p for p in (directory / "blocks").rglob("*") if p.is_file() and p.name != UNCLEAN_NAME]
    return sum(p.stat().st_size for p in files)


@pytest.fixture
def shared_dir(tmp_path: Path) -> dict[str, Any]:
    """Three entries kept as blocks that share two cell blocks, each with a block of its own (its skeleton; c also
    a cell block), beside an entry kept as one file: a = A + [x, y], b = B + [x, y], c = C + [x, z]. x is all
    three's, y a's and b's; least recently used first: a, b, the file, c."""
    d = tmp_path / "cache"
    data = {name: name.encode() * (BLOCK_CELLS * CELL) for name in ("x", "y", "z")}
    data |= {"A": b"A" * 1000, "B": b"B" * 1200, "C": b"C" * 1500}
    e = {
        "a": write_block_entry(d, "aaaa" + "01" * 6, data["A"], [data["x"], data["y"]], used_age=10 * DAY),
        "b": write_block_entry(d, "bbbb" + "02" * 6, data["B"], [data["x"], data["y"]], used_age=5 * DAY),
        "c": write_block_entry(d, "cccc" + "03" * 6, data["C"], [data["x"], data["z"]], used_age=HOUR),
        "file": write_entry(d, tokens=200, age=2 * DAY, entry_id="dddd" + "04" * 6),
    }
    assert len(block_names(d)) == 6
    return {"dir": d, **e, "data": data, "block": {name: block_hash(value) for name, value in data.items()}}


def manifest_size(directory: Path, entry: Entry) -> int:
    return entry_files(directory, entry)[1].stat().st_size


def test_ls_counts_each_block_once_and_what_each_entry_holds_alone(capsys, shared_dir):
    d, block = shared_dir["dir"], shared_dir["block"]

    def size(*names: str) -> int:
        return sum(block_path(d / "blocks", block[name]).stat().st_size for name in names)

    code, out, err = run(ls_main, capsys, str(d), "--json")
    assert code == 0 and err == ""
    directory, *records = json.loads(out)
    rows = {r["id"]: r for r in records}
    assert {rows[shared_dir[k].id]["status"] for k in ("a", "b", "c", "file")} == {"usable"}
    for key, own in (("a", ["A"]), ("b", ["B"]), ("c", ["C", "z"])):
        row, entry = rows[shared_dir[key].id], shared_dir[key]
        assert row["bytes"] == entry.nbytes and row["bin_size"] is None and row["bin"] is None and row["blocks"] == 3
        assert row["own_bytes"] == size(*own)  # the blocks it shares are no one's own
        assert row["disk_bytes"] == row["own_bytes"] + manifest_size(d, entry)
    kept_as_file = rows[shared_dir["file"].id]
    bin_size = entry_files(d, shared_dir["file"])[0].stat().st_size
    assert kept_as_file["blocks"] is None and kept_as_file["own_bytes"] == kept_as_file["bin_size"] == bin_size
    assert kept_as_file["disk_bytes"] == bin_size + manifest_size(d, shared_dir["file"])
    # the directory: its bytes on disk, each block once (not the sum of the entries' sizes)
    assert directory["bytes"] == disk_total(d) < sum(r["bytes"] for r in records)
    assert directory["blocks"] == 6 and directory["block_bytes"] == size(*block)
    assert directory["unused_blocks"] == directory["unused_block_bytes"] == 0

    _, out, _ = run(ls_main, capsys, str(d))
    header = next(line for line in out.splitlines() if line.strip().startswith("entry"))
    assert header.split()[:4] == ["entry", "tokens", "size", "own"]
    table = table_rows(out)
    assert table["aaaa"][1:4] == ["300", fmt_bytes(shared_dir["a"].nbytes), fmt_bytes(size("A"))]
    assert table["cccc"][3] == fmt_bytes(size("C", "z")) and table["cccc"][-1] == "usable"
    assert table["dddd"][2] == table["dddd"][3] == fmt_bytes(bin_size)
    state = sum(shared_dir[k].nbytes for k in "abc")
    summary = " ".join(out.split())
    assert f"4 entries, {fmt_bytes(disk_total(d))}; blocks/: 6 blocks, {fmt_bytes(size(*block))} for " in summary
    assert f" for {fmt_bytes(state)} of state; quarantine: 0 entries;" in summary
    assert all(len(line) <= 100 for line in out.splitlines())


def test_prune_of_an_entry_kept_as_blocks_removes_only_its_own_blocks(capsys, shared_dir):
    d, a, block = shared_dir["dir"], shared_dir["a"], shared_dir["block"]
    before = block_names(d)
    freed = manifest_size(d, a) + 1000  # its manifest and its skeleton
    code, out, err = run(prune_main, capsys, str(d), "--older-than", "7d")
    assert code == 0 and err == ""
    assert out.splitlines() == [
        f"removed entry aaaa in {d} (300 tokens, {fmt_bytes(a.nbytes)}, frees {fmt_bytes(freed)}, "
        "last used 10 d ago): unused for over 7 d",
        f"removed 1 entry: {fmt_bytes(freed)}",
    ]
    assert not entry_files(d, a)[1].exists()
    assert block_names(d) == before - {block["A"]}  # x and y stay: b and c use them
    assert not (d / "blocks" / UNCLEAN_NAME).exists()  # the blocks are as the manifests say
    # the others are whole: listed usable (y is now b's alone), and the store takes them as they are
    _, out, _ = run(ls_main, capsys, str(d), "--json")
    rows = {r["id"]: r for r in json.loads(out)[1:]}
    assert {i: r["status"] for i, r in rows.items()} == {shared_dir[k].id: "usable" for k in ("b", "c", "file")}
    assert rows[shared_dir["b"].id]["own_bytes"] == 1200 + BLOCK_CELLS * CELL
    store = ConversationStore(d, None, dict(FP), fsync=False)
    store.open()
    assert set(store.entries) == {shared_dir[k].id for k in ("b", "c", "file")} and not store.skipped


def test_prune_max_total_counts_each_block_once(capsys, shared_dir):
    """The budget is the bytes on disk; an entry frees its own blocks, and a shared block goes with its last
    user: b, once a went, frees y as well."""
    d, a, b, block = shared_dir["dir"], shared_dir["a"], shared_dir["b"], shared_dir["block"]
    total = disk_total(d)
    code, out, _ = run(prune_main, capsys, str(d), "--max-total", str(total))
    assert code == 0 and out == "nothing to remove\n" and len(block_names(d)) == 6
    freed_a = manifest_size(d, a) + 1000
    freed_b = manifest_size(d, b) + 1200 + BLOCK_CELLS * CELL
    code, out, _ = run(prune_main, capsys, str(d), "--max-total", str(total - freed_a - 1))
    assert code == 0
    assert [line.split()[2] for line in out.splitlines()[:-1]] == ["aaaa", "bbbb"]
    assert f", frees {fmt_bytes(freed_b)}, last used 5 d ago): over --max-total" in out.splitlines()[1]
    assert out.splitlines()[-1] == f"removed 2 entries: {fmt_bytes(freed_a + freed_b)}"
    assert block_names(d) == {block[name] for name in ("x", "z", "C")}
    assert disk_total(d) == total - freed_a - freed_b


def test_prune_of_every_entry_removes_every_block(capsys, shared_dir):
    d = shared_dir["dir"]
    total = disk_total(d)
    code, out, err = run(prune_main, capsys, str(d), "--older-than", "0s")
    assert code == 0 and err == ""
    assert names(d / "entries") == set() and block_names(d) == set()
    assert not (d / "blocks" / UNCLEAN_NAME).exists()
    assert out.splitlines()[-1] == f"removed 4 entries: {fmt_bytes(total)}"  # each block counted once


def test_a_block_prune_cannot_remove_is_said_and_left_to_the_next_start(capsys, shared_dir, monkeypatch):
    """blocks/ is marked unclean before the manifests go: a block left behind (here one that could not be
    removed; or a crash) is swept by the store's next start, as after a save that crashed."""
    d, block = shared_dir["dir"], shared_dir["block"]
    monkeypatch.setattr(blockfiles, "remove_blocks", lambda folder, names: len(names))  # as on a read-only remount
    code, out, err = run(prune_main, capsys, str(d), "--older-than", "7d")
    assert code == 1 and out.splitlines()[-1].startswith("removed 1 entry: ")
    assert err == f"slotkeeper prune: not removed: 1 unused block in {d} (a later prune removes them)\n"
    assert block["A"] in block_names(d) and (d / "blocks" / UNCLEAN_NAME).exists()
    monkeypatch.undo()
    store = ConversationStore(d, None, dict(FP), fsync=False)
    store.open()
    assert block_names(d) == {block[name] for name in ("B", "C", "x", "y", "z")}
    assert not (d / "blocks" / UNCLEAN_NAME).exists()


def test_prune_removes_no_block_while_a_manifest_cannot_be_read(capsys, shared_dir):
    """A manifest another slotkeeper version wrote (or a damaged one) may name any block: prune removes the
    manifests it is asked to and no block, in one line; once no such manifest is left, the blocks go."""
    d, a, block = shared_dir["dir"], shared_dir["a"], shared_dir["block"]
    bad = d / "entries" / ("eeee" + "05" * 6 + ".json")
    bad.write_text(json.dumps({"version": 4, "parts": "a newer slotkeeper's"}))
    os.utime(bad, (NOW - HOUR, NOW - HOUR))
    crashed = write_block(d, b"saved, never committed" * 10)
    before = block_names(d)
    freed = manifest_size(d, a)  # its manifest only
    code, out, err = run(prune_main, capsys, str(d), "--older-than", "7d")
    assert code == 0 and err == ""
    assert out.splitlines() == [
        f"removed entry aaaa in {d} (300 tokens, {fmt_bytes(a.nbytes)}, frees {fmt_bytes(freed)}, "
        "last used 10 d ago): unused for over 7 d",
        f"blocks kept in {d} ({fmt_bytes(1000 + 220)} that no remaining entry uses): "
        "1 manifest in entries/ cannot be read and may use them",
        f"removed 1 entry: {fmt_bytes(freed)}",
    ]
    assert not entry_files(d, a)[1].exists() and block_names(d) == before
    assert not (d / "blocks" / UNCLEAN_NAME).exists()  # no start is asked to sweep them: a later prune does
    # once the unreadable manifest goes too (here by age), so do the blocks no manifest names
    os.utime(bad, (NOW - 30 * DAY, NOW - 30 * DAY))
    code, out, err = run(prune_main, capsys, str(d), "--older-than", "7d")
    assert code == 0 and err == "" and not bad.exists()
    assert block_names(d) == before - {block["A"], crashed}
    assert out.splitlines()[1] == f"removed 2 unused blocks in {d}, {fmt_bytes(1000 + 220)} (no manifest uses them)"
    assert not (d / "blocks" / UNCLEAN_NAME).exists()


def test_prune_removes_the_blocks_no_manifest_uses(capsys, shared_dir):
    """Blocks no manifest names (a save that crashed before its manifest, a manifest removed by hand) and
    partial ones: ls counts them, prune removes them (not with --dry-run), with the marker a crash left."""
    d, block = shared_dir["dir"], shared_dir["block"]
    crashed = write_block(d, b"saved, never committed" * 100)
    partial = block_path(d / "blocks", block["x"]).with_name(f"{block['x']}.0badcafe.partial")
    partial.write_bytes(b"p" * 10)
    (d / "blocks" / UNCLEAN_NAME).touch()  # what a run that did not stop cleanly leaves
    unused = 2200 + 10
    _, out, _ = run(ls_main, capsys, str(d), "--json")
    directory = json.loads(out)[0]
    assert directory["unused_blocks"] == 2 and directory["unused_block_bytes"] == unused
    assert directory["blocks"] == 6 and directory["bytes"] == disk_total(d) - unused  # no entry holds them
    _, out, _ = run(ls_main, capsys, str(d))
    assert f", 2 unused ({fmt_bytes(unused)}: prune removes them);" in " ".join(out.split())
    before = names(d)
    code, out, err = run(prune_main, capsys, str(d), "--older-than", "30d", "--dry-run")
    assert code == 0 and err == "" and names(d) == before
    assert out == f"would remove 2 unused blocks in {d}, {fmt_bytes(unused)} (no manifest uses them)\n"
    code, out, err = run(prune_main, capsys, str(d), "--older-than", "30d")
    assert code == 0 and err == ""
    assert out == f"removed 2 unused blocks in {d}, {fmt_bytes(unused)} (no manifest uses them)\n"
    gone = {f"blocks/{crashed[:2]}/{crashed}", f"blocks/{partial.parent.name}/{partial.name}", "blocks/.unclean"}
    assert names(d) == before - gone
    code, out, _ = run(prune_main, capsys, str(d), "--older-than", "30d")
    assert out == "nothing to remove\n"


def test_a_quarantined_entry_kept_as_blocks_is_listed_and_pruned(capsys, shared_dir):
    """quarantine/<stamp>-<id>.json without a .bin: the store dropped its blocks as it moved it aside, so it
    holds none (a block it names that another entry uses stays)."""
    d, data = shared_dir["dir"], shared_dir["data"]
    stem = "20250101-120000-" + "4444" + "09" * 6
    path = d / "quarantine" / f"{stem}.json"
    entry = write_block_entry(
        d, "4444" + "09" * 6, b"Q" * 900, [data["x"]], used_age=3 * DAY, manifest=path, blocks=False
    )
    _, out, err = run(ls_main, capsys, str(d), "--json")
    assert err == ""
    directory, *records = json.loads(out)
    (row,) = [r for r in records if r["kind"] == "quarantined"]
    assert row["id"] == entry.id and row["status"] == "quarantined" and row["tokens"] == 300
    assert row["bytes"] == entry.nbytes and row["bin"] is None and row["bin_size"] is None
    assert row["own_bytes"] == 0 and row["disk_bytes"] == path.stat().st_size and row["manifest"] == str(path)
    assert directory["quarantined"] == 1 and directory["quarantine_bytes"] == path.stat().st_size
    assert directory["bytes"] == disk_total(d)  # not counted among the entries
    _, out, _ = run(ls_main, capsys, str(d))
    assert table_rows(out)["4444"][1:4] == ["300", fmt_bytes(entry.nbytes), "0 B"]
    assert table_rows(out)["4444"][-1] == "quarantined"
    before, manifest_bytes = block_names(d), path.stat().st_size
    code, out, _ = run(prune_main, capsys, str(d), "--quarantine")
    assert code == 0 and not path.exists() and block_names(d) == before  # x stays: a, b and c use it
    assert out.splitlines()[-1] == f"removed 0 entries and 1 quarantined entry: {fmt_bytes(manifest_bytes)}"


def test_prune_force_keeps_the_blocks_a_running_slotkeeper_may_count_on(capsys, shared_dir):
    """Under --force, the running slotkeeper's saves count on the blocks it knows: only manifests go, one line
    says so, and its blocks/ (and marker) are left to it."""
    d, a = shared_dir["dir"], shared_dir["a"]
    before = block_names(d)
    freed = manifest_size(d, a)
    fd = lock_store(d)
    try:
        code, out, err = run(prune_main, capsys, str(d), "--older-than", "7d", "--force")
    finally:
        os.close(fd)
    assert code == 0 and err == ""
    assert out.splitlines()[1:] == [
        f"removed entry aaaa in {d} (300 tokens, {fmt_bytes(a.nbytes)}, frees {fmt_bytes(freed)}, "
        "last used 10 d ago): unused for over 7 d",
        f"blocks kept in {d} ({fmt_bytes(1000)} that no remaining entry uses): "
        f"it is in use by slotkeeper pid {os.getpid()}",
        f"removed 1 entry: {fmt_bytes(freed)}",
    ]
    assert not entry_files(d, a)[1].exists() and block_names(d) == before
    assert not (d / "blocks" / UNCLEAN_NAME).exists()
    code, out, _ = run(prune_main, capsys, str(d), "--older-than", "7d")  # once it is not held: they go
    assert out == f"removed 1 unused block in {d}, {fmt_bytes(1000)} (no manifest uses them)\n"


def test_prune_keeps_the_blocks_a_manifest_beside_a_link_names(capsys, shared_dir):
    """A pair with a link is never used nor removed; the blocks its manifest names stay with it."""
    d, c, block = shared_dir["dir"], shared_dir["c"], shared_dir["block"]
    linked = "ffff" + "06" * 6
    write_json_atomic(d / "entries" / f"{linked}.json", {**c.manifest(), "id": linked}, fsync=False)
    (d / "entries" / f"{linked}.bin").symlink_to("/etc/passwd")
    code, out, err = run(prune_main, capsys, str(d), "--older-than", "0s")
    assert code == 0 and err == "" and out.splitlines()[-1].startswith("removed 4 entries: ")
    assert names(d / "entries") == {f"{linked}.json", f"{linked}.bin"}
    assert (d / "entries" / f"{linked}.bin").is_symlink()
    assert block_names(d) == {block[name] for name in ("C", "x", "z")}


# ---- against a real slotkeeper ----------------------------------------------------------------------------------


def test_ls_and_prune_what_a_real_slotkeeper_saved(capsys, stub_slotkeeper):
    """Two chats on the stub llama-server, saved at stop: listed as usable entries; prune refuses while
    slotkeeper runs and keeps the one used last, which the next run restores."""
    prompts = [f"conversation {i}: " + "Every token of this conversation is kept. " * 8 for i in range(2)]
    assert all(len(p) > 256 for p in prompts)  # over --min-save-tokens (the stub's tokens are bytes)
    sk = stub_slotkeeper("-np", "2")
    save_dir = sk.extra["save_dir"]
    for slot, prompt in enumerate(prompts):
        assert sk.call("POST", "/completion", {"prompt": prompt, "n_predict": 4, "id_slot": slot}).status == 200
    env = {"XDG_CACHE_HOME": "/nonexistent-xdg"}
    code, out, err = run(prune_main, capsys, str(save_dir), "--max-total", "0", env=env)
    assert code == 1 and f"skipped {save_dir}: in use by slotkeeper pid {sk.pid}" in err
    _, out, _ = run(ls_main, capsys, str(save_dir), env=env)
    assert f"in use by slotkeeper pid {sk.pid}" in " ".join(out.split())
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0, sk.logs()

    code, out, _ = run(ls_main, capsys, str(save_dir), "--json", "--", "-np", "2", "-c", "4096", env=env)
    assert code == 0
    directory, *rows = json.loads(out)
    assert directory["entries"] == directory["usable"] == 2 and directory["in_use"] is False
    manifests = {p.stem: read_json(p) or {} for p in (save_dir / "entries").glob("*.json")}
    assert {r["id"] for r in rows} == set(manifests) and len(manifests) == 2
    skeletons = {}
    for row in rows:
        assert row["status"] == "usable" and row["model_name"] == "stub-model.gguf" and row["match"] is True
        assert row["tokens"] == manifests[row["id"]]["tokens"] > 256
        # kept as blocks (no .bin): the stub's file is one block, its skeleton, which no other entry shares
        parts = Parts.from_json(manifests[row["id"]]["parts"])
        skeletons[row["id"]] = block_path(save_dir / "blocks", parts.skeleton)
        assert row["bin_size"] is None and row["bin"] is None
        assert not (save_dir / "entries" / f"{row['id']}.bin").exists()
        assert row["bytes"] == manifests[row["id"]]["bytes"] == parts.nbytes and row["blocks"] == 1
        assert row["own_bytes"] == skeletons[row["id"]].stat().st_size == row["bytes"]
        manifest_size = (save_dir / "entries" / f"{row['id']}.json").stat().st_size
        assert row["disk_bytes"] == row["own_bytes"] + manifest_size
    assert directory["bytes"] == sum(r["disk_bytes"] for r in rows)  # nothing shared between the two
    _, out, _ = run(ls_main, capsys, str(save_dir), "--", "-np", "3", env=env)
    assert [r[-1] for r in table_rows(out).values()] == ["no: total_slots 2 -> 3 (-np)"] * 2

    last = max(rows, key=lambda r: r["last_used"])
    first = min(rows, key=lambda r: r["last_used"])
    code, out, _ = run(prune_main, capsys, str(save_dir), "--max-total", str(last["disk_bytes"]), env=env)
    assert code == 0 and out.splitlines()[0].startswith(f"removed entry {first['short']} ")
    assert {p.stem for p in (save_dir / "entries").glob("*.json")} == {last["id"]}
    assert not skeletons[first["id"]].exists() and skeletons[last["id"]].exists()  # its block went with it
    sk2 = stub_slotkeeper("-np", "2")
    assert f"chat {last['id'][:4]} restored into slot" in sk2.logs(), sk2.logs()


# ---- the shared tier (--remote) -----------------------------------------------------------------------------------

BUCKET = "shared"
URL = f"s3://{BUCKET}/kv"


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[S3Server]:
    server = S3Server(tmp_path / "s3", bucket=BUCKET).start()
    yield server
    server.kill()


def remote_objects(s3: S3Server) -> set[str]:
    root = s3.object_path("kv")
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def put_remote(
    s3: S3Server,
    namespace: str,
    entry: Entry | None,
    *,
    manifest: dict[str, Any] | None = None,
    entry_id: str | None = None,
) -> str:
    """An entry as the remote tier uploads it: the .bin, then its manifest with the .bin's sha256 and bytes."""
    import obstore

    from slotkeeper.remote.tier import RemoteConfig

    bucket = RemoteConfig.from_url(URL, s3.env()).store(timedelta(seconds=10), timedelta(seconds=10))
    data = encode_slot_file(list(range(1, (entry.n_tokens if entry else 10) + 1)), "m.gguf")
    entry_id = entry.id if entry else entry_id or secrets.token_hex(8)
    obstore.put(bucket, f"{namespace}/{entry_id}.bin", data)
    body = manifest if manifest is not None else entry.manifest() if entry else {}
    body = {**body, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    obstore.put(bucket, f"{namespace}/{entry_id}.json", json.dumps(body).encode())
    return entry_id


def remote_entry(tokens: int, used_age: float, fingerprint: dict[str, Any]) -> Entry:
    return Entry(
        id=secrets.token_hex(8),
        n_tokens=tokens,
        nbytes=0,
        keys=["k"],
        saved_at=NOW - used_age,
        last_used=NOW - used_age,
        fingerprint=fingerprint,
        seq_version=4,
        layout="packed-1",
    )


def test_ls_and_prune_the_shared_tier(capsys, s3):
    """Each namespace's entries, judged as a fetch would (readable manifest, the namespace its fingerprint
    names); prune deletes both objects of an entry and nothing else."""
    plain, q8 = {**FP}, {**FP, "cache_type_k": "q8_0"}
    ns_plain, ns_q8 = namespace_key(plain), namespace_key(q8)
    old = remote_entry(100, 10 * DAY, plain)
    new = remote_entry(200, HOUR, plain)
    other = remote_entry(300, 2 * HOUR, q8)
    misplaced = remote_entry(50, HOUR, plain)  # plain's entry under q8's namespace: never fetched there
    for namespace, entry in ((ns_plain, old), (ns_plain, new), (ns_q8, other), (ns_q8, misplaced)):
        put_remote(s3, namespace, entry)
    bad = put_remote(s3, ns_q8, None, manifest={"id": "x"}, entry_id="badbadbadbadbad0")
    env = {**s3.env(), "XDG_CACHE_HOME": "/nonexistent-xdg"}

    code, out, err = run(ls_main, capsys, "--remote", "--remote-store", URL, "--json", env=env)
    assert code == 0 and err == ""
    records = json.loads(out)
    namespaces = {r["namespace"]: r for r in records if r["kind"] == "remote_namespace"}
    assert set(namespaces) == {ns_plain, ns_q8} and namespaces[ns_q8]["entries"] == 3
    rows = {r["id"]: r for r in records if r["kind"] == "remote"}
    assert {i: rows[i]["status"] for i in rows} == {
        old.id: "shared",
        new.id: "shared",
        other.id: "shared",
        misplaced.id: "other_namespace",
        bad: "remote_bad_manifest",
    }
    assert rows[new.id]["tokens"] == 200 and rows[new.id]["age_s"] == HOUR and rows[new.id]["namespace"] == ns_plain
    assert rows[new.id]["bytes"] == len(encode_slot_file(list(range(200)), "m.gguf"))

    code, out, _ = run(ls_main, capsys, "--remote", "--", "-ctk", "q8_0", env={**env, "SLOTKEEPER_REMOTE_STORE": URL})
    assert code == 0 and f"{URL}/{ns_plain}\n" in out and f"{URL}/{ns_q8}\n" in out
    table = table_rows(out)
    assert table[short(other)][-2:] == ["shared", "yes"]
    assert table[short(new)][-1] == "no: cache_type_k default -> q8_0"
    assert table[short(misplaced)][-2:] == ["other namespace (never used)", "-"]
    assert "3 entries, " in out and "(2 never used)" in out and "total: 5 entries, " in out

    before = remote_objects(s3)
    code, out, _ = run(
        prune_main, capsys, "--remote", "--remote-store", URL, "--older-than", "7d", "--dry-run", env=env
    )
    assert code == 0 and remote_objects(s3) == before
    assert {line.split()[4] for line in out.splitlines()[:-1]} == {short(old), bad[:4]}  # (no last use: oldest)
    code, out, _ = run(prune_main, capsys, "--remote", "--remote-store", URL, "--older-than", "7d", env=env)
    assert code == 0 and out.splitlines()[-1].startswith("removed 2 remote entries: ")
    gone = {f"{ns_plain}/{old.id}.bin", f"{ns_plain}/{old.id}.json", f"{ns_q8}/{bad}.bin", f"{ns_q8}/{bad}.json"}
    assert remote_objects(s3) == before - gone
    code, out, _ = run(
        prune_main, capsys, "--remote", "--remote-store", URL, "--other-configs", "--", "-ctk", "q8_0", env=env
    )
    assert code == 0 and out.splitlines()[0].startswith(f"removed remote entry {short(new)} in {URL}/{ns_plain} ")
    assert out.splitlines()[0].endswith("not for these llama-server arguments: cache_type_k default -> q8_0")
    assert {p.split("/")[1].split(".")[0] for p in remote_objects(s3)} == {other.id, misplaced.id}


def test_ls_and_prune_remote_what_a_real_slotkeeper_uploaded(capsys, s3, stub_slotkeeper):
    """A slotkeeper with --remote-store uploads its entries; ls --remote lists them under the namespace of its
    fingerprint, with the local manifests' tokens; prune --remote --max-total keeps the one used last, and
    leaves the local store alone."""
    sk = stub_slotkeeper("-np", "2", own=("--remote-store", URL), stub=s3.env())
    for slot in range(2):
        prompt = f"conversation {slot}: " + "Every token of this conversation is kept. " * 8
        assert sk.call("POST", "/completion", {"prompt": prompt, "n_predict": 4, "id_slot": slot}).status == 200
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0, sk.logs()
    if not wait_until(lambda: sum(p.endswith(".json") for p in remote_objects(s3)) == 2, 5):
        sk = stub_slotkeeper("-np", "2", own=("--remote-store", URL), stub=s3.env())  # resumes the uploads
        assert wait_until(lambda: sum(p.endswith(".json") for p in remote_objects(s3)) == 2, 30), sk.logs()
        sk.killpg(signal.SIGTERM)
        sk.wait()
    save_dir = sk.extra["save_dir"]
    local = {p.stem: read_json(p) for p in (save_dir / "entries").glob("*.json")}
    assert len(local) == 2
    env = {**s3.env(), "XDG_CACHE_HOME": "/nonexistent-xdg"}
    code, out, _ = run(ls_main, capsys, "--remote", "--remote-store", URL, "--json", "--", "-np", "2", env=env)
    assert code == 0
    (namespace, *rows) = json.loads(out)
    fingerprint = next(iter(local.values()))["fingerprint"]  # type: ignore[index]
    assert namespace["namespace"] == namespace_key(fingerprint) and namespace["entries"] == 2
    assert {r["id"]: r["tokens"] for r in rows} == {i: m["tokens"] for i, m in local.items()}  # type: ignore[index]
    assert all(r["status"] == "shared" and r["match"] is True for r in rows)
    last = max(rows, key=lambda r: r["last_used"])
    # each entry is its manifest and its blocks (content-addressed, under the namespace's blocks/)
    ns = namespace["namespace"]
    blocks = {i: set(Parts.from_json(m["parts"]).block_sizes()) for i, m in local.items()}  # type: ignore[index]
    assert all(blocks.values()) and not set.intersection(*blocks.values())  # two chats: no block shared
    assert remote_objects(s3) == {f"{ns}/{i}.json" for i in local} | {
        f"{ns}/blocks/{b}" for b in set.union(*blocks.values())
    }
    code, out, _ = run(
        prune_main, capsys, "--remote", "--remote-store", URL, "--max-total", str(last["bytes"]), env=env
    )
    assert code == 0 and out.splitlines()[-1].startswith("removed 1 remote entry: ")
    assert remote_objects(s3) == {f"{ns}/{last['id']}.json"} | {f"{ns}/blocks/{b}" for b in blocks[last["id"]]}
    assert {p.stem for p in (save_dir / "entries").glob("*.json")} == set(local)


def put_remote_blocks(s3: S3Server, namespace: str, directory: Path, entry: Entry) -> None:
    """An entry kept as blocks as the remote tier uploads it: its blocks, then its manifest (the local one, with
    the checksum of its file, which the store takes at every save and a remote entry must have)."""
    import obstore

    from slotkeeper.remote.tier import RemoteConfig

    bucket = RemoteConfig.from_url(URL, s3.env()).store(timedelta(seconds=10), timedelta(seconds=10))
    assert entry.parts is not None
    for name in entry.parts.block_sizes():
        obstore.put(bucket, f"{namespace}/blocks/{name}", block_path(directory / "blocks", name).read_bytes())
    checksum = blockfiles.assemble(directory / "blocks", entry.parts, directory / "assembled")
    (directory / "assembled").unlink()
    manifest = {**entry.manifest(), "checksum": checksum}
    obstore.put(bucket, f"{namespace}/{entry.id}.json", json.dumps(manifest).encode())


@pytest.fixture
def shared_bucket(s3, shared_dir) -> dict[str, Any]:
    """shared_dir's three entries kept as blocks, uploaded to the bucket under FP's namespace: a = A + [x, y],
    b = B + [x, y], c = C + [x, z], least recently used first."""
    namespace = namespace_key(FP)
    for key in "abc":
        put_remote_blocks(s3, namespace, shared_dir["dir"], shared_dir[key])
    return {**shared_dir, "ns": namespace, "env": {**s3.env(), "XDG_CACHE_HOME": "/nonexistent-xdg"}}


def remote_blocks(s3: S3Server, namespace: str) -> set[str]:
    return {p.split("/")[-1] for p in remote_objects(s3) if p.startswith(f"{namespace}/blocks/")}


def test_ls_remote_lists_entries_kept_as_blocks_and_what_each_holds_alone(capsys, s3, shared_bucket):
    ns, block, env = shared_bucket["ns"], shared_bucket["block"], shared_bucket["env"]
    code, out, err = run(ls_main, capsys, "--remote", "--remote-store", URL, "--json", env=env)
    assert code == 0 and err == ""
    namespace, *records = json.loads(out)
    assert namespace["namespace"] == ns and namespace["entries"] == 3
    rows = {r["id"]: r for r in records}
    for key, own in (("a", "A"), ("b", "B"), ("c", "Cz")):
        row, entry = rows[shared_bucket[key].id], shared_bucket[key]
        assert row["status"] == "shared" and row["bytes"] == entry.nbytes and row["blocks"] == 3
        assert row["sha256"] is None
        assert row["own_bytes"] == sum(len(shared_bucket["data"][name]) for name in own)
    _, out, _ = run(ls_main, capsys, "--remote", "--remote-store", URL, env=env)
    table = table_rows(out)
    assert table["cccc"][1:4] == ["300", fmt_bytes(shared_bucket["c"].nbytes), fmt_bytes(1500 + 4000)]
    assert remote_blocks(s3, ns) == set(block.values())


def test_prune_remote_removes_an_entry_and_only_the_blocks_no_remaining_entry_uses(capsys, s3, shared_bucket):
    ns, block, env = shared_bucket["ns"], shared_bucket["block"], shared_bucket["env"]
    a, b = shared_bucket["a"], shared_bucket["b"]
    where = f"{URL}/{ns}"
    before = remote_objects(s3)
    code, out, err = run(
        prune_main, capsys, "--remote", "--remote-store", URL, "--older-than", "7d", "--dry-run", env=env
    )
    assert code == 0 and err == "" and remote_objects(s3) == before
    assert out.splitlines()[1:] == [
        f"would remove 1 remote block in {where}, {fmt_bytes(1000)} (no remaining entry uses them)",
        f"would remove 1 remote entry: {fmt_bytes(1000)} (dry run)",
    ]
    code, out, err = run(prune_main, capsys, "--remote", "--remote-store", URL, "--older-than", "7d", env=env)
    assert code == 0 and err == ""
    assert out.splitlines() == [
        f"removed remote entry aaaa in {where} (300 tokens, {fmt_bytes(a.nbytes)}, frees {fmt_bytes(1000)}, "
        "last used 10 d ago): unused for over 7 d",
        f"removed 1 remote block in {where}, {fmt_bytes(1000)} (no remaining entry uses them)",
        f"removed 1 remote entry: {fmt_bytes(1000)}",
    ]
    assert remote_objects(s3) == before - {f"{ns}/{a.id}.json", f"{ns}/blocks/{block['A']}"}  # x, y: b's too
    code, out, _ = run(prune_main, capsys, "--remote", "--remote-store", URL, "--older-than", "2d", env=env)
    assert code == 0 and out.splitlines()[1] == (
        f"removed 2 remote blocks in {where}, {fmt_bytes(1200 + 4000)} (no remaining entry uses them)"
    )
    assert remote_blocks(s3, ns) == {block[name] for name in ("C", "x", "z")}  # y went with b, its last user
    assert f"{ns}/{b.id}.json" not in remote_objects(s3)


def test_prune_remote_removes_no_block_while_a_manifest_cannot_be_read(capsys, s3, shared_bucket):
    import obstore

    from slotkeeper.remote.tier import RemoteConfig

    ns, env = shared_bucket["ns"], shared_bucket["env"]
    bucket = RemoteConfig.from_url(URL, s3.env()).store(timedelta(seconds=10), timedelta(seconds=10))
    obstore.put(bucket, f"{ns}/damaged0damaged0.json", b'{"parts": "not parts", "bytes": 1')
    blocks = remote_blocks(s3, ns)
    code, out, err = run(prune_main, capsys, "--remote", "--remote-store", URL, "--older-than", "7d", env=env)
    assert code == 0 and err == ""
    assert out.splitlines()[1:] == [
        f"remote blocks kept in {URL}/{ns}: a manifest there cannot be read and may use them",
        "removed 1 remote entry: 0 B",
    ]
    assert remote_blocks(s3, ns) == blocks and f"{ns}/{shared_bucket['a'].id}.json" not in remote_objects(s3)


def test_prune_remote_removes_the_old_blocks_no_manifest_uses(capsys, s3, shared_bucket):
    """A block no manifest uses (an upload cut off before its manifest) goes once it is over two days old:
    younger, an upload may still count on it."""
    import obstore

    from slotkeeper.remote.tier import RemoteConfig

    ns, env = shared_bucket["ns"], shared_bucket["env"]
    bucket = RemoteConfig.from_url(URL, s3.env()).store(timedelta(seconds=10), timedelta(seconds=10))
    old, young = block_hash(b"old" * 100), block_hash(b"young" * 100)
    stamp = time.time() - 3 * DAY  # (rclone takes an object's time from its "mtime" metadata)
    obstore.put(bucket, f"{ns}/blocks/{old}", b"old" * 100, attributes={"mtime": f"{stamp:.3f}"})
    obstore.put(bucket, f"{ns}/blocks/{young}", b"young" * 100)
    before = remote_blocks(s3, ns)
    code, out, err = run(prune_main, capsys, "--remote", "--remote-store", URL, "--older-than", "30d", env=env)
    assert code == 0 and err == ""
    assert out.splitlines() == [f"removed 1 remote block in {URL}/{ns}, 300 B (no remaining entry uses them)"]
    assert remote_blocks(s3, ns) == before - {old}


def test_an_unreachable_shared_tier_is_one_line_and_exit_1(capsys):
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
        "AWS_ACCESS_KEY_ID": "k" * 20,
        "AWS_SECRET_ACCESS_KEY": "s" * 30,
        "XDG_CACHE_HOME": "/nonexistent-xdg",
    }
    for main, extra in ((ls_main, []), (prune_main, ["--older-than", "1d"])):
        code, out, err = run(main, capsys, "--remote", "--remote-store", URL, *extra, env=env)
        assert code == 1 and out == ""
        assert err.count("\n") == 1 and f"listing {URL} failed (connection refused)" in err and "Traceback" not in err


# ---- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("main", "argv", "message"),
    [
        (ls_main, ["{tmp}/missing"], "no such directory"),
        (ls_main, ["{tmp}/file"], "not a directory"),
        (ls_main, ["--bogus"], "unrecognized arguments"),
        (ls_main, ["{tmp}", "--", "-m", "{tmp}/no-model.gguf"], "model file not found"),
        (ls_main, ["{tmp}", "--", "-np", "two"], "-np needs an integer"),
        (ls_main, ["{tmp}", "--", "-c", "lots"], "-c needs an integer"),
        (ls_main, ["{tmp}", "--", "-m"], "needs a value"),
        (prune_main, ["{tmp}", "--older-than", "7"], "invalid duration '7'"),
        (prune_main, ["{tmp}", "--older-than", "soon"], "invalid duration"),
        (prune_main, ["{tmp}", "--max-total", "20 parsecs"], "invalid size"),
        (prune_main, ["{tmp}"], "nothing to prune"),
        (prune_main, ["{tmp}/missing", "--quarantine"], "no such directory"),
        (prune_main, ["{tmp}", "--older-than"], "expected one argument"),
        (prune_main, ["{tmp}", "--older-than", "1d", "--", "-np", "2"], "only used with --other-configs"),
        (prune_main, ["{tmp}", "--other-configs", "--", "-m", "{tmp}/no-model.gguf"], "model file not found"),
        (ls_main, ["--remote"], "--remote needs --remote-store s3://bucket/prefix or SLOTKEEPER_REMOTE_STORE"),
        (ls_main, ["--remote-store", "s3://b/p"], "--remote-store is used with --remote"),
        (ls_main, ["{tmp}", "--remote", "--remote-store", "s3://bucket/p"], "give DIR or --remote, not both"),
        (
            ls_main,
            ["--remote", "--remote-store", "http://bucket/p"],
            "--remote-store must look like s3://bucket/prefix",
        ),
        (prune_main, ["--remote", "--remote-store", "s3://bucket/p", "--quarantine"], "--quarantine applies to save"),
        (
            prune_main,
            ["--remote", "--remote-store", "s3://bucket/p", "--older-than", "1d", "--force"],
            "--force applies",
        ),
        (
            prune_main,
            ["--remote", "--remote-store", "s3://bucket/p", "--other-configs"],
            "needs llama-server arguments",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, main, argv, message):
    (tmp_path / "file").write_text("x")
    entry = write_entry(tmp_path, age=30 * DAY)
    code, out, err = run(main, capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert err.startswith(("slotkeeper ls: error: ", "slotkeeper prune: error: "))
    assert all(p.exists() for p in entry_files(tmp_path, entry))


# ---- formats ----------------------------------------------------------------------------------------------------


def test_parse_duration_and_size():
    assert parse_duration("7d") == 7 * DAY and parse_duration("30min") == 30 * MIN and parse_duration("30m") == 30 * MIN
    assert parse_duration("1.5h") == 1.5 * HOUR and parse_duration("2w") == 14 * DAY and parse_duration("90s") == 90
    assert parse_size("20GB") == 20_000_000_000 and parse_size("20G") == 20_000_000_000
    assert parse_size("8GiB") == 8 * 1024**3 and parse_size("1.5 MB") == 1_500_000 and parse_size("4096") == 4096
    for bad in ("", "7", "d", "-1d", "1y"):
        with pytest.raises(CatalogError):
            parse_duration(bad)
    for bad in ("", "GB", "-5GB", "20 parsecs", "1e9"):
        with pytest.raises(CatalogError):
            parse_size(bad)


def test_format_age():
    assert [format_age(s) for s in (-5, 0, 59, 60, 3 * MIN + 59, HOUR, 2 * HOUR + 1, DAY - 1, 5 * DAY)] == [
        "0 s",
        "0 s",
        "59 s",
        "1 min",
        "3 min",
        "1 h",
        "2 h",
        "23 h",
        "5 d",
    ]


def test_short_ids_tell_entries_apart(capsys, tmp_path):
    ids = ["abcd" + "0" * 12, "abcd" + "1" * 12, "abcd1" + "2" * 11, "9876" + "5" * 12]
    for entry_id in ids:
        write_entry(tmp_path, entry_id=entry_id)
    _, out, _ = run(ls_main, capsys, str(tmp_path))
    assert set(table_rows(out)) == {"abcd0", "abcd11", "abcd12", "9876"}


def reference_short_ids(rows: Sequence[Row | RemoteRow]) -> list[str]:
    """The rule as first written (every id against every other): the shortest prefix of at least 4 characters
    that no other id starts with, or the whole id."""
    ids = [r.id for r in rows if r.kind is not Kind.SLOT_FILE]
    shorts = []
    for row in rows:
        if isinstance(row, Row) and row.kind is Kind.SLOT_FILE:
            shorts.append(row.name)
            continue
        n = 4
        while n < len(row.id) and sum(i.startswith(row.id[:n]) for i in ids if i != row.id) > 0:
            n += 1
        shorts.append(row.id[:n])
    return shorts


def random_ids(rng: random.Random, n: int) -> list[str]:
    """Hex ids as saves make them, and the cases that are not: ids sharing long prefixes (up to all but the last
    digit), ids that are prefixes of others, repeats, ids shorter than 4 characters, the empty id."""

    def hexes(k: int) -> str:
        return "".join(rng.choice("0123456789abcdef") for _ in range(k))

    ids = [hexes(16) for _ in range(n)]
    for _ in range(n // 2):
        base = rng.choice(ids)
        cut = rng.randint(0, len(base))
        ids.append(rng.choice([base[:cut] + hexes(16 - cut), base[:cut], base, base + hexes(rng.randint(1, 3))]))
    ids += [hexes(rng.randint(0, 3)) for _ in range(rng.randint(0, 3))]
    rng.shuffle(ids)
    return ids


@pytest.mark.parametrize("seed", range(40))
def test_short_ids_are_the_reference_rules(tmp_path, seed):
    rng = random.Random(seed)
    rows: list[Row | RemoteRow] = []
    for entry_id in random_ids(rng, rng.choice([0, 1, 2, 5, 30, 200])):
        kind = rng.choice([Kind.ENTRY, Kind.ENTRY, Kind.QUARANTINED, Kind.SLOT_FILE])
        name = {Kind.QUARANTINED: f"20250101-120000-{entry_id}", Kind.SLOT_FILE: str(rng.randint(0, 3))}.get(
            kind, entry_id
        )
        rows.append(Row(kind, tmp_path, tmp_path, name, None, None, None, Status.USABLE))
    expected = reference_short_ids(rows)
    assign_short_ids(rows)
    assert [r.short for r in rows] == expected
    remote = [RemoteRow("s3://b/p", "ns", entry_id, {}, None, Status.SHARED) for entry_id in random_ids(rng, 50)]
    expected = reference_short_ids(remote)
    assign_short_ids(remote)
    assert [r.short for r in remote] == expected


def test_short_ids_of_a_large_store_take_no_quadratic_time(tmp_path):
    """20,000 ids (the reference rule took minutes): well under a second, and still told apart."""
    rng = random.Random(7)
    rows = [
        Row(Kind.ENTRY, tmp_path, tmp_path, f"{rng.getrandbits(64):016x}", None, None, None, Status.USABLE)
        for _ in range(20_000)
    ]
    started = time.monotonic()
    assign_short_ids(rows)
    assert time.monotonic() - started < 2.0
    shorts = [r.short for r in rows]
    assert len(set(shorts)) == len(shorts) and min(map(len, shorts)) == 4
    ids = [r.id for r in rows]
    for row in rows[:20]:  # the reference rule, for a few of them
        n = 4
        while any(i.startswith(row.id[:n]) for i in ids if i != row.id):
            n += 1
        assert row.short == row.id[:n]


def random_json(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(12 if depth < 4 else 8)
    if choice == 0:
        return rng.choice(["", "plain", "ünïcødé ✓", 'quote " back\\slash', "tab\tnew\nline\x00", "\ud83d\ude00"])
    if choice == 1:
        return rng.choice([0, -1, 7, 2**70, -(2**63)])
    if choice == 2:
        return rng.choice([0.0, -0.0, 1.5, 1e-7, 1e300, 1 / 3, math.nan, math.inf, -math.inf, 1_750_000_000.25])
    if choice == 3:
        return rng.choice([True, False, None])
    if choice in (4, 5, 6, 7):
        return rng.choice(["entry", 12, 3.25, None])
    if choice in (8, 9):
        return {
            rng.choice(["a", "kind", "ü", "x y", str(i)]) + str(i): random_json(rng, depth + 1)
            for i in range(rng.randrange(4))
        }
    if choice == 10:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return rng.choice([(1, 2), Status.USABLE, {1: "int key"}, {"k": (None,)}, [Kind.ENTRY], 2.5])


@pytest.mark.parametrize("seed", range(30))
def test_json_text_is_json_dumps_byte_for_byte(seed):
    rng = random.Random(seed)
    values = [random_json(rng) for _ in range(20)]
    for value in [*values, values, {"rows": values}]:
        assert dumps_indented(value) == json.dumps(value, indent=1)


def test_ls_json_text_is_json_dumps_of_its_records(mixed_dir, tmp_path):
    matched = expectation_from_args(["-m", str(write_model(tmp_path / "m.gguf")), "-np", "1", "-c", "4096"], {})
    for expectation in (None, matched):
        records = json_records([scan_dir(mixed_dir["dir"])], NOW, expectation)
        assert dumps_indented(records) == json.dumps(records, indent=1)


def test_ls_and_prune_leave_the_garbage_collector_as_they_found_it(capsys, tmp_path):
    write_entry(tmp_path)
    assert gc.isenabled()
    run(ls_main, capsys, str(tmp_path))
    run(prune_main, capsys, str(tmp_path), "--older-than", "0s", "--dry-run")
    assert gc.isenabled()
    gc.disable()
    try:
        run(ls_main, capsys, str(tmp_path))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_listed_file_is_a_regular_file_and_never_a_link(tmp_path):
    """FileStat.maybe, in one lstat: a regular file is listed; a link (to a file or not), a directory or a name
    that is gone is not."""
    regular = tmp_path / "a.bin"
    regular.write_bytes(b"x" * 10)
    (tmp_path / "link.bin").symlink_to(regular)
    (tmp_path / "dangling.bin").symlink_to(tmp_path / "gone.bin")
    (tmp_path / "dir.bin").mkdir()
    stat = FileStat.maybe(regular)
    assert stat is not None and stat.size == 10 and stat.identity[0] == regular.stat().st_ino
    assert stat == FileStat.of(regular)
    for name in ("link.bin", "dangling.bin", "dir.bin", "gone.bin"):
        assert FileStat.maybe(tmp_path / name) is None


def test_ls_time_is_now_by_default(capsys, tmp_path):
    entry = write_entry(tmp_path)
    edit_manifest(tmp_path, entry, last_used=time.time() - 2 * HOUR)
    assert ls_main([str(tmp_path)]) == 0
    assert table_rows(capsys.readouterr().out)[short(entry)][3] == "2 h ago"


# ---- as a process -----------------------------------------------------------------------------------------------

ENTRY = "import sys; from slotkeeper.catalog.cli import {0}; sys.exit({0}(sys.argv[1:]))"


def test_as_a_process_bad_input_prints_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", ENTRY.format("prune_main"), str(tmp_path), "--max-total", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr
        == "slotkeeper prune: error: invalid size 'lots': use e.g. 500MB, 20GB, 1.5TB, 8GiB or a byte count\n"
    )


def test_as_a_process_a_closed_pipe_is_not_an_error(tmp_path):
    """`slotkeeper ls --json | head`: the reader goes away early; no traceback, exit 0."""
    for _ in range(400):
        write_entry(tmp_path, tokens=1)
    proc = subprocess.Popen(
        [sys.executable, "-c", ENTRY.format("ls_main"), str(tmp_path), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdout.read(10) == b'[\n {\n  "ki'
    proc.stdout.close()
    assert proc.wait(60) == 0
    assert proc.stderr is not None and proc.stderr.read() == b""


def test_prune_remote_max_total_counts_a_shared_block_once():
    """--max-total over the shared tier counts what the bucket holds: a block three entries share, once. Under
    the cap nothing goes; over it the least recently used go, each freeing only what it holds alone, until the
    bucket fits (counted per entry, three 1,124-byte entries looked 3,372 bytes for 1,324 held)."""
    from slotkeeper.catalog.remote_prune import planned

    shared = f"{1:032x}"
    rows = []
    for n in range(3):
        parts = Parts(
            nbytes=100 + 256 * 4,
            block_cells=256,
            skeleton=f"{n + 2:032x}",  # its own 100 bytes
            sections=(CellSection(cells=256, start=100, shape=((4, 1),), blocks=(shared,)),),  # 1,024 shared
        )
        parts.check()
        manifest = {"bytes": parts.nbytes, "parts": parts.to_json()}
        rows.append(RemoteRow("s3://b/p", "ns", f"{n:016x}", manifest, None, Status.SHARED))
    assert planned(rows, time.time(), set(), max_total=1324) == []
    assert planned(rows, time.time(), set(), max_total=2500) == []
    removals = planned(rows, time.time(), set(), max_total=1200)
    assert [(r.row.id, r.freed) for r in removals] == [(rows[0].id, 100), (rows[1].id, 100)]
    removals = planned(rows, time.time(), {"ns"}, max_total=1200)  # a manifest there could not be read
    assert [(r.row.id, r.freed) for r in removals] == [(rows[0].id, 0), (rows[1].id, 0)]
    removals = planned(rows, time.time(), set(), max_total=0)
    assert [r.freed for r in removals] == [100, 100, 1124]
