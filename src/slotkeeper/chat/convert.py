"""The chat-completions form of a request body, as llama-server builds it, before it is forwarded.

Why: to choose a slot (a KV cache) for a request slotkeeper needs the exact prompt tokens
llama-server will evaluate. For chat-form bodies it asks the child ``POST /apply-template``
(the chat body; returns ``{"prompt": str}``) and then ``POST /tokenize`` with
``{"content": prompt, "add_special": true, "parse_special": true}``, which is what the
child's own completion path does with the templated prompt. ``/apply-template`` only takes
the chat-completions form, so the bodies of ``/v1/responses`` (OpenAI Responses API) and
``/v1/messages`` (Anthropic Messages API) are first converted here exactly as llama-server
converts them (``server_chat_convert_responses_to_chatcmpl`` and
``server_chat_convert_anthropic_to_oai`` in ``tools/server/server-chat.cpp``, llama.cpp
b11434). The ports keep the C++ behaviour, including what it does with odd input, because
any difference would change the prompt:

* ``json_value(obj, key, default)`` semantics: a missing or null key, a non-object, or a value
  of the wrong type gives the default (the C++ logs a warning and goes on).
* Object keys keep their order (llama.cpp's ``common_json`` is an insertion-ordered JSON):
  a replaced key keeps its place, an erased and re-added key moves to the end. Templates
  that ``tojson`` a tool see that order.
* A ``tool_use`` block's ``input`` becomes the ``arguments`` string through nlohmann's
  ``dump()``: compact, UTF-8 unescaped, and its own Grisu2 float format (``1e+15``, not
  ``1000000000000000.0``), so :func:`_dump` reproduces that byte for byte.
* Where the C++ throws on invalid input the port raises :class:`ValueError` with the same
  one-line message (llama-server answers it with a 400, or 500 for Anthropic's missing
  ``messages``). The input is never modified.

``/infill`` is not supported (:func:`to_chat_form` returns None for it, as for the other
prompt-form endpoints): its tokens cannot be rebuilt exactly through the child's
``/tokenize``. ``format_prompt_infill`` (server-common.cpp) splices in the vocabulary's FIM
token ids (``fim_pre``/``fim_suf``/``fim_mid``, and ``fim_rep``/``fim_sep`` when present),
which llama.cpp takes from GGUF metadata or guesses from token texts in ``llama-vocab.cpp``
and which no endpoint reports (``/props`` gives only the BOS/EOS texts); it adds BOS from
``llama_vocab_get_add_bos``; and it truncates the prefix, suffix and extra chunks to budgets
computed from server settings that are not in the request (``--batch-size``, the server-wide
``--n-predict``, the slot's context size, ``--spm-infill``).
"""

from __future__ import annotations

import copy
import json
import math
import struct
from typing import Any

from .apis import Api, api_of

__all__ = ["anthropic_to_chat", "responses_to_chat", "to_chat_form"]


