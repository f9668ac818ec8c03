"""Issue 6: `slotkeeper ls` and `slotkeeper prune` on real save directories built in tmp_path."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from slotkeeper import catalog
from slotkeeper.catalog import ls_main, parse_duration, parse_size, plan_prune, prune_main, scan_dir
from slotkeeper.fingerprint import build_fingerprint, model_identity
from slotkeeper.log import fmt_bytes
from slotkeeper.slots import SaveOutcome, SlotStore

NOW = 1_750_000_000.0
MIN, HOUR, DAY = 60, 3600, 86400


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


def write_pair(
    directory: Path, slot: int, *, tokens: int = 1000, nbytes: int = 4096, age: float = 0.0,
    fingerprint: dict[str, Any] | None = None, bin_size: int | None = None, manifest: bool = True,
) -> None:
    """A pair as SlotStore._commit leaves it: `<slot>.bin` of `nbytes` bytes, then `<slot>.json` with the same keys."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{slot}.bin", "wb") as f:
        f.truncate(nbytes if bin_size is None else bin_size)
    saved_at = NOW - age
    os.utime(directory / f"{slot}.bin", (saved_at, saved_at))
    if manifest:
        data = {
            "version": 1, "slot": slot, "tokens": tokens, "bytes": nbytes, "saved_at": saved_at, "save_ms": 12.5,
            "fingerprint": fingerprint if fingerprint is not None else {"model": "/models/m.gguf"},
        }
        (directory / f"{slot}.json").write_text(json.dumps(data, indent=1), encoding="utf-8")


def run(main, capsys, *argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    code = main(list(argv), env=env or {"XDG_CACHE_HOME": "/nonexistent-xdg"}, now=NOW)
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out: str) -> dict[str, list[str]]:
    """Rows of the ls table keyed by slot id, split on runs of two or more spaces."""
    rows = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0].isdigit() and len(cells) >= 6:
            rows[cells[0]] = cells
    return rows


@pytest.fixture
def mixed_dir(tmp_path: Path) -> Path:
    """Every kind of file a save directory can hold, plus files that are not slotkeeper's."""
    d = tmp_path / "cache"
    model = "/models/Qwen2.5-7B-Instruct-Q4_K_M.gguf"
    write_pair(d, 0, tokens=6222, nbytes=12_800_000, age=3 * MIN + 5, fingerprint={"model": model})
    write_pair(d, 1, tokens=12_001, nbytes=2_000_000, age=2 * HOUR + 100, fingerprint={"model": model}, bin_size=1_999_000)
    write_pair(d, 2, nbytes=1_000_000, age=5 * DAY + 7, manifest=False)
    write_pair(d, 10, tokens=50, nbytes=3000, age=40, fingerprint={"model": model})
    (d / "10.bin").unlink()  # manifest without its file
    write_pair(d, 3, nbytes=5000, age=10)
    (d / "3.json").write_text("{not json", encoding="utf-8")
    (d / "0.bin.partial").write_bytes(b"x" * 3000)
    (d / "quarantine").mkdir()
    (d / "quarantine" / "20250101-120000-4.bin").write_bytes(b"x" * 700)
    (d / "quarantine" / "20250101-120000-4.json").write_text("{}")
    for name in ("20250101-120000-4.bin", "20250101-120000-4.json"):
        os.utime(d / "quarantine" / name, (NOW - 3 * DAY, NOW - 3 * DAY))
    for name in ("notes.txt", "007.bin", "1.bin.bak", "foo.json", "model.gguf"):
        (d / name).write_bytes(b"not slotkeeper's")
    return d


FOREIGN = ("notes.txt", "007.bin", "1.bin.bak", "foo.json", "model.gguf")


# ---- ls ---------------------------------------------------------------------------------------------------------


