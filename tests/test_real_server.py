"""The claims that matter, on a real llama.cpp llama-server with a tiny random-weight model (issue 3).

Numbered as in issue 3; foreign-cache scenarios from issue 4 are marked so.
"""

from __future__ import annotations

import re
import signal
import socket
import tempfile
from pathlib import Path

import pytest
from process_helpers import llama_servers_of
from store_helpers import blocks_dir, entry_bytes, entry_parts, manifest_path, only_entry

from slotkeeper.store.blockfiles import block_path
from slotkeeper.testing.harness import health_status, wait_until

PROMPT = "".join(f"Line {i}: the slot cache keeps every token of this conversation. " for i in range(30))
BASE = ["-c", "8192", "-t", "2", "--no-warmup"]


@pytest.fixture
def real(starter, llama_server, models):
    """start(model="A", *extra, ...) around the real llama-server."""

    def start(*extra: str, model: str = "A", **kw):
        return starter(llama_server, ["-m", str(models[model]), *BASE])(*extra, **kw)

    return start


def complete(sk, prompt: str = PROMPT, n_predict: int = 12, headers: dict[str, str] | None = None, **kw):
    reply = sk.call(
        "POST",
        "/completion",
        {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": True, **kw},
        headers=headers,
    )
    assert reply.status == 200, reply.body
    return reply.body


def n_tokens(sk, text: str) -> int:
    return len(sk.call("POST", "/tokenize", {"content": text, "add_special": True}).body["tokens"])


def cache_from(real, model: str = "A"):
    """One conversation with `model`, then a swap out: its slot 0 cache is on disk."""
    sk = real("-np", "1", model=model)
    complete(sk)
    swap_out(sk)
    return sk


def swap_out(sk) -> None:
    """What llama-swap does to unload a model: SIGTERM to the whole process group."""
    sk.killpg(signal.SIGTERM)
    assert sk.wait(30) == 0, sk.logs()


def test_1_cache_survives_a_restart(real):
    """1. Converse, SIGTERM the group, start again: the repeated request reuses the cache, same output."""
    sk = real("-np", "1")
    cold = complete(sk)
    assert cold["timings"]["cache_n"] == 0
    prompt_tokens = n_tokens(sk, PROMPT)
    swap_out(sk)
    assert "saved from slot 0 (at stop)" in sk.logs()
    sk2 = real("-np", "1")
    assert "restored into slot 0" in sk2.logs()
    warm = complete(sk2)
    assert warm["timings"]["cache_n"] >= prompt_tokens - 1
    assert warm["content"] == cold["content"]


def test_2_first_request_never_races_the_restore(real):
    """2. A request fired the moment the public port accepts still finds the cache restored."""
    cache_from(real)
    sk2 = real("-np", "1", wait=False)
    assert wait_until(sk2.accepting, 30, interval=0.001), sk2.logs()
    first = complete(sk2)
    assert first["timings"]["cache_n"] > 0, sk2.logs()


def test_3_default_slots_both_conversations_restored(real):
    """3. llama-server's default slots (auto = 4, unified KV, idle-slot caching): both conversations come back."""
    sk = real()
    other = PROMPT.replace("Line", "Row")
    first_a = complete(sk, PROMPT)
    first_b = complete(sk, other)
    assert first_a["id_slot"] != first_b["id_slot"]
    swap_out(sk)
    sk2 = real()
    again_a = complete(sk2, PROMPT)
    again_b = complete(sk2, other)
    assert again_a["timings"]["cache_n"] >= n_tokens(sk2, PROMPT) - 1, sk2.logs()
    assert again_b["timings"]["cache_n"] >= n_tokens(sk2, other) - 1, sk2.logs()
    assert (again_a["content"], again_b["content"]) == (first_a["content"], first_b["content"])


def test_4_api_key(real):
    """4. With --api-key: slotkeeper's own /props and /slots calls authenticate; the cache comes back."""
    auth = {"Authorization": "Bearer tok-123"}
    sk = real("-np", "1", "--api-key", "tok-123")
    assert sk.call("POST", "/completion", {"prompt": "x"}).status == 401
    complete(sk, headers=auth)
    swap_out(sk)
    sk2 = real("-np", "1", "--api-key", "tok-123")
    assert complete(sk2, headers=auth)["timings"]["cache_n"] > 0, sk2.logs()


def the_entry(sk) -> str:
    """The one entry a run left in its store."""
    return only_entry(sk.extra["save_dir"])


def test_5a_truncated_file_starts_cold(real):
    """5. A truncated cache file: the server still becomes ready, that chat starts cold, one clear log line."""
    sk = cache_from(real)
    entry = the_entry(sk)
    parts = entry_parts(sk.extra["save_dir"], entry)
    assert parts is not None
    cache = block_path(blocks_dir(sk.extra["save_dir"]), parts.sections[0].blocks[-1])
    cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])
    sk2 = real("-np", "1")
    assert complete(sk2)["timings"]["cache_n"] == 0
    assert f"entry {entry[:4]} quarantined (its file changed on disk: 1 of its blocks" in sk2.logs()
    assert "Traceback" not in sk2.logs()


