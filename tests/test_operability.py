"""Issue 6: is there any way to know the slots were restored? /slotkeeper/status and /slotkeeper/metrics."""

from __future__ import annotations

import signal

from store_helpers import entry_bin, only_entry, read_manifest

PROMPT = "remember this " * 24  # 336 tokens: over --min-save-tokens' 256


def test_status_reports_restore_and_dirty_slots(stub_slotkeeper):
    sk = stub_slotkeeper("-np", "2", own=("--autosave-idle", "0"))
    status = sk.call("GET", "/slotkeeper/status").body
    assert status["state"] == "ready" and status["total_slots"] == 2
    assert [s["slot"] for s in status["slots"]] == [0, 1]
    assert status["slots"][0]["entry"] is None and status["slots"][0]["chat"] is None  # nothing to restore
    assert status["store"]["entries"] == 0 and status["save_estimate"] is None
    sk.call("POST", "/completion", {"prompt": PROMPT, "n_predict": 4, "id_slot": 0})
    assert sk.call("GET", "/slotkeeper/status").body["slots"][0]["dirty"] is True
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0
    save_dir = sk.extra["save_dir"]
    entry = only_entry(save_dir)
    sk2 = stub_slotkeeper("-np", "2", own=("--autosave-idle", "0"))
    status = sk2.call("GET", "/slotkeeper/status").body
    slot0 = status["slots"][0]
    assert slot0["entry"] == entry and slot0["chat"] == entry[:4], status
    assert slot0["tokens_known"] == read_manifest(save_dir, entry)["tokens"] > 0
    assert slot0["dirty"] is False and status["slots"][1]["entry"] is None
    assert status["store"]["entries"] == 1 and status["store"]["bytes"] == entry_bin(save_dir, entry).stat().st_size
    assert status["on_demand_restores"] == 0  # the start's restore is not on demand
    # what a stop may have to write once the slots are used: the entry slot 0 holds
    assert status["save_estimate"]["bytes"] == entry_bin(save_dir, entry).stat().st_size
    assert status["child_pid"] > 0 and status["save_dir"] == str(sk2.extra["save_dir"].resolve())


def test_metrics_count_restores_and_requests(stub_slotkeeper):
    sk = stub_slotkeeper("-np", "1", own=("--autosave-idle", "0"))
    sk.call("POST", "/completion", {"prompt": PROMPT, "n_predict": 4})
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0
    sk2 = stub_slotkeeper("-np", "1")
    reply = sk2.call("GET", "/slotkeeper/metrics")
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
    text = reply.body
    assert 'slotkeeper_restores_total{outcome="restored"} 1.0' in text
    assert "slotkeeper_restore_seconds_count 1.0" in text
    assert 'slotkeeper_state{state="ready"} 1.0' in text
    sk2.call("POST", "/completion", {"prompt": "x", "n_predict": 2})
    sk2.call("GET", "/no-such-path")
    text = sk2.call("GET", "/slotkeeper/metrics").body
    assert 'slotkeeper_proxied_requests_total{status="200"}' in text
    assert 'slotkeeper_proxied_requests_total{status="404"} 1.0' in text
    assert sk2.call("GET", "/slotkeeper/nope").status == 404


def test_json_log_format(stub_slotkeeper):
    """--log-format json: slotkeeper's own lines are JSON objects; the child's lines pass through as they are."""
    import json

    sk = stub_slotkeeper(own=("--log-format", "json"))
    ours = [json.loads(line) for line in sk.logs().splitlines() if line.startswith("{")]
    assert any(entry["msg"].startswith("ready ") and entry["level"] == "info" for entry in ours)
    assert any(line.startswith("stub: ") for line in sk.logs().splitlines())


def test_a_start_says_when_it_compiles_its_modules(stub_slotkeeper, tmp_path):
    """With PYTHONDONTWRITEBYTECODE (container images set it) and an install without cached bytecode, every start
    compiles slotkeeper's modules inside llama-swap's health check budget: the log says so, and how to stop it;
    once they are compiled, it says nothing."""
    import compileall
    import shutil
    from pathlib import Path

    import slotkeeper

    install = tmp_path / "site"
    package = install / "slotkeeper"
    shutil.copytree(Path(slotkeeper.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    env = {"PYTHONPATH": str(install), "PYTHONDONTWRITEBYTECODE": "1"}
    hint = f"every start compiles them (~0.1 s): python -m compileall -q {package} once"
    sk = stub_slotkeeper(stub=env)
    assert hint in sk.logs() and not any(package.rglob("*.pyc"))
    sk.killpg(signal.SIGTERM)
    assert sk.wait() == 0
    assert compileall.compile_dir(package, quiet=1)
    sk = stub_slotkeeper(stub=env)
    assert "no cached bytecode" not in sk.logs() and "ready" in sk.logs()