def test_ls_table_shows_each_pair_with_its_status(capsys, mixed_dir):
    code, out, err = run(ls_main, capsys, str(mixed_dir))
    assert code == 0 and err == ""
    rows = table_rows(out)
    assert set(rows) == {"0", "1", "2", "3", "10"}  # 007.bin, foo.json, notes.txt are not slotkeeper's
    assert rows["0"][:4] == ["0", "6,222", "12.8 MB", "3 min"] and rows["0"][-1] == "ok"
    assert rows["0"][4] == "Qwen2.5-7B-Instruct-Q4_K_M.gguf"
    assert rows["1"][:4] == ["1", "12,001", fmt_bytes(1_999_000), "2 h"] and rows["1"][-1] == "size mismatch"
    assert rows["2"] == ["2", "-", "1.0 MB", "5 d", "-", "no manifest"]
    assert rows["3"][-1] == "bad manifest"
    assert rows["10"][-1] == "no .bin"
    assert "  5 caches, " in out and "; 1 partial (3.0 KB); quarantine: 2 files (702 B)" in out
    assert all(len(line) <= 100 for line in out.splitlines())


def test_ls_columns_are_aligned(capsys, mixed_dir):
    _, out, _ = run(ls_main, capsys, str(mixed_dir))
    lines = [line for line in out.splitlines() if line.startswith("  ") and "  " in line.strip()]
    header = next(line for line in lines if line.strip().startswith("slot"))
    body = [line for line in lines if line is not header and line.strip()[0].isdigit() and "caches" not in line]
    assert len(body) == 5
    # right-aligned numbers end where their header ends; the model column starts where its header starts
    for column in ("tokens", "size", "age"):
        end = header.index(column) + len(column)
        assert all(line[end - 1] != " " and line[end] == " " for line in body), column
    start = header.index("model")
    assert all(line[start - 1] == " " and line[start] != " " for line in body)


def test_ls_shortens_long_model_names_to_fit_100_columns(capsys, tmp_path):
    model = write_model(tmp_path / ("Meta-Llama-3.1-70B-Instruct-abliterated-" + "x" * 40 + "-Q4_K_M.gguf"))
    write_pair(tmp_path / "a", 0, tokens=123_456, nbytes=12_000_000_000, fingerprint=fingerprint_for(str(model), [], 1, 4096))
    write_pair(tmp_path / "b", 7, fingerprint={"model": "/m/short.gguf"})
    _, out, _ = run(ls_main, capsys, str(tmp_path / "a"), str(tmp_path / "b"), "--", "-m", str(model), "-np", "2")
    lines = out.splitlines()
    assert all(len(line) <= 100 for line in lines[2:]), out  # (the `match:` line names the model in full)
    rows = table_rows(out)
    assert rows["0"][4].startswith("Meta-Llama") and rows["0"][4].endswith("-Q4_K_M") and "…" in rows["0"][4]
    assert rows["0"][-1] == "no: total_slots 1 -> 2 (-np)" and rows["7"][-1] == "no: model differs"
    # both directories' tables share their column positions
    headers = [line for line in lines if line.strip().startswith("slot ")]
    assert len(headers) == 2 and headers[0] == headers[1]


def test_ls_json_lists_every_file_with_its_fields(capsys, mixed_dir):
    code, out, _ = run(ls_main, capsys, str(mixed_dir), "--json")
    assert code == 0
    records = json.loads(out)
    caches = {r["slot"]: r for r in records if r["kind"] == "cache"}
    assert sorted(caches) == [0, 1, 2, 3, 10]
    zero = caches[0]
    assert zero["tokens"] == 6222 and zero["bytes"] == 12_800_000 and zero["bin_size"] == 12_800_000
    assert zero["status"] == "ok" and zero["model_name"] == "Qwen2.5-7B-Instruct-Q4_K_M.gguf"
    assert zero["age_s"] == 3 * MIN + 5 and zero["save_ms"] == 12.5
    assert zero["bin"] == str(mixed_dir / "0.bin") and zero["manifest"] == str(mixed_dir / "0.json")
    assert "match" not in zero  # no llama-server arguments given
    assert caches[1]["status"] == "size mismatch" and caches[1]["bin_size"] == 1_999_000
    assert caches[2]["status"] == "no manifest" and caches[2]["manifest"] is None and caches[2]["tokens"] is None
    assert caches[10]["bin"] is None
    assert [r["name"] for r in records if r["kind"] == "partial"] == ["0.bin.partial"]
    assert sorted(r["name"] for r in records if r["kind"] == "quarantine") == [
        "20250101-120000-4.bin", "20250101-120000-4.json"]


