"""The conversation store's own claims, against the stub llama-server: taking over the old layout, one
slotkeeper per directory, entries of another state format, and entries out of every client's reach."""

from __future__ import annotations

import http.client
import json
import signal
import time

from store_helpers import (
    assert_entry_sound,
    bins_snapshot,
    edit_manifest,
    entries_snapshot,
    entry_bin,
    entry_ids,
    only_entry,
    quarantine_dir,
    read_manifest,
    restored,
    saved,
    snapshots_dir,
)
from stub import encode_slot_file, tokenize

from slotkeeper.testing.harness import read_events

PROMPT = "A conversation the store must keep, whatever its layout or its neighbours. " * 5  # 375 tokens
MODEL = "stub-model.gguf"  # the conftest's -m


def complete(sk, prompt: str = PROMPT, **kw):
    reply = sk.call("POST", "/completion", {"prompt": prompt, "n_predict": 8, **kw})
    assert reply.status == 200, reply.body
    return reply.body


def stop(sk) -> None:
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0, sk.logs()


def test_old_layout_is_taken_over_and_restored(stub_slotkeeper, tmp_path):
    """A directory of the slot-file layout (`0.bin` + a version 1 manifest with this configuration's
    fingerprint) becomes an entry on the first start: the old pair is gone and the conversation restores.
    A client's own slot file there moves to snapshots/, where the client still finds it."""
    probe = stub_slotkeeper("-np", "1", save_dir=tmp_path / "probe")
    fingerprint = probe.call("GET", "/slotkeeper/status").body["fingerprint"]
    probe.killpg(signal.SIGKILL)
    probe.wait()

    old = tmp_path / "old-layout"
    old.mkdir()
    tokens = tokenize(PROMPT)
    data = encode_slot_file(tokens, MODEL)
    (old / "0.bin").write_bytes(data)
    (old / "0.json").write_text(
        json.dumps(
            {
                "version": 1,
                "slot": 0,
                "tokens": len(tokens),
                "bytes": len(data),
                "saved_at": time.time() - 60,
                "save_ms": 3.0,
                "fingerprint": fingerprint,
            }
        )
    )
    mine = encode_slot_file(tokenize("a client's own save " * 3), MODEL)
    (old / "mine.bin").write_bytes(mine)

    sk = stub_slotkeeper("-np", "1", save_dir=old)
    entry = only_entry(old)
    assert f"slot file 0.bin taken over as entry {entry[:4]}" in sk.logs(), sk.logs()
    assert not (old / "0.bin").exists() and not (old / "0.json").exists()
    assert assert_entry_sound(old, entry) == tokens
    manifest = read_manifest(old, entry)
    assert manifest["fingerprint"] == fingerprint and manifest["format"]["seq_version"] == 4
    assert restored(sk.logs()) == [(entry[:4], 0)], sk.logs()
    assert complete(sk)["timings"]["cache_n"] == len(tokens) - 1  # all of it (the last token is always evaluated)

    assert not (old / "mine.bin").exists() and (snapshots_dir(old) / "mine.bin").read_bytes() == mine
    reply = sk.call("POST", "/slots/0?action=restore", {"filename": "mine.bin"})
    assert reply.status == 200 and reply.body["n_restored"] == len(tokenize("a client's own save " * 3)), reply.body


def test_second_slotkeeper_on_the_same_directory_is_refused(stub_slotkeeper):
    """A second slotkeeper on a --slot-save-path in use exits 2 with one line naming the directory and the
    other's pid, before it starts a llama-server; the first keeps working."""
    first = stub_slotkeeper("-np", "1", own=("--autosave-idle", "0"))
    save_dir = first.extra["save_dir"]
    complete(first)
    second = stub_slotkeeper("-np", "1", wait=False)
    assert second.wait(15) == 2
    lines = second.logs().strip().splitlines()
    assert lines == [
        f"slotkeeper: error: slot save directory {save_dir.resolve()} is in use by another slotkeeper "
        f"(pid {first.pid}); give each running model its own --slot-save-path"
    ], second.logs()
    assert len([e for e in read_events(first.extra["events"]) if e["event"] == "start"]) == 1, (
        "the refused slotkeeper started a llama-server"
    )
    assert first.health() == 200
    assert complete(first)["timings"]["cache_n"] > 0
    stop(first)
    entry = only_entry(save_dir)
    assert saved(first.logs()) == [(entry[:4], 0, "at stop")], first.logs()
    assert_entry_sound(save_dir, entry)


