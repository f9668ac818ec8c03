"""GET /slotkeeper/metrics' text: the counters of metrics.Metrics as Prometheus families, prefixed `slotkeeper_`.

Every family is a row of a table (name, help, type, and the getter that reads its value), and one function
renders any row: a new counter is one row, and every family is exposed the same way. This module and
prometheus-client are imported at the first scrape, so that nothing of them is on the start-up path.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .metrics import Histogram, Metrics

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from .remote.bucket import RemoteStats

PREFIX = "slotkeeper_"
STATES = ("starting", "restoring", "ready", "draining", "saving", "stopping", "stopped")

Source = TypeVar("Source")  # what a table's getters read: Metrics, or the shared tier's RemoteStats
# A getter's value: one sample; a sample per key (sorted by key) or per pair (in order); a histogram; for INFO,
# the labels.
Value = float | Mapping[Any, Any] | Sequence[tuple[str, float]] | Histogram


class Type(enum.Enum):
    """How a family is exposed."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"
    INFO = "info"  # a gauge of 1 whose labels say what is; left out when there is nothing to say


@dataclass(frozen=True)
class Family(Generic[Source]):
    """One metric family: a row of a table, rendered by `family()`."""

    name: str  # without the prefix
    help: str
    type: Type
    get: Callable[[Source], Value]
    label: str | None = None  # a sample per key of the getter's value, under this label


COUNTER, GAUGE, HISTOGRAM, INFO = Type.COUNTER, Type.GAUGE, Type.HISTOGRAM, Type.INFO

