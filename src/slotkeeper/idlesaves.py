"""When each model's changed chats are saved while idle: the schedule, with no I/O (the daemon saves).

Why per model: each of a router's children has its own idle clock and falls asleep on its own
(`--sleep-idle-seconds`), taking its KV cache with it. A save that waited for every model to be quiet would let
one model's long answer hold another's save past that model's sleep, and its changed chats would be lost. So a
model's save is due --autosave-idle seconds (always before its sleep, llama.sleep.save_after) after its own last
request ended, whatever the other models are doing; with one model, its requests are all the proxy forwards to
llama-server (status polls and slotkeeper's own routes are no work, and delay nothing).

A save that leaves changes behind (a full disk, a read-only remount) is tried again without waiting for another
request: after --autosave-idle, then twice as long each time up to RETRY_MAX_S.
"""

from __future__ import annotations

from dataclasses import dataclass

RETRY_MAX_S = 300.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Activity:
    """What the proxy saw of one model's requests."""

    in_flight: int  # its requests not ended
    last_end: float  # time.monotonic() when its last request ended
    requests: int  # its requests so far


class IdleSaves:
    """The one owner of the idle-save schedule: for each model, when its next idle save is due."""

    def __init__(self, *, idle_s: float) -> None:
        self._idle_s = idle_s
        self._seen: dict[str, int] = {}  # per model: its requests counted when its last idle save started
        self._retry_s: dict[str, float] = {}  # per model: after a save that left changes, the wait before the next
        self._retry_at: dict[str, float] = {}  # ... and when that wait ends

    @property
    def idle_s(self) -> float:
        return self._idle_s

    def due(self, name: str, activity: Activity) -> float | None:
        """When the model's idle save is due (time.monotonic(); at or before now: now); None while a request of its
        own runs, or when nothing came since its last save and that save left nothing behind."""
        if activity.in_flight:
            return None
        retry_at = self._retry_at.get(name)
        if retry_at is not None:
            return max(retry_at, activity.last_end + self._idle_s)
        if activity.requests == self._seen.get(name, 0):
            return None
        return activity.last_end + self._idle_s

    def started(self, name: str, activity: Activity) -> None:
        """Its save starts now: what came before it is what it saves."""
        self._seen[name] = activity.requests

    def ended(self, name: str, *, left_changes: bool, now: float) -> float | None:
        """Its save ended at `now`; returns how long until it is tried again (None: it left nothing behind)."""
        if not left_changes:
            self._retry_s.pop(name, None)
            self._retry_at.pop(name, None)
            return None
        retry_s = self._retry_s[name] = min(max(self._retry_s.get(name, 0.0) * 2, self._idle_s), RETRY_MAX_S)
        self._retry_at[name] = now + retry_s
        return retry_s
