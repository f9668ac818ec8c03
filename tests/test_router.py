"""llama-server as a router (`--models-dir`, a child per model), on the real llama-server: today slotkeeper
passes it through whole and says so in one line; requests are answered as the router answers them."""

from __future__ import annotations

import shutil

from slotkeeper.testing.harness import http_call


def test_a_router_is_passed_through_and_says_so(starter, llama_server, family_models, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    for name in ("a", "b"):
        shutil.copy(family_models["llama"], models / f"{name}.gguf")
    sk = starter(llama_server, ["--models-dir", str(models), "--models-max", "1", "-c", "4096", "-t", "2"])()
    ask = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0}
    for name in ("a", "b", "a"):
        reply = http_call(sk.port, "POST", "/v1/chat/completions", {"model": name, **ask})
        assert reply.status == 200, (reply.body, sk.logs()[-3000:])
    unknown = http_call(sk.port, "POST", "/v1/chat/completions", {"model": "zzz", **ask})
    assert unknown.status == 400 and "not found" in str(unknown.body), unknown.body
    status = http_call(sk.port, "GET", "/slotkeeper/status").body
    assert status["router"] is True and status["slots"] == [], status
    logs = sk.logs()
    assert "runs as a router" in logs, logs[-3000:]
    own = [line for line in logs.splitlines() if line.startswith("slotkeeper: ")]
    assert not [line for line in own if "warning" in line or "error" in line], own