def test_5b_file_from_other_dimensions_starts_cold(real):
    """5. A cache from a model with other dimensions is refused: ready, cold, one line naming the difference."""
    cache_from(real, "W")
    sk2 = real("-np", "1")
    assert complete(sk2)["timings"]["cache_n"] == 0
    assert "1 entry kept but not used: saved for another configuration: model" in sk2.logs()


def test_5c_unverified_foreign_file_is_refused_by_llama_server(real):
    """5. Even when the fingerprint check is bypassed, llama-server's refusal leaves the slot cold and quarantined."""
    sk = cache_from(real, "W")
    save_dir = sk.extra["save_dir"]
    entry = the_entry(sk)
    # a slot file of the old layout, without its manifest
    (save_dir / "0.bin").write_bytes(entry_bytes(save_dir, entry, save_dir))
    manifest_path(save_dir, entry).unlink()
    sk2 = real("-np", "1", own=("--restore-unverified",))
    assert complete(sk2)["timings"]["cache_n"] == 0
    assert "quarantined (llama-server refused it" in sk2.logs()


def test_issue4_2_same_shape_foreign_model_never_restored(real):
    """Issue 4, 2: model A's cache is not restored into model B of the same shape (which llama-server accepts).
    (--recompute 0: B recomputing A's chat from its tokens is tests/test_recompute.py's.)"""
    cache_from(real, "A")
    sk2 = real("-np", "1", model="B", own=("--recompute", "0"))
    assert complete(sk2)["timings"]["cache_n"] == 0
    assert "saved for another configuration: model" in sk2.logs()


def test_llama_server_runs_with_the_signal_dispositions_it_has_alone(real, llama_server, models, tmp_path):
    """slotkeeper is Python, which ignores SIGPIPE and SIGXFSZ, and an ignored signal survives exec: its child
    must not inherit that (what llama-server ignores is its own choice, the same as when run alone)."""
    from slotkeeper.testing.harness import plain_server

    def ignored(pid: int) -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)

    sk = real()
    child = sk.call("GET", "/slotkeeper/status").body["child_pid"]
    args = ["-m", str(models["A"]), *BASE]
    with plain_server(llama_server, args, tmp_path) as plain:
        assert ignored(child) == ignored(plain.proc.pid)
    assert ignored(sk.pid) & (1 << (signal.SIGPIPE - 1))  # slotkeeper's own: ignored, as Python does


@pytest.mark.parametrize("mistake", ["port taken", "host unknown"])
def test_a_taken_port_or_an_unknown_host_is_one_line_exit_1_and_llama_server_goes(real, mistake):
    """Two start-up mistakes users make every day: the port already taken, a host that does not resolve. One
    line naming the address and the reason (no Python exception's text), exit 1 as plain llama-server's, and
    the llama-server it started gone at once, its runtime directory with it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        if mistake == "port taken":
            sk = real("-np", "1", port=port, wait=False)
            line, where = "Address already in use", f"127.0.0.1:{port}"
        else:
            sk = real("-np", "1", "--host", "999.1.1.1", wait=False)
            line, where = "not known", "999.1.1.1:"
        assert sk.wait(30) == 1, sk.logs()
    errors = [x for x in sk.logs().splitlines() if x.startswith("slotkeeper: error:")]
    assert len(errors) == 1 and f"cannot listen on {where}" in errors[0] and line in errors[0], sk.logs()
    assert "internal error" not in sk.logs() and "Traceback" not in sk.logs(), sk.logs()
    assert wait_until(lambda: not llama_servers_of(sk.pid), 2), "llama-server outlived slotkeeper's start"
    assert not list(Path(tempfile.gettempdir()).glob(f"slotkeeper-{sk.pid}-*")), "its runtime directory stayed"


def test_port_0_listens_where_the_kernel_chose_and_says_where(real):
    """`--port 0`, as plain llama-server takes it: the kernel chooses a free port, and the log line names that
    one (it said 0, which no client can reach)."""
    sk = real("-np", "1", "--port", "0", wait=False)

    def announced() -> list[str]:
        return re.findall(r"listening on http://127\.0\.0\.1:(\d+);", sk.logs())

    assert wait_until(announced, 30), sk.logs()
    port = int(announced()[0])
    assert port != 0 and wait_until(lambda: health_status(port) == 200, 30), sk.logs()
