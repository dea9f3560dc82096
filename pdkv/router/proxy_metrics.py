"""The proxy's own Prometheus metrics (`pdkv:proxy_` prefix), served at the proxy's /metrics.

Legs: "prefill" and "decode" in P/D mode, "whole" in colocated mode (the request goes whole to one
kv_both instance). Latencies are seconds from sending a leg to its last byte (a streamed leg ends
with its stream).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)

