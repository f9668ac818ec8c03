"""slotkeeper's own HTTP calls to its llama-server child, over the proxy's pool of connections.

One client to the child: health, props, tokenize and slot actions go through the same keep-alive pool as
proxied requests (proxy.upstream.ChildPool), so a call on the request path (placing a completion) costs what a
proxied request costs, and no second HTTP stack is imported.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

if TYPE_CHECKING:
    from ..proxy.upstream import ChildPool


@dataclass(frozen=True)
class ChildReply:
    """A parsed JSON reply and its status; `error` is llama-server's error message when there is one."""

    status: int
    body: Any

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def error(self) -> str:
        if isinstance(self.body, dict) and isinstance(self.body.get("error"), dict):
            return str(self.body["error"].get("message", ""))
        return str(self.body)[:200]


# What llama-server runs as a task that restarts its idle clock (b11434, --sleep-idle-seconds): a completion, a slot
# action, GET /slots. /tokenize and /apply-template wake a sleeping child but do not restart the clock.
TASK_PATHS = frozenset({"/completion", "/completions", "/v1/completions", "/chat/completions", "/v1/chat/completions"})


def is_task(method: str, path: str) -> bool:
    """Whether llama-server runs this call as a task that restarts its idle clock (only those known to)."""
    path = path.partition("?")[0]
    if method == "GET":
        return path == "/slots"
    return path in TASK_PATHS or path.startswith("/slots/")


class TaskClock:
    """When one llama-server last had work, as slotkeeper saw it: its own calls and the requests it placed.

    Why: llama-server's idle clock (--sleep-idle-seconds) restarts when a task ends, and it sleeps N seconds after;
    so slotkeeper reckons its sleep deadline from the same ends, and a request that comes near or past it asks
    first whether it sleeps (llama.sleep.SleepWatch). Only what certainly is a task counts: a deadline reckoned
    too early costs a /props, one reckoned too late would place a request on slots the sleep emptied.
    """

    __slots__ = ("check_from", "last_end", "lead_s", "running")

    def __init__(self) -> None:
        self.running = 0  # tasks under way
        self.last_end = time.monotonic()  # when the last one ended (at first: before the child could start)
        self.lead_s = math.inf  # from that end until a request asks whether it sleeps (set by SleepWatch)
        self.check_from = math.inf  # last_end + lead_s while nothing runs: the hot path's one comparison

    def started(self) -> None:
        self.running += 1
        self.check_from = math.inf

    def ended(self, worked: bool = True) -> None:
        """A task ended; `worked`: it reached llama-server's task loop (a refused call restarts nothing)."""
        self.running -= 1
        if worked:
            self.last_end = time.monotonic()
        if not self.running:
            self.check_from = self.last_end + self.lead_s

    def restarted(self) -> None:
        """The child's idle clock restarts now without a task slotkeeper counted (a request wakes it)."""
        self.last_end = time.monotonic()
        if not self.running:
            self.check_from = self.last_end + self.lead_s


