"""The tiny vision projector (slotkeeper.testing.tinymmproj) on a real llama-server with the tiny llama.

Image tests rely on two things checked here: an image takes exactly IMAGE_POSITIONS (64) positions, and its
colour changes the greedy answer (so a wrong or stale image in a restored slot would show).
"""

from __future__ import annotations

from family_helpers import BASE

from slotkeeper.testing.tinymmproj import IMAGE_POSITIONS, image_part, solid_png

QUESTION = {"type": "text", "text": "What colour?"}


def ask(sk, content: list[dict]) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
    reply = sk.call("POST", "/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    return reply.body


def test_an_image_is_64_positions_and_its_colour_changes_the_answer(starter, llama_server, family_models, tiny_mmproj):
    mmproj = tiny_mmproj(64)  # the tiny llama is 64 wide
    assert mmproj.stat().st_size < 1_000_000
    sk = starter(llama_server, ["-m", str(family_models["llama"]), "--mmproj", str(mmproj), *BASE])("-np", "1")

    # The gemma3 projector wraps the image in the text "<start_of_image>" / "<end_of_image>": ordinary tokens here.
    markers = sk.call("POST", "/tokenize", {"content": "<start_of_image><end_of_image>", "add_special": False})
    n_markers = len(markers.body["tokens"])

    text_only = ask(sk, [QUESTION])
    red = ask(sk, [QUESTION, image_part(solid_png((255, 0, 0)))])
    blue = ask(sk, [QUESTION, image_part(solid_png((0, 0, 255)))])
    red_again = ask(sk, [QUESTION, image_part(solid_png((255, 0, 0)))])

    for reply in (red, blue):
        assert reply["usage"]["prompt_tokens"] - text_only["usage"]["prompt_tokens"] == IMAGE_POSITIONS + n_markers
        assert reply["usage"]["completion_tokens"] == 8
    answer = [r["choices"][0]["message"]["content"] for r in (red, blue, red_again)]
    assert answer[0] != answer[1], answer
    assert answer[0] == answer[2], answer  # deterministic: the difference is the colour, not noise
