"""A completion request as placement sees it: which chat it continues (its request key), its body with the slot
pinned, and the frozen view that `decide()` reads.

Nothing here does I/O: the request's tokens come from llama-server (`keeper.Keeper.render_prompt`) and are put in
the view before a decision.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..chat import convert
from ..chat.apis import Api, api_of
from ..chat.openings import Opening
from ..chat.prefix import common_keys, unit_keys
from ..llama.client import with_member

# Body fields that do not change the prompt: a chat whose turns differ only in these is still one chat.
# fmt: off
NOT_PROMPT_FIELDS = frozenset({
    "messages", "input", "prompt", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
    "max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict", "seed", "stop", "stop_sequences",
    "id_slot", "cache_prompt", "timings_per_token", "return_progress", "presence_penalty", "frequency_penalty",
    "repeat_penalty", "repeat_last_n", "typical_p", "mirostat", "mirostat_tau", "mirostat_eta", "logit_bias",
    "n_probs", "logprobs", "top_logprobs", "samplers", "user", "metadata", "store", "dry_multiplier",
    "dry_base", "dry_allowed_length", "dry_penalty_last_n", "xtc_probability", "xtc_threshold", "top_n_sigma",
    "t_max_predict_ms", "n_indent", "return_tokens", "post_sampling_probs", "response_fields", "lora",
})
# fmt: on


@dataclass(frozen=True)
class RequestKey:
    """What recognises a chat continuing in its slot without a tokenize round trip.

    Chat form: chained keys of the prompt-relevant settings and of each message (`messages`). Prompt form: the
    prompt itself (text, or canonical JSON of a token list, open-ended so that only whole items compare).
    """

    message_keys: tuple[str, ...] = ()
    prompt: str | None = None

    def continued_by(self, other: RequestKey) -> bool:
        """`other` opens with everything this request had: the same chat, one turn on."""
        if self.message_keys:
            n = len(self.message_keys)
            return n >= 2 and n <= len(other.message_keys) and common_keys(self.message_keys, other.message_keys) == n
        if self.prompt and other.prompt is not None:
            return other.prompt.startswith(self.prompt)
        return False


NO_KEY = RequestKey()


@dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    """A completion request as placement reads it, once: what it is, what chat it continues, where it may go."""

    path: str
    api: Api
    body: bytes  # as the client sent it
    data: dict[str, Any]  # the body, parsed
    chat: dict[str, Any] | None  # its chat form (None for prompt-form requests)
    key: RequestKey  # what recognises its chat continuing in a slot
    pinned: int | None  # the slot the client chose (`id_slot`)
    unpinnable: bool  # llama-server chooses its slot itself (see apis.Api.pinnable)


def read_request(path: str, body: bytes, n_slots: int) -> CompletionRequest | None:
    """The request placement places, or None for what it leaves to llama-server (not a completion, not a JSON
    object, several prompts at once). Raises ValueError, TypeError, KeyError, AttributeError or RecursionError
    on a body llama-server will answer with its own message."""
    api = api_of(path)
    data = json.loads(body)
    if api is None or not isinstance(data, dict) or (not api.templated and is_multi_prompt(data)):
        return None
    key, chat = request_key(path, data)
    unpinnable = not api.pinnable
    pinned = None if unpinnable else data.get("id_slot")
    return CompletionRequest(
        path=path,
        api=api,
        body=body,
        data=data,
        chat=chat,
        key=key,
        pinned=pinned % n_slots if isinstance(pinned, int) and pinned >= 0 else None,
        unpinnable=unpinnable,
    )


@dataclass(frozen=True, kw_only=True)
class RequestView:
    """Everything `decide()` knows of one completion request."""

    keys: list[str] | None = None  # the prompt's block keys; None when its tokens are unknown
    n_tokens: int = 0  # how many tokens its prompt has (0 when unknown)
    token_ids: list[int] | None = None  # the prompt's tokens (extend-only models need them)
    pinned: int | None = None  # the slot the client chose (`id_slot`)
    unpinnable: bool = False  # llama-server chooses its slot itself (see apis.Api.pinnable)
    opening: Opening | None = None  # its chat's opening (system prompt, tools), when known
    key: RequestKey = NO_KEY  # what recognises its chat continuing in a slot
    partial: bool = False  # its tokens end before a picture not known yet (`promptview`): its prompt is longer


def request_key(path: str, data: dict[str, Any]) -> tuple[RequestKey, dict[str, Any] | None]:
    """A request's key, and its chat-form body (None for prompt-form requests)."""
    api = api_of(path)
    if api is not None and api.templated:
        chat = convert.to_chat_form(path, data)
        if chat is None:
            return NO_KEY, None
        messages = chat.get("messages")
        if not isinstance(messages, list):
            return NO_KEY, chat
        return RequestKey(message_keys=tuple(message_keys_of(chat, messages))), chat
    prompt = data.get("prompt")
    if api is Api.INFILL or prompt is None:
        return NO_KEY, None
    if isinstance(prompt, str):
        return RequestKey(prompt=prompt), None
    text = canonical(prompt).decode()
    return RequestKey(prompt=text[:-1] + "," if text.endswith("]") else text), None


def message_keys_of(chat: dict[str, Any], messages: list[Any]) -> list[str]:
    """The chained keys of a chat's prompt-relevant settings and of each of these messages."""
    settings = {k: v for k, v in chat.items() if k not in NOT_PROMPT_FIELDS}
    return unit_keys([canonical(settings), *map(canonical, messages)])


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def with_id_slot(body: bytes, slot_id: int) -> bytes:
    """The body with `"id_slot": N` added as its last member, every other byte unchanged.

    Last, because llama-server's JSON parser keeps the last of duplicate keys: an `"id_slot": -1` the client
    sent earlier in the object is overridden.
    """
    return with_member(body, b'"id_slot":%d' % slot_id)


def is_multi_prompt(data: dict[str, Any]) -> bool:
    """A prompt-form request with several prompts runs on several slots at once: llama-server places it."""
    prompt = data.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt)
