"""llama-server as a router (`--models-dir`, a child per model), on the real llama-server: every model's chats
are kept across the router's unloads and across a swap, and what slotkeeper cannot do is the router's answer.

slotkeeper runs the router with `--models-max 0` and applies the user's `--models-max` itself: a load that
would exceed it first saves the least recently used model's changed slots and unloads it.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from family_helpers import NO_THINKING, Chat, cold_ones, converse, swap_out

from slotkeeper.demo import stream_chat
from slotkeeper.testing.harness import http_call, wait_until

ROUTER = ["-c", "8192", "-t", "2", "--no-warmup"]
LONG_S = 600.0  # a bound no answer reaches, however loaded the machine (a stream's own timeout)


def models_dir(tmp_path, family_models):
    """A (the tiny llama, full attention) and b (the tiny qwen35 hybrid)."""
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(family_models["llama"], models / "a.gguf")
    shutil.copy(family_models["qwen35"], models / "b.gguf")
    return models


def processing(port: int, model: str) -> bool:
    """One of the model's slots is processing a request (its child's GET /slots, through the router)."""
    reply = http_call(port, "GET", f"/slots?model={model}")
    return reply.status == 200 and any(slot.get("is_processing") for slot in reply.body)


def statuses(port: int) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in http_call(port, "GET", "/models").body["data"]}


def test_each_models_chats_are_warm_after_the_router_unloads_it_and_after_a_swap(
    starter, llama_server, family_models, tmp_path
):
    """--models-max 1: chats on a, a chat on b (slotkeeper saves a, then unloads it), a's next turns warm; b's
    too; after a swap, both models' chats warm."""
    start = starter(
        llama_server, ["--models-dir", str(models_dir(tmp_path, family_models)), "--models-max", "1", *ROUTER]
    )
    sk = start()
    on_a = [Chat(i, {"model": "a"}) for i in range(2)]
    on_b = Chat(5, {"model": "b", **NO_THINKING})
    for chat in on_a:
        chat.turn(sk.port)
    on_b.turn(sk.port)
    assert statuses(sk.port) == {"a": "unloaded", "b": "loaded"}, sk.logs()[-3000:]
    for chat in on_a:
        timings = chat.turn(sk.port)
        assert chat.reused_enough(timings), (timings, chat.previous_prompt_tokens, sk.logs()[-4000:])
    timings = on_b.turn(sk.port)
    assert on_b.reused_enough(timings), (timings, on_b.previous_prompt_tokens, sk.logs()[-4000:])
    logs = sk.logs()
    assert "model a: unloading (model b loads): saved" in logs, logs[-4000:]
    swap_out(sk)
    sk2 = start()
    for chat in (*on_a, on_b):
        timings = chat.turn(sk2.port)
        assert chat.reused_enough(timings), (chat.n, timings, chat.previous_prompt_tokens, sk2.logs()[-4000:])
    status = http_call(sk2.port, "GET", "/slotkeeper/status").body
    assert status["router"] is True and set(status["models"]) == {"b"}, status["models"]  # (a unloaded for b)
    assert status["models"]["b"]["placements"].get("resident", 0) >= 1, status["models"]["b"]
    metrics = http_call(sk2.port, "GET", "/slotkeeper/metrics").body
    assert 'slotkeeper_placements_total{model="b",outcome="resident"}' in str(metrics), str(metrics)[:3000]
    own = [line for line in sk2.logs().splitlines() if line.startswith("slotkeeper: ")]
    assert not [line for line in own if "warning" in line or "error" in line], own
    listed = subprocess.run(
        [sys.executable, "-m", "slotkeeper.cli", "ls", str(sk2.extra["save_dir"]), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    stores = {Path(r["dir"]).name: r["entries"] for r in json.loads(listed.stdout) if r["kind"] == "directory"}
    assert stores.get("a", 0) >= 2 and stores.get("b", 0) >= 1, stores  # `ls` shows each model's store


def test_what_slotkeeper_cannot_place_gets_the_routers_own_answer(starter, llama_server, family_models, tmp_path):
    sk = starter(llama_server, ["--models-dir", str(models_dir(tmp_path, family_models)), *ROUTER])()
    ask = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0}
    unknown = http_call(sk.port, "POST", "/v1/chat/completions", {"model": "zzz", **ask})
    assert unknown.status == 400 and "not found" in str(unknown.body), unknown.body
    missing = http_call(sk.port, "POST", "/v1/chat/completions", ask)
    assert missing.status == 400 and "model name is missing" in str(missing.body), missing.body
    assert http_call(sk.port, "POST", "/v1/chat/completions", {"model": "a", **ask}).status == 200
    assert "runs as a router" in sk.logs(), sk.logs()[-3000:]


def test_six_chats_per_model_with_title_requests_stay_warm_as_the_models_take_turns(
    starter, llama_server, family_models, tmp_path
):
    """A chat front end's traffic on both models, --models-max 1: six chats each (more than the four slots),
    a title request after every turn, the models taking turns (each switch unloads the other): from the
    second round on, every chat reuses at least 90% of its previous prompt."""
    sk = starter(
        llama_server, ["--models-dir", str(models_dir(tmp_path, family_models)), "--models-max", "1", *ROUTER]
    )()
    chats = {
        "a": [Chat(i, {"model": "a"}) for i in range(6)],
        "b": [Chat(i, {"model": "b", **NO_THINKING}) for i in range(6)],
    }
    for round_n in range(2):
        for name in ("a", "b"):
            results = converse(chats[name], sk.port)
            if round_n:
                assert not cold_ones(chats[name], results), (name, cold_ones(chats[name], results), sk.logs()[-5000:])


def test_a_preset_files_models_are_kept_too(starter, llama_server, family_models, tmp_path):
    """--models-preset: one chat per model, a swap, both warm."""
    preset = tmp_path / "models.ini"
    preset.write_text(
        f"[a]\nmodel = {family_models['llama']}\n\n[b]\nmodel = {family_models['qwen35']}\n", encoding="utf-8"
    )
    start = starter(llama_server, ["--models-preset", str(preset), "--models-max", "1", *ROUTER])
    sk = start()
    chats = [Chat(0, {"model": "a"}), Chat(1, {"model": "b", **NO_THINKING})]
    for chat in chats:
        chat.turn(sk.port)
    swap_out(sk)
    sk2 = start()
    for chat in chats:
        timings = chat.turn(sk2.port)
        assert chat.reused_enough(timings), (chat.n, timings, chat.previous_prompt_tokens, sk2.logs()[-4000:])


def test_in_router_mode_a_childs_own_sleep_keeps_its_chats(starter, llama_server, family_models, tmp_path):
    """Children inherit --sleep-idle-seconds: a chat on a, its child asleep (not woken by slotkeeper), the
    chat's next turn warm."""
    sk = starter(
        llama_server, ["--models-dir", str(models_dir(tmp_path, family_models)), *ROUTER, "--sleep-idle-seconds", "3"]
    )()
    chat = Chat(0, {"model": "a"})
    chat.turn(sk.port)

    def asleep() -> bool:
        return http_call(sk.port, "GET", "/props?model=a").body.get("is_sleeping") is True

    assert wait_until(asleep, 15, interval=0.2), sk.logs()[-3000:]
    time.sleep(3)
    assert asleep(), "something woke model a's llama-server:\n" + sk.logs()[-3000:]
    logs = sk.logs()
    assert logs.count("server is entering sleeping state") == 1 and "exiting sleeping state" not in logs, logs[-3000:]
    assert "model a: llama-server is asleep" in logs, logs[-3000:]
    timings = chat.turn(sk.port)
    assert chat.reused_enough(timings), (timings, chat.previous_prompt_tokens, sk.logs()[-4000:])


def test_a_model_is_unloaded_only_once_its_requests_have_ended(starter, llama_server, family_models, tmp_path):
    """--models-max 1: a long answer streams from a while a request for b comes. b waits for it (as the router
    itself waits for a model's requests before it unloads it); both complete, and a's chat is saved.

    The wait is bounded by --drain-timeout (5 s by default), and on a loaded machine (llama-server's threads
    oversubscribed) the 3000 tokens take tens of seconds: so a bound far past any such answer, as the subject
    here is the wait, not its bound. b's request comes once a's answer is under way (a's slot processing)."""
    models = models_dir(tmp_path, family_models)
    sk = starter(llama_server, ["--models-dir", str(models), "--models-max", "1", *ROUTER])(
        own=("--drain-timeout", str(LONG_S))
    )
    chat = Chat(0, {"model": "a"})
    chat.turn(sk.port)
    long_answer: dict = {}

    def stream_a() -> None:
        long_answer["turn"] = stream_chat(
            sk.port, chat.messages, 3000, timeout=LONG_S, request={"model": "a", "ignore_eos": True}
        )

    streaming = threading.Thread(target=stream_a)
    streaming.start()
    assert wait_until(lambda: processing(sk.port, "a") or not streaming.is_alive(), 60), sk.logs()[-3000:]
    on_b = Chat(1, {"model": "b", **NO_THINKING}, timeout=LONG_S)  # (its reply waits for a's to end)
    on_b.turn(sk.port)
    streaming.join(LONG_S)
    turn = long_answer.get("turn")
    assert turn is not None and turn.timings.get("predicted_n") == 3000, (long_answer, sk.logs()[-4000:])
    assert "model a: unloading (model b loads): saved 1 of 1" in sk.logs(), sk.logs()[-4000:]


def test_a_clients_own_unload_and_a_get_that_loads_a_model_keep_the_chats(
    starter, llama_server, family_models, tmp_path
):
    """A client's POST /models/unload goes on after slotkeeper saved the model; a GET for a model not loaded
    loads it as the router would (autoload), and --models-max 1 holds again at the next request for it."""
    sk = starter(
        llama_server, ["--models-dir", str(models_dir(tmp_path, family_models)), "--models-max", "1", *ROUTER]
    )()
    chat = Chat(0, {"model": "a"})
    chat.turn(sk.port)
    unloaded = http_call(sk.port, "POST", "/models/unload", {"model": "a"})
    assert unloaded.status == 200, unloaded.body
    assert wait_until(lambda: statuses(sk.port)["a"] == "unloaded", 30), statuses(sk.port)
    assert "model a: unloading (a client unloads it): saved 1 of 1" in sk.logs(), sk.logs()[-3000:]
    timings = chat.turn(sk.port)  # loads a again: warm from what was saved before the unload
    assert chat.reused_enough(timings), (timings, chat.previous_prompt_tokens, sk.logs()[-4000:])
    props = http_call(sk.port, "GET", "/props?model=b")
    assert props.status == 200 and props.body.get("total_slots"), props.body  # the router loaded b for it
    on_b = Chat(1, {"model": "b", **NO_THINKING})
    on_b.turn(sk.port)
    assert statuses(sk.port) == {"a": "unloaded", "b": "loaded"}, sk.logs()[-3000:]
    timings = chat.turn(sk.port)
    assert chat.reused_enough(timings), (timings, chat.previous_prompt_tokens, sk.logs()[-4000:])


def test_with_autoload_off_a_model_not_loaded_gets_the_routers_answer(starter, llama_server, family_models, tmp_path):
    """--no-models-autoload is the user's: slotkeeper loads nothing by itself, and the router answers as it does."""
    sk = starter(
        llama_server, ["--models-dir", str(models_dir(tmp_path, family_models)), "--no-models-autoload", *ROUTER]
    )()
    ask = {"model": "a", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
    refused = http_call(sk.port, "POST", "/v1/chat/completions", ask)
    assert refused.status == 400 and "model is not loaded" in str(refused.body), refused.body
    assert http_call(sk.port, "POST", "/models/load", {"model": "a"}).status == 200
    assert wait_until(lambda: statuses(sk.port)["a"] == "loaded", 30), statuses(sk.port)
    assert http_call(sk.port, "POST", "/v1/chat/completions", ask).status == 200
    assert "model a: ready for its first request" in sk.logs(), sk.logs()[-3000:]


def test_a_model_whose_file_fails_to_load_gets_the_routers_error_at_once(
    starter, llama_server, family_models, tmp_path
):
    """bad.gguf is no GGUF: its child exits as it loads, and the router marks it failed. A request for it gets
    the router's own 500 at once (not after --startup-timeout), each time it is asked for, with one plain log
    line each; a request for another model, sent while bad loads, does not wait behind it."""
    models = models_dir(tmp_path, family_models)
    (models / "bad.gguf").write_bytes(random.Random(0).randbytes(64 * 1024))
    sk = starter(llama_server, ["--models-dir", str(models), *ROUTER])(own=("--startup-timeout", "60"))
    ask = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0}
    assert http_call(sk.port, "POST", "/v1/chat/completions", {"model": "a", **ask}).status == 200
    on_b: dict = {}

    def ask_b() -> None:
        on_b["reply"] = http_call(
            sk.port, "POST", "/v1/chat/completions", {"model": "b", **ask, **NO_THINKING}, timeout=LONG_S
        )

    for attempt in range(2):
        other = threading.Thread(target=ask_b) if attempt == 0 else None
        started = time.monotonic()
        if other is not None:
            other.start()
        bad = http_call(sk.port, "POST", "/v1/chat/completions", {"model": "bad", **ask}, timeout=LONG_S)
        took = time.monotonic() - started
        assert bad.status == 500 and "failed to load" in str(bad.body), (attempt, bad.status, bad.body)
        assert took < 5, (attempt, took, sk.logs()[-3000:])
        if other is not None:
            other.join(LONG_S)
            assert on_b["reply"].status == 200, (on_b["reply"].body, sk.logs()[-3000:])
        assert http_call(sk.port, "POST", "/v1/chat/completions", {"model": "a", **ask}).status == 200
    own = [line for line in sk.logs().splitlines() if line.startswith("slotkeeper: ") and "bad" in line]
    assert len(own) == 2 and all(line.startswith("slotkeeper: warning: model bad: ") for line in own), own
    assert not [line for line in own if re.search(r"\w+Error\(|Error:", line)], own
