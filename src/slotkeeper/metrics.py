"""Prometheus metrics at GET /slotkeeper/metrics, prefixed `slotkeeper_`.

Events are counted in plain attributes (cheap, no import on the start-up path); prometheus-client is
imported at the first scrape and renders them through a collector. One Metrics per daemon, no globals.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Iterator
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
    restores: collections.Counter[str] = field(default_factory=collections.Counter)  # by outcome
    restore_seconds: Histogram = field(default_factory=Histogram)
    restored_bytes: int = 0
    restored_tokens: int = 0
    saves: collections.Counter[str] = field(default_factory=collections.Counter)  # by outcome
    save_seconds: Histogram = field(default_factory=Histogram)
    saved_bytes: int = 0
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
    store_bytes: Callable[[], int] = lambda: 0
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

    def saved(self, seconds: float, nbytes: int, tokens: int) -> None:
        self.saves["saved"] += 1
        self.save_seconds.observe(seconds)
        self.saved_bytes += nbytes
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

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry), CONTENT_TYPE_LATEST


class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        """The model's families (a router's: each model's, labelled `model`), then the process's own."""
        models = self.metrics.models()
        if models:
            yield from _labelled(models)
        else:
            yield from _model_families(self.metrics)
        yield from _process_families(self.metrics)


def _labelled(models: dict[str, Metrics]) -> Iterator[Any]:
    """Each model's families merged into one per name, every sample with its model's label."""
    from prometheus_client.core import Metric

    merged: dict[str, Any] = {}
    for name, metrics in sorted(models.items()):
        for family in _model_families(metrics):
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                out.add_sample(sample.name, {"model": name, **sample.labels}, sample.value)
    yield from merged.values()


def _model_families(m: Metrics) -> Iterator[Any]:
    """What one model's counters say (all but the process's requests and state)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    def counter(name: str, doc: str, label: str | None = None, values: dict[Any, int] | float = 0) -> Any:
        family = CounterMetricFamily(f"slotkeeper_{name}", doc, labels=[label] if label else None)
        if isinstance(values, dict):
            for key, value in sorted(values.items()):
                family.add_metric([str(key)], value)
        else:
            family.add_metric([], values)
        return family

    yield counter("restores", "Entry restores (at start and on demand), by outcome", "outcome", dict(m.restores))
    yield HistogramMetricFamily(
        "slotkeeper_restore_seconds",
        "Duration of successful slot restores",
        buckets=m.restore_seconds.cumulative(),
        sum_value=m.restore_seconds.total,
    )
    yield counter("restored_bytes", "Bytes of slot cache restored", values=m.restored_bytes)
    yield counter("restored_tokens", "Tokens of slot cache restored", values=m.restored_tokens)
    yield counter("saves", "Slot saves, by outcome", "outcome", dict(m.saves))
    yield HistogramMetricFamily(
        "slotkeeper_save_seconds",
        "Duration of successful slot saves (incl. fsync)",
        buckets=m.save_seconds.cumulative(),
        sum_value=m.save_seconds.total,
    )
    yield counter("saved_bytes", "Bytes of slot cache saved", values=m.saved_bytes)
    yield counter("saved_tokens", "Tokens of slot cache saved", values=m.saved_tokens)
    yield counter("save_failures", "Failed or abandoned slot saves, by reason", "reason", dict(m.save_failures))
    yield counter("quarantines", "Cache files moved to quarantine/", values=m.quarantines)
    yield counter(
        "checksum_seconds",
        "Time spent checking entries against their checksums before restores",
        values=m.checksum_seconds,
    )
    yield counter(
        "placements",
        "Completion requests placed: resident (hit), restored (on demand), new, branch "
        "(a miss), pinned (the client chose), unplaced (tokens unknown)",
        "outcome",
        dict(m.placements),
    )
    yield counter("on_demand_restores", "Entries restored into a slot for a request", values=m.on_demand_restores)
    yield counter("remote_fetches", "Entries downloaded from the remote tier for a request", values=m.remote_fetches)
    yield counter(
        "remote_prefill_faster",
        "Remote entries not downloaded: prefilling was estimated faster",
        values=m.remote_prefill_faster,
    )
    yield counter(
        "prompt_tokenizations",
        "Placements that asked llama-server for the prompt's tokens (a chat continuing in its slot needs none)",
        values=m.prompt_tokenizations,
    )
    yield counter(
        "prefill_tokens_saved",
        "Prompt tokens placed requests found cached (estimated, in 64-token blocks)",
        values=m.prefill_tokens_saved,
    )
    yield counter(
        "extend_hits",
        "Requests that extend a saved turn boundary exactly (hybrid and sliding-window models)",
        values=m.extend_hits,
    )
    yield counter(
        "extend_misses",
        "Requests that went cold though an entry shares their opening, by why",
        "reason",
        dict(m.extend_misses),
    )
    yield counter("boundaries_reached", "Slots brought to a turn boundary before a save", values=m.boundaries_reached)
    yield counter(
        "boundaries_settled",
        "Hybrid chats' idle slots brought to their turn boundary after a turn",
        values=m.boundaries_settled,
    )
    yield counter(
        "settle_prefill_tokens",
        "Tokens prefilled to bring idle hybrid slots to their boundary",
        values=m.settle_prefill_tokens,
    )
    yield counter(
        "settle_seconds", "Seconds spent bringing idle hybrid slots to their boundary", values=m.settle_seconds
    )
    yield counter(
        "boundary_prefill_tokens", "Tokens prefilled to reach turn boundaries", values=m.boundary_prefill_tokens
    )
    yield counter("boundary_seconds", "Seconds spent reaching turn boundaries", values=m.boundary_seconds)
    yield counter(
        "boundary_unknown",
        "Saves whose chat's last reply was unknown (only its earlier boundary saved)",
        values=m.boundary_unknown,
    )
    yield counter(
        "openings_saved", "Shared openings (system prompt, tools) saved for new chats", values=m.openings_saved
    )
    yield counter(
        "opening_prefill_tokens",
        "Tokens prefilled to reach openings before saving them (the chat that brought each reused them)",
        values=m.opening_prefill_tokens,
    )
    yield counter("opening_seconds", "Seconds spent reaching openings before saving them", values=m.opening_seconds)
    yield counter("opening_hits", "New chats that started from a saved opening", values=m.opening_hits)
    yield counter("opening_tokens_saved", "Opening tokens new chats did not prefill", values=m.opening_tokens_saved)
    yield counter(
        "slots_parked",
        "Idle slots saved and erased so that a long prompt on another slot attends over fewer KV cells",
        values=m.slots_parked,
    )
    yield counter(
        "unpinned_elsewhere",
        "Requests llama-server places itself (Anthropic Messages) that it ran on another slot than slotkeeper prepared",
        values=m.unpinned_elsewhere,
    )
    yield counter(
        "chats_found_empty", "Saves of a slot a chat was placed on that found it empty", values=m.chats_found_empty
    )
    memory = m.memory()
    if memory:
        info = GaugeMetricFamily(
            "slotkeeper_model_memory", "The model's memory kind and the cache policy", labels=sorted(memory)
        )
        info.add_metric([str(memory[k]) for k in sorted(memory)], 1)
        yield info
    for name, doc, value in (
        ("store_entries", "Entries in the conversation store", m.store_entries()),
        ("store_bytes", "Bytes of entries in the conversation store", m.store_bytes()),
        ("store_images", "Pictures held by the entries of the conversation store", m.store_images()),
    ):
        gauge = GaugeMetricFamily(f"slotkeeper_{name}", doc)
        gauge.add_metric([], value)
        yield gauge
    remote = m.remote()
    if remote is not None:
        pending = GaugeMetricFamily("slotkeeper_remote_uploads_pending", "Uploads to the remote tier not done yet")
        pending.add_metric([], remote.uploads_pending)
        yield pending
        for name, doc in (
            ("uploads_failed", "Uploads that gave up (kept for the next start)"),
            ("uploads_done", "Entries uploaded"),
            ("upload_bytes", "Bytes uploaded"),
            ("upload_seconds", "Seconds spent uploading"),
            ("remote_hits", "Lookups that found a remote entry"),
            ("remote_misses", "Lookups that found none"),
            ("download_bytes", "Bytes downloaded"),
            ("download_seconds", "Seconds spent downloading"),
            ("fetches_failed", "Downloads that failed (network or disk)"),
            ("rejected", "Remote entries refused: tampered, truncated, malformed or foreign"),
        ):
            yield counter(
                f"remote_{name}" if not name.startswith("remote_") else name, doc, values=getattr(remote, name)
            )


def _process_families(m: Metrics) -> Iterator[Any]:
    """The process's own: requests proxied and in flight, the lifecycle state."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    proxied = CounterMetricFamily(
        "slotkeeper_proxied_requests", "Requests proxied to llama-server, by status", labels=["status"]
    )
    for key, value in sorted(m.requests_by_status().items()):
        proxied.add_metric([str(key)], value)
    yield proxied
    dropped = CounterMetricFamily(
        "slotkeeper_attribution_lines_dropped",
        "Requests whose Claude Code attribution line was dropped from the system prompt (one opening for all sessions)",
    )
    dropped.add_metric([], m.attribution_lines_dropped())
    yield dropped
    in_flight = GaugeMetricFamily("slotkeeper_requests_in_flight", "Requests being proxied now")
    in_flight.add_metric([], m.requests_in_flight())
    yield in_flight
    state = GaugeMetricFamily("slotkeeper_state", "Lifecycle state (1 for the current one)", labels=["state"])
    for name in ("starting", "restoring", "ready", "draining", "saving", "stopping", "stopped"):
        state.add_metric([name], 1 if m.state() == name else 0)
    yield state
