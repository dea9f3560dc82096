"""Prometheus metrics of KV movement: P/D transfer, KV pool tiers, CPU offload (`pdkv:` prefix).

Fed by the cumulative dict `SchedulerStats.kv_transfer` and the histogram samples
`SchedulerStats.transfer_seconds` / `kv_observations` (the connectors' reports); every metric has
the labels of ServerMetrics (`model_name`, `engine`) first.

P/D (P2PConnector): keys "kv_bytes_received", "kv_bytes_sent", "lease_expirations" and
"kv_load_failures_<policy>" become `pdkv:kv_transfer_bytes_received`, `..._sent`,
`pdkv:kv_lease_expirations` and `pdkv:kv_load_failures{policy}` counters; each pull duration is a
`pdkv:kv_transfer_seconds` sample. Push mode (issue 29): the PUSH_COUNTERS keys become
`pdkv:<key>` counters (P: bytes pushed, writes, failed pushes; D: refused writes, windows whose
lease passed).

KV pool (pdkv/kvpool, through the connector's reports): keys "pool:<tier>:<name>" and histogram
samples "pool:<tier>:load_seconds" / "pool:<tier>:save_seconds". They are exported as
`pdkv:kv_pool_<name>{tier}` counters (POOL_COUNTERS), gauges (POOL_GAUGES: the cumulative sum of
deltas is the current value, so they may go down), `pdkv:kv_pool_failures{tier,kind}` for
"failures_<kind>", and histograms `pdkv:kv_pool_load_seconds{tier}` /
`pdkv:kv_pool_save_seconds{tier}`. A pool key with another name is not exported (logged once at
debug level): a counter cannot carry a value that may go down, and a name with unknown meaning
gets no metric until it is added here.

CPU offload (OffloadingConnector): keys "offload:<name>" are exported as `pdkv:kv_offload_<name>`
counters (OFFLOAD_COUNTERS) and gauges (OFFLOAD_GAUGES, the cumulative sum of deltas is the
current value); other "offload:" names are not exported. With worker processes (TP / DCP) the
worker-side values (OFFLOAD_RANK_NAMES) are the sum over ranks, and each rank's own keys
"offload:rank<r>:<name>" are exported as `pdkv:kv_offload_rank_<name>{rank="<r>"}`.

KV cache events (pdkv.kv_events, `--kv-events-config`): the publisher's own counters, read at
render time, as `pdkv:kv_events_<name>` counters (KV_EVENT_COUNTERS).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from pdkv.kv_events.base import KVEventCounters
from pdkv.sched.output import SchedulerStats

logger = logging.getLogger(__name__)

# KV pool counters by name (`pdkv:kv_pool_<name>`, exposed with the `_total` suffix).
POOL_COUNTERS: dict[str, str] = {
    "lookups": "Chunk keys looked up in the KV pool",
    "hits": "Chunk keys found in the KV pool",
    "chunks_read": "Chunks read from the KV pool",
    "bytes_read": "Bytes read from the KV pool",
    "chunks_written": "Chunks written to the KV pool",
    "bytes_written": "Bytes written to the KV pool",
    "evictions": "Chunks evicted from the KV pool",
    "skipped": "KV pool accesses skipped while a tier is down",
    "save_drops": "KV pool saves dropped (save queue full)",
    "saves": "KV pool saves accepted",
    "save_skips": "Chunk saves skipped because the KV pool already held the chunk",
    "hit_tokens": "Prompt tokens found in the KV pool",
    "lookup_tokens": "Prompt tokens looked up in the KV pool",
    "lookup_timeouts": "KV pool lookups that passed lookup_timeout_s (a miss)",
    "rank_misses": "Chunks some TP/DCP ranks held and others did not (a miss for every rank)",
    "rank_lookup_timeouts": "KV pool lookups a TP/DCP rank did not answer in time (a miss)",
}
# KV pool gauges by name (`pdkv:kv_pool_<name>`).
POOL_GAUGES: dict[str, str] = {
    "bytes_in_use": "Bytes the KV pool holds",
    "save_queue_depth": "KV pool saves queued, not yet written",
}
# CPU offload counters by name (`pdkv:kv_offload_<name>`, exposed with the `_total` suffix).
OFFLOAD_COUNTERS: dict[str, str] = {
    "bytes_d2h": "Bytes copied from the KV cache to the host store (device to host)",
    "bytes_h2d": "Bytes copied from the host store into the KV cache (host to device)",
    "copies_d2h": "Blocks copied to the host store",
    "copies_h2d": "Blocks copied back from the host store",
    "exposed_wait_seconds": "Time steps waited for offload copies before their forward pass (s)",
    "recompute_tokens_avoided": "Tokens loaded from the host store instead of recomputed",
    "hits": "Blocks found in the host store and loaded",
    "reuse_skips": (
        "Evicted blocks not copied because the host store already held them (mode reuse)"),
    "store_skips": "Evicted blocks not copied for lack of a free host slot",
    "host_evictions": "Blocks dropped from the host store (LRU)",
}
# CPU offload gauges by name (`pdkv:kv_offload_<name>`).
OFFLOAD_GAUGES: dict[str, str] = {
    "queue_depth": "Offload block copies queued for the last step",
}
# Worker-side offload values (each rank's host copies) also exported per rank
# (`pdkv:kv_offload_rank_<name>{rank}`; the engine-wide series is their sum).
OFFLOAD_RANK_NAMES = ("bytes_d2h", "bytes_h2d", "copies_d2h", "copies_h2d",
                      "exposed_wait_seconds", "queue_depth")
_OFFLOAD_RANK_PREFIX = "rank"
# kv_load_failure_policy values (pre-created so the family has samples from the start).
LOAD_FAILURE_POLICIES = ("recompute", "fail")
_POOL_FAILURE_PREFIX = "failures_"
_POOL_HISTOGRAMS = {"load_seconds": "load", "save_seconds": "save"}

# Seconds; fine-grained at the low end (a pull of a few blocks takes milliseconds).
TRANSFER_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)


class KVTransferMetrics:
    """Collectors of KV movement in `registry`, labelled `labelnames` = `labelvalues` first.

    `observe` runs on the engine loop thread under ServerMetrics' lock.

    Args:
        registry: where the collectors are registered.
        labelnames: common label names (e.g. ["model_name", "engine"]).
        labelvalues: their values for this server.
    """

    def __init__(
        self, registry: CollectorRegistry, labelnames: list[str], labelvalues: list[str]
    ) -> None:
        r, labels, values = registry, labelnames, labelvalues
        self._values = values

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        self.bytes_received = counter(
            "pdkv:kv_transfer_bytes_received", "KV bytes pulled from prefill engines"
        )
        self.bytes_sent = counter(
            "pdkv:kv_transfer_bytes_sent",
            "KV bytes decode engines read from this engine (as they report)",
        )
        self.transfer_time = Histogram(
            "pdkv:kv_transfer_seconds",
            "Duration of one KV pull (s)",
            labels,
            registry=r,
            buckets=TRANSFER_BUCKETS,
        ).labels(*values)
        self.waiting_remote = gauge(
            "pdkv:num_requests_waiting_for_remote_kv", "Requests waiting for remote KV"
        )
        self.blocks_held = gauge(
            "pdkv:num_blocks_held_for_remote", "Blocks held until a remote engine reads them"
        )
        self.lease_expirations = counter(
            "pdkv:kv_lease_expirations",
            "Requests whose held blocks were freed at lease expiry (never read)",
        )
        self.load_failures = Counter(
            "pdkv:kv_load_failures",
            "Failed KV loads by load-failure policy",
            labels + ["policy"],
            registry=r,
        )
        for policy in LOAD_FAILURE_POLICIES:
            self.load_failures.labels(*values, policy)
        self.push_counters = {key: counter(f"pdkv:{key}", doc)
                              for key, doc in PUSH_COUNTERS.items()}
        self._seen: dict[str, float] = {}
        pool_labels = labels + ["tier"]
        self.pool_counters = {
            name: Counter(f"pdkv:kv_pool_{name}", doc, pool_labels, registry=r)
            for name, doc in POOL_COUNTERS.items()
        }
        self.pool_gauges = {
            name: Gauge(f"pdkv:kv_pool_{name}", doc, pool_labels, registry=r)
            for name, doc in POOL_GAUGES.items()
        }
        self.pool_failures = Counter(
            "pdkv:kv_pool_failures", "KV pool failures by kind", pool_labels + ["kind"], registry=r
        )
        self.pool_histograms = {
            key: Histogram(f"pdkv:kv_pool_{key}", f"Duration of one KV pool chunk {verb} (s)",
                           pool_labels, registry=r, buckets=TRANSFER_BUCKETS)
            for key, verb in _POOL_HISTOGRAMS.items()
        }
        self._ignored: set[str] = set()
        self.offload_metrics: dict[str, Counter | Gauge] = {
            **{
                name: counter(f"pdkv:kv_offload_{name}", doc)
                for name, doc in OFFLOAD_COUNTERS.items()
            },
            **{name: gauge(f"pdkv:kv_offload_{name}", doc) for name, doc in OFFLOAD_GAUGES.items()},
        }
        offload_docs = {**OFFLOAD_COUNTERS, **OFFLOAD_GAUGES}
        self.offload_rank_metrics: dict[str, Counter | Gauge] = {
            name: (Gauge if name in OFFLOAD_GAUGES else Counter)(
                f"pdkv:kv_offload_rank_{name}", f"{offload_docs[name]}, of one worker rank",
                labels + ["rank"], registry=r)
            for name in OFFLOAD_RANK_NAMES
        }

    def observe(self, stats: SchedulerStats) -> None:
        """Record one step's KV stats (cumulative totals become counter increments)."""
        self.waiting_remote.set(stats.num_waiting_for_remote_kv)
        self.blocks_held.set(stats.num_blocks_held_for_remote)
        for key, total in (stats.kv_transfer or {}).items():
            if key.startswith("pool:"):
                self._observe_pool_value(key, total)
                continue
            if key.startswith("offload:"):
                self._observe_offload_value(key, total)
                continue
            delta = self._delta(key, total)
            if delta <= 0:
                continue
            if key == "kv_bytes_received":
                self.bytes_received.inc(delta)
            elif key == "kv_bytes_sent":
                self.bytes_sent.inc(delta)
            elif key == "lease_expirations":
                self.lease_expirations.inc(delta)
            elif key in self.push_counters:
                self.push_counters[key].inc(delta)
            elif key.startswith("kv_load_failures_"):
                self.load_failures.labels(*self._values, key.rsplit("_", 1)[1]).inc(delta)
        for seconds in stats.transfer_seconds or ():
            self.transfer_time.observe(seconds)
        for key, samples in (stats.kv_observations or {}).items():
            parts = key.split(":")
            hist = (
                self.pool_histograms.get(parts[2])
                if len(parts) == 3 and parts[0] == "pool"
                else None
            )
            if hist is None:
                self._ignore(key)
                continue
            child = hist.labels(*self._values, parts[1])
            for seconds in samples:
                child.observe(seconds)

    def _delta(self, key: str, total: float) -> float:
        """Increase of the cumulative value `key` since it was last seen (remembered if > 0)."""
        delta = total - self._seen.get(key, 0.0)
        if delta > 0:
            self._seen[key] = total
        return delta

    def _observe_pool_value(self, key: str, total: float) -> None:
        """One cumulative "pool:<tier>:<name>" value: a gauge is set to it, a counter grows by
        its increase since the last step."""
        parts = key.split(":")
        if len(parts) != 3 or not parts[1] or not parts[2]:
            self._ignore(key)
            return
        _, tier, name = parts
        if name in POOL_GAUGES:
            self.pool_gauges[name].labels(*self._values, tier).set(total)
            return
        if name in POOL_COUNTERS:
            child = self.pool_counters[name].labels(*self._values, tier)
        elif name.startswith(_POOL_FAILURE_PREFIX) and len(name) > len(_POOL_FAILURE_PREFIX):
            child = self.pool_failures.labels(*self._values, tier, name[len(_POOL_FAILURE_PREFIX):])
        else:
            self._ignore(key)
            return
        delta = self._delta(key, total)
        if delta > 0:
            child.inc(delta)

    def _observe_offload_value(self, key: str, total: float) -> None:
        """One cumulative "offload:<name>" or "offload:rank<r>:<name>" value: a gauge is set to
        it, a counter grows by its increase since the last step."""
        parts = key.split(":")
        metric: Counter | Gauge | None = None
        if len(parts) == 2:
            metric = self.offload_metrics.get(parts[1])
        elif (len(parts) == 3 and parts[1].startswith(_OFFLOAD_RANK_PREFIX)
              and parts[1][len(_OFFLOAD_RANK_PREFIX):].isdigit()
              and parts[2] in self.offload_rank_metrics):
            family = self.offload_rank_metrics[parts[2]]
            metric = family.labels(*self._values, parts[1][len(_OFFLOAD_RANK_PREFIX):])
        if metric is None:
            self._ignore(key)
            return
        if isinstance(metric, Gauge):  # the OFFLOAD_GAUGES names
            metric.set(total)
            return
        delta = self._delta(key, total)
        if delta > 0:
            metric.inc(delta)

    def _ignore(self, key: str) -> None:
        if key not in self._ignored:
            self._ignored.add(key)
            logger.debug("KV metric %r is not exported (unknown name)", key)


