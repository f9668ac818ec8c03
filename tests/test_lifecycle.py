"""The lifecycle against the stub llama-server: the faults a real one cannot be made to show on demand.

Scenarios are numbered as in issue 2; each drives a real slotkeeper process in its own process group.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from store_helpers import (
    assert_entry_sound,
    bins_snapshot,
    entry_bin,
    entry_files,
    entry_ids,
    only_entry,
    only_files_of,
    read_manifest,
    restored,
    saved,
    transients,
)

from slotkeeper.testing.harness import pid_alive, read_events, stream_lines, wait_until

# 360 bytes: the stub's tokens are bytes, and prompts under --min-save-tokens (256) are not saved
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8
OTHER = "Something else entirely, to make slot 0 hold another conversation. " * 6


def complete(sk, prompt: str = PROMPT, **kw):
    reply = sk.call("POST", "/completion", {"prompt": prompt, "n_predict": 8, **kw})
    assert reply.status == 200, reply.body
    return reply.body


def child_pid(sk) -> int:
    starts = [e for e in read_events(sk.extra["events"]) if e["event"] == "start"]
    return starts[-1]["pid"]


def save_requested(sk) -> bool:
    """The current child has received a slot save request."""
    pid = child_pid(sk)
    return any(
        e["event"] == "request" and e["pid"] == pid and e["path"].startswith("/slots/") and "save" in e.get("query", "")
        for e in read_events(sk.extra["events"])
    )


def seed_cache(stub_slotkeeper) -> str:
    """One run that converses and stops, leaving slot 0's conversation in the store. Returns its entry id."""
    sk = stub_slotkeeper("-np", "2")
    complete(sk, id_slot=0)
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0, sk.logs()
    entry = only_entry(sk.extra["save_dir"])
    assert_entry_sound(sk.extra["save_dir"], entry)
    return entry


def test_1_request_before_ready_waits_for_restore(stub_slotkeeper):
    """1. A request sent the moment the public port accepts is answered only after the restore."""
    seed_cache(stub_slotkeeper)
    sk = stub_slotkeeper("-np", "2", stub={"STUB_RESTORE_SECONDS": "1.0"}, wait=False)
    assert wait_until(sk.accepting, 30), sk.logs()
    assert sk.health() == 503  # restoring: llama-swap must not forward yet
    body = complete(sk, id_slot=0)
    assert body["timings"]["cache_n"] > 0, "the first request ran on a cold slot"
    events = read_events(sk.extra["events"])
    run = [e for e in events if e["pid"] == child_pid(sk)]
    restored_at = next(e["t"] for e in run if e["event"] == "restore")
    first_completion = next(e["t"] for e in run if e["event"] == "request" and e["path"] == "/completion")
    assert first_completion > restored_at, "a completion reached llama-server before the restore finished"


def test_2a_group_sigterm_saves_before_child_stops(stub_slotkeeper):
    """2. llama-swap's stop: killpg(SIGTERM) saves first, then stops the child, exit 0."""
    sk = stub_slotkeeper()
    complete(sk, id_slot=0)
    pid = child_pid(sk)
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0, sk.logs()
    events = [e for e in read_events(sk.extra["events"]) if e["pid"] == pid]
    kinds = [e["event"] for e in events]
    assert "save" in kinds and "term" in kinds, kinds
    assert kinds.index("save") < kinds.index("term"), "the child was stopped before the save"
    entry = only_entry(sk.extra["save_dir"])
    assert saved(sk.logs()) == [(entry[:4], 0, "at stop")], sk.logs()
    manifest = read_manifest(sk.extra["save_dir"], entry)
    assert manifest["bytes"] == entry_bin(sk.extra["save_dir"], entry).stat().st_size
    assert_entry_sound(sk.extra["save_dir"], entry)


