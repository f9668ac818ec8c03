"""Image chats (--mmproj) on the real llama-server: warm after a swap, found again by their pictures, and never a
wrong answer. On the tiny llama (full attention), the tiny qwen35 (thinking on and off) and lfm2 hybrids and
the real Gemma 3 270M with --swa-full (all extend-only: saved at turn boundaries, which slotkeeper reaches with
the real pictures), each with the tiny random projector."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from family_helpers import (
    BASE,
    FAMILIES,
    LOGPROB_TOLERANCE,
    NO_THINKING,
    Chat,
    answer,
    max_difference,
    same_answer,
    swap_out,
)

from slotkeeper.testing.agents import AgentSession
from slotkeeper.testing.harness import PlainServer, clean_env, free_port, http_call, wait_until
from slotkeeper.testing.tinymodel import image_part, solid_png

RED, BLUE, GREEN = (230, 20, 20), (20, 20, 230), (20, 200, 20)
ROUTER = ["-c", "8192", "-t", "2", "--no-warmup"]
IMAGE_FAMILIES = {
    "llama": 64,
    "qwen35-thinking-off": 64,
    "qwen35-thinking-on": 64,
    "lfm2": 64,
    "gemma3-270m-swa-full": 640,
}  # -> width


def picture_chat(n: int, family: str, *colours: tuple[int, int, int], text: str = "What is in this picture?") -> Chat:
    """A chat whose first user message carries pictures (the same text for every colour)."""
    chat = Chat(n, FAMILIES[family].request, facts=12)
    chat.messages[1]["content"] = [
        {"type": "text", "text": f"{text} " + chat.messages[1]["content"]},
        *(image_part(solid_png(rgb)) for rgb in colours),
    ]
    return chat


def status(port: int) -> dict[str, Any]:
    return http_call(port, "GET", "/slotkeeper/status").body


@pytest.fixture
def image_start(family_start, tiny_mmproj):
    def start(name: str, *extra: str, **kw):
        return family_start(FAMILIES[name], "--mmproj", str(tiny_mmproj(IMAGE_FAMILIES[name])), *extra, **kw)

    return start


def cold_answers(llama_server: str, model: Path, mmproj: Path, name: str, asks: list[list[dict]], tmp_path) -> list:
    """Each request's answer from a plain llama-server started cold (one process, its cache erased between)."""
    port = free_port()
    args = ["-m", str(model), "--mmproj", str(mmproj), *BASE, *FAMILIES[name].args, "-np", "1", "--cache-ram", "0"]
    plain = PlainServer(llama_server, args, port, tmp_path / "plain.log", clean_env(llama_server))
    try:
        plain.wait_ready()
        out = []
        for messages in asks:
            http_call(port, "POST", "/slots/0?action=erase", {})
            out.append(answer(port, Chat(0, FAMILIES[name].request), messages))
        return out
    finally:
        plain.stop()