# What one model's counters say (all but the process's requests and state), in the order they are exposed.
MODEL_FAMILIES: tuple[Family[Metrics], ...] = (
    Family("restores", "Entry restores (at start and on demand), by outcome", COUNTER, lambda m: m.restores, "outcome"),
    Family("restore_seconds", "Duration of successful slot restores", HISTOGRAM, lambda m: m.restore_seconds),
    Family("restored_bytes", "Bytes of slot cache restored", COUNTER, lambda m: m.restored_bytes),
    Family("restored_tokens", "Tokens of slot cache restored", COUNTER, lambda m: m.restored_tokens),
    Family("saves", "Slot saves, by outcome", COUNTER, lambda m: m.saves, "outcome"),
    Family("save_seconds", "Duration of successful slot saves (incl. fsync)", HISTOGRAM, lambda m: m.save_seconds),
    Family("saved_bytes", "Bytes of slot cache saved", COUNTER, lambda m: m.saved_bytes),
    Family(
        "written_bytes",
        "Bytes the saves wrote to the store: the blocks it did not hold yet (a whole file, without blocks)",
        COUNTER,
        lambda m: m.written_bytes,
    ),
    Family("saved_tokens", "Tokens of slot cache saved", COUNTER, lambda m: m.saved_tokens),
    Family("save_failures", "Failed or abandoned slot saves, by reason", COUNTER, lambda m: m.save_failures, "reason"),
    Family("quarantines", "Cache files moved to quarantine/", COUNTER, lambda m: m.quarantines),
    Family(
        "checksum_seconds",
        "Time spent checking entries against their checksums before restores",
        COUNTER,
        lambda m: m.checksum_seconds,
    ),
    Family(
        "placements",
        "Completion requests placed: resident (hit), restored (on demand), new, branch "
        "(a miss), pinned (the client chose), unplaced (tokens unknown)",
        COUNTER,
        lambda m: m.placements,
        "outcome",
    ),
    Family(
        "on_demand_restores",
        "Entries restored into a slot for a request",
        COUNTER,
        lambda m: m.on_demand_restores,
    ),
    Family(
        "remote_fetches",
        "Entries downloaded from the remote tier for a request",
        COUNTER,
        lambda m: m.remote_fetches,
    ),
    Family(
        "remote_prefill_faster",
        "Remote entries not downloaded: prefilling was estimated faster",
        COUNTER,
        lambda m: m.remote_prefill_faster,
    ),
    Family(
        "prompt_tokenizations",
        "Placements that asked llama-server for the prompt's tokens (a chat continuing in its slot needs none)",
        COUNTER,
        lambda m: m.prompt_tokenizations,
    ),
    Family(
        "prefill_tokens_saved",
        "Prompt tokens placed requests found cached (estimated, in 64-token blocks)",
        COUNTER,
        lambda m: m.prefill_tokens_saved,
    ),
    Family(
        "extend_hits",
        "Requests that extend a saved turn boundary exactly (hybrid and sliding-window models)",
        COUNTER,
        lambda m: m.extend_hits,
    ),
    Family(
        "extend_misses",
        "Requests that went cold though an entry shares their opening, by why",
        COUNTER,
        lambda m: m.extend_misses,
        "reason",
    ),
    Family(
        "boundaries_reached",
        "Slots brought to a turn boundary before a save",
        COUNTER,
        lambda m: m.boundaries_reached,
    ),
    Family(
        "boundaries_settled",
        "Hybrid chats' idle slots brought to their turn boundary after a turn",
        COUNTER,
        lambda m: m.boundaries_settled,
    ),
    Family(
        "settle_prefill_tokens",
        "Tokens prefilled to bring idle hybrid slots to their boundary",
        COUNTER,
        lambda m: m.settle_prefill_tokens,
    ),
    Family(
        "settle_seconds",
        "Seconds spent bringing idle hybrid slots to their boundary",
        COUNTER,
        lambda m: m.settle_seconds,
    ),
    Family(
        "boundary_prefill_tokens",
        "Tokens prefilled to reach turn boundaries",
        COUNTER,
        lambda m: m.boundary_prefill_tokens,
    ),
    Family("boundary_seconds", "Seconds spent reaching turn boundaries", COUNTER, lambda m: m.boundary_seconds),
    Family(
        "boundary_unknown",
        "Saves whose chat's last reply was unknown (only its earlier boundary saved)",
        COUNTER,
        lambda m: m.boundary_unknown,
    ),
    Family(
        "openings_saved",
        "Shared openings (system prompt, tools) saved for new chats",
        COUNTER,
        lambda m: m.openings_saved,
    ),
    Family(
        "opening_prefill_tokens",
        "Tokens prefilled to reach openings before saving them (the chat that brought each reused them)",
        COUNTER,
        lambda m: m.opening_prefill_tokens,
    ),
    Family(
        "opening_seconds",
        "Seconds spent reaching openings before saving them",
        COUNTER,
        lambda m: m.opening_seconds,
    ),
    Family("opening_hits", "New chats that started from a saved opening", COUNTER, lambda m: m.opening_hits),
    Family(
        "opening_tokens_saved",
        "Opening tokens new chats did not prefill",
        COUNTER,
        lambda m: m.opening_tokens_saved,
    ),
    Family(
        "slots_parked",
        "Idle slots saved and erased so that a long prompt on another slot attends over fewer KV cells",
        COUNTER,
        lambda m: m.slots_parked,
    ),
    Family(
        "unpinned_elsewhere",
        "Requests llama-server places itself (Anthropic Messages) that it ran on another slot than slotkeeper prepared",
        COUNTER,
        lambda m: m.unpinned_elsewhere,
    ),
    Family(
        "chats_found_empty",
        "Saves of a slot a chat was placed on that found it empty",
        COUNTER,
        lambda m: m.chats_found_empty,
    ),
    Family("model_memory", "The model's memory kind and the cache policy", INFO, lambda m: m.memory()),
    Family("store_entries", "Entries in the conversation store", GAUGE, lambda m: m.store_entries()),
    Family("store_bytes", "Bytes of entries in the conversation store", GAUGE, lambda m: m.store_bytes()),
    Family(
        "store_disk_bytes",
        "Bytes the conversation store holds on disk (each shared block once)",
        GAUGE,
        lambda m: m.store_disk_bytes(),
    ),
    Family(
        "store_images",
        "Pictures held by the entries of the conversation store",
        GAUGE,
        lambda m: m.store_images(),
    ),
    Family(
        "recompute_pending",
        "Chats saved by another configuration waiting to be recomputed from their tokens",
        GAUGE,
        lambda m: m.recompute().get("pending", 0),
    ),
    Family(
        "recomputed",
        "Chats saved by another configuration recomputed from their tokens while idle",
        COUNTER,
        lambda m: m.recompute().get("recomputed", 0),
    ),
    Family(
        "recompute_prefill_tokens",
        "Tokens prefilled to recompute them",
        COUNTER,
        lambda m: m.recompute().get("prefilled_tokens", 0),
    ),
    Family(
        "recompute_skipped",
        "Chats saved by another configuration that cannot be recomputed, by reason",
        GAUGE,
        lambda m: m.recompute().get("skipped", {}),
        "reason",
    ),
)

