"""Never lose a good cache (issue 4), against the stub llama-server: kills, bad files, disk full, budgets.

The store keeps conversations as entries (`entries/<id>.bin` + manifest, see tests/store_helpers.py); a save
is a new entry, committed by its manifest, and only then are the entries it extends removed. The claims about
foreign caches run against the real llama-server in test_real_server.py.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from store_helpers import (
    assert_entry_sound,
    assert_store_sound,
    bins_snapshot,
    block_files,
    edit_manifest,
    entries_dir,
    entry_bin,
    entry_ids,
    manifest_path,
    only_entry,
    only_files_of,
    quarantine_dir,
    read_manifest,
    restored,
    rewrite_entry,
    saved,
    staged_in_ram,
    transients,
    uncommitted,
)
from stub import encode_slot_file, tokenize

from slotkeeper.testing.harness import pid_alive, read_events, wait_until

# 360 bytes (the stub's tokens are bytes): over --min-save-tokens' 256, so it is worth an entry
PROMPT = "Every token of this conversation is kept in the slot cache. " * 6
MODEL = "stub-model.gguf"  # the conftest's -m


def complete(sk, prompt: str = PROMPT, **kw):
    reply = sk.call("POST", "/completion", {"prompt": prompt, "n_predict": 8, **kw})
    assert reply.status == 200, reply.body
    return reply.body


def child_pid(sk) -> int:
    return [e for e in read_events(sk.extra["events"]) if e["event"] == "start"][-1]["pid"]


def stop(sk) -> None:
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0, sk.logs()


def saved_cache(stub_slotkeeper) -> tuple[Path, str]:
    """One run that converses and stops: its conversation is an entry. Returns the save directory and its id."""
    sk = stub_slotkeeper("-np", "1")
    complete(sk)
    stop(sk)
    save_dir = sk.extra["save_dir"]
    entry = only_entry(save_dir)
    assert_entry_sound(save_dir, entry)
    return save_dir, entry


def restores(sk) -> list[dict]:
    """The current child's restore events."""
    pid = child_pid(sk)
    return [e for e in read_events(sk.extra["events"]) if e["event"] == "restore" and e["pid"] == pid]


def test_1_sigkill_at_random_moments_of_a_stop_never_loses_the_cache(stub_slotkeeper):
    """1. SIGKILL the group at random moments of a slow stop-time save, 20 times, one chat growing turn by turn.

    After each kill the store holds the previous entry or a committed new one that extends it (never neither),
    every committed entry is sound, and the next start restores the latest committed entry, never a partial or
    uncommitted file (those are removed)."""
    rng = random.Random(4)
    prompt = PROMPT
    committed: dict[str, list[int]] = {}  # what the previous kill left
    outcomes = {"kept old": 0, "new committed": 0}
    killed = 0  # the previous slotkeeper's pid
    for trial in range(20):
        sk = stub_slotkeeper("-np", "1", own=("--autosave-idle", "0"), stub={"STUB_SAVE_SECONDS": "0.3"})
        save_dir = sk.extra["save_dir"]
        assert not uncommitted(save_dir) and not transients(save_dir), f"trial {trial}: leftovers kept\n{sk.logs()}"
        assert only_files_of(save_dir, *committed), f"trial {trial}: leftovers kept: {block_files(save_dir)}"
        assert not staged_in_ram(killed), f"trial {trial}: what the killed run staged in RAM was kept"
        assert set(entry_ids(save_dir)) == set(committed), f"trial {trial}: a committed entry went at start"
        if committed:
            latest = max(committed, key=lambda i: read_manifest(save_dir, i)["saved_at"])
            assert restored(sk.logs()) == [(latest[:4], 0)], f"trial {trial}: not the latest entry\n{sk.logs()}"
            assert [e["n_restored"] for e in restores(sk) if e["ok"]] == [len(committed[latest])]
        body = complete(sk, prompt)
        if committed:
            assert body["timings"]["cache_n"] > 0, f"trial {trial}: the restored chat was not used"
        prompt += body["content"] + f" Turn {trial}. "  # the chat goes on: each entry extends the previous one
        pid, killed = child_pid(sk), sk.pid
        sk.killpg(signal.SIGTERM)
        time.sleep(rng.uniform(0.0, 0.5))
        sk.killpg(signal.SIGKILL)
        sk.wait()
        assert wait_until(partial(lambda pid: not pid_alive(pid), pid), 5), (
            f"trial {trial}: llama-server outlived slotkeeper"
        )
        after = assert_store_sound(save_dir)
        if not after:
            assert not committed, f"trial {trial}: the previous entry was lost"
            continue  # killed before the very first save completed: nothing to keep yet
        new = set(after) - set(committed)
        assert len(new) <= 1, f"trial {trial}: {new}"
        for gone in set(committed) - set(after):  # only ever superseded by a committed entry that extends it
            assert new and after[next(iter(new))][: len(committed[gone])] == committed[gone], (
                f"trial {trial}: entry {gone} lost"
            )
        outcomes["new committed" if new else "kept old"] += 1
        committed = after
    assert outcomes["kept old"] and outcomes["new committed"], f"kills did not cover both moments: {outcomes}"