def test_entry_of_another_state_format_is_kept_not_used(stub_slotkeeper):
    """An entry written by a llama-server with another seq-state format (found by probing, because the entry's
    recorded llama-server differs from this one) is, with --recompute 0, skipped with one line and kept, not
    quarantined: the llama-server that wrote it restores it again."""
    v3 = {"STUB_STATE_VERSION": "3"}
    sk = stub_slotkeeper("-np", "1", stub=v3)
    complete(sk)
    stop(sk)
    save_dir = sk.extra["save_dir"]
    old = only_entry(save_dir)
    assert read_manifest(save_dir, old)["format"]["seq_version"] == 3
    edit_manifest(save_dir, old, lambda m: m["llama_server"].update(size=m["llama_server"]["size"] + 1))
    before = {name: data for name, data in entries_snapshot(save_dir).items() if name.startswith(old)}
    before_file = bins_snapshot(save_dir)[f"{old}.bin"]

    sk2 = stub_slotkeeper("-np", "1", own=("--recompute", "0"))  # writes v4
    lines = [line for line in sk2.logs().splitlines() if "saved by another" in line]
    assert lines == [
        "slotkeeper: warning: 1 chat was saved by another llama-server configuration (state v3; this one "
        "writes v4): kept, not used (--recompute 0)"
    ], sk2.logs()
    assert not restored(sk2.logs()) and "quarantined" not in sk2.logs()
    assert complete(sk2)["timings"]["cache_n"] == 0
    stop(sk2)
    assert not quarantine_dir(save_dir).exists()
    assert {name: data for name, data in entries_snapshot(save_dir).items() if name.startswith(old)} == before
    assert bins_snapshot(save_dir)[f"{old}.bin"] == before_file
    new = set(entry_ids(save_dir)) - {old}
    assert len(new) == 1, "the same conversation in v4 is an entry of its own; the v3 one is not superseded"

    sk3 = stub_slotkeeper("-np", "1", stub=v3)  # the llama-server that wrote it
    assert restored(sk3.logs()) == [(old[:4], 0)], sk3.logs()
    assert "recomputing" not in sk3.logs(), "the v4 entry's chat is saved in v3 already: nothing to recompute"
    assert complete(sk3)["timings"]["cache_n"] > 0


def raw_post(port: int, target: str, body: bytes) -> int:
    """A POST sent exactly as given (target and body bytes unchanged); its status."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("POST", target, skip_accept_encoding=True)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_no_client_slot_action_can_change_an_entry(stub_slotkeeper):
    """Clients' slot saves and restores reach llama-server, whose save path is snapshots/: whatever name they
    give (the entry's own, relative or absolute paths into entries/, the transient prefix, encoded variants),
    the entries stay byte for byte as they were, manifests included."""
    sk = stub_slotkeeper("-np", "1", own=("--autosave-idle", "0"))
    save_dir = sk.extra["save_dir"]
    complete(sk)
    complete(sk, "Another conversation takes the only slot, so the first one is written back. " * 5)
    entry = only_entry(save_dir)
    assert saved(sk.logs()) == [(entry[:4], 0, "before it is reused")], sk.logs()
    before = entries_snapshot(save_dir)
    before_bins = bins_snapshot(save_dir)
    path = entry_bin(save_dir, entry)
    names = [
        f"{entry}.bin",
        f"{entry}.json",
        entry,
        f"../entries/{entry}.bin",
        f"entries/{entry}.bin",
        f"..\\entries\\{entry}.bin",
        f"./../entries/{entry}.bin",
        str(path),
        str(path.with_suffix(".json")),
        f"/{entry}.bin",
        f"..%2Fentries%2F{entry}.bin",
        f"entries%2F{entry}.bin",
        f"%2e%2e%2fentries%2f{entry}.bin",
        f"..\u2215entries\u2215{entry}.bin",
        f"..\uff0fentries\uff0f{entry}.bin",
        f"slotkeeper-{entry}.bin",
        "slotkeeper-" + "0" * 32 + ".bin",
        f"slotkeeper-{entry}{entry}.bin",
        "../.lock",
        "..",
        ".",
        f"../quarantine/{entry}.bin",
        f"../snapshots/../entries/{entry}.bin",
    ]
    targets = [
        "/slots/0?action={}",
        "/slots/-1?action={}",
        "/slots/0?action={}&action=erase",
        "/slots/%30?action={}",
        "/slots/0?%61ction={}",
        "/slots/0?action=%73%61%76%65",
    ]
    statuses: dict[str, int] = {}
    for action in ("save", "restore"):
        for name in names:
            for target in targets:
                if "%73%61" in target and action != "save":
                    continue
                body = json.dumps({"filename": name}).encode()
                statuses[f"{target.format(action)} {name!r}"] = raw_post(sk.port, target.format(action), body)
            # the name with JSON escapes for its slashes and dots
            escaped = json.dumps({"filename": name}).replace("/", "\\/").replace(".", "\\u002e").encode()
            statuses[f"{action} escaped {name!r}"] = raw_post(sk.port, f"/slots/0?action={action}", escaped)
    assert any(status == 200 for status in statuses.values()), "no request reached llama-server's save path"
    assert entries_snapshot(save_dir) == before, f"a client's slot action changed the store: {statuses}"
    assert sk.call("GET", "/health").status == 200
    stop(sk)
    assert bins_snapshot(save_dir)[f"{entry}.bin"] == before_bins[f"{entry}.bin"]
    assert_entry_sound(save_dir, entry)
    assert not quarantine_dir(save_dir).exists()