# Push mode (P2PConnector transfer_mode "push") counters: key -> help, exported as `pdkv:<key>`.
PUSH_COUNTERS: dict[str, str] = {
    "kv_bytes_pushed": "KV bytes this prefill engine wrote into decode engines' blocks (push)",
    "kv_push_writes": "Layer writes of KV blocks this prefill engine pushed",
    "kv_push_failures": "Pushes that failed (the decode engine's window then expires)",
    "kv_push_refused": "Pushed writes this decode engine refused (no open window, wrong nonce, "
                       "outside the window, partial layer or a second write)",
    "kv_push_window_expirations": "Write windows whose lease passed before every layer landed",
}


# KV event publisher counters (pdkv.kv_events.base.KVEventCounters field -> help), exported as
# `pdkv:kv_events_<field>` counters (`_total` suffix) while an engine publishes KV events.
KV_EVENT_COUNTERS: dict[str, str] = {
    "batches_published": "KV event batches sent on the publisher's PUB socket",
    "events_published": "KV cache events (block stored / removed / all cleared) sent",
    "batches_dropped": "KV event batches dropped (publisher queue full or send failed)",
    "replay_requests": "KV event replay requests answered",
    "replay_malformed": "Malformed KV event replay requests dropped",
    "events_dropped": "KV cache events dropped before a batch (the KV pool tiers' event queue "
                      "was full)",
}


class KVEventMetrics(Collector):
    """The KV event publisher's counters, read when /metrics is rendered (they live in the
    publisher; nothing is copied per step). No samples until `watch` names a reader.

    Args:
        labelnames: common label names (e.g. ["model_name", "engine"]).
        labelvalues: their values for this server.
    """

    def __init__(self, labelnames: list[str], labelvalues: list[str]) -> None:
        self._labels, self._values = labelnames, labelvalues
        self._read: Callable[[], KVEventCounters] | None = None

    def watch(self, read: Callable[[], KVEventCounters]) -> None:
        """Export `read()`'s counters from now on (the server, once, at start-up)."""
        self._read = read

    def collect(self) -> Iterator[Metric]:
        if self._read is None:
            return
        counters = self._read()
        for name, doc in KV_EVENT_COUNTERS.items():
            family = CounterMetricFamily(f"pdkv:kv_events_{name}", doc, labels=self._labels)
            family.add_metric(self._values, getattr(counters, name))
            yield family