def to_chat_form(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The chat-completions body llama-server templates for a request to `path`, or None.

    `path` is the decoded request path without the query string (and without any
    ``--api-prefix``). A chat-completions body is returned as it is (the same object);
    Responses and Anthropic Messages bodies are converted (ValueError where llama-server
    rejects them, a body that is not a JSON object included). None for every other path:
    the prompt-form endpoints (``/completion``, ``/completions``, ``/v1/completions``,
    ``/infill``), whose prompt is not templated, and paths that run no completion.
    """
    api = api_of(path)
    if api is Api.CHAT:
        return body
    if api is Api.RESPONSES:
        return responses_to_chat(body)
    if api is Api.MESSAGES:
        return anthropic_to_chat(body)
    return None


# --- json_value() and friends, as in server-common.h --------------------------------------


def _has(obj: Any, key: str) -> bool:
    """``obj.contains(key)``: false for anything that is not an object."""
    return isinstance(obj, dict) and key in obj


def _is_str(obj: Any, key: str) -> bool:
    return _has(obj, key) and isinstance(obj[key], str)


def _is_list(obj: Any, key: str) -> bool:
    return _has(obj, key) and isinstance(obj[key], list)


def _str(obj: Any, key: str, default: str = "") -> str:
    """``json_value<std::string>``: the default unless the value is a string."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, str) else default


def _json(obj: Any, key: str, default: Any) -> Any:
    """``json_value<json>``: the value (a copy) unless missing or null."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return default if value is None else copy.deepcopy(value)


def _int(obj: Any, key: str, default: int) -> int:
    """``json_value<int>``: nlohmann's ``get<int>()`` is a C++ cast from any number or bool."""
    value = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and -(2**63) <= value < 2**64:
        return (value + 2**31) % 2**32 - 2**31  # int64/uint64 -> int wraps
    if isinstance(value, (int, float)):  # a larger integer is parsed as a double
        number = float(value) if isinstance(value, float) or abs(value) < 2**1024 else math.inf
        if math.isfinite(number) and -(2**31) <= math.trunc(number) < 2**31:
            return math.trunc(number)
        return -(2**31)  # out of range is undefined in C++; x86-64 cvttsd2si gives INT_MIN
    return default


# --- OpenAI Responses -> chat completions -----------------------------------------------


def responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:  # noqa: C901 - a port, branch for branch
    """Port of ``server_chat_convert_responses_to_chatcmpl``: a Responses body in chat form.

    Every field of the body but ``input``/``instructions``/``tools``/``max_output_tokens``/
    ``reasoning`` passes through; those become ``messages``, ``tools``, ``max_tokens`` and
    ``reasoning_effort``. Consecutive assistant items (output messages, function calls,
    reasoning) merge into one assistant message.
    """
    if not _has(body, "input"):
        raise ValueError("'input' is required")
    if _str(body, "previous_response_id"):
        raise ValueError("llama.cpp does not support 'previous_response_id'.")

    out: dict[str, Any] = copy.deepcopy(body)
    input_value = out.pop("input")
    messages: list[dict[str, Any]] = []

    if "instructions" in body:
        messages.append({"role": "system", "content": _str(body, "instructions")})
        del out["instructions"]

    if isinstance(input_value, str):
        messages.append({"role": "user", "content": input_value})
    elif isinstance(input_value, list):
        for item in input_value:
            _responses_item(item, messages)
    else:
        raise ValueError("'input' must be a string or array of objects")

    out["messages"] = messages

    if "tools" in body:
        if not isinstance(body["tools"], list):
            raise ValueError("'tools' must be an array of objects")
        tools = []
        for tool in copy.deepcopy(body["tools"]):
            if _str(tool, "type") != "function":
                continue  # non-function Responses tools have no chat equivalent (skipped)
            del tool["type"]
            tool.setdefault("strict", True)
            tools.append({"type": "function", "function": tool})
        del out["tools"]
        if tools:
            out["tools"] = tools

    if "max_output_tokens" in body:
        out["max_tokens"] = out.pop("max_output_tokens")

    if "reasoning" in body:
        if _has(body["reasoning"], "effort"):
            out["reasoning_effort"] = copy.deepcopy(body["reasoning"]["effort"])
        del out["reasoning"]

    return out


def _responses_item(item: Any, messages: list[dict[str, Any]]) -> None:  # noqa: C901 - a port, branch for branch
    """Append one Responses input item (already a private copy) to the chat `messages`."""
    merge_prev = bool(messages) and messages[-1].get("role") == "assistant"

    if _is_str(item, "content"):
        # an input message's text content is one input_text part
        item["content"] = [{"text": item["content"], "type": "input_text"}]

    if _is_list(item, "content") and _is_str(item, "role") and item["role"] in ("user", "system", "developer"):
        content = []
        for part in item["content"]:
            kind = _str(part, "type")
            if kind == "input_text":
                if not _has(part, "text"):
                    raise ValueError("'Input text' requires 'text'")
                content.append({"text": part["text"], "type": "text"})
            elif kind == "input_image":
                if not _has(part, "image_url"):
                    raise ValueError("'image_url' is required")
                content.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
            elif kind == "input_file":
                raise ValueError("'input_file' is not supported by llamacpp at this moment")
            else:
                raise ValueError("'type' must be one of 'input_text', 'input_image', or 'input_file'")
        item.pop("type", None)
        item.pop("status", None)
        item["content"] = content
        messages.append(item)

    elif _is_str(item, "role") and item["role"] == "assistant" and _is_str(item, "type") and item["type"] == "message":
        content = []
        if _is_list(item, "content"):  # string content was made a part list above
            for part in item["content"]:
                kind = _str(part, "type")
                if kind in ("output_text", "input_text"):
                    if not _is_str(part, "text"):
                        raise ValueError("'Output text' requires 'text'")
                    content.append({"text": part["text"], "type": "text"})
                elif kind == "refusal":
                    if not _is_str(part, "refusal"):
                        raise ValueError("'Refusal' requires 'refusal'")
                    content.append({"refusal": part["refusal"], "type": "refusal"})
                else:
                    raise ValueError("'type' must be one of 'output_text' or 'refusal'")
        if merge_prev:
            prev = messages[-1]
            if not _is_list(prev, "content"):
                prev["content"] = []
            prev["content"].extend(content)
        else:
            item.pop("status", None)
            item.pop("type", None)
            item["content"] = content
            messages.append(item)

    elif (
        _is_str(item, "arguments")
        and _is_str(item, "call_id")
        and _is_str(item, "name")
        and _is_str(item, "type")
        and item["type"] == "function_call"
    ):
        call = {
            "function": {"arguments": item["arguments"], "name": item["name"]},
            "id": item["call_id"],
            "type": "function",
        }
        if merge_prev:
            prev = messages[-1]
            if not _is_list(prev, "tool_calls"):
                prev["tool_calls"] = []
            prev["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})

    elif (
        _is_str(item, "call_id")
        and (_is_str(item, "output") or _is_list(item, "output"))
        and _is_str(item, "type")
        and item["type"] == "function_call_output"
    ):
        output = item["output"]
        if isinstance(output, list):
            for part in output:
                if not _has(part, "type"):
                    raise ValueError("Output of tool call missing 'type' field")
                kind = part["type"]
                if kind != "input_text" and kind != "input_image":
                    raise ValueError("Output of tool call should be 'Input text' or 'Input image'")
                if kind == "input_text":
                    part["type"] = "text"
                else:
                    if "image_url" not in part:
                        raise ValueError("'image_url' is required")
                    part["type"] = "image_url"
                    part["image_url"] = {"url": part["image_url"]}
        messages.append({"content": output, "role": "tool", "tool_call_id": item["call_id"]})

    elif _is_list(item, "summary") and _is_str(item, "type") and item["type"] == "reasoning":
        if not _is_list(item, "content"):
            raise ValueError("item['content'] is not an array")
        if not item["content"]:
            raise ValueError("item['content'] is empty")
        if not _is_str(item["content"][0], "text"):
            raise ValueError("item['content']['text'] is not a string")
        text = item["content"][0]["text"]
        if merge_prev:
            messages[-1]["reasoning_content"] = text
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": text})

    else:
        raise ValueError("Cannot determine type of 'item'")


# --- Anthropic Messages -> chat completions ---------------------------------------------

#: Anthropic fields passed through unchanged, in the order the C++ adds them.
_ANTHROPIC_PASSTHROUGH = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")


def anthropic_to_chat(body: dict[str, Any]) -> dict[str, Any]:  # noqa: C901 - a port, branch for branch
    """Port of ``server_chat_convert_anthropic_to_oai``: an Anthropic Messages body in chat form.

    Unlike the Responses conversion this builds a new body: only ``system``, ``messages``,
    ``tools``, ``tool_choice``, ``stop_sequences``, ``max_tokens`` (default 4096), the
    sampling fields, ``thinking`` and ``metadata.user_id`` are carried over.
    """
    out: dict[str, Any] = {}
    messages: list[Any] = []

    system = _json(body, "system", None)
    if system is not None:
        text = ""
        if isinstance(system, str):
            text = _normalize_billing_header(system)
        elif isinstance(system, list):
            for block in system:
                if _str(block, "type") == "text":
                    text += _normalize_billing_header(_str(block, "text"))
        messages.append({"role": "system", "content": text})

    if not _has(body, "messages"):
        raise ValueError("'messages' is required")
    if isinstance(body["messages"], list):
        for msg in copy.deepcopy(body["messages"]):
            _anthropic_message(msg, messages)
    out["messages"] = messages

    if _is_list(body, "tools"):
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": _str(tool, "name"),
                    "description": _str(tool, "description"),
                    "parameters": copy.deepcopy(tool["input_schema"]) if _has(tool, "input_schema") else {},
                },
            }
            for tool in body["tools"]
        ]

    if _has(body, "tool_choice") and isinstance(body["tool_choice"], dict):
        kind = _str(body["tool_choice"], "type")
        if kind == "auto":
            out["tool_choice"] = "auto"
        elif kind in ("any", "tool"):
            out["tool_choice"] = "required"

    if _has(body, "stop_sequences"):
        out["stop"] = copy.deepcopy(body["stop_sequences"])

    out["max_tokens"] = copy.deepcopy(body["max_tokens"]) if _has(body, "max_tokens") else 4096

    for key in _ANTHROPIC_PASSTHROUGH:
        if _has(body, key):
            out[key] = copy.deepcopy(body[key])

    if _has(body, "thinking"):
        thinking = _json(body, "thinking", {})
        if _str(thinking, "type") == "enabled":
            out["thinking_budget_tokens"] = _int(thinking, "budget_tokens", 10000)

    if _has(body, "metadata"):
        user_id = _str(_json(body, "metadata", {}), "user_id")
        if user_id:
            out["__metadata_user_id"] = user_id

    return out