def test_1b_leftovers_of_an_interrupted_save_are_removed_never_used(stub_slotkeeper):
    """1. What a kill can leave (an entry file renamed in whose manifest was never written, a manifest half
    written, llama-server's half-written transient file) is removed at the next start and never restored."""
    save_dir, entry = saved_cache(stub_slotkeeper)
    other = "A newer conversation whose save was interrupted before its manifest. " * 6
    orphan = "0123456789abcdef"
    entry_bin(save_dir, orphan).write_bytes(encode_slot_file(tokenize(other), MODEL))
    (entries_dir(save_dir) / f"{orphan}.json.partial").write_text('{"version": 2, "id": "0123456789abcdef"')
    transient = save_dir / "snapshots" / ("slotkeeper-" + "ab" * 16 + ".bin")
    transient.write_bytes(encode_slot_file(tokenize(other)[:100], MODEL))
    sk2 = stub_slotkeeper("-np", "1")
    assert f"removed entry {orphan[:4]} left by an interrupted save" in sk2.logs(), sk2.logs()
    assert only_files_of(save_dir, entry) and not transients(save_dir)
    assert restored(sk2.logs()) == [(entry[:4], 0)], sk2.logs()
    assert [e["n_restored"] for e in restores(sk2)] == [read_manifest(save_dir, entry)["tokens"]]
    assert complete(sk2, other)["timings"]["cache_n"] == 0


def test_3a_random_bytes_are_quarantined(stub_slotkeeper):
    """3. An entry's block (a stub entry's whole file) turned to random bytes of its size: it no longer holds
    what it was saved with, so the entry is quarantined (its manifest; the block goes with its last user), and
    the state is never handed to llama-server (put together and checked first); cold, ready."""
    save_dir, entry = saved_cache(stub_slotkeeper)
    cache = entry_bin(save_dir, entry)
    cache.write_bytes(os.urandom(cache.stat().st_size))
    sk2 = stub_slotkeeper("-np", "1")
    assert f"entry {entry[:4]} quarantined (its file changed on disk: 1 of its blocks no longer holds" in sk2.logs(), (
        sk2.logs()
    )
    assert not restores(sk2), "a state that failed its checksum was handed to llama-server"
    assert complete(sk2)["timings"]["cache_n"] == 0
    assert entry not in entry_ids(save_dir) and not cache.exists() and not manifest_path(save_dir, entry).exists()
    assert sorted(p.suffix for p in quarantine_dir(save_dir).iterdir()) == [".json"]


def test_3a_a_file_llama_server_refuses_is_quarantined(stub_slotkeeper):
    """3. An entry whose checksum matches but that llama-server refuses (random bytes, checksum taken again):
    quarantined with its manifest, cold, ready."""
    save_dir, entry = saved_cache(stub_slotkeeper)
    rewrite_entry(save_dir, entry, os.urandom(entry_bin(save_dir, entry).stat().st_size))
    cache = entry_bin(save_dir, entry)
    sk2 = stub_slotkeeper("-np", "1")
    assert f"entry {entry[:4]} quarantined (llama-server refused it" in sk2.logs()
    assert complete(sk2)["timings"]["cache_n"] == 0
    assert entry not in entry_ids(save_dir) and not cache.exists() and not manifest_path(save_dir, entry).exists()
    assert sorted(p.suffix for p in quarantine_dir(save_dir).iterdir()) == [".json"]


