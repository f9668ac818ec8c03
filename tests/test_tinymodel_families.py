"""The tiny qwen35 / lfm2 / gemma3 models on the real llama-server (b11434).

Each family's preset is loaded with ``-c 4096 -np 4 --no-warmup -t 2`` and checked for what
slotkeeper relies on: it loads and never stops early, the greedy output depends on an early
change of the prompt, a slot saved and restored gives the same continuation as the live
slot (gemma3 without ``--swa-full``: is re-processed, as from scratch), and the embedded chat
template renders (with its special tokens as single tokens). Runs in a few seconds.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slotkeeper.testing.harness import Reply, free_port, http_call
from slotkeeper.testing.tinymodel import PRESETS, TinyModelSpec, main, write_tiny_model

FAMILIES = ("qwen35", "lfm2", "gemma3")
SERVER_ARGS = ["-c", "4096", "-np", "4", "--no-warmup", "-t", "2"]
# ~230 tokens: longer than gemma3's 128-token window, so an early change reaches the output
# only through the global layer (or the delta-net / attention layers of the hybrids).
BASE = "".join(f"Line {i}: the slot cache keeps every token of this conversation. " for i in range(6))
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "<think>\nearlier reasoning\n</think>\n\nHello."},
    {"role": "user", "content": "  And now?  "},
]
EXPECTED_PROMPT = {
    "qwen35": (  # the system turn, earlier reasoning dropped, content trimmed, think block opened
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nAnd now?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    ),
    "gemma": (  # the system prompt goes into the first user turn; <bos> is added by the tokenizer
        "<start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\n<think>\nearlier reasoning\n</think>\n\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nAnd now?<end_of_turn>\n"
        "<start_of_turn>model\n"
    ),
}
SPECIAL_MARKERS = {"qwen35": ("<|im_start|>", "<|im_end|>", "<think>"), "gemma": ("<start_of_turn>", "<end_of_turn>")}


@dataclass
class Server:
    family: str
    spec: TinyModelSpec
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    def call(self, method: str, path: str, body: Any = None) -> Reply:
        return http_call(self.port, method, path, body, timeout=30)

    def post(self, path: str, body: Any = None) -> Any:
        reply = self.call("POST", path, body)
        assert reply.status == 200, (path, reply.body)
        return reply.body

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tokens(self, text: str, add_special: bool = True) -> list[int]:
        return self.post("/tokenize", {"content": text, "add_special": add_special})["tokens"]


def start_server(binary: str, model: Path, family: str, spec: TinyModelSpec, workdir: Path, *extra: str) -> Server:
    """llama-server on a free port with a slot save dir; returns once /health says ready."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "slots").mkdir(exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
    log_path = workdir / "llama-server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                "-m",
                str(model),
                *SERVER_ARGS,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--slot-save-path",
                str(workdir / "slots"),
                *extra,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=workdir,
        )
    server = Server(family, spec, port, proc, log_path)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"llama-server exited with {proc.returncode}:\n{server.logs()[-4000:]}")
        try:
            if http_call(port, "GET", "/health", timeout=2).status == 200:
                return server
        except OSError:
            pass
        time.sleep(0.02)
    stop_server(server)
    pytest.fail(f"llama-server not ready after 30 s:\n{server.logs()[-4000:]}")


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(10)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(10)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family-models")
    return {f: write_tiny_model(root / f"{f}.gguf", PRESETS[f]) for f in FAMILIES}


@pytest.fixture(scope="module", params=FAMILIES)
def server(request, llama_server, family_models, tmp_path_factory) -> Iterator[Server]:
    family = request.param
    srv = start_server(
        llama_server, family_models[family], family, PRESETS[family], tmp_path_factory.mktemp(f"server-{family}")
    )
    yield srv
    stop_server(srv)


def template_family(spec: TinyModelSpec) -> str:
    return "gemma" if spec.chat_template == "gemma" else "qwen35"


def printable(text: str) -> bool:
    return all(0x20 <= ord(ch) <= 0x7E for ch in text)


