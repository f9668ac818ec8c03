"""Never lose a good cache (issue 4), against the stub llama-server: kills, bad files, disk full, budgets.

The claims about foreign caches run against the real llama-server in test_real_server.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from slotkeeper.testing.harness import pid_alive, read_events, wait_until
from slotkeeper.testing.stub import decode_slot_file

PROMPT = "Every token of this conversation is kept in the slot cache. " * 3


def complete(sk, prompt: str = PROMPT, slot: int = 0, **kw):
    reply = sk.call("POST", "/completion", {"prompt": prompt, "n_predict": 8, "id_slot": slot, **kw})
    assert reply.status == 200, reply.body
    return reply.body


def child_pid(sk) -> int:
    return [e for e in read_events(sk.extra["events"]) if e["event"] == "start"][-1]["pid"]


def stop(sk) -> None:
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0, sk.logs()


def saved_cache(stub_slotkeeper) -> Path:
    """One run that converses and stops: slot 0's cache pair is on disk. Returns the save directory."""
    sk = stub_slotkeeper("-np", "1")
    complete(sk)
    stop(sk)
    return sk.extra["save_dir"]


def edit_manifest(save_dir: Path, change: Callable[[dict], None], slot: int = 0) -> None:
    path = save_dir / f"{slot}.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def assert_pair_consistent(save_dir, slot: int = 0) -> list[int]:
    """The file and its manifest agree, and the file decodes: it would restore."""
    manifest = json.loads((save_dir / f"{slot}.json").read_text())
    data = (save_dir / f"{slot}.bin").read_bytes()
    assert manifest["bytes"] == len(data)
    tokens = decode_slot_file(data)
    assert manifest["tokens"] == len(tokens)
    return tokens


def test_1_sigkill_at_random_moments_of_a_stop_never_loses_the_cache(stub_slotkeeper):
    """1. SIGKILL the group at random moments of a slow stop-time save, 20 times: a good pair always restores."""
    rng = random.Random(4)
    have_file = False
    outcomes = {"kept old": 0, "new in place": 0}
    for trial in range(20):
        sk = stub_slotkeeper("-np", "1", own=("--autosave-idle", "0"), stub={"STUB_SAVE_SECONDS": "0.3"})
        save_dir = sk.extra["save_dir"]
        if have_file:
            assert "slot 0 restored:" in sk.logs(), f"trial {trial}: the surviving file did not restore\n{sk.logs()}"
        before = (save_dir / "0.bin").read_bytes() if have_file else None
        complete(sk, f"trial {trial}: " + PROMPT)
        pid = child_pid(sk)
        sk.killpg(signal.SIGTERM)
        time.sleep(rng.uniform(0.0, 0.5))
        sk.killpg(signal.SIGKILL)
        sk.wait()
        assert wait_until(lambda pid=pid: not pid_alive(pid), 5), f"trial {trial}: llama-server outlived slotkeeper"
        if not (save_dir / "0.bin").exists():
            assert not have_file, f"trial {trial}: the previous cache file was lost"
            continue  # killed before the very first save completed: nothing to keep yet
        have_file = True
        assert_pair_consistent(save_dir)
        outcomes["kept old" if (save_dir / "0.bin").read_bytes() == before else "new in place"] += 1
    assert outcomes["kept old"] and outcomes["new in place"], f"kills did not cover both moments: {outcomes}"


def test_3a_random_bytes_are_quarantined(stub_slotkeeper):
    """3. A cache file of random bytes (with a manifest of the right size): quarantined, cold, ready."""
    save_dir = saved_cache(stub_slotkeeper)
    cache = save_dir / "0.bin"
    cache.write_bytes(os.urandom(cache.stat().st_size))
    sk2 = stub_slotkeeper("-np", "1")
    assert complete(sk2)["timings"]["cache_n"] == 0
    assert "slot 0: cache quarantined (llama-server refused it" in sk2.logs()
    assert not cache.exists() and len(list((save_dir / "quarantine").iterdir())) == 2


