"""Prometheus metrics of one server (prometheus-client, `pdkv:` prefix, own registry).

Names follow vLLM's `vllm:` metrics where one exists (time_to_first_token_seconds,
inter_token_latency_seconds, e2e_request_latency_seconds, request_queue_time_seconds,
request_prefill_time_seconds, num_requests_running/waiting, kv_cache_usage_perc,
prefix_cache_queries/hits, prompt_tokens, generation_tokens).

KV pool (pdkv/kvpool, through the connector's reports): the engine's cumulative dict
`SchedulerStats.kv_transfer` carries keys "pool:<tier>:<name>" and `kv_observations` carries
histogram samples "pool:<tier>:load_seconds" / "pool:<tier>:save_seconds". They are exported as
`pdkv:kv_pool_<name>{tier}` counters (POOL_COUNTERS), gauges (POOL_GAUGES: the cumulative sum of
deltas is the current value, so they may go down), `pdkv:kv_pool_failures{tier,kind}` for
"failures_<kind>", and histograms `pdkv:kv_pool_load_seconds{tier}` /
`pdkv:kv_pool_save_seconds{tier}`. A pool key with another name is not exported (logged once at
debug level): a counter cannot carry a value that may go down, and a name with unknown meaning
gets no metric until it is added here.

CPU offload (OffloadingConnector): keys "offload:<name>" in `SchedulerStats.kv_transfer` are
exported as `pdkv:kv_offload_<name>` counters (OFFLOAD_COUNTERS) and gauges (OFFLOAD_GAUGES, the
cumulative sum of deltas is the current value); other "offload:" names are not exported.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdkv.outputs import RequestOutput
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
    "hit_tokens": "Prompt tokens found in the KV pool",
    "lookup_tokens": "Prompt tokens looked up in the KV pool",
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
    "reuse_skips": "Evicted blocks not copied because the host store already held them (mode reuse)",
    "store_skips": "Evicted blocks not copied for lack of a free host slot",
    "host_evictions": "Blocks dropped from the host store (LRU)",
}
# CPU offload gauges by name (`pdkv:kv_offload_<name>`).
OFFLOAD_GAUGES: dict[str, str] = {
    "queue_depth": "Offload block copies queued for the last step",
}
_POOL_FAILURE_PREFIX = "failures_"
_POOL_HISTOGRAMS = {"load_seconds": "load", "save_seconds": "save"}

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)


class ServerMetrics:
    """Collectors plus the per-request state needed to observe inter-token latency.

    `observe_step` is the AsyncLLM step observer (engine loop thread); `render` is called by the
    /metrics handler (event loop thread).

    Args:
        model_name: value of the `model_name` label.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name

        def hist(name: str, doc: str) -> Any:
            return Histogram(name, doc, labels, registry=r, buckets=_LATENCY_BUCKETS).labels(model_name)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        self.ttft = hist("pdkv:time_to_first_token_seconds", "Time to first token (s)")
        self.itl = hist("pdkv:inter_token_latency_seconds", "Gap between output tokens (s)")
        self.e2el = hist("pdkv:e2e_request_latency_seconds", "Request end-to-end latency (s)")
        self.queue_time = hist("pdkv:request_queue_time_seconds", "Arrival to first scheduling (s)")
        self.prefill_time = hist("pdkv:request_prefill_time_seconds", "First scheduling to first token (s)")
        self.running = gauge("pdkv:num_requests_running", "Requests running")
        self.waiting = gauge("pdkv:num_requests_waiting", "Requests waiting")
        self.kv_usage = gauge("pdkv:kv_cache_usage_perc", "KV cache usage (fraction of blocks in use)")
        self.free_blocks = gauge("pdkv:num_free_blocks", "Free KV cache blocks")
        self.prefix_queries = counter("pdkv:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("pdkv:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prompt_tokens = counter("pdkv:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("pdkv:generation_tokens", "Generated tokens")
        self.preemptions = counter("pdkv:num_preemptions", "Requests preempted")
        self.kv_bytes_received = counter("pdkv:kv_transfer_bytes_received", "KV bytes pulled from prefill engines")
        self.kv_bytes_sent = counter(
            "pdkv:kv_transfer_bytes_sent", "KV bytes decode engines read from this engine (as they report)"
        )
        self.kv_transfer_time = hist("pdkv:kv_transfer_seconds", "Duration of one KV pull (s)")
        self.waiting_remote = gauge("pdkv:num_requests_waiting_for_remote_kv", "Requests waiting for remote KV")
        self.blocks_held = gauge("pdkv:num_blocks_held_for_remote", "Blocks held until a remote engine reads them")
        self.lease_expirations = counter(
            "pdkv:kv_lease_expirations", "Requests whose held blocks were freed at lease expiry (never read)"
        )
        self.load_failures = Counter(
            "pdkv:kv_load_failures", "Failed KV loads by load-failure policy", labels + ["policy"], registry=r
        )
        self._seen_kv: dict[str, float] = {}
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
                           pool_labels, registry=r, buckets=_LATENCY_BUCKETS)
            for key, verb in _POOL_HISTOGRAMS.items()
        }
        self._ignored_pool_keys: set[str] = set()
        self.offload_metrics: dict[str, Any] = {
            **{name: counter(f"pdkv:kv_offload_{name}", doc) for name, doc in OFFLOAD_COUNTERS.items()},
            **{name: gauge(f"pdkv:kv_offload_{name}", doc) for name, doc in OFFLOAD_GAUGES.items()},
        }
        self.request_success = Counter(
            "pdkv:request_success", "Finished requests by reason", labels + ["finished_reason"], registry=r
        )
        self._last_token: dict[str, float] = {}
        self._seen_prefix = (0, 0)
        self._seen_preemptions = 0
        self._lock = threading.Lock()

    def observe_step(self, outputs: list[RequestOutput], stats: SchedulerStats, now: float) -> None:
        """Record one engine step (called from the engine loop thread)."""
        with self._lock:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.kv_usage.set(stats.kv_cache_usage)
            self.free_blocks.set(stats.num_free_blocks)
            if stats.num_preemptions > self._seen_preemptions:
                self.preemptions.inc(stats.num_preemptions - self._seen_preemptions)
                self._seen_preemptions = stats.num_preemptions
            queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
            if queries > self._seen_prefix[0]:
                self.prefix_queries.inc(queries - self._seen_prefix[0])
            if hits > self._seen_prefix[1]:
                self.prefix_hits.inc(hits - self._seen_prefix[1])
            self._seen_prefix = (queries, hits)
            self._observe_kv(stats)
            for out in outputs:
                self._observe_output(out, now)

    def _observe_kv(self, stats: SchedulerStats) -> None:
        self.waiting_remote.set(stats.num_waiting_for_remote_kv)
        self.blocks_held.set(stats.num_blocks_held_for_remote)
        for key, total in (stats.kv_transfer or {}).items():
            if key.startswith("pool:"):
                self._observe_pool_value(key, total)
                continue
            if key.startswith("offload:"):
                self._observe_offload_value(key, total)
                continue
            delta = total - self._seen_kv.get(key, 0.0)
            if delta <= 0:
                continue
            self._seen_kv[key] = total
            if key == "kv_bytes_received":
                self.kv_bytes_received.inc(delta)
            elif key == "kv_bytes_sent":
                self.kv_bytes_sent.inc(delta)
            elif key == "lease_expirations":
                self.lease_expirations.inc(delta)
            elif key.startswith("kv_load_failures_"):
                self.load_failures.labels(self.model_name, key.rsplit("_", 1)[1]).inc(delta)
        for seconds in stats.transfer_seconds or ():
            self.kv_transfer_time.observe(seconds)
        for key, samples in (stats.kv_observations or {}).items():
            parts = key.split(":")
            hist = self.pool_histograms.get(parts[2]) if len(parts) == 3 and parts[0] == "pool" else None
            if hist is None:
                self._ignore_pool_key(key)
                continue
            child = hist.labels(self.model_name, parts[1])
            for seconds in samples:
                child.observe(seconds)

    def _observe_pool_value(self, key: str, total: float) -> None:
        """One cumulative "pool:<tier>:<name>" value: a gauge is set to it, a counter grows by
        its increase since the last step."""
        parts = key.split(":")
        if len(parts) != 3 or not parts[1] or not parts[2]:
            self._ignore_pool_key(key)
            return
        _, tier, name = parts
        if name in POOL_GAUGES:
            self.pool_gauges[name].labels(self.model_name, tier).set(total)
            return
        if name in POOL_COUNTERS:
            child = self.pool_counters[name].labels(self.model_name, tier)
        elif name.startswith(_POOL_FAILURE_PREFIX) and len(name) > len(_POOL_FAILURE_PREFIX):
            child = self.pool_failures.labels(self.model_name, tier, name[len(_POOL_FAILURE_PREFIX):])
        else:
            self._ignore_pool_key(key)
            return
        delta = total - self._seen_kv.get(key, 0.0)
        if delta <= 0:
            return
        self._seen_kv[key] = total
        child.inc(delta)

    def _observe_offload_value(self, key: str, total: float) -> None:
        """One cumulative "offload:<name>" value: a gauge is set to it, a counter grows by its
        increase since the last step."""
        name = key[len("offload:"):]
        metric = self.offload_metrics.get(name)
        if metric is None:
            self._ignore_pool_key(key)
            return
        if name in OFFLOAD_GAUGES:
            metric.set(total)
            return
        delta = total - self._seen_kv.get(key, 0.0)
        if delta <= 0:
            return
        self._seen_kv[key] = total
        metric.inc(delta)

    def _ignore_pool_key(self, key: str) -> None:
        if key not in self._ignored_pool_keys:
            self._ignored_pool_keys.add(key)
            logger.debug("KV pool metric %r is not exported (unknown name)", key)

    def _observe_output(self, out: RequestOutput, now: float) -> None:
        rid = out.request_id
        n_new = len(out.outputs[0].delta_token_ids)
        m = out.metrics
        if n_new:
            self.generation_tokens.inc(n_new)
            last = self._last_token.get(rid)
            if last is None:
                if m is not None and m.ttft is not None:
                    self.ttft.observe(m.ttft)
                    if m.queue_time is not None:
                        self.queue_time.observe(m.queue_time)
                    if m.first_scheduled_time is not None and m.first_token_time is not None:
                        self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
            else:
                self.itl.observe(now - last)
            self._last_token[rid] = now
        if out.finished:
            self._last_token.pop(rid, None)
            reason = out.outputs[0].finish_reason or "abort"
            self.request_success.labels(self.model_name, reason).inc()
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            if m is not None and m.e2el is not None:
                self.e2el.observe(m.e2el)

    def render(self) -> bytes:
        """Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