def _anthropic_message(msg: Any, messages: list[Any]) -> None:  # noqa: C901 - a port, branch for branch
    """Append one Anthropic message (a private copy) as chat messages: itself, then its tool results."""
    role = _str(msg, "role")
    if not _has(msg, "content"):
        if role != "assistant":
            messages.append(msg)
        return
    content = msg["content"]
    if not isinstance(content, list):
        messages.append(msg)
        return

    tool_calls: list[dict[str, Any]] = []
    converted: list[Any] = []
    tool_results: list[dict[str, Any]] = []
    reasoning = ""
    has_tool_calls = False

    for block in content:
        kind = _str(block, "type")
        if kind == "text":
            converted.append(block)
        elif kind == "thinking":
            reasoning += _str(block, "thinking")
        elif kind == "image":
            url = _image_url(_json(block, "source", {}))
            if url is not None:
                converted.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use":
            tool_calls.append(
                {
                    "id": _str(block, "id"),
                    "type": "function",
                    "function": {"name": _str(block, "name"), "arguments": _dump(_json(block, "input", {}))},
                }
            )
            has_tool_calls = True
        elif kind == "tool_result":
            tool_results.append(
                {
                    "role": "tool",
                    "tool_call_id": _str(block, "tool_use_id"),
                    "content": _tool_result_content(_json(block, "content", None)),
                }
            )

    if converted or has_tool_calls or reasoning:
        new_msg: dict[str, Any] = {"role": role}
        new_msg["content"] = converted if converted else ""
        if tool_calls:
            new_msg["tool_calls"] = tool_calls
        if reasoning:
            new_msg["reasoning_content"] = reasoning
        messages.append(new_msg)
    messages.extend(tool_results)