def test_3b_manifest_for_other_kv_settings_is_skipped(stub_slotkeeper):
    """3. A manifest saved with another -ctk is skipped with one line naming the field; the file is kept."""
    save_dir = saved_cache(stub_slotkeeper)
    edit_manifest(save_dir, lambda m: m["fingerprint"].update(cache_type_k="q8_0"))
    sk2 = stub_slotkeeper("-np", "1")
    assert complete(sk2)["timings"]["cache_n"] == 0
    assert "slot 0: cache skipped, saved for another configuration: cache_type_k: 'q8_0' -> None" in sk2.logs()
    assert (save_dir / "0.bin").exists()


def test_3c_bin_without_manifest_needs_opt_in(stub_slotkeeper):
    """3. A .bin saved by llama-server directly has no manifest: skipped, unless --restore-unverified."""
    save_dir = saved_cache(stub_slotkeeper)
    (save_dir / "0.json").unlink()
    sk2 = stub_slotkeeper("-np", "1")
    assert "has no slotkeeper manifest; skipped" in sk2.logs()
    assert complete(sk2)["timings"]["cache_n"] == 0
    sk2.killpg(signal.SIGKILL)
    sk2.wait()
    sk3 = stub_slotkeeper("-np", "1", own=("--restore-unverified",))
    assert "slot 0 restored:" in sk3.logs()


def test_3d_size_differs_from_manifest_is_quarantined(stub_slotkeeper):
    """3. A file whose size differs from its manifest (truncated behind slotkeeper's back): quarantined, cold."""
    save_dir = saved_cache(stub_slotkeeper)
    cache = save_dir / "0.bin"
    cache.write_bytes(cache.read_bytes()[:100])
    sk2 = stub_slotkeeper("-np", "1")
    assert "slot 0: cache quarantined (size 100 differs from manifest" in sk2.logs()
    assert complete(sk2)["timings"]["cache_n"] == 0


def test_4_restored_but_unused_slot_is_not_rewritten(stub_slotkeeper):
    """4. At stop, a slot that was only restored keeps its file (mtime unchanged); a used one is saved."""
    sk = stub_slotkeeper("-np", "2", own=("--autosave-idle", "0"))
    complete(sk, slot=0)
    complete(sk, "another conversation " * 4, slot=1)
    stop(sk)
    save_dir = sk.extra["save_dir"]
    before = {i: (save_dir / f"{i}.bin").stat().st_mtime_ns for i in (0, 1)}
    time.sleep(0.05)
    sk2 = stub_slotkeeper("-np", "2", own=("--autosave-idle", "0"))
    complete(sk2, PROMPT + " and a follow-up", slot=0)
    stop(sk2)
    after = {i: (save_dir / f"{i}.bin").stat().st_mtime_ns for i in (0, 1)}
    assert after[1] == before[1], "an unused restored slot was written again"
    assert after[0] != before[0], "the used slot was not saved"
    assert "slot 1 saved" not in sk2.logs()


