"""The proxy's own Prometheus metrics (`pdkv:proxy_` prefix), served at the proxy's /metrics.

Legs: "prefill" and "decode" in P/D mode, "whole" in colocated mode (the request goes whole to one
kv_both instance). Latencies are seconds from sending a leg to its last byte (a streamed leg ends
with its stream).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdkv.router.kv_subscriber import SubscriberCounters

LEG_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
"""Histogram buckets of a leg's latency (s)."""


class ProxyMetrics:
    """Collectors in their own registry (one per proxy app: no process-wide state).

    Metrics:
        pdkv:proxy_requests_total{backend, leg}: legs sent to each backend.
        pdkv:proxy_routing_decisions_total{policy, reason, leg}: decisions (reasons:
            `pdkv.router.policies.Decision`).
        pdkv:proxy_prefix_matched_tokens_total{backend}: prompt tokens the chosen backend held by
            the proxy's record (prefix_aware; matched chunks × chunk size).
        pdkv:proxy_prefill_legs_skipped_total: prefill legs not sent because the pool held the whole
            prompt (0 until the proxy can skip them).
        pdkv:proxy_errors_total{leg, kind}: failed legs; kind "unreachable" (502), "status" (the
            backend answered >= 500), "client" (the client's error: a backend's 4xx, or leg
            "proxy" for a request the proxy itself refused: bad body, unknown model), "stream"
            (the stream broke after it started), "bad_response", "unavailable" (503 before any
            leg: no healthy engine in the leg's pool).
        pdkv:proxy_leg_latency_seconds{leg}: leg latency histogram (s).
        pdkv:proxy_client_disconnects_total{phase}: clients that left before their response
            started, by what the proxy was doing: "before" (checks, routing), "prefill" (the
            prefill leg; its grant is released when P answers), "between" (after P answered),
            "decode" (a non-streamed decode leg or whole request).
        pdkv:proxy_backend_healthy{backend, role}: 1 while the proxy routes to the engine, 0
            while it is unhealthy (`pdkv.router.backend_health`).
        pdkv:proxy_kv_predictions_total{backend, outcome} (kv_aware, kv_aware_oracle): legs
            whose engine reported its prefix-cache hit; outcome "exact" (the prompt tokens the
            policy predicted the engine's own cache holds = the engine's hit), "over" (predicted
            more), "under" (predicted less). Wrong predictions = over + under.
        pdkv:proxy_kv_predicted_cached_tokens_total{backend}, ...reported_cached_tokens_total:
            those legs' predicted and engine-reported prefix-cache hit tokens.
        pdkv:proxy_kv_index_blocks{backend, medium}, pdkv:proxy_kv_events_<counter>_total
            {backend}: the KV event index's size and its subscriber's counters
            (`pdkv.router.kv_subscriber.SubscriberCounters`: batches and events received,
            replayed, replays asked, duplicates, gaps unfilled, restarts, malformed, foreign),
            while the proxy follows KV events (`watch_kv_events`).
    """

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "pdkv:proxy_requests", "Legs sent to each backend", ["backend", "leg"], registry=r
        )
        self.decisions = Counter(
            "pdkv:proxy_routing_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason", "leg"],
            registry=r,
        )
        self.matched_tokens = Counter(
            "pdkv:proxy_prefix_matched_tokens",
            "Prompt tokens the chosen backend held by the proxy's record",
            ["backend"],
            registry=r,
        )
        self.prefill_skipped = Counter(
            "pdkv:proxy_prefill_legs_skipped",
            "Prefill legs skipped because the pool held the whole prompt",
            registry=r,
        )
        self.errors = Counter(
            "pdkv:proxy_errors",
            "Failed legs, and requests the proxy refused (leg proxy), by leg and kind",
            ["leg", "kind"],
            registry=r,
        )
        self.latency = Histogram(
            "pdkv:proxy_leg_latency_seconds",
            "Leg latency, send to last byte (s)",
            ["leg"],
            registry=r,
            buckets=LEG_BUCKETS,
        )
        self.client_disconnects = Counter(
            "pdkv:proxy_client_disconnects",
            "Clients that left before their response started, by the proxy's phase",
            ["phase"],
            registry=r,
        )
        self.backend_healthy = Gauge(
            "pdkv:proxy_backend_healthy",
            "1 while the proxy routes to the backend, 0 while it is unhealthy",
            ["backend", "role"],
            registry=r,
        )

        self.kv_predictions = Counter(
            "pdkv:proxy_kv_predictions",
            "Legs whose engine reported its prefix-cache hit, by the routing prediction's outcome",
            ["backend", "outcome"],
            registry=r,
        )
        self.kv_predicted_tokens = Counter(
            "pdkv:proxy_kv_predicted_cached_tokens",
            "Prompt tokens the routing policy predicted the engine's prefix cache holds",
            ["backend"],
            registry=r,
        )
        self.kv_reported_tokens = Counter(
            "pdkv:proxy_kv_reported_cached_tokens",
            "Prompt tokens the engine reported as hits of its own prefix cache",
            ["backend"],
            registry=r,
        )

    def watch_kv_events(self, read: Callable[[], Mapping[str, KVEventsState]]) -> None:
        """Export the KV event index's size and the subscriber's counters, read from `read`
        (backend URL -> its state) each time /metrics is rendered."""
        self.registry.register(_KVEventsCollector(read))

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)



KVEventsState = tuple[SubscriberCounters, Mapping[str, int]]
"""One backend's subscriber counters and its index size (medium -> block hashes held)."""


class _KVEventsCollector(Collector):
    def __init__(self, read: Callable[[], Mapping[str, KVEventsState]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        states = self._read()
        size = GaugeMetricFamily("pdkv:proxy_kv_index_blocks",
                                 "Block hashes the KV event index holds per backend and medium",
                                 labels=["backend", "medium"])
        counters: dict[str, CounterMetricFamily] = {}
        for url, (counts, blocks) in states.items():
            for medium, n in blocks.items():
                size.add_metric([url, medium], n)
            for name, value in asdict(counts).items():
                family = counters.get(name)
                if family is None:
                    family = counters[name] = CounterMetricFamily(
                        f"pdkv:proxy_kv_events_{name}",
                        f"KV event subscriber: {name.replace('_', ' ')} (per backend)",
                        labels=["backend"])
                family.add_metric([url], value)
        yield size
        yield from counters.values()