def _image_url(source: Any) -> str | None:
    """An Anthropic image source as a URL (a data: URL for base64), None for other source types."""
    kind = _str(source, "type")
    if kind == "base64":
        return f"data:{_str(source, 'media_type', 'image/jpeg')};base64,{_str(source, 'data')}"
    if kind == "url":
        return _str(source, "url")
    return None


def _tool_result_content(content: Any) -> str | list[Any]:
    """A tool_result's content: a string as is; text parts joined, unless there is an image."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    text = ""
    parts: list[dict[str, Any]] = []
    has_images = False
    for part in content:
        kind = _str(part, "type")
        if kind == "text":
            piece = _str(part, "text")
            text += piece
            parts.append({"type": "text", "text": piece})
        elif kind == "image":
            has_images = True  # even when the source type is unknown and nothing is added
            url = _image_url(_json(part, "source", {}))
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts if has_images else text


def _normalize_billing_header(text: str) -> str:
    """``normalize_anthropic_billing_header``: blank the per-request ``cch=`` stamp of Claude Code's
    billing-header system prompt (5 bytes, when followed by ``;``), which would defeat prefix caching."""
    prefix = "x-anthropic-billing-header:"
    if not text.startswith(prefix):
        return text
    raw = text.encode("utf-8", "surrogatepass")  # the C++ indexes bytes
    at = raw.find(b"cch=", len(prefix))
    if at < 0:
        return text
    start = at + 4
    if start + 5 < len(raw) and raw[start + 5] == ord(";"):
        return (raw[:start] + b"fffff" + raw[start + 5 :]).decode("utf-8", "surrogatepass")
    return text  # the C++ logs an error and leaves it


# --- nlohmann::json dump() ----------------------------------------------------------------


def _dump(value: Any) -> str:
    """``json.dump()`` as nlohmann writes it: compact, keys in order, non-ASCII as UTF-8,
    control characters as ``\\u00xx``, floats in Grisu2 form, non-finite numbers as null."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        if -(2**63) <= value < 2**64:
            return str(value)
        try:  # nlohmann parses an integer beyond 64 bits as a double
            return _dump_float(float(value))
        except OverflowError:
            return "null"
    if isinstance(value, float):
        return _dump_float(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(k, ensure_ascii=False) + ":" + _dump(v) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_dump(v) for v in value) + "]"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def _cached_power(k: int) -> tuple[int, int]:
    """10^k as a 64-bit significand f and binary exponent e (f * 2^e), rounded to nearest."""
    if k >= 0:
        n = 10**k
        e = n.bit_length() - 64
        return ((n + (1 << (e - 1))) >> e if e > 0 else n << -e), e
    d = 10**-k
    e = -(d.bit_length() + 63)
    while (1 << -e) // d < 1 << 63:
        e -= 1
    return ((1 << (1 - e)) + d) // (2 * d), e


