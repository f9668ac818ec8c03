"""Agent sessions as agent clients speak them to llama-server: chat completions, Responses, Anthropic Messages.

Each session has a long system prompt and six tools, and re-sends every reply in its API's own form (the
Responses `output` items, the Anthropic `content` blocks), streamed or not. The responses are read here on
their own terms (not with slotkeeper's reader, which the tests check), and each turn records the API's own
count of reused prompt tokens. Used by tests/test_agents.py and benchmarks/agents.py.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import time
from dataclasses import dataclass, field
from typing import Any

from slotkeeper.testing.harness import http_call

APIS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
AGENT_SYSTEM = "You are a coding agent working in a repository. " + " ".join(
    f"Rule {i}: read the file before you change it, run the tests after, and report what you did in one line."
    for i in range(60)
)


def _tool(name: str, what: str, **params: str) -> dict[str, Any]:
    return {
        "name": name,
        "description": what,
        "parameters": {
            "type": "object",
            "properties": {p: {"type": "string", "description": d} for p, d in params.items()},
            "required": list(params),
        },
    }


TOOLS = [
    _tool("read_file", "Read a file of the repository.", path="The file's path."),
    _tool("write_file", "Write a file of the repository.", path="The file's path.", text="What it holds."),
    _tool("run_tests", "Run the test suite.", selector="Which tests."),
    _tool("search", "Search the repository for a pattern.", pattern="A regular expression."),
    _tool("list_dir", "List a directory.", path="The directory."),
    _tool("shell", "Run a shell command.", command="The command line."),
]


CLAUDE_CODE_VERSION = "2.1.197"
CLAUDE_CODE_IDENTITY = "You are Claude Code, Anthropic's official CLI for Claude."


def attribution_line(first: str) -> str:
    """Claude Code's attribution line for a session that opens with `first`: three characters after the version
    are derived from the session's first prompt, and older builds add a `cch=` stamp."""
    suffix = hashlib.sha256(first.encode()).hexdigest()
    pairs = f"cc_version={CLAUDE_CODE_VERSION}.{suffix[:3]}; cc_entrypoint=sdk-cli; cch={suffix[3:8]};"
    return f"x-anthropic-billing-header: {pairs}"


def claude_code_system(first: str, system: str = AGENT_SYSTEM, *, attribution: bool = True) -> list[dict[str, Any]]:
    """The system blocks of a Claude Code request: the attribution line, the identity block and the long system
    prompt, the last two marked for prompt caching as Claude Code marks them."""
    cached = {"cache_control": {"type": "ephemeral"}}
    blocks = [{"type": "text", "text": attribution_line(first)}] if attribution else []
    return [
        *blocks,
        {"type": "text", "text": CLAUDE_CODE_IDENTITY, **cached},
        {"type": "text", "text": system, **cached},
    ]


def claude_code_session(
    n: int, first: str, request: dict[str, Any] | None = None, stream: bool = False
) -> AgentSession:
    """A new Claude Code session over Anthropic Messages, opening with `first`."""
    return AgentSession(n, "messages", stream, dict(request or {}), system=claude_code_system(first), first=first)


@dataclass
class Turn:
    prompt: int  # the prompt's tokens, as the API counts them
    reused: int  # of which llama-server reused this many from its cache
    reply: Any  # the reply in the API's own form (what the client sends back)
    text: str  # the reply's text
    seconds: float = 0.0  # the whole request, as the client waited for it
    first_token_s: float = 0.0  # until the first delta of a streamed reply (the whole request's if not streamed)