def test_3b_manifest_for_other_kv_settings_is_tried_and_used_when_llama_server_loads_it(stub_slotkeeper):
    """3. An entry saved with another -ctk is not judged by the flag: one file of its kind is loaded at start,
    and llama-server's answer decides (the stub takes it, as llama-server takes one saved with a smaller -c).
    Taken, it is used as saved (and superseded, like any entry, by the save of its grown chat); never
    quarantined."""
    save_dir, entry = saved_cache(stub_slotkeeper)
    edit_manifest(save_dir, entry, lambda m: m["fingerprint"].update(cache_type_k="q8_0"))
    sk2 = stub_slotkeeper("-np", "1")
    line = "1 entry saved by another configuration used as saved: this llama-server loads it"
    assert sk2.logs().count(line) == 1, sk2.logs()
    assert restored(sk2.logs())
    assert complete(sk2)["timings"]["cache_n"] > 0
    stop(sk2)
    assert not quarantine_dir(save_dir).exists()


def test_3c_legacy_bin_without_manifest_needs_opt_in(stub_slotkeeper):
    """3. A slot file of the old layout (`0.bin`, saved by llama-server directly) has no manifest: left as it is,
    unless --restore-unverified, which takes it over as an entry and restores it."""
    save_dir, entry = saved_cache(stub_slotkeeper)
    legacy = save_dir / "0.bin"
    os.replace(entry_bin(save_dir, entry), legacy)
    manifest_path(save_dir, entry).unlink()
    sk2 = stub_slotkeeper("-np", "1")
    assert "0.bin has no slotkeeper manifest; left as it is (--restore-unverified takes it over)" in sk2.logs()
    assert complete(sk2)["timings"]["cache_n"] == 0
    sk2.killpg(signal.SIGKILL)
    sk2.wait()
    assert legacy.is_file() and not entry_ids(save_dir)
    sk3 = stub_slotkeeper("-np", "1", own=("--restore-unverified",))
    taken = only_entry(save_dir)
    assert not legacy.exists() and f"slot file 0.bin taken over as entry {taken[:4]}" in sk3.logs()
    assert restored(sk3.logs()) == [(taken[:4], 0)], sk3.logs()
    assert complete(sk3)["timings"]["cache_n"] > 0


def test_3d_size_differs_from_manifest_is_quarantined(stub_slotkeeper):
    """3. An entry whose file is shorter than its manifest says (its block truncated behind slotkeeper's back):
    quarantined, never handed to llama-server, cold."""
    save_dir, entry = saved_cache(stub_slotkeeper)
    cache = entry_bin(save_dir, entry)
    cache.write_bytes(cache.read_bytes()[:100])
    sk2 = stub_slotkeeper("-np", "1")
    assert f"entry {entry[:4]} quarantined (its file changed on disk: 1 of its blocks no longer holds" in sk2.logs()
    assert not restores(sk2), "a truncated file was handed to llama-server"
    assert complete(sk2)["timings"]["cache_n"] == 0
    assert not entry_ids(save_dir)


def test_4_restored_but_unused_entry_is_not_rewritten(stub_slotkeeper):
    """4. At stop, an entry that was only restored is not saved again (its file untouched); a used one is."""
    other = "Another conversation, in the other slot, never continued. " * 6
    sk = stub_slotkeeper("-np", "2", own=("--autosave-idle", "0"))
    complete(sk)
    complete(sk, other)
    stop(sk)
    save_dir = sk.extra["save_dir"]
    tokens = assert_store_sound(save_dir)
    assert len(tokens) == 2
    chat = next(i for i, t in tokens.items() if bytes(t[: len(PROMPT)]) == PROMPT.encode())
    unused = next(i for i in tokens if i != chat)
    before = entry_bin(save_dir, unused).stat()
    unused_bin = entry_bin(save_dir, unused).read_bytes()
    time.sleep(0.05)
    sk2 = stub_slotkeeper("-np", "2", own=("--autosave-idle", "0"))
    assert sorted(c for c, _ in restored(sk2.logs())) == sorted([chat[:4], unused[:4]]), sk2.logs()
    assert complete(sk2, PROMPT + " and a follow-up")["timings"]["cache_n"] >= len(PROMPT)
    stop(sk2)
    after = entry_bin(save_dir, unused).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "an unused entry was written again"
    assert entry_bin(save_dir, unused).read_bytes() == unused_bin
    new = set(entry_ids(save_dir)) - {unused}
    assert len(new) == 1 and chat not in new, "the used chat was not saved (superseding its old entry)"
    assert [c for c, _, _ in saved(sk2.logs())] == [next(iter(new))[:4]], sk2.logs()