#: Grisu's table of cached powers 10^-300, 10^-292, ..., 10^324 (as in nlohmann's dtoa_impl).
_CACHED_POWERS = [(*_cached_power(k), k) for k in range(-300, 325, 8)]


def _dump_float(x: float) -> str:
    """nlohmann's ``to_chars``: Grisu2 digits, fixed notation for 1e-4 <= |x| < 1e15."""
    if not math.isfinite(x):
        return "null"
    sign = "-" if math.copysign(1.0, x) < 0 else ""
    x = abs(x)
    if x == 0:
        return sign + "0.0"
    digits, exponent = _grisu2(x)
    k = len(digits)
    n = k + exponent
    if k <= n <= 15:
        text = digits + "0" * (n - k) + ".0"
    elif 0 < n <= 15:
        text = digits[:n] + "." + digits[n:]
    elif -4 < n <= 0:
        text = "0." + "0" * -n + digits
    else:
        mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
        e = n - 1
        text = f"{mantissa}e{'-' if e < 0 else '+'}{abs(e):02d}"
    return sign + text


def _grisu2(value: float) -> tuple[str, int]:
    """The decimal digits and exponent nlohmann's Grisu2 gives for a finite positive double."""
    bits = struct.unpack("<Q", struct.pack("<d", value))[0]
    biased, fraction = bits >> 52, bits & ((1 << 52) - 1)
    if biased == 0:
        vf, ve = fraction, -1074
    else:
        vf, ve = fraction + (1 << 52), biased - 1075
    plus_f, plus_e = 2 * vf + 1, ve - 1
    if fraction == 0 and biased > 1:
        minus_f, minus_e = 4 * vf - 1, ve - 2
    else:
        minus_f, minus_e = 2 * vf - 1, ve - 1

    def normalize(f: int, e: int) -> tuple[int, int]:
        shift = 64 - f.bit_length()
        return f << shift, e - shift

    plus_f, plus_e = normalize(plus_f, plus_e)
    minus_f = minus_f << (minus_e - plus_e)
    vf, ve = normalize(vf, ve)  # ve == plus_e

    # cached power c ~ 10^-k such that -60 <= e_c + plus_e + 64 <= -32
    f = -60 - plus_e - 1
    k = (abs(f * 78913) >> 18) * (1 if f >= 0 else -1) + (f > 0)  # C++ division truncates
    c_f, c_e, c_k = _CACHED_POWERS[(300 + k + 7) // 8]

    def mul(a: int) -> int:
        return (a * c_f + (1 << 63)) >> 64

    e = plus_e + c_e + 64
    w = mul(vf)
    m_minus = mul(minus_f) + 1
    m_plus = mul(plus_f) - 1
    return _grisu2_digits(m_minus, w, m_plus, e, -c_k)


def _grisu2_digits(m_minus: int, w: int, m_plus: int, e: int, exponent: int) -> tuple[str, int]:
    """``grisu2_digit_gen`` and ``grisu2_round``: digits of a value within [m_minus, m_plus] * 2^e."""
    delta = m_plus - m_minus
    dist = m_plus - w
    shift = -e
    one = 1 << shift
    p1, p2 = m_plus >> shift, m_plus & (one - 1)
    buf: list[int] = []

    def round_last(rest: int, ten_k: int) -> None:
        while rest < dist and delta - rest >= ten_k and (rest + ten_k < dist or dist - rest > rest + ten_k - dist):
            buf[-1] -= 1
            rest += ten_k

    n = len(str(p1))
    pow10 = 10 ** (n - 1)
    while n > 0:
        d, p1 = divmod(p1, pow10)
        buf.append(d)
        n -= 1
        rest = (p1 << shift) + p2
        if rest <= delta:
            round_last(rest, pow10 << shift)
            return "".join(map(str, buf)), exponent + n
        pow10 //= 10
    m = 0
    while True:
        p2 *= 10
        buf.append(p2 >> shift)
        p2 &= one - 1
        m += 1
        delta *= 10
        dist *= 10
        if p2 <= delta:
            break
    round_last(p2, one)
    return "".join(map(str, buf)), exponent - m