def test_ls_without_dirs_lists_the_default_cache_dirs(capsys, tmp_path):
    root = tmp_path / "xdg" / "slotkeeper"
    write_pair(root / "qwen.gguf-1a2b3c4d", 0)
    write_pair(root / "bench", 0)  # demo/bench are listed when they hold caches
    (root / "demo").mkdir()
    (root / "demo" / "model-e.gguf").write_bytes(b"m")  # a model only: skipped
    (root / "empty").mkdir()
    (root / "only-quarantine" / "quarantine").mkdir(parents=True)  # found, so that prune --quarantine reaches it
    (root / "only-quarantine" / "quarantine" / "20250101-000000-0.bin").write_bytes(b"x")
    (root / "other").mkdir()
    (root / "other" / "config.json").write_text("{}")  # not a slotkeeper name: skipped
    code, out, _ = run(ls_main, capsys, "--json", env={"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert code == 0
    assert sorted({Path(r["dir"]).name for r in json.loads(out)}) == ["bench", "only-quarantine", "qwen.gguf-1a2b3c4d"]
    code, out, _ = run(ls_main, capsys, env={"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert "total: 2 caches" in out and "in 3 directories" in out
    assert "only-quarantine\n  (no cache files)\n  0 caches, 0 B; 0 partials; quarantine: 1 file (1 B)" in out
    code, out, _ = run(ls_main, capsys, env={"XDG_CACHE_HOME": str(tmp_path / "nothing")})
    assert code == 0 and out.startswith("no slotkeeper caches under")
    # naming the cache root lists the directories below it, as with no DIR
    code, out, _ = run(ls_main, capsys, str(root), "--json", env={"XDG_CACHE_HOME": str(tmp_path / "nothing")})
    assert sorted({Path(r["dir"]).name for r in json.loads(out)}) == ["bench", "only-quarantine", "qwen.gguf-1a2b3c4d"]
    code, out, _ = run(ls_main, capsys, str(root / "empty"))
    assert out.splitlines()[1:] == ["  (no cache files)", "  0 caches, 0 B; 0 partials; quarantine: 0 files"]


def test_ls_reads_what_slotstore_commit_writes(capsys, tmp_path):
    """The format ls reads is the one the daemon writes (SlotStore._commit itself, not a copy of it)."""
    d = tmp_path / "cache"
    d.mkdir()
    fp = fingerprint_for(str(write_model(tmp_path / "a.gguf")), ["-ctk", "q8_0"], 2, 512)
    partial = d / "1.bin.partial"
    partial.write_bytes(b"k" * 777)
    store = SlotStore(d, client=None, fingerprint=fp, fsync=False)  # type: ignore[arg-type]
    store._commit(1, partial, SaveOutcome(1, True, tokens=321, nbytes=777, save_ms=3.0))
    (entry,) = scan_dir(d).entries
    assert (entry.slot, entry.status, entry.tokens, entry.model) == (1, "ok", 321, str((tmp_path / "a.gguf").resolve()))
    code, out, _ = run(ls_main, capsys, str(d), "--", "-m", str(tmp_path / "a.gguf"), "-ctk", "q8_0", "-np", "2")
    assert table_rows(out)["1"][-1] == "yes"


# ---- ls: matching llama-server arguments ------------------------------------------------------------------------


@pytest.fixture
def matched(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A cache saved for model A with -ctk q8_0 -np 2 -c 1024 (512 per slot), and a model B of the same size."""
    model_a = write_model(tmp_path / "a.gguf")
    model_b = write_model(tmp_path / "b.gguf", b"GGUF model B" * 1000)
    d = tmp_path / "cache"
    write_pair(d, 0, fingerprint=fingerprint_for(str(model_a), ["-ctk", "q8_0", "-np", "2"], 2, 512))
    return d, model_a, model_b


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
    d, model_a, model_b = matched
    args = [a.format(a=model_a, b=model_b) for a in args]
    code, out, _ = run(ls_main, capsys, str(d), "--", *args)
    assert code == 0
    assert table_rows(out)["0"][-1] == expected
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
    write_pair(tmp_path / "cache", 0, fingerprint=fingerprint_for(str(model), ["-kvu", "-np", "2"], 2, 512))
    _, out, _ = run(ls_main, capsys, str(tmp_path / "cache"), "--", "-m", str(model), *args)
    assert table_rows(out)["0"][-1] == expected


def test_ls_match_skips_the_context_when_the_slot_count_is_unknown(capsys, tmp_path):
    """-no-kvu without -np: the context is split over llama-server's automatic slot count, unknown offline."""
    model = write_model(tmp_path / "a.gguf")
    write_pair(tmp_path / "cache", 0, fingerprint=fingerprint_for(str(model), ["-no-kvu"], 4, 1024))
    _, out, _ = run(ls_main, capsys, str(tmp_path / "cache"), "--", "-m", str(model), "-no-kvu", "-c", "16384")
    assert table_rows(out)["0"][-1] == "yes"
    assert "n_ctx_slot not checked (-np unknown)" in " ".join(out.split())


def test_ls_match_notices_a_changed_model_file(capsys, matched):
    d, model_a, _ = matched
    write_model(model_a, b"GGUF model C" * 1000)  # same path and size, other weights
    _, out, _ = run(ls_main, capsys, str(d), "--", "-m", str(model_a), "-ctk", "q8_0")
    assert table_rows(out)["0"][-1] == "no: model file changed"
    _, out, _ = run(ls_main, capsys, str(d), "--json", "--", "-m", str(model_a), "-ctk", "q8_0", "-np", "3")
    (record,) = json.loads(out)
    assert record["match"] is False
    assert record["differences"] == ["model file changed", "total_slots 2 -> 3 (-np)"]


def test_ls_match_notices_a_moved_model_file(capsys, matched, tmp_path):
    d, model_a, _ = matched
    moved = tmp_path / "elsewhere" / "a.gguf"
    moved.parent.mkdir()
    moved.write_bytes(model_a.read_bytes())  # same bytes, other path: the daemon would not restore it either
    _, out, _ = run(ls_main, capsys, str(d), "--", "-m", str(moved), "-ctk", "q8_0")
    assert table_rows(out)["0"][-1] == f"no: model path {model_a.resolve()}"


def test_ls_match_reports_unusable_files_as_no_match(capsys, matched):
    d, model_a, _ = matched
    write_pair(d, 1, manifest=False)
    _, out, _ = run(ls_main, capsys, str(d), "--json", "--", "-m", str(model_a), "-ctk", "q8_0")
    records = {r["slot"]: r for r in json.loads(out)}
    assert records[0]["match"] is True and records[0]["differences"] == []
    assert records[1]["match"] is False and records[1]["differences"] == ["no manifest"]


# ---- prune ------------------------------------------------------------------------------------------------------


def names(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


def test_prune_older_than_removes_whole_pairs(capsys, tmp_path):
    d = tmp_path / "cache"
    write_pair(d, 0, age=10 * DAY, tokens=6222, nbytes=5000)
    write_pair(d, 1, age=2 * DAY)
    write_pair(d, 2, age=9 * DAY, manifest=False)
    code, out, err = run(prune_main, capsys, str(d), "--older-than", "7d")
    assert code == 0 and err == ""
    assert names(d) == {"1.bin", "1.json"}
    lines = out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(f"removed {d}/0.json + 0.bin (6,222 tokens, ") and lines[0].endswith("10 d old): older than 7 d")
    assert lines[1].startswith(f"removed {d}/2.bin (")
    assert lines[2].startswith("removed 2 cache pairs: ")


def test_prune_max_total_removes_the_oldest_first_across_dirs(capsys, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_pair(a, 0, nbytes=1_000_000, age=5 * HOUR)
    write_pair(a, 1, nbytes=1_000_000, age=1 * HOUR)
    write_pair(b, 0, nbytes=1_000_000, age=3 * HOUR)
    write_pair(b, 1, nbytes=1_000_000, age=2 * HOUR)
    code, out, _ = run(prune_main, capsys, str(a), str(b), "--max-total", "2.5MB")
    assert code == 0
    assert names(a) == {"1.bin", "1.json"} and names(b) == {"1.bin", "1.json"}  # 5 h and 3 h old went
    assert out.splitlines()[-1].startswith("removed 2 cache pairs")
    code, out, _ = run(prune_main, capsys, str(a), str(b), "--max-total", "20GB")
    assert out.strip() == "nothing to remove" and names(a) == {"1.bin", "1.json"}


def test_prune_max_total_keeps_a_directory_exactly_at_the_limit(capsys, tmp_path):
    write_pair(tmp_path, 0, nbytes=1000, age=2 * HOUR)
    write_pair(tmp_path, 1, nbytes=1000, age=1 * HOUR)
    total = sum(p.stat().st_size for p in tmp_path.iterdir())  # both .bin and both .json count
    code, out, _ = run(prune_main, capsys, str(tmp_path), "--max-total", str(total))
    assert out.strip() == "nothing to remove" and len(names(tmp_path)) == 4
    code, out, _ = run(prune_main, capsys, str(tmp_path), "--max-total", str(total - 1))
    assert names(tmp_path) == {"1.bin", "1.json"}


def test_prune_quarantine_only_touches_quarantine(capsys, mixed_dir):
    before = names(mixed_dir)
    code, out, _ = run(prune_main, capsys, str(mixed_dir), "--quarantine")
    assert code == 0
    assert names(mixed_dir) == before - {"quarantine/20250101-120000-4.bin", "quarantine/20250101-120000-4.json"}
    assert (mixed_dir / "quarantine").is_dir()
    assert out.splitlines()[0] == (f"removed {mixed_dir}/quarantine/20250101-120000-4.json + 20250101-120000-4.bin "
                                   "(702 B, 3 d old): quarantined")
    assert out.splitlines()[-1] == "removed 0 cache pairs and 1 quarantined pair: 702 B"


def test_prune_missing_models(capsys, tmp_path):
    present = write_model(tmp_path / "present.gguf")
    gone = write_model(tmp_path / "gone.gguf")
    d = tmp_path / "cache"
    write_pair(d, 0, fingerprint=fingerprint_for(str(present), [], 1, 512))
    write_pair(d, 1, fingerprint=fingerprint_for(str(gone), [], 1, 512))
    write_pair(d, 2, fingerprint=fingerprint_for("stub-model.gguf", [], 1, 512))  # never was a file: unknown
    write_pair(d, 3, manifest=False)
    gone.unlink()
    code, out, _ = run(prune_main, capsys, str(d), "--missing-models")
    assert code == 0
    assert names(d) == {"0.bin", "0.json", "2.bin", "2.json", "3.bin"}
    assert f"model gone: {gone}" in out.splitlines()[0]


@pytest.mark.parametrize(
    "criteria",
    [["--older-than", "1s"], ["--max-total", "0"], ["--quarantine"], ["--missing-models"],
     ["--older-than", "0s", "--max-total", "0", "--quarantine", "--missing-models"]],
)
def test_prune_dry_run_removes_nothing(capsys, mixed_dir, criteria):
    before = names(mixed_dir)
    code, out, _ = run(prune_main, capsys, str(mixed_dir), *criteria, "--dry-run")
    assert code == 0 and names(mixed_dir) == before
    assert out.splitlines()[-1].endswith("(dry run)") or out.strip() == "nothing to remove"
    assert all(line.startswith("would remove") for line in out.splitlines() if line != "nothing to remove")


def test_prune_everything_leaves_foreign_files_alone(capsys, mixed_dir):
    (mixed_dir / "quarantine" / "keep").mkdir()
    (mixed_dir / "quarantine" / "keep" / "x.bin").write_bytes(b"x")
    code, out, _ = run(prune_main, capsys, str(mixed_dir), "--older-than", "0s", "--max-total", "0",
                       "--quarantine", "--missing-models")
    assert code == 0
    # every pair and quarantined file went; what is not slotkeeper's (and the in-flight partial) stayed
    assert names(mixed_dir) == {*FOREIGN, "0.bin.partial", "quarantine/keep/x.bin"}
    assert out.splitlines()[-1].startswith("removed 5 cache pairs and 1 quarantined pair: ")


def test_prune_deletes_the_manifest_before_the_bin(capsys, tmp_path, monkeypatch):
    d = tmp_path / "cache"
    write_pair(d, 0, age=DAY)
    order: list[str] = []
    real_unlink = Path.unlink

    def recording_unlink(self: Path, missing_ok: bool = False) -> None:
        order.append(self.name)
        if self.name == "0.bin":
            raise PermissionError(13, "Permission denied")  # interrupted after the manifest went
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", recording_unlink)
    code, out, err = run(prune_main, capsys, str(d), "--older-than", "1h")
    assert order == ["0.json", "0.bin"]
    assert names(d) == {"0.bin"}  # a .bin without a manifest is never restored without an opt-in
    assert code == 1 and err.count("\n") == 1 and "Permission denied" in err


def test_prune_keeps_a_pair_rewritten_after_it_was_listed(tmp_path):
    d = tmp_path / "cache"
    write_pair(d, 0, age=DAY, nbytes=100)
    (removal,) = plan_prune([scan_dir(d)], NOW, older_than=HOUR)
    write_pair(d, 0, age=0, nbytes=200)  # a running slotkeeper saved slot 0 again
    assert "changed since it was listed" in (catalog.remove_files(removal) or "")
    assert names(d) == {"0.bin", "0.json"}


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
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, main, argv, message):
    (tmp_path / "file").write_text("x")
    write_pair(tmp_path, 0, age=30 * DAY)
    code, out, err = run(main, capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert err.startswith(("slotkeeper ls: error: ", "slotkeeper prune: error: "))
    assert (tmp_path / "0.bin").exists() and (tmp_path / "0.json").exists()


# ---- formats ----------------------------------------------------------------------------------------------------


def test_parse_duration_and_size():
    assert parse_duration("7d") == 7 * DAY and parse_duration("30min") == 30 * MIN and parse_duration("30m") == 30 * MIN
    assert parse_duration("1.5h") == 1.5 * HOUR and parse_duration("2w") == 14 * DAY and parse_duration("90s") == 90
    assert parse_size("20GB") == 20_000_000_000 and parse_size("20G") == 20_000_000_000
    assert parse_size("8GiB") == 8 * 1024**3 and parse_size("1.5 MB") == 1_500_000 and parse_size("4096") == 4096
    for bad in ("", "7", "d", "-1d", "1y"):
        with pytest.raises(catalog.CatalogError):
            parse_duration(bad)
    for bad in ("", "GB", "-5GB", "20 parsecs", "1e9"):
        with pytest.raises(catalog.CatalogError):
            parse_size(bad)


def test_format_age():
    assert [catalog.format_age(s) for s in (-5, 0, 59, 60, 3 * MIN + 59, HOUR, 2 * HOUR + 1, DAY - 1, 5 * DAY)] == [
        "0 s", "0 s", "59 s", "1 min", "3 min", "1 h", "2 h", "23 h", "5 d"]


def test_ls_time_is_now_by_default(capsys, tmp_path):
    write_pair(tmp_path, 0)
    manifest = json.loads((tmp_path / "0.json").read_text())
    manifest["saved_at"] = time.time() - 2 * HOUR
    (tmp_path / "0.json").write_text(json.dumps(manifest))
    assert ls_main([str(tmp_path)]) == 0
    assert table_rows(capsys.readouterr().out)["0"][3] == "2 h"


# ---- as a process -----------------------------------------------------------------------------------------------

ENTRY = "import sys; from slotkeeper.catalog import {0}; sys.exit({0}(sys.argv[1:]))"


def test_as_a_process_bad_input_prints_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-c", ENTRY.format("prune_main"), str(tmp_path), "--max-total", "lots"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "slotkeeper prune: error: invalid size 'lots': use e.g. 500MB, 20GB, 1.5TB, 8GiB or a byte count\n"


def test_as_a_process_a_closed_pipe_is_not_an_error(tmp_path):
    """`slotkeeper ls --json | head`: the reader goes away early; no traceback, exit 0."""
    for slot in range(400):
        write_pair(tmp_path, slot, nbytes=1)
    proc = subprocess.Popen([sys.executable, "-c", ENTRY.format("ls_main"), str(tmp_path), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.read(10) == b'[\n {\n  "ki'
    proc.stdout.close()
    assert proc.wait(60) == 0
    assert proc.stderr is not None and proc.stderr.read() == b""
