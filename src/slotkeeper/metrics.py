"""What slotkeeper counts for GET /slotkeeper/metrics and /slotkeeper/status: one Metrics per daemon (and one
per model in router mode), no globals.

Events are counted in plain attributes (cheap, no import on the start-up path); exposition renders them as
Prometheus text at a scrape.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class Histogram:
    """Cumulative-bucket histogram state in Prometheus' shape."""

    buckets: tuple[float, ...] = SECONDS_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(SECONDS_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        running, out = 0, []
        for bound, count in zip((*map(str, self.buckets), "+Inf"), self.counts):
            running += count
            out.append((bound, running))
        return out


@dataclass
class Metrics:
    """The run's counters, written where the work happens and read by /slotkeeper/status and /slotkeeper/metrics."""

    restores: collections.Counter[str] = field(default_factory=collections.Counter)  # by outcome
    restore_seconds: Histogram = field(default_factory=Histogram)
    restored_bytes: int = 0
    restored_tokens: int = 0
    saves: collections.Counter[str] = field(default_factory=collections.Counter)  # by outcome
    save_seconds: Histogram = field(default_factory=Histogram)
    saved_bytes: int = 0
    written_bytes: int = 0  # what the saves wrote to the store: their new blocks (or whole files)
    saved_tokens: int = 0
    save_failures: collections.Counter[str] = field(default_factory=collections.Counter)  # by reason
    quarantines: int = 0
    checksum_seconds: float = 0.0  # spent checking entries' files against their checksums before restores
    placements: collections.Counter[str] = field(default_factory=collections.Counter)  # by outcome
    on_demand_restores: int = 0
    remote_fetches: int = 0  # entries downloaded from the shared tier for a request
    remote_prefill_faster: int = 0  # remote entries not fetched: the prefill was estimated faster
    prompt_tokenizations: int = 0  # placements that asked llama-server for the prompt's tokens
    prefill_tokens_saved: int = 0  # estimated: the prompt tokens placed requests found in their slot
    extend_hits: int = 0  # extend-only models: requests that extend a saved boundary exactly
    extend_misses: collections.Counter[str] = field(default_factory=collections.Counter)  # by decide.Miss
    boundaries_reached: int = 0  # slots brought to a turn boundary before a save
    boundaries_settled: int = 0  # hybrid chats' idle slots brought to their boundary once a turn was over
    settle_prefill_tokens: int = 0  # tokens prefilled for those (off the turns' critical path)
    settle_seconds: float = 0.0
    boundary_prefill_tokens: int = 0  # tokens llama-server prefilled to get there
    boundary_seconds: float = 0.0
    boundary_unknown: int = 0  # saves of a chat whose last reply could not be read (only its fallback saved)
    openings_saved: int = 0  # shared openings saved for the first new chat that brought each
    opening_prefill_tokens: int = 0  # tokens prefilled to reach them (which those chats' requests then reused)
    opening_seconds: float = 0.0
    opening_hits: int = 0  # new chats that started from a saved opening (restored for them, or in their slot)
    opening_tokens_saved: int = 0  # the opening tokens those chats did not prefill
    slots_parked: int = 0  # idle slots saved and erased before a long prefill on another slot
    unpinned_elsewhere: int = 0  # unpinnable requests that llama-server ran on another slot than predicted
    chats_found_empty: int = 0  # saves of a slot a chat was placed on that found it empty
    memory: Callable[[], dict[str, Any]] = dict  # the model's memory kind and slotkeeper's cache policy
    remote: Callable[[], Any] = lambda: None  # remote.RemoteStats, with --remote-store
    store_entries: Callable[[], int] = lambda: 0
    store_images: Callable[[], int] = lambda: 0  # pictures held by the store's entries
    # chats of another configuration: pending, recomputed, prefilled tokens, seconds, pauses, skipped by reason
    recompute: Callable[[], dict[str, Any]] = dict
    store_bytes: Callable[[], int] = lambda: 0
    store_disk_bytes: Callable[[], int] = lambda: 0
    requests_by_status: Callable[[], dict[int, int]] = dict
    models: Callable[[], dict[str, Metrics]] = dict  # router mode: each loaded model's own counters
    requests_in_flight: Callable[[], int] = lambda: 0
    attribution_lines_dropped: Callable[[], int] = lambda: 0  # requests whose attribution line was dropped
    state: Callable[[], str] = lambda: "starting"

    def restored(self, seconds: float, nbytes: int, tokens: int) -> None:
        """A restore's time and size (the store counts each restore's outcome)."""
        self.restore_seconds.observe(seconds)
        self.restored_bytes += nbytes
        self.restored_tokens += tokens

    def saved(self, seconds: float, nbytes: int, tokens: int, written: int) -> None:
        self.saves["saved"] += 1
        self.save_seconds.observe(seconds)
        self.saved_bytes += nbytes
        self.written_bytes += written
        self.saved_tokens += tokens

    def boundary_reached(self, prefilled: int, seconds: float) -> None:
        self.boundaries_reached += 1
        self.boundary_prefill_tokens += prefilled
        self.boundary_seconds += seconds

    def opening_reached(self, prefilled: int, seconds: float) -> None:
        self.opening_prefill_tokens += prefilled
        self.opening_seconds += seconds

    def boundary_settled(self, prefilled: int, seconds: float) -> None:
        self.boundaries_settled += 1
        self.settle_prefill_tokens += prefilled
        self.settle_seconds += seconds

    def status(self) -> dict[str, Any]:
        """Placement's counters, as /slotkeeper/status shows them."""
        return {
            "placements": dict(self.placements),
            "on_demand_restores": self.on_demand_restores,
            "prefill_tokens_saved": self.prefill_tokens_saved,
            "prompt_tokenizations": self.prompt_tokenizations,
            "slots_parked": self.slots_parked,
            "unpinned_elsewhere": self.unpinned_elsewhere,
            "chats_found_empty": self.chats_found_empty,
            "extend_only": {
                "hits": self.extend_hits,
                "misses": dict(self.extend_misses),
                "boundaries_reached": self.boundaries_reached,
                "boundaries_settled": self.boundaries_settled,
                "settle_prefill_tokens": self.settle_prefill_tokens,
                "settle_ms": round(self.settle_seconds * 1000, 1),
                "boundary_prefill_tokens": self.boundary_prefill_tokens,
                "boundary_ms": round(self.boundary_seconds * 1000, 1),
                "boundary_unknown": self.boundary_unknown,
            },
            "openings": {
                "saved": self.openings_saved,
                "hits": self.opening_hits,
                "tokens_saved": self.opening_tokens_saved,
                "prefill_tokens": self.opening_prefill_tokens,
                "prefill_ms": round(self.opening_seconds * 1000, 1),
            },
        }

    def save_failed(self, reason: str) -> None:
        self.saves["failed"] += 1
        self.save_failures[reason] += 1
