"""Faults met by slotkeeper's background work and by its stop (issue 21).

A save that fails in the idle autosave (the save directory remounted read-only under a running slotkeeper, or
an error nobody expected from the store) is one log line and is tried again: it never ends the autosave, and
a stop that meets one still stops llama-server and exits 0. A stop while a restore runs waits for that slot
action before it signals llama-server, which finishes a slot action before it honours SIGTERM: it then exits
on its SIGTERM instead of being SIGKILLed.

The read-only directory is a real read-only bind mount (root only, as in CI) and the server the real
llama-server; the timing faults (a restore that lasts seconds) come from the stub's knobs, and the error
nobody expected from a patch of the store loaded at interpreter start (the store itself reports failures).
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
from pathlib import Path

import pytest
from family_helpers import FAMILIES, Chat
from store_helpers import entry_ids, only_entry, restored, saved

from slotkeeper.testing.harness import http_call, read_events, wait_until

PROMPT = "".join(f"Line {i}: the slot cache keeps every token of this conversation. " for i in range(30))
STUB_PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # the stub's tokens are bytes: over 256
OTHER = "Something else entirely, to make the slot hold another conversation. " * 6
ESCALATED = "after SIGTERM; sending SIGKILL"  # supervisor.ChildProcess.stop, when the child outlives SIGTERM
# Loaded before slotkeeper runs (PYTHONPATH): the store's save (restore) raises EROFS while the marker file
# `save` (`restore`) exists in $FAULT_DIR.
FAULTY_STORE = """
import errno, os
from pathlib import Path
from slotkeeper.store.conversations import ConversationStore

def _faulty(name):
    original = getattr(ConversationStore, name)

    async def method(self, *args, **kwargs):
        if (Path(os.environ["FAULT_DIR"]) / name.removesuffix("_slot")).exists():
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return await original(self, *args, **kwargs)

    setattr(ConversationStore, name, method)

_faulty("save_slot")
_faulty("restore")
"""


def complete(sk, prompt: str = PROMPT, **kw) -> dict:
    reply = sk.call("POST", "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0, **kw})
    assert reply.status == 200, reply.body
    return reply.body


def clean_exit(logs: str) -> bool:
    return "Traceback" not in logs and "internal error" not in logs and ESCALATED not in logs


def restarts_warm(family_start, save_dir: Path) -> None:
    """The next start restores the one entry, and the chat's next request reuses it: nothing was lost."""
    entry = only_entry(save_dir)
    sk = family_start(FAMILIES["llama"], "-np", "1", own=("--autosave-idle", "0"))
    assert restored(sk.logs()) == [(entry[:4], 0)], sk.logs()
    assert complete(sk)["timings"]["cache_n"] > 0, sk.logs()