def test_5_idle_autosave_survives_sigkill(stub_slotkeeper):
    """5. After activity and the idle delay, the cache is saved in the background: a SIGKILL loses nothing."""
    sk = stub_slotkeeper("-np", "1", own=("--autosave-idle", "0.5"))
    complete(sk)
    assert wait_until(lambda: len(saved(sk.logs())) >= 1, 10), sk.logs()
    # a request arriving right after (or during) an autosave must not fail
    complete(sk, PROMPT + " more")
    assert wait_until(lambda: len(saved(sk.logs())) >= 2, 10), sk.logs()
    assert [(slot, why) for _, slot, why in saved(sk.logs())] == [(0, "idle"), (0, "idle")]
    sk.killpg(signal.SIGKILL)
    sk.wait()
    save_dir = sk.extra["save_dir"]
    entry = only_entry(save_dir)  # the second save superseded the first
    assert saved(sk.logs())[-1][0] == entry[:4]
    sk2 = stub_slotkeeper("-np", "1")
    assert restored(sk2.logs()) == [(entry[:4], 0)], sk2.logs()
    assert complete(sk2, PROMPT + " more")["timings"]["cache_n"] > len(PROMPT)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs as the save directory: a real 'No space left on device'."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        if os.environ.get("SLOTKEEPER_REQUIRE_LLAMA_SERVER"):
            pytest.fail(f"cannot mount a tmpfs for the disk-full test: {result.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs (needs root): {result.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.parametrize("staging", ["ram", "disk"])
def test_6_disk_full_keeps_the_old_file(stub_slotkeeper, tiny_disk, staging):
    """6. The disk fills during a save, as llama-server writes it (staged on disk) or as slotkeeper writes its
    blocks (staged in RAM): the save fails, the old entry is intact, one clear log line, no partial file or
    block left. And when the store can tell beforehand that a save will not fit, it does not start it."""
    stub = {"STUB_BYTES_PER_TOKEN": "1024"}
    own = () if staging == "ram" else ("--no-ram-staging",)
    first = "short conversation " * 16  # 304 tokens: ~310 KB
    sk = stub_slotkeeper("-np", "1", save_dir=tiny_disk, stub=stub, own=own)
    reply = complete(sk, first)
    stop(sk)
    entry = only_entry(tiny_disk)
    good = bins_snapshot(tiny_disk)
    (tiny_disk / "filler").write_bytes(b"\0" * (1024 * 1024 - len(good[f"{entry}.bin"]) - 450 * 1024))

    # The follow-up continues in its slot without a tokenize round trip and, with --no-slots, llama-server
    # cannot say what the slot holds: slotkeeper expects the size it last knew (~330 KB, which fits), and
    # llama-server runs out of space writing ~860 KB.
    sk2 = stub_slotkeeper("-np", "1", "--no-slots", save_dir=tiny_disk, stub=stub, own=own)
    assert restored(sk2.logs()) == [(entry[:4], 0)], sk2.logs()
    turn = first + reply["content"] + " and a short follow-up."
    turn = turn + complete(sk2, turn)["content"] + " and a much longer follow-up " * 18
    complete(sk2, turn)
    stop(sk2)
    why = "llama-server answered 500: Unable to save slot" if staging == "disk" else "No space left on device"
    assert f"slot 0 not saved (at stop): {why}; its previous entries are kept" in sk2.logs(), sk2.logs()
    assert "No space left on device" in sk2.logs()  # llama-server's own line, or slotkeeper's: the disk did fill
    assert only_files_of(tiny_disk, entry) and bins_snapshot(tiny_disk) == good
    assert_entry_sound(tiny_disk, entry)
    assert not transients(tiny_disk) and not uncommitted(tiny_disk) and not list(tiny_disk.rglob("*.partial"))

    # Now its tokens are known (the restored slot is tokenized): the save is refused before it starts.
    sk3 = stub_slotkeeper("-np", "1", save_dir=tiny_disk, stub=stub, own=own)
    assert restored(sk3.logs()) == [(entry[:4], 0)], sk3.logs()
    complete(sk3, turn)
    stop(sk3)
    assert re.search(
        r"slot 0 not saved \(at stop\): only .* free in .*, ~.* needed; its previous entries are kept", sk3.logs()
    ), sk3.logs()
    assert not any(e["event"] == "save" and e["pid"] == child_pid(sk3) for e in read_events(sk3.extra["events"]))
    assert only_files_of(tiny_disk, entry) and bins_snapshot(tiny_disk) == good
    assert not transients(tiny_disk)


def test_7_save_over_budget_is_abandoned_within_budget(stub_slotkeeper):
    """7. A save longer than --save-timeout is abandoned: old entry intact, exit within budget + stop timeout."""
    save_dir, entry = saved_cache(stub_slotkeeper)
    good = bins_snapshot(save_dir)
    sk2 = stub_slotkeeper(
        "-np",
        "1",
        own=("--save-timeout", "1", "--stop-timeout", "1", "--autosave-idle", "0"),
        stub={"STUB_SAVE_SECONDS": "30"},
    )
    complete(sk2, PROMPT + " changed")
    started = time.monotonic()
    sk2.killpg(signal.SIGTERM)
    assert sk2.wait(10) == 0
    assert time.monotonic() - started < 1 + 1 + 0.8, sk2.logs()
    assert re.search(r"the save budget \(--save-timeout( 1\.0 s)?\) ran out", sk2.logs()), sk2.logs()
    assert only_files_of(save_dir, entry) and bins_snapshot(save_dir) == good
    assert_entry_sound(save_dir, entry)


def test_long_save_reports_progress(stub_slotkeeper):
    """A save that takes seconds logs the partial file's growth, so llama-swap's log shows it is alive."""
    sk = stub_slotkeeper("-np", "1", own=("--autosave-idle", "0"), stub={"STUB_SAVE_SECONDS": "2.5"})
    complete(sk)
    stop(sk)
    assert "slot 0 saving: " in sk.logs(), sk.logs()
    assert [(slot, why) for _, slot, why in saved(sk.logs())] == [(0, "at stop")]
    progress = sk.logs().index("slot 0 saving: ")
    assert progress < sk.logs().index(" saved from slot 0 (at stop)"), "progress came after the save"


def test_startup_warns_when_the_cache_would_not_fit_the_budget(stub_slotkeeper):
    """From the last saves' speed, a cache that cannot be saved inside --save-timeout is announced at start.

    The estimate is what a stop-time save may have to write: at most one entry per slot (the largest), not
    the whole store."""
    sk = stub_slotkeeper("-np", "1", own=("--autosave-idle", "0"))
    complete(sk)
    complete(sk, "A second conversation, which takes the one slot over. " * 7)  # the first is written back
    stop(sk)
    save_dir = sk.extra["save_dir"]
    ids = entry_ids(save_dir)
    assert len(ids) == 2
    largest = max(entry_bin(save_dir, i).stat().st_size for i in ids)

    for entry in ids:  # as if each file took 6 s to write: 12 s for the store, 6 s for what one slot holds
        edit_manifest(save_dir, entry, lambda m: m.update(save_ms=6_000.0))
    sk2 = stub_slotkeeper("-np", "1", own=("--save-timeout", "8"))
    estimate = sk2.call("GET", "/slotkeeper/status").body["save_estimate"]
    assert estimate["bytes"] == largest and 5 < estimate["seconds"] < 7, estimate
    assert "more than --save-timeout" not in sk2.logs(), sk2.logs()
    sk2.killpg(signal.SIGKILL)
    sk2.wait()

    for entry in ids:  # 20 s each: even one slot's entry does not fit
        edit_manifest(save_dir, entry, lambda m: m.update(save_ms=20_000.0))
    sk3 = stub_slotkeeper("-np", "1", own=("--save-timeout", "8"))
    assert "more than --save-timeout 8.0 s" in sk3.logs() and "unloadTimeout" in sk3.logs(), sk3.logs()


def test_max_cache_bytes_evicts_the_least_recently_used(stub_slotkeeper):
    """--max-cache-bytes keeps the store under the cap: the least recently used entry goes first (not the
    oldest saved), its manifest with it; an entry a slot holds stays."""
    conversations = {
        name: f"The conversation called {name}, with enough words to be worth a file. " * 6 for name in "ABC"
    }
    sk = stub_slotkeeper("-np", "1", own=("--autosave-idle", "0"))
    complete(sk, conversations["A"])
    complete(sk, conversations["B"])  # A is written back before its slot is reused
    stop(sk)
    save_dir = sk.extra["save_dir"]
    tokens = assert_store_sound(save_dir)
    by_name = {
        name: next(i for i, t in tokens.items() if bytes(t[: len(p)]) == p.encode())
        for name, p in conversations.items()
        if name != "C"
    }
    a, b = by_name["A"], by_name["B"]
    assert read_manifest(save_dir, a)["saved_at"] < read_manifest(save_dir, b)["saved_at"]
    # A was used (restored, read) after B was saved: B is the least recently used, A the oldest saved.
    edit_manifest(save_dir, a, lambda m: m.update(last_used=read_manifest(save_dir, b)["saved_at"] + 10))
    size = entry_bin(save_dir, a).stat().st_size
    assert entry_bin(save_dir, b).stat().st_size == size

    sk2 = stub_slotkeeper("-np", "1", own=("--autosave-idle", "0", "--max-cache-bytes", str(2 * size + size // 2)))
    assert restored(sk2.logs()) == [(a[:4], 0)], sk2.logs()
    complete(sk2, conversations["C"])
    stop(sk2)
    remaining = set(entry_ids(save_dir))
    assert b not in remaining and not manifest_path(save_dir, b).exists() and not entry_bin(save_dir, b).exists()
    assert a in remaining and len(remaining) == 2, remaining
    assert f"entry {b[:4]} evicted" in sk2.logs() and f"entry {a[:4]} evicted" not in sk2.logs()
    assert_store_sound(save_dir)
    assert sum(entry_bin(save_dir, i).stat().st_size for i in remaining) <= 2 * size + size // 2


# Loaded before slotkeeper runs (PYTHONPATH): its RAM filesystem for staging is the test's small tmpfs.
SMALL_RAM = """
import os
from pathlib import Path
from slotkeeper.store import staging

staging._ram_dir = lambda root: Path(os.environ["RAM_BASE"]) / f"slotkeeper-{os.getuid()}-{os.getpid()}-test"
"""


@pytest.fixture
def small_ram(tmp_path) -> Iterator[tuple[Path, dict[str, str]]]:
    """(its folder, slotkeeper's environment): a 512 KiB tmpfs that slotkeeper takes for its RAM filesystem."""
    mount_point = tmp_path / "ram"
    mount_point.mkdir()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SMALL_RAM)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount_point)], check=True)
    try:
        yield mount_point, {"PYTHONPATH": str(site), "RAM_BASE": str(mount_point)}
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_ram_filesystem_stages_the_save_on_disk_with_one_line(stub_slotkeeper, small_ram):
    """llama-server runs out of room writing a save into RAM (its size was expected smaller: with --no-slots
    slotkeeper expects the size it last knew): one line, the save staged on disk instead succeeds, and nothing
    is left in RAM."""
    ram, env = small_ram
    stub = {"STUB_BYTES_PER_TOKEN": "1024"}
    first = "short conversation " * 16  # 304 tokens: ~310 KB, which fits in RAM with room to spare
    stub.update(env)
    sk = stub_slotkeeper("-np", "1", stub=stub)
    reply = complete(sk, first)
    stop(sk)
    entry = only_entry(sk.extra["save_dir"])
    sk2 = stub_slotkeeper("-np", "1", "--no-slots", stub=stub)
    assert restored(sk2.logs()) == [(entry[:4], 0)], sk2.logs()
    turn = first + reply["content"] + " and a short follow-up."
    turn = turn + complete(sk2, turn)["content"] + " and a much longer follow-up " * 18  # ~860 KB: too much
    complete(sk2, turn)
    stop(sk2)
    lines = [line for line in sk2.logs().splitlines() if "could not stage in" in line]
    assert len(lines) == 1 and str(ram) in lines[0] and "Unable to save slot" in lines[0], sk2.logs()
    assert [why for _, _, why in saved(sk2.logs())] == ["at stop"], sk2.logs()
    assert "not saved" not in sk2.logs(), sk2.logs()
    assert_store_sound(sk2.extra["save_dir"])
    assert not list(ram.iterdir()), "something was left in RAM"