def test_5_idle_autosave_survives_sigkill(stub_slotkeeper):
    """5. After activity and the idle delay, the cache is saved in the background: a SIGKILL loses nothing."""
    sk = stub_slotkeeper("-np", "1", own=("--autosave-idle", "0.5"))
    complete(sk)
    assert wait_until(lambda: "slot 0 saved:" in sk.logs(), 10), sk.logs()
    # a request arriving right after (or during) an autosave must not fail
    complete(sk, PROMPT + " more")
    assert wait_until(lambda: sk.logs().count("slot 0 saved:") >= 2, 10), sk.logs()
    sk.killpg(signal.SIGKILL)
    sk.wait()
    sk2 = stub_slotkeeper("-np", "1")
    assert "slot 0 restored:" in sk2.logs()
    assert complete(sk2, PROMPT + " more")["timings"]["cache_n"] > len(PROMPT)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs as the save directory: a real 'No space left on device'."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        if os.environ.get("SLOTKEEPER_REQUIRE_LLAMA_SERVER"):
            pytest.fail(f"cannot mount a tmpfs for the disk-full test: {result.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs (needs root): {result.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_6_disk_full_keeps_the_old_file(stub_slotkeeper, tiny_disk):
    """6. The disk fills during a save: the save fails, the old file is intact, one clear log line."""
    stub = {"STUB_BYTES_PER_TOKEN": "1024"}
    sk = stub_slotkeeper("-np", "1", save_dir=tiny_disk, stub=stub)
    complete(sk, "short conversation " * 10)  # ~200 tokens: ~200 KB
    stop(sk)
    good = (tiny_disk / "0.bin").read_bytes()
    (tiny_disk / "filler").write_bytes(b"\0" * (1024 * 1024 - len(good) - 450 * 1024))
    sk2 = stub_slotkeeper("-np", "1", save_dir=tiny_disk, stub=stub)
    complete(sk2, "short conversation " * 10 + "and a much longer follow-up " * 20)  # needs ~800 KB
    stop(sk2)
    assert (tiny_disk / "0.bin").read_bytes() == good
    assert_pair_consistent(tiny_disk)
    assert "slot 0 save failed: llama-server answered 500: Unable to save slot; its previous file is kept" in sk2.logs()
    assert not list(tiny_disk.glob("*.partial"))


def test_7_save_over_budget_is_abandoned_within_budget(stub_slotkeeper):
    """7. A save longer than --save-timeout is abandoned: old file intact, exit within budget + stop timeout."""
    save_dir = saved_cache(stub_slotkeeper)
    good = (save_dir / "0.bin").read_bytes()
    sk2 = stub_slotkeeper("-np", "1", own=("--save-timeout", "1", "--stop-timeout", "1", "--autosave-idle", "0"),
                          stub={"STUB_SAVE_SECONDS": "30"})
    complete(sk2, PROMPT + " changed")
    started = time.monotonic()
    sk2.killpg(signal.SIGTERM)
    assert sk2.wait(10) == 0
    assert time.monotonic() - started < 1 + 1 + 0.8, sk2.logs()
    assert (save_dir / "0.bin").read_bytes() == good
    assert "the save budget (--save-timeout 1.0 s) ran out" in sk2.logs()


def test_long_save_reports_progress(stub_slotkeeper):
    """A save that takes seconds logs the partial file's growth, so llama-swap's log shows it is alive."""
    sk = stub_slotkeeper("-np", "1", own=("--autosave-idle", "0"), stub={"STUB_SAVE_SECONDS": "2.5"})
    complete(sk)
    stop(sk)
    assert "slot 0 saving: " in sk.logs() and "slot 0 saved:" in sk.logs()


def test_startup_warns_when_the_cache_would_not_fit_the_budget(stub_slotkeeper):
    """From the last saves' speed, a cache that cannot be saved inside --save-timeout is announced at start."""
    save_dir = saved_cache(stub_slotkeeper)
    edit_manifest(save_dir, lambda m: m.update(save_ms=20_000.0))  # as if this file took 20 s to write
    sk2 = stub_slotkeeper("-np", "1", own=("--save-timeout", "8"))
    assert "more than --save-timeout 8.0 s" in sk2.logs() and "unloadTimeout" in sk2.logs()


def test_max_cache_bytes_evicts_the_oldest(stub_slotkeeper):
    """--max-cache-bytes keeps the directory under the cap, oldest pair first, manifest with it."""
    sk = stub_slotkeeper("-np", "2", own=("--autosave-idle", "0"))
    complete(sk, "the older conversation " * 4, slot=0)
    stop(sk)
    size = (sk.extra["save_dir"] / "0.bin").stat().st_size
    sk2 = stub_slotkeeper("-np", "2", own=("--autosave-idle", "0", "--max-cache-bytes", str(size + size // 2)))
    complete(sk2, "the newer conversation " * 4, slot=1)
    stop(sk2)
    assert not (sk.extra["save_dir"] / "0.bin").exists() and not (sk.extra["save_dir"] / "0.json").exists()
    assert (sk.extra["save_dir"] / "1.bin").exists()
    assert "slot 0 cache evicted" in sk2.logs()