@pytest.fixture
def faulty_store(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """(environment, faults): with that environment slotkeeper's store raises EROFS from its saves while
    faults/save exists, from its restores while faults/restore does."""
    site, faults = tmp_path / "faulty-store", tmp_path / "faults"
    site.mkdir()
    faults.mkdir()
    (site / "sitecustomize.py").write_text(FAULTY_STORE)
    return {"PYTHONPATH": str(site), "FAULT_DIR": str(faults)}, faults


def test_idle_autosave_survives_a_read_only_save_dir_and_saves_once_writable(family_start, read_only):
    """The save directory turns read-only under a running slotkeeper: the idle autosave fails with one line,
    goes on, and saves the chat once the directory is writable again, with no new request; SIGTERM exits 0."""
    sk = family_start(FAMILIES["llama"], "-np", "1", own=("--autosave-idle", "2"))
    save_dir = sk.extra["save_dir"]
    failed = "slot 0 not saved (idle): llama-server answered 500: Unable to save slot"
    with read_only(save_dir):
        complete(sk)
        assert wait_until(lambda: failed in sk.logs(), 20), sk.logs()
    assert "Read-only file system" in sk.logs()  # llama-server's own line: the directory was read-only
    assert not entry_ids(save_dir)
    assert wait_until(lambda: saved(sk.logs()), 20), f"the autosave did not run again:\n{sk.logs()}"
    assert [(slot, why) for _, slot, why in saved(sk.logs())] == [(0, "idle")], sk.logs()
    assert sk.logs().count(failed) == 1, sk.logs()
    sk.killpg(signal.SIGTERM)
    assert sk.wait(30) == 0, sk.logs()
    assert clean_exit(sk.logs()) and "nothing to save" in sk.logs(), sk.logs()
    restarts_warm(family_start, save_dir)


def test_a_hybrid_chats_failed_boundary_save_is_tried_again_once_writable(family_start, read_only):
    """On a hybrid the idle autosave saves a chat at its turn boundary. The save directory read-only: the save
    fails with one line and the slot stays changed, so once the directory is writable again the autosave saves
    it, with no new request; the next start restores it and the chat's next turn reuses it."""
    family = FAMILIES["qwen35-thinking-off"]
    sk = family_start(family, "-np", "1", own=("--autosave-idle", "1"))
    save_dir = sk.extra["save_dir"]
    chat = Chat(1, family.request, system="Be brief.")
    with read_only(save_dir):
        chat.turn(sk.port)
        assert wait_until(lambda: "slot 0 not saved (idle)" in sk.logs(), 20), sk.logs()
    assert not entry_ids(save_dir)
    boundary_saved = re.compile(r"chat \w+ saved from slot 0 at its turn boundary \(idle\)")
    assert wait_until(lambda: boundary_saved.search(sk.logs()), 20), f"not tried again:\n{sk.logs()}"
    sk.killpg(signal.SIGTERM)
    assert sk.wait(30) == 0 and clean_exit(sk.logs()), sk.logs()
    sk2 = family_start(family, "-np", "1")
    assert chat.reused_enough(chat.turn(sk2.port)), sk2.logs()


def test_stop_with_a_read_only_save_dir_keeps_the_entry_and_exits_0(family_start, read_only):
    """SIGTERM while the save directory is read-only: the save fails with one line, llama-server exits on
    its SIGTERM, slotkeeper exits 0, and the previous entry is kept whole."""
    sk = family_start(FAMILIES["llama"], "-np", "1", own=("--autosave-idle", "0"))
    complete(sk)
    sk.killpg(signal.SIGTERM)
    assert sk.wait(30) == 0, sk.logs()
    save_dir = sk.extra["save_dir"]
    entry = only_entry(save_dir)
    sk2 = family_start(FAMILIES["llama"], "-np", "1", own=("--autosave-idle", "0"))
    assert restored(sk2.logs()) == [(entry[:4], 0)], sk2.logs()
    with read_only(save_dir):
        complete(sk2, PROMPT + " And one more line, so the slot changed.")
        sk2.killpg(signal.SIGTERM)
        assert sk2.wait(30) == 0, sk2.logs()
    assert sk2.logs().count("slot 0 not saved (at stop): ") == 1, sk2.logs()
    assert clean_exit(sk2.logs()), sk2.logs()
    assert entry_ids(save_dir) == [entry]
    restarts_warm(family_start, save_dir)


def test_an_error_in_the_idle_autosave_is_one_line_and_the_autosave_goes_on(family_start, faulty_store):
    """The store's save raises (EROFS) under the idle autosave: one warning line naming it, the autosave is
    tried again after --autosave-idle and saves once the error is gone; the stop is clean and exits 0."""
    env, faults = faulty_store
    marker = faults / "save"
    marker.touch()
    sk = family_start(FAMILIES["llama"], "-np", "1", own=("--autosave-idle", "2"), env=env)
    complete(sk)
    failed = "idle autosave failed: [Errno 30] Read-only file system; retrying in 2 s"
    assert wait_until(lambda: failed in sk.logs(), 20), sk.logs()
    marker.unlink()
    assert wait_until(lambda: saved(sk.logs()), 20), f"the autosave did not run again:\n{sk.logs()}"
    assert sk.logs().count(failed) == 1 and "warning: idle autosave failed" not in sk.logs().replace(
        f"warning: {failed}", ""
    ), sk.logs()
    sk.killpg(signal.SIGTERM)
    assert sk.wait(30) == 0, sk.logs()
    assert clean_exit(sk.logs()) and "nothing to save" in sk.logs(), sk.logs()
    restarts_warm(family_start, sk.extra["save_dir"])


def test_an_error_in_the_stop_time_save_still_stops_the_child_and_exits_0(family_start, faulty_store):
    """The store's save raises (EROFS) at stop: one warning line, llama-server exits on its SIGTERM, exit 0,
    and the previous entry is kept."""
    env, faults = faulty_store
    marker = faults / "save"
    sk = family_start(FAMILIES["llama"], "-np", "1", own=("--autosave-idle", "0"), env=env)
    complete(sk)
    sk.killpg(signal.SIGTERM)
    assert sk.wait(30) == 0, sk.logs()
    save_dir = sk.extra["save_dir"]
    entry = only_entry(save_dir)
    marker.touch()
    sk2 = family_start(FAMILIES["llama"], "-np", "1", own=("--autosave-idle", "0"), env=env)
    complete(sk2, PROMPT + " And one more line, so the slot changed.")
    sk2.killpg(signal.SIGTERM)
    assert sk2.wait(30) == 0, sk2.logs()
    logs = sk2.logs()
    assert re.findall(r"warning: saving at stop failed: (.*)", logs) == [
        "[Errno 30] Read-only file system; slots not saved yet keep their previous entries"
    ], logs
    assert clean_exit(logs), logs
    assert entry_ids(save_dir) == [entry]
    marker.unlink()
    restarts_warm(family_start, save_dir)


def test_an_error_in_a_start_up_restore_is_one_line_and_the_start_goes_on(family_start, faulty_store):
    """The store's restore raises (EROFS) at start: one warning line, slotkeeper gets ready with the slot cold,
    and the entry stays for the next start."""
    env, faults = faulty_store
    sk = family_start(FAMILIES["llama"], "-np", "1", own=("--autosave-idle", "0"), env=env)
    complete(sk)
    sk.killpg(signal.SIGTERM)
    assert sk.wait(30) == 0, sk.logs()
    entry = only_entry(sk.extra["save_dir"])
    (faults / "restore").touch()
    sk2 = family_start(FAMILIES["llama"], "-np", "1", own=("--autosave-idle", "0"), env=env)
    assert (
        f"warning: chat {entry[:4]} not restored into slot 0 (OSError(30, 'Read-only file system')); it "
        "starts cold" in sk2.logs()
    ), sk2.logs()
    assert complete(sk2)["timings"]["cache_n"] == 0
    sk2.killpg(signal.SIGTERM)
    assert sk2.wait(30) == 0, sk2.logs()
    assert clean_exit(sk2.logs()), sk2.logs()
    (faults / "restore").unlink()
    restarts_warm(family_start, sk.extra["save_dir"])


# ---- a stop while a restore runs (the stub: a restore that lasts seconds) ------------------------------------


def child_pid(sk) -> int:
    return [e for e in read_events(sk.extra["events"]) if e["event"] == "start"][-1]["pid"]


def restores_begun(sk) -> int:
    pid = child_pid(sk)
    return sum(e["event"] == "restore_begin" and e["pid"] == pid for e in read_events(sk.extra["events"]))


def seed(stub_slotkeeper) -> str:
    sk = stub_slotkeeper("-np", "1")
    complete(sk, STUB_PROMPT, id_slot=0)
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0, sk.logs()
    return only_entry(sk.extra["save_dir"])


def test_sigterm_during_the_start_up_restore_waits_for_it_then_the_child_exits_on_sigterm(stub_slotkeeper):
    """A stop while the start-up restore runs (3 s; --stop-timeout 2): the restore's slot action ends before
    llama-server is signalled, so it exits on its SIGTERM (no SIGKILL), nothing is saved, exit 0."""
    entry = seed(stub_slotkeeper)
    sk = stub_slotkeeper("-np", "1", own=("--stop-timeout", "2"), stub={"STUB_RESTORE_SECONDS": "3"}, wait=False)
    assert wait_until(lambda: restores_begun(sk) == 1, 30), sk.logs()
    sk.killpg(signal.SIGTERM)
    assert sk.wait(15) == 0, sk.logs()
    logs = sk.logs()
    assert (
        "stop requested during restoring: stopping llama-server without saving once its slot restore under "
        "way ends (up to 2 s)" in logs
    ), logs
    assert clean_exit(logs), logs
    pid = child_pid(sk)
    assert [
        e["event"] for e in read_events(sk.extra["events"]) if e["pid"] == pid and e["event"] in ("term", "save")
    ] == ["term"]
    assert entry_ids(sk.extra["save_dir"]) == [entry]


def test_sigterm_during_an_on_demand_restore_waits_for_it_then_the_child_exits_on_sigterm(stub_slotkeeper):
    """A stop while a request's restore runs (3 s) outlasts the drain (0.5 s): the request is cancelled, but
    its slot action ends before llama-server is signalled, so it exits on its SIGTERM (no SIGKILL), exit 0."""
    entry = seed(stub_slotkeeper)
    sk = stub_slotkeeper(
        "-np", "1", own=("--drain-timeout", "0.5", "--autosave-idle", "0"), stub={"STUB_RESTORE_SECONDS": "3"}
    )
    assert restored(sk.logs()) == [(entry[:4], 0)], sk.logs()
    complete(sk, OTHER)  # the slot now holds another chat: the first one is in the store only

    def cut_off_request() -> None:  # the drain cancels it: its connection is closed without a reply
        with contextlib.suppress(OSError):
            http_call(sk.port, "POST", "/completion", {"prompt": STUB_PROMPT + " and on", "n_predict": 8}, timeout=30)

    threading.Thread(target=cut_off_request, daemon=True).start()
    assert wait_until(lambda: restores_begun(sk) == 2, 15), sk.logs()
    sk.killpg(signal.SIGTERM)
    assert sk.wait(20) == 0, sk.logs()
    logs = sk.logs()
    assert "llama-server is busy with a slot restore: it is stopped once that ends" in logs, logs
    assert clean_exit(logs), logs
    assert "term" in [e["event"] for e in read_events(sk.extra["events"]) if e["pid"] == child_pid(sk)]