# The shared tier's, after the model's, with --remote-store.
REMOTE_FAMILIES: tuple[Family[RemoteStats], ...] = (
    Family("remote_uploads_pending", "Uploads to the remote tier not done yet", GAUGE, lambda r: r.uploads_pending),
    Family(
        "remote_uploads_failed",
        "Uploads that gave up (kept for the next start)",
        COUNTER,
        lambda r: r.uploads_failed,
    ),
    Family("remote_uploads_done", "Entries uploaded", COUNTER, lambda r: r.uploads_done),
    Family("remote_upload_bytes", "Bytes uploaded", COUNTER, lambda r: r.upload_bytes),
    Family("remote_upload_seconds", "Seconds spent uploading", COUNTER, lambda r: r.upload_seconds),
    Family("remote_hits", "Lookups that found a remote entry", COUNTER, lambda r: r.remote_hits),
    Family("remote_misses", "Lookups that found none", COUNTER, lambda r: r.remote_misses),
    Family("remote_download_bytes", "Bytes downloaded", COUNTER, lambda r: r.download_bytes),
    Family("remote_download_seconds", "Seconds spent downloading", COUNTER, lambda r: r.download_seconds),
    Family("remote_fetches_failed", "Downloads that failed (network or disk)", COUNTER, lambda r: r.fetches_failed),
    Family(
        "remote_rejected",
        "Remote entries refused: tampered, truncated, malformed or foreign",
        COUNTER,
        lambda r: r.rejected,
    ),
)

# The process's own (in router mode too, unlabelled): requests proxied and in flight, the lifecycle state.
PROCESS_FAMILIES: tuple[Family[Metrics], ...] = (
    Family(
        "proxied_requests",
        "Requests proxied to llama-server, by status",
        COUNTER,
        lambda m: m.requests_by_status(),
        "status",
    ),
    Family(
        "attribution_lines_dropped",
        "Requests whose Claude Code attribution line was dropped from the system prompt (one opening for all sessions)",
        COUNTER,
        lambda m: m.attribution_lines_dropped(),
    ),
    Family("requests_in_flight", "Requests being proxied now", GAUGE, lambda m: m.requests_in_flight()),
    Family(
        "state",
        "Lifecycle state (1 for the current one)",
        GAUGE,
        lambda m: [(name, 1 if m.state() == name else 0) for name in STATES],  # in the lifecycle's order
        "state",
    ),
)


def family(spec: Family[Source], source: Source) -> Metric | None:
    """One family of the table as prometheus-client's object; None for an INFO with nothing to say."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    name, value = PREFIX + spec.name, spec.get(source)
    if spec.type is Type.HISTOGRAM:
        assert isinstance(value, Histogram)
        return HistogramMetricFamily(name, spec.help, buckets=value.cumulative(), sum_value=value.total)
    if spec.type is Type.INFO:
        assert isinstance(value, Mapping)
        if not value:
            return None
        labels = sorted(value)
        info = GaugeMetricFamily(name, spec.help, labels=labels)
        info.add_metric([str(value[k]) for k in labels], 1)
        return info
    kind = CounterMetricFamily if spec.type is Type.COUNTER else GaugeMetricFamily
    out = kind(name, spec.help, labels=[spec.label] if spec.label else None)
    if isinstance(value, (int, float)):
        out.add_metric([], value)
        return out
    assert not isinstance(value, Histogram)
    pairs: Iterable[tuple[Any, float]] = sorted(value.items()) if isinstance(value, Mapping) else value
    for key, sample in pairs:
        out.add_metric([str(key)], sample)
    return out


def families(table: Iterable[Family[Source]], source: Source) -> Iterator[Metric]:
    """A table's families, in its order."""
    for spec in table:
        out = family(spec, source)
        if out is not None:
            yield out


def model_families(m: Metrics) -> Iterator[Metric]:
    """What one model's counters say, the shared tier's with them."""
    yield from families(MODEL_FAMILIES, m)
    remote = m.remote()
    if remote is not None:
        yield from families(REMOTE_FAMILIES, remote)


def labelled(models: dict[str, Metrics]) -> Iterator[Metric]:
    """Each model's families merged into one per name, every sample with its model's label."""
    from prometheus_client.core import Metric

    merged: dict[str, Metric] = {}
    for name, metrics in sorted(models.items()):
        for one in model_families(metrics):
            out = merged.get(one.name)
            if out is None:
                out = merged[one.name] = Metric(one.name, one.documentation, one.type, one.unit)
            for sample in one.samples:
                out.add_sample(sample.name, {"model": name, **sample.labels}, sample.value)
    yield from merged.values()


class _Collector:
    """prometheus-client's view of one Metrics: read at each scrape, so the counters stay plain attributes."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        """The model's families (a router's: each model's, labelled `model`), then the process's own."""
        models = self.metrics.models()
        yield from labelled(models) if models else model_families(self.metrics)
        yield from families(PROCESS_FAMILIES, self.metrics)


def render(metrics: Metrics) -> tuple[bytes, str]:
    """The exposition text and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics))
    return generate_latest(registry), CONTENT_TYPE_LATEST