def test_2b_group_sigkill_during_slow_save_leaves_no_child(stub_slotkeeper):
    """2. SIGKILL of slotkeeper's group during a slow save: no child process remains, and the half-written
    file never becomes an entry (the next start removes it and restores nothing)."""
    sk = stub_slotkeeper(stub={"STUB_SAVE_SECONDS": "5"})
    save_dir = sk.extra["save_dir"]
    complete(sk, id_slot=0)
    pid = child_pid(sk)
    sk.killpg(signal.SIGTERM)
    assert wait_until(lambda: save_requested(sk), 10), sk.logs()
    sk.killpg(signal.SIGKILL)
    sk.wait()
    assert wait_until(lambda: not pid_alive(pid), 5), "llama-server outlived slotkeeper"
    assert not entry_files(save_dir), "a half-written save was put in place"
    sk2 = stub_slotkeeper()
    assert not restored(sk2.logs()) and not transients(save_dir), sk2.logs()
    assert not entry_ids(save_dir)


def test_3a_second_signal_skips_the_save(stub_slotkeeper):
    """3. A second SIGTERM during a slow save abandons it: prompt non-zero exit, previous entry intact."""
    entry = seed_cache(stub_slotkeeper)
    sk = stub_slotkeeper("-np", "2", stub={"STUB_SAVE_SECONDS": "10"})
    old = bins_snapshot(sk.extra["save_dir"])
    complete(sk, prompt=OTHER, id_slot=0)
    sk.killpg(signal.SIGTERM)
    assert wait_until(lambda: save_requested(sk), 10), sk.logs()
    started = time.monotonic()
    sk.killpg(signal.SIGTERM)
    code = sk.wait(5)
    assert code != 0
    assert time.monotonic() - started < 2.0
    assert bins_snapshot(sk.extra["save_dir"]) == old and only_files_of(sk.extra["save_dir"], entry)
    assert_entry_sound(sk.extra["save_dir"], entry)


def test_3b_signal_while_loading_exits_promptly(stub_slotkeeper):
    """3. A signal while the child is still loading stops it at once, no save, exit within a second."""
    sk = stub_slotkeeper(stub={"STUB_LOAD_SECONDS": "30"}, wait=False)
    assert wait_until(sk.accepting, 30)
    assert sk.health() == 503
    started = time.monotonic()
    sk.killpg(signal.SIGTERM)
    assert sk.wait(5) == 0
    assert time.monotonic() - started < 1.0, sk.logs()
    assert not any(e["event"] == "save" for e in read_events(sk.extra["events"]))


def test_4a_child_crash_at_load(stub_slotkeeper):
    """4. The child dies while loading: slotkeeper exits with its code and one line saying so."""
    sk = stub_slotkeeper(stub={"STUB_CRASH_AT_LOAD": "3"}, wait=False)
    assert sk.wait(15) == 3
    assert "llama-server exited with code 3 during startup" in sk.logs()
    assert "Traceback" not in sk.logs()


def test_4a_child_that_exits_at_once_ends_slotkeeper_at_once(starter):
    """4. llama-server refuses its arguments and exits before slotkeeper's loop even runs: slotkeeper exits
    with its code at once (it used to poll /health forever and ignore SIGTERM)."""
    sk = starter("sh -c 'echo error: invalid argument; exit 3' --", ["-m", "x.gguf"])(wait=False)
    assert sk.wait(15) == 3, sk.logs()
    assert "llama-server exited with code 3 during startup" in sk.logs()


def test_4b_child_crash_while_serving(stub_slotkeeper):
    """4. The child dies while serving: the request fails cleanly, slotkeeper exits with the child's code."""
    sk = stub_slotkeeper(stub={"STUB_CRASH_AFTER_REQUESTS": "1", "STUB_CRASH_CODE": "7"})
    reply = sk.call("POST", "/completion", {"prompt": "hi", "n_predict": 4})
    assert reply.status == 502
    assert reply.body["error"]["type"] == "server_error"
    assert sk.wait(10) == 7
    assert "llama-server exited with code 7 while serving" in sk.logs()
    assert "Traceback" not in sk.logs()