@pytest.mark.parametrize("name", IMAGE_FAMILIES)
def test_image_chats_come_back_warm_after_a_swap_at_start_and_on_demand(name, image_start):
    """Two image chats on one slot, a swap: the chat restored at start and the one restored on demand both
    reuse at least 90% of their previous prompt; status counts their pictures."""
    sk = image_start(name, "-np", "1")
    red, blue = picture_chat(1, name, RED), picture_chat(2, name, BLUE)
    for chat in (red, blue):
        chat.turn(sk.port)
    swap_out(sk)

    sk2 = image_start(name, "-np", "1")
    store = status(sk2.port)["store"]
    assert store["images"] >= 2 and store["entries_with_images"] >= 2, (store, sk2.logs()[-3000:])
    metrics = str(http_call(sk2.port, "GET", "/slotkeeper/metrics").body)
    assert f"slotkeeper_store_images {float(store['images'])}" in metrics, metrics[:3000]
    listed = subprocess.run(
        [sys.executable, "-m", "slotkeeper.cli", "ls", str(sk2.extra["save_dir"]), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [row for row in json.loads(listed.stdout) if row["kind"] == "entry"]
    assert sum(row["images"] or 0 for row in rows) == store["images"], rows
    for chat in (blue, red):  # blue was restored at start, red is restored on demand
        timings = chat.turn(sk2.port)
        assert chat.reused_enough(timings), (chat.n, timings, chat.previous_prompt_tokens, sk2.logs()[-4000:])
    assert "restored into slot 0" in sk2.logs()


# (not with thinking on: its first answer tokens are reasoning, where red and blue differ too little for the
# test to see a mix-up; the same chats with thinking off are compared)
@pytest.mark.parametrize("name", [name for name in IMAGE_FAMILIES if name != "qwen35-thinking-on"])
def test_same_text_different_pictures_interleaved_across_swaps_answer_as_cold_runs(
    name, image_start, llama_server, family_models, real_gemma, tiny_mmproj, tmp_path
):
    """Two chats with the same text and a red or a blue picture, interleaved on one slot across two swaps: each
    answer equals a cold llama-server's, and the pictures make the answers differ (the test can see a mix-up)."""
    asks: list[list[dict]] = []
    warm: list[tuple] = []
    red, blue = picture_chat(1, name, RED), picture_chat(1, name, BLUE)
    for _ in range(2):
        sk = image_start(name, "-np", "1")
        for chat in (red, blue):
            asks.append([dict(m) for m in chat.messages])
            warm.append(answer(sk.port, chat, chat.messages))
            chat.turn(sk.port)
        swap_out(sk)
    model = real_gemma if name.startswith("gemma3-270m") else family_models[FAMILIES[name].model]
    cold = cold_answers(llama_server, model, tiny_mmproj(IMAGE_FAMILIES[name]), name, asks, tmp_path)
    for i, (w, c) in enumerate(zip(warm, cold)):
        print(i, "max logprob difference warm vs cold:", max_difference(w, c))
        assert same_answer(w, c, LOGPROB_TOLERANCE), (i, w, c)
    assert cold[0][0] != cold[1][0] or max_difference(cold[0], cold[1]) > 1.0, "red and blue answer alike"


@pytest.mark.parametrize("name", IMAGE_FAMILIES)
def test_a_chat_with_two_pictures_and_a_text_chat_beside_image_chats_come_back_warm(name, image_start):
    """A chat with two pictures, an image chat and a text chat on two slots, a swap: all three come back warm."""
    sk = image_start(name, "-np", "2")
    chats = [picture_chat(1, name, RED, GREEN), picture_chat(2, name, BLUE), Chat(3, FAMILIES[name].request)]
    for chat in chats:
        chat.turn(sk.port)
    swap_out(sk)
    sk2 = image_start(name, "-np", "2")
    for chat in chats:
        timings = chat.turn(sk2.port)
        assert chat.reused_enough(timings), (chat.n, timings, chat.previous_prompt_tokens, sk2.logs()[-4000:])


@pytest.mark.parametrize("name", IMAGE_FAMILIES)
def test_a_new_chat_with_the_same_text_and_another_picture_is_not_taken_for_a_saved_one(name, image_start):
    """A saved chat opens with a red picture, then a long text. After a swap, a new chat with the same text and
    a green picture shares only the few tokens before the picture with it: no entry is restored for it (a
    text-only view would take the saved chat for it in full). The saved chat's own next turn is restored on
    demand and warm."""
    sk = image_start(name, "-np", "1")
    red = Chat(1, FAMILIES[name].request, system="Be brief.", facts=30)
    text = red.messages[1]["content"]
    red.messages[1]["content"] = [image_part(solid_png(RED)), {"type": "text", "text": text}]
    red.turn(sk.port)
    Chat(2, FAMILIES[name].request).turn(sk.port)  # the latest chat: the start after the swap restores it
    swap_out(sk)

    sk2 = image_start(name, "-np", "1")
    green = [
        red.messages[0],
        {"role": "user", "content": [image_part(solid_png(GREEN)), {"type": "text", "text": text}]},
    ]
    red.send(sk2.port, green)
    assert status(sk2.port)["on_demand_restores"] == 0, sk2.logs()[-3000:]
    timings = red.turn(sk2.port)
    assert status(sk2.port)["on_demand_restores"] == 1 and red.reused_enough(timings), (timings, sk2.logs()[-3000:])


def test_a_regenerate_is_restored_from_its_own_picture_not_the_same_text_with_another(image_start):
    """Two chats with the same text after a red or a blue picture, on one slot; after a swap the slot holds the
    red one. The blue chat's first answer asked again (a regenerate) shares its whole prompt with the red chat
    but for the picture: slotkeeper restores the blue chat for it, and llama-server reuses all of it. (Full
    attention: an extend-only model restores a turn boundary, which a regenerate does not extend.)"""
    sk = image_start("llama", "-np", "1")
    chats = []
    for colour in (BLUE, RED):  # red last: the start after the swap restores it
        chat = Chat(1, {}, system="Be brief.", facts=60)
        text = chat.messages[1]["content"]
        chat.messages[1]["content"] = [image_part(solid_png(colour)), {"type": "text", "text": text}]
        chat.turn(sk.port)
        chats.append(chat)
    swap_out(sk)
    sk2 = image_start("llama", "-np", "1")
    blue = chats[0]
    timings = blue.send(sk2.port, blue.messages[:2])["timings"]
    assert timings["cache_n"] >= 0.9 * blue.previous_prompt_tokens or timings["cache_n"] >= 0.9 * (
        timings["prompt_n"] + timings["cache_n"]
    ), (timings, sk2.logs()[-3000:])
    assert status(sk2.port)["on_demand_restores"] == 1


def agent_picture(api: str, png: bytes) -> dict[str, Any]:
    data = base64.b64encode(png).decode()
    if api == "responses":
        return {"type": "input_image", "image_url": f"data:image/png;base64,{data}"}
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


@pytest.mark.parametrize("name", IMAGE_FAMILIES)
@pytest.mark.parametrize("api", ["responses", "messages"])
def test_agent_sessions_with_pictures_come_back_warm_over_responses_and_messages(name, api, image_start):
    """Two agent sessions with the same words and a red or a blue picture, over the Responses API or Anthropic
    Messages, on one slot; after a swap, each one's next turn reuses at least 90% of its previous prompt."""
    sk = image_start(name, "-np", "1")
    sessions = []
    for colour in (RED, BLUE):
        session = AgentSession(1, api, request=dict(FAMILIES[name].request))
        words = {"type": "input_text" if api == "responses" else "text", "text": session.history[0]["content"]}
        session.history[0]["content"] = [words, agent_picture(api, solid_png(colour))]
        session.turn(sk.port)
        sessions.append(session)
    swap_out(sk)
    sk2 = image_start(name, "-np", "1")
    for session in sessions:
        turn = session.turn(sk2.port)
        assert session.reused_enough(turn), (
            api,
            turn.prompt,
            turn.reused,
            sessions[0].turns[0].prompt,
            sk2.logs()[-3000:],
        )


@pytest.mark.parametrize("name", ["llama", "qwen35-thinking-off"])
def test_image_chats_are_warm_after_llama_server_slept(name, image_start):
    """Two chats with the same text and a red or a blue picture on one slot, llama-server's own sleep
    (--sleep-idle-seconds): it unloads the model, the projector and the cache; each chat's next turn after it
    reuses at least 90% of its previous prompt."""
    sk = image_start(name, "-np", "1", "--sleep-idle-seconds", "2")
    chats = [picture_chat(1, name, RED), picture_chat(1, name, BLUE)]
    for chat in chats:
        chat.turn(sk.port)
    asleep = lambda: http_call(sk.port, "GET", "/props").body.get("is_sleeping") is True  # noqa: E731
    assert wait_until(asleep, 10, interval=0.2), sk.logs()[-3000:]
    for chat in chats:
        timings = chat.turn(sk.port)
        assert chat.reused_enough(timings), (chat.n, timings, chat.previous_prompt_tokens, sk.logs()[-4000:])
    assert "llama-server is asleep" in sk.logs()


def test_in_router_mode_a_models_image_chats_are_kept(starter, llama_server, family_models, tiny_mmproj, tmp_path):
    """Router mode with a preset whose model a has a projector: two chats with the same text and a red or a
    blue picture on a, a text chat on b (the router unloads a for it, --models-max 1), then a swap; every
    chat's next turn is warm."""
    preset = tmp_path / "models.ini"
    preset.write_text(
        f"[a]\nmodel = {family_models['llama']}\nmmproj = {tiny_mmproj(64)}\n\n"
        f"[b]\nmodel = {family_models['qwen35']}\n",
        encoding="utf-8",
    )
    start = starter(llama_server, ["--models-preset", str(preset), "--models-max", "1", *ROUTER, "-np", "1"])
    sk = start()
    on_a = []
    for colour in (RED, BLUE):
        chat = picture_chat(1, "llama", colour)
        chat.request = {"model": "a"}
        on_a.append(chat)
    on_b = Chat(5, {"model": "b", **NO_THINKING})
    for chat in (*on_a, on_b):
        chat.turn(sk.port)
    for chat in on_a:  # a was unloaded for b: both come back from the store
        timings = chat.turn(sk.port)
        assert chat.reused_enough(timings), (chat.n, timings, chat.previous_prompt_tokens, sk.logs()[-4000:])
    swap_out(sk)
    sk2 = start()
    for chat in (on_b, *on_a):  # a last: its status is there to read
        timings = chat.turn(sk2.port)
        assert chat.reused_enough(timings), (chat.n, timings, chat.previous_prompt_tokens, sk2.logs()[-4000:])
    assert http_call(sk2.port, "GET", "/slotkeeper/status").body["models"]["a"]["store"]["images"] >= 2