class LlamaClient:
    """The few llama-server endpoints slotkeeper calls itself, with the API key llama-server requires."""

    def __init__(self, pool: ChildPool, api_key: str | None) -> None:
        self.pool = pool
        self._auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
        self.running: dict[asyncio.Future[ChildReply], str] = {}  # each slot action under way -> its name
        self.model: str | None = None  # router mode: the model every call is for
        self._model_member = b""
        self.clock = TaskClock()  # (a router's model: its own child's, see for_model)

    def for_model(self, name: str) -> LlamaClient:
        """A client whose calls all go to one model of a router (llama-server routes a POST by its body's
        "model", a GET by `?model=`), over the same pool; its slot actions count as this client's."""
        client = LlamaClient(self.pool, None)
        client._auth, client.running, client.model = self._auth, self.running, name  # (its own clock: its child's)
        client._model_member = b'"model":' + json.dumps(name).encode()
        return client

    async def call_raw(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """Status and raw body; `body` goes as JSON, byte for byte (with the model added, for a router)."""
        if self.model is not None:
            if method == "GET":
                path += ("&" if "?" in path else "?") + urlencode({"model": self.model})
            else:
                body = with_member(body or b"{}", self._model_member)
        head = b"%s %s HTTP/1.1\r\nHost: localhost\r\n%s" % (method.encode(), path.encode(), self._auth)
        if body is not None:
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        if not is_task(method, path):
            reply = await self.pool.request(head + b"\r\n" + (body or b""))
            return reply.status, reply.body
        self.clock.started()
        status = 0
        try:
            reply = await self.pool.request(head + b"\r\n" + (body or b""))
            status = reply.status
        finally:
            self.clock.ended(status == 200)
        return reply.status, reply.body

    async def call_json(
        self, method: str, path: str, payload: Any = None, params: dict[str, str] | None = None
    ) -> ChildReply:
        if params:
            path = f"{path}?{urlencode(params)}"
        body = None if payload is None else json.dumps(payload, separators=(",", ":")).encode()
        status, raw = await self.call_raw(method, path, body)
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode("utf-8", "replace")
        return ChildReply(status, parsed)

    async def health(self) -> ChildReply:
        return await self.call_json("GET", "/health")

    async def props(self) -> ChildReply:
        return await self.call_json("GET", "/props")

    async def slots(self) -> ChildReply:
        return await self.call_json("GET", "/slots")

    async def prompt_rate(self) -> float | None:
        """Prompt tokens per second this llama-server measured over its life (from its /metrics, which needs
        --metrics); None when it cannot say yet."""
        status, raw = await self.call_raw("GET", "/metrics")
        if status != 200:
            return None
        values: dict[str, float] = {}
        for line in raw.decode(errors="replace").splitlines():
            name, _, value = line.partition(" ")
            if name in ("llamacpp:prompt_tokens_total", "llamacpp:prompt_seconds_total"):
                values[name] = float(value)
        tokens, seconds = values.get("llamacpp:prompt_tokens_total", 0.0), values.get("llamacpp:prompt_seconds_total")
        return tokens / seconds if seconds else None

    async def tokenize(self, prompt: Any, *, add_special: bool = True) -> list[int] | None:
        """The prompt's tokens as a completion request would see them (special tokens parsed, BOS added unless
        `add_special` is False: the text after a picture, which mtmd tokenizes on its own)."""
        payload = json.dumps(
            {"content": prompt, "add_special": add_special, "parse_special": True}, separators=(",", ":")
        ).encode()
        status, raw = await self.call_raw("POST", "/tokenize", payload)
        if status != 200:
            return None
        tokens = json.loads(raw)["tokens"]
        return tokens if isinstance(tokens, list) else None

    async def apply_template(self, chat_body: bytes) -> str | None:
        """A chat-form body's prompt text, its template applied (/apply-template)."""
        status, raw = await self.call_raw("POST", "/apply-template", chat_body)
        if status != 200:
            return None
        prompt = json.loads(raw)["prompt"]
        return prompt if isinstance(prompt, str) else None

    async def slot_action(self, slot_id: int, action: str, filename: str | None = None) -> ChildReply:
        """A slot action, run to its end even when the caller is cancelled (a stop cancels start-up's restores;
        a drain that runs out cancels a request mid-restore).

        Why: llama-server finishes a slot action it has begun, whatever became of the request, and only then
        honours SIGTERM; signalled in the middle of a long one it outlives --stop-timeout and is SIGKILLed. So
        the action goes on here, and a stop waits for it (`until_idle`) before it signals the child.
        """
        body = {"filename": filename} if filename is not None else {}
        call = asyncio.ensure_future(
            self.call_json("POST", f"/slots/{slot_id}", payload=body, params={"action": action})
        )
        self.running[call] = action
        call.add_done_callback(self._ended)
        return await asyncio.shield(call)

    def _ended(self, call: asyncio.Future[ChildReply]) -> None:
        self.running.pop(call, None)
        if not call.cancelled():
            call.exception()  # taken: a caller that was cancelled is not there to take it (its error is moot)

    def busy_with(self) -> str:
        """The slot actions under way, in words (`restore`, `save, restore`); empty when there is none."""
        return ", ".join(sorted(set(self.running.values())))

    async def until_idle(self, deadline: float) -> bool:
        """Wait until no slot action is under way, or until `deadline` (monotonic); True when none is."""
        while self.running:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                return False
            await asyncio.wait(list(self.running), timeout=timeout)
        return True


def with_member(body: bytes, member: bytes) -> bytes:
    """A JSON object's bytes with `member` (`"key":value`) added as its last member, the rest unchanged (the
    last of duplicate keys wins in llama-server's parser)."""
    close = body.rstrip().rfind(b"}")
    if close < 0:
        return body
    last = len(body[:close].rstrip())
    separator = b"" if body[last - 1 : last] == b"{" else b","
    return b"%s%s%s%s" % (body[:last], separator, member, body[last:])