def test_5_api_key_restore_and_save(stub_slotkeeper):
    """5. With --api-key, slotkeeper's own slot calls authenticate: save and restore still work."""
    auth = {"Authorization": "Bearer s3cret"}
    sk = stub_slotkeeper("--api-key", "s3cret")
    assert sk.call("POST", "/completion", {"prompt": PROMPT}).status == 401
    assert sk.call("POST", "/completion", {"prompt": PROMPT, "n_predict": 4, "id_slot": 0}, headers=auth).status == 200
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0
    entry = only_entry(sk.extra["save_dir"])
    assert saved(sk.logs()) == [(entry[:4], 0, "at stop")], sk.logs()
    sk2 = stub_slotkeeper("--api-key", "s3cret")
    assert restored(sk2.logs()) == [(entry[:4], 0)], sk2.logs()
    body = sk2.call("POST", "/completion", {"prompt": PROMPT, "n_predict": 4, "id_slot": 0}, headers=auth).body
    assert body["timings"]["cache_n"] > 0


def test_7_zero_token_save_never_replaces_a_good_file(stub_slotkeeper):
    """7. A save that returns n_saved == 0 leaves the existing entry untouched and adds no empty entry."""
    entry = seed_cache(stub_slotkeeper)
    sk = stub_slotkeeper("-np", "2", stub={"STUB_SAVE_ZERO": "1"})
    save_dir = sk.extra["save_dir"]
    good = bins_snapshot(save_dir)
    manifest = read_manifest(save_dir, entry)
    complete(sk, prompt=OTHER, id_slot=0)  # slot 0 held the good entry's conversation
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0
    assert "saved 0 of 1 changed slot(s)" in sk.logs(), sk.logs()
    assert only_files_of(save_dir, entry) and bins_snapshot(save_dir) == good
    assert not transients(save_dir)
    assert_entry_sound(save_dir, entry)
    unchanged = {k: v for k, v in manifest.items() if k != "last_used"}  # a restore records its last use
    assert {k: v for k, v in read_manifest(save_dir, entry).items() if k != "last_used"} == unchanged


def test_8_sse_chunks_arrive_incrementally(stub_slotkeeper):
    """8. An SSE token stream arrives token by token through the proxy, not buffered to the end."""
    sk = stub_slotkeeper(stub={"STUB_TOKEN_SECONDS": "0.15"})
    arrivals = [
        t
        for t, line in stream_lines(sk.port, "/completion", {"prompt": "hi", "n_predict": 6, "stream": True})
        if line.startswith(b"data:")
    ]
    assert len(arrivals) >= 6
    assert arrivals[-1] - arrivals[0] > 0.5, "events arrived together: the stream was buffered"


def test_child_output_passes_through_unchanged(stub_slotkeeper):
    """llama-server's output reaches slotkeeper's own stream byte for byte, however long its lines."""
    sk = stub_slotkeeper(stub={"STUB_CHATTY": "3", "STUB_CHATTY_BYTES": "200000"})
    long_lines = [line for line in sk.log_path.read_bytes().split(b"\n") if len(line) >= 200000]
    assert len(long_lines) == 3, "long child lines were cut, merged or lost"


def test_child_ignoring_sigterm_is_killed_after_stop_timeout(stub_slotkeeper):
    """A child that ignores SIGTERM is SIGKILLed after --stop-timeout; slotkeeper still saves and exits 0."""
    sk = stub_slotkeeper(own=("--stop-timeout", "0.5"), stub={"STUB_IGNORE_SIGTERM": "1"})
    complete(sk, id_slot=0)
    pid = child_pid(sk)
    started = time.monotonic()
    sk.killpg(signal.SIGTERM)
    assert sk.wait(10) == 0
    assert time.monotonic() - started < 2.0
    assert "did not exit 0.5 s after SIGTERM; sending SIGKILL" in sk.logs()
    assert saved(sk.logs()) == [(only_entry(sk.extra["save_dir"])[:4], 0, "at stop")], sk.logs()
    assert wait_until(lambda: not pid_alive(pid), 2)