def complete(srv: Server, prompt: Any, n_predict: int = 16, **kw: Any) -> dict[str, Any]:
    return srv.post("/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0, **kw})


def test_loads_and_never_stops_early(server):
    reply = complete(server, "Hello there, how are you doing today?", n_predict=32, cache_prompt=False)
    assert (reply["stop_type"], reply["tokens_predicted"]) == ("limit", 32)
    assert printable(reply["content"]) and reply["content"].strip(), reply["content"]


def test_output_depends_on_an_early_change(server):
    a, b = ("Alpha " + BASE, "Omega " + BASE)
    assert len(server.tokens(a)) > 1.5 * server.spec.sliding_window
    out_a = complete(server, a, cache_prompt=False)["content"]
    out_b = complete(server, b, cache_prompt=False)["content"]
    assert out_a != out_b


@dataclass
class RoundTrip:
    n_saved: int
    live: dict[str, Any]  # the continuation on the live slot: no round trip
    fresh: dict[str, Any]  # the same tokens evaluated from scratch on another slot
    restored: dict[str, Any]  # the continuation after erase + restore of the saved slot


def save_restore_round_trip(srv: Server, filename: str = "x.bin") -> RoundTrip:
    """Run a prompt in slot 0 and save it; continue it live, from scratch, and after a restore.

    Prompts are token lists so that the continuation extends the cached tokens exactly (the
    last generated token was sampled but never decoded, so it is not in the cache).
    """
    prompt = srv.tokens("Alpha " + BASE)
    first = complete(srv, prompt, n_predict=8, id_slot=0, return_tokens=True)
    extended = prompt + first["tokens"] + srv.tokens(" And then some more words follow here.", add_special=False)
    saved = srv.post("/slots/0?action=save", {"filename": filename})
    assert saved["n_saved"] == len(prompt) + len(first["tokens"]) - 1
    live = complete(srv, extended, id_slot=0)
    fresh = complete(srv, extended, id_slot=1, cache_prompt=False)
    srv.post("/slots/0?action=erase")
    restored = srv.post("/slots/0?action=restore", {"filename": filename})
    assert restored["n_restored"] == saved["n_saved"]
    return RoundTrip(saved["n_saved"], live, fresh, complete(srv, extended, id_slot=0))


def test_slot_save_restore_round_trip(server):
    trip = save_restore_round_trip(server)
    assert trip.fresh["timings"]["cache_n"] == 0
    if server.family == "gemma3":
        # b11434 without --swa-full: the file holds the SWA cells of the last n_swa positions
        # (pos_min = pos_next - n_swa), the server wants pos_min < pos_next - n_swa, and a
        # restored slot has no context checkpoint to fall back on ("forcing full prompt
        # re-processing due to lack of cache data"): it evaluates from scratch, as fresh does.
        # (The live slot resumes from the context checkpoint it made at the end of the prompt.)
        assert trip.restored["timings"]["cache_n"] == 0
        assert trip.restored["content"] == trip.fresh["content"]
    else:
        assert trip.restored["timings"]["cache_n"] == trip.live["timings"]["cache_n"] == trip.n_saved
        assert trip.restored["content"] == trip.live["content"]


def test_gemma3_with_swa_full(llama_server, family_models, tmp_path):
    """--swa-full: the restored slot is used; but only the window of SWA cells is in the file."""
    srv = start_server(
        llama_server, family_models["gemma3"], "gemma3", PRESETS["gemma3"], tmp_path, "--swa-full", "-lv", "4"
    )
    try:
        logs = srv.logs()
        assert re.search(r"print_info: n_swa\s+= 128\n", logs), logs[-3000:]
        assert "using full-size SWA cache" in logs
        trip = save_restore_round_trip(srv)
        assert trip.restored["timings"]["cache_n"] == trip.live["timings"]["cache_n"] == trip.n_saved
        assert trip.restored["content"] == trip.live["content"]

        # A restored slot continued from inside its tokens (as a chat that edits its last
        # turn does): the server reuses the prefix, but llama_state_seq saves only the SWA
        # cells within the window of the last position, so the local layers miss keys and
        # the continuation differs from the fresh one. (Without --swa-full the server
        # re-processes instead.) The tiny model makes such a stale state visible.
        prompt = srv.tokens("Alpha " + BASE)
        cut = trip.n_saved - 60  # attends back to cut - 127 < n_saved - 128: evicted from the file
        diverging = prompt[:cut] + srv.tokens(" Something else entirely.", add_special=False)
        fresh = complete(srv, diverging, id_slot=2, cache_prompt=False)
        srv.post("/slots/0?action=erase")
        srv.post("/slots/0?action=restore", {"filename": "x.bin"})
        reused = complete(srv, diverging, id_slot=0)
        assert reused["timings"]["cache_n"] == cut
        assert reused["content"] != fresh["content"]
    finally:
        stop_server(srv)


def test_chat_template_renders_with_single_special_tokens(server):
    family = template_family(server.spec)
    prompt = server.post("/apply-template", {"messages": MESSAGES})["prompt"]
    assert prompt == EXPECTED_PROMPT[family]
    if family == "qwen35":
        no_think = server.post(
            "/apply-template", {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
        )["prompt"]
        assert no_think == EXPECTED_PROMPT[family] + "\n</think>\n\n"
    pieces = [
        t["piece"]
        for t in server.post("/tokenize", {"content": prompt, "parse_special": True, "with_pieces": True})["tokens"]
    ]
    for marker in SPECIAL_MARKERS[family]:
        assert pieces.count(marker) == prompt.count(marker) > 0, (marker, pieces)
    # Without parse_special, CONTROL tokens are plain text (USER_DEFINED ones like <think> stay single).
    plain = [
        t["piece"]
        for t in server.post("/tokenize", {"content": prompt, "parse_special": False, "with_pieces": True})["tokens"]
    ]
    assert SPECIAL_MARKERS[family][0] not in plain


def chat(srv: Server, messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
    reply = srv.post("/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0, **kw})
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "length"
    return choice["message"]


def test_multi_turn_chat(server):
    thinking = template_family(server.spec) == "qwen35"
    turn1 = [{"role": "user", "content": "Hi there"}]
    for kwargs in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
        first = chat(server, turn1, **kwargs)
        if thinking and not kwargs:
            # The prompt opens <think> and the model never closes it: it is all reasoning.
            assert first["content"] == "" and first["reasoning_content"].strip()
            text = first["reasoning_content"]
        else:
            assert first["content"].strip() and not first.get("reasoning_content")
            text = first["content"]
        assert printable(text), text
        answer = {"role": "assistant", "content": first["content"]}
        if first.get("reasoning_content"):
            answer["reasoning_content"] = first["reasoning_content"]
        turn2 = [*turn1, answer, {"role": "user", "content": "Go on."}]
        second = chat(server, turn2, **kwargs)
        assert printable(second.get("reasoning_content") or "") and printable(second["content"])
        assert (second.get("reasoning_content") or second["content"]).strip()


def test_files_are_deterministic_and_carry_their_template(tmp_path):
    import gguf

    for family in FAMILIES:
        spec = PRESETS[family]
        a = write_tiny_model(tmp_path / f"{family}-a.gguf", spec).read_bytes()
        b = write_tiny_model(tmp_path / f"{family}-b.gguf", spec).read_bytes()
        assert a == b
        reader = gguf.GGUFReader(tmp_path / f"{family}-a.gguf")
        arch = reader.fields["general.architecture"]
        assert bytes(arch.parts[arch.data[0]]).decode() == family
        tmpl = reader.fields["tokenizer.chat_template"]
        text = bytes(tmpl.parts[tmpl.data[0]]).decode()
        assert ("<start_of_turn>" in text) == (family == "gemma3")
    qwen3 = write_tiny_model(tmp_path / "lfm2-qwen3.gguf", dataclasses.replace(PRESETS["lfm2"], template="qwen3"))
    field = gguf.GGUFReader(qwen3).fields["tokenizer.chat_template"]
    assert "enable_thinking is false" in bytes(field.parts[field.data[0]]).decode()


def test_command_line_arch_and_window(tmp_path, capsys):
    import gguf

    out = tmp_path / "g.gguf"
    assert main([str(out), "--arch", "gemma3", "--sliding-window", "64", "--layers", "3"]) == 0
    assert capsys.readouterr().out.startswith(str(out))
    fields = gguf.GGUFReader(out).fields
    window = fields["gemma3.attention.sliding_window"]
    assert int(window.parts[window.data[0]][0]) == 64
    pattern = fields["gemma3.attention.sliding_window_pattern"]
    assert [bool(pattern.parts[i][0]) for i in pattern.data] == [True, True, False]
    with pytest.raises(ValueError):
        TinyModelSpec(arch="mamba")
    with pytest.raises(ValueError):
        TinyModelSpec(arch="lfm2", n_layers=1)