@dataclass
class AgentSession:
    """One agent session over one API; `turn()` sends it and grows it as the client would."""

    n: int
    api: str
    stream: bool = False
    request: dict[str, Any] = field(default_factory=dict)  # extra fields (chat_template_kwargs: thinking off)
    system: str | list[dict[str, Any]] = AGENT_SYSTEM  # Anthropic's system blocks too (`claude_code_system`)
    first: str = ""
    history: list[Any] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.history = [
            self._user(
                self.first
                or f"Session {self.n}: fix the failing test in module {self.n} and tell me which file was wrong."
            )
        ]

    def _user(self, text: str) -> dict[str, Any]:
        return {"role": "user", "content": text}

    def body(self) -> dict[str, Any]:
        common = {"temperature": 0, "stream": self.stream, **self.request}
        if self.api == "chat":
            return {
                "messages": [{"role": "system", "content": self.system}, *self.history],
                "max_tokens": 8,
                "tools": [{"type": "function", "function": t} for t in TOOLS],
                **common,
            }
        if self.api == "responses":
            return {
                "instructions": self.system,
                "input": self.history,
                "max_output_tokens": 8,
                "tools": [{"type": "function", **t} for t in TOOLS],
                **common,
            }
        return {
            "system": self.system,
            "messages": self.history,
            "max_tokens": 8,
            "tools": [
                {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS
            ],
            **common,
        }

    def turn(self, port: int) -> Turn:
        """Send the session's next request; the reply and a next user message join the history."""
        started = time.monotonic()
        status, raw, first = post(port, PATHS[self.api], self.body())
        elapsed = time.monotonic() - started
        assert status == 200, raw[:2000]
        turn = (_read_stream if self.stream else _read_json)[self.api](raw)
        turn.seconds = elapsed
        turn.first_token_s = elapsed if first is None else first - started
        self.turns.append(turn)
        if self.api == "responses":
            self.history.extend(turn.reply)
        else:
            self.history.append(turn.reply)
        self.history.append(self._user(f"Good. Now step {len(self.turns) + 1}: what does the next file do?"))
        return turn

    def reused_enough(self, turn: Turn) -> bool:
        """The turn reused at least 90% of the session's previous prompt."""
        return turn.reused >= 0.9 * self.turns[-2].prompt


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, bytes, float | None]:
    """The status, the whole answer, and when its first delta event arrived (streamed answers)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if not body.get("stream"):
            return resp.status, resp.read(), None
        lines, first = [], None
        while line := resp.readline():
            if first is None and line.startswith(b"data:") and b'delta"' in line:
                first = time.monotonic()
            lines.append(line)
        return resp.status, b"".join(lines), first
    finally:
        conn.close()


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for line in raw.decode().split("\n"):
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            out.append(json.loads(line[5:]))
    return out


def _chat_json(raw: bytes) -> Turn:
    body = json.loads(raw)
    message = body["choices"][0]["message"]
    t = body["timings"]
    reply = {"role": "assistant", "content": message.get("content") or ""}
    return Turn(t["prompt_n"] + t["cache_n"], t["cache_n"], reply, reply["content"])


def _chat_stream(raw: bytes) -> Turn:
    text, timings = "", dict[str, Any]()
    for event in _events(raw):
        for choice in event.get("choices") or ():
            text += (choice.get("delta") or {}).get("content") or ""
        timings = event.get("timings") or timings
    return Turn(
        timings["prompt_n"] + timings["cache_n"], timings["cache_n"], {"role": "assistant", "content": text}, text
    )


def _responses_turn(response: dict[str, Any]) -> Turn:
    usage = response["usage"]
    text = "".join(
        part.get("text", "") for item in response["output"] if item["type"] == "message" for part in item["content"]
    )
    return Turn(usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"], response["output"], text)


def _responses_stream(raw: bytes) -> Turn:
    done = [e for e in _events(raw) if e.get("type") == "response.completed"]
    return _responses_turn(done[-1]["response"])


def _messages_turn(content: list[dict[str, Any]], usage: dict[str, Any]) -> Turn:
    cached = usage.get("cache_read_input_tokens", 0)
    text = "".join(b.get("text", "") for b in content if b["type"] == "text")
    return Turn(usage["input_tokens"] + cached, cached, {"role": "assistant", "content": content}, text)


def _messages_stream(raw: bytes) -> Turn:
    blocks: dict[int, dict[str, Any]] = {}
    usage: dict[str, Any] = {}
    for event in _events(raw):
        if event["type"] == "message_start":
            usage = event["message"]["usage"]
        elif event["type"] == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            for key, field_ in (("text_delta", "text"), ("thinking_delta", "thinking")):
                if delta["type"] == key:
                    block[field_] = block.get(field_, "") + delta[field_]
    return _messages_turn([blocks[i] for i in sorted(blocks)], usage)


_read_json = {
    "chat": _chat_json,
    "responses": lambda raw: _responses_turn(json.loads(raw)),
    "messages": lambda raw: _messages_turn(json.loads(raw)["content"], json.loads(raw)["usage"]),
}
_read_stream = {"chat": _chat_stream, "responses": _responses_stream, "messages": _messages_stream}


def prompt_tokens(port: int, body: dict[str, Any]) -> list[int]:
    """A chat-completions body's prompt tokens, as llama-server renders them."""
    rendered = http_call(port, "POST", "/apply-template", body).body["prompt"]
    tokens: list[int] = http_call(
        port, "POST", "/tokenize", {"content": rendered, "add_special": True, "parse_special": True}
    ).body["tokens"]
    return tokens