def test_no_slots_endpoint_still_saves(stub_slotkeeper):
    """With placement off (llama-server chooses the slots) and --no-slots, slotkeeper cannot see which slots
    hold tokens: it tries each; empty ones are skipped (no empty entry)."""
    sk = stub_slotkeeper("-np", "2", "--no-slots", own=("--no-placement",))
    complete(sk, id_slot=1)
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0
    save_dir = sk.extra["save_dir"]
    entry = only_entry(save_dir)
    assert saved(sk.logs()) == [(entry[:4], 1, "at stop")], sk.logs()
    assert "saved 1 of 2 changed slot(s)" in sk.logs(), sk.logs()
    saves = [e for e in read_events(sk.extra["events"]) if e["event"] == "save"]
    assert sorted(e["slot"] for e in saves) == [0, 1], "not every slot was tried"
    assert len(assert_entry_sound(save_dir, entry)) > len(PROMPT)


def test_crash_while_saving_keeps_the_old_file(stub_slotkeeper):
    """The child dies in the middle of the stop-time save: no half file becomes an entry, the old entry is
    intact, exit is prompt."""
    entry = seed_cache(stub_slotkeeper)
    sk = stub_slotkeeper("-np", "2", stub={"STUB_SAVE_SECONDS": "5"})
    save_dir = sk.extra["save_dir"]
    good = bins_snapshot(save_dir)
    complete(sk, prompt=PROMPT + OTHER, id_slot=0)
    sk.killpg(signal.SIGTERM)
    assert wait_until(lambda: save_requested(sk), 10), sk.logs()
    os.kill(child_pid(sk), signal.SIGKILL)
    sk.wait(5)
    assert only_files_of(save_dir, entry) and bins_snapshot(save_dir) == good
    assert_entry_sound(save_dir, entry)
    assert "Traceback" not in sk.logs()


def test_3c_second_signal_while_draining_stops_at_once(stub_slotkeeper):
    """3. A second signal while a long request drains: no waiting for --drain-timeout, prompt non-zero exit."""
    sk = stub_slotkeeper(own=("--drain-timeout", "20", "--save-timeout", "30"), stub={"STUB_TOKEN_SECONDS": "0.5"})
    streaming = threading.Thread(
        target=lambda: list(stream_lines(sk.port, "/completion", {"prompt": "hi", "n_predict": 60, "stream": True})),
        daemon=True,
    )
    streaming.start()
    assert wait_until(
        lambda: any(e["event"] == "request" and e["path"] == "/completion" for e in read_events(sk.extra["events"])), 10
    )
    sk.killpg(signal.SIGTERM)
    assert wait_until(lambda: "state: ready -> draining" in sk.logs(), 5), sk.logs()
    started = time.monotonic()
    sk.killpg(signal.SIGTERM)
    assert sk.wait(10) != 0
    assert time.monotonic() - started < 2.0, sk.logs()
    assert not any(e["event"] == "save" for e in read_events(sk.extra["events"]))


def test_3d_signal_while_restoring_exits_promptly(stub_slotkeeper):
    """3. A signal during a slow restore: the child is stopped at once, nothing is saved, the entries stay."""
    entry = seed_cache(stub_slotkeeper)
    sk = stub_slotkeeper("-np", "2", own=("--stop-timeout", "0.5"), stub={"STUB_RESTORE_SECONDS": "20"}, wait=False)
    assert wait_until(lambda: "state: starting -> restoring" in sk.logs(), 30), sk.logs()
    good = bins_snapshot(sk.extra["save_dir"])
    started = time.monotonic()
    sk.killpg(signal.SIGTERM)
    assert sk.wait(10) == 0
    assert time.monotonic() - started < 0.5 + 1.0, sk.logs()
    assert "stop requested during restoring" in sk.logs()
    assert only_files_of(sk.extra["save_dir"], entry) and bins_snapshot(sk.extra["save_dir"]) == good
    assert not transients(sk.extra["save_dir"]), "the restore's transient link was left behind"
    assert not any(e["event"] == "save" and e["pid"] == child_pid(sk) for e in read_events(sk.extra["events"]))


def test_child_on_loopback_tcp(stub_slotkeeper):
    """--child-tcp: the child listens on a private loopback port instead of a unix socket; all else the same."""
    sk = stub_slotkeeper(own=("--child-tcp",))
    assert "llama-server on 127.0.0.1:" in sk.logs()
    complete(sk, id_slot=0)
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0
    assert saved(sk.logs()) == [(only_entry(sk.extra["save_dir"])[:4], 0, "at stop")], sk.logs()
