"""KV pool metrics on /metrics: SchedulerStats with "pool:<tier>:<name>" totals and histogram
samples go through ServerMetrics.observe_step and come out as `pdkv:kv_pool_*` families with a
tier label (counters grow by deltas, gauges follow the value, down too); unknown pool names
are not exported and do not break the P2P keys."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdkv.sched.output import SchedulerStats
from pdkv.serve.metrics import POOL_COUNTERS, POOL_GAUGES, ServerMetrics


def _stats(kv: dict[str, float], obs: dict[str, list[float]] | None = None) -> SchedulerStats:
    return SchedulerStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=8,
                          num_preemptions=0, kv_transfer=kv, kv_observations=obs)


def _samples(m: ServerMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def _get(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_pool_counters_gauges_failures_and_histograms():
    m = ServerMetrics("smollm2")
    step1 = {
        "pool:dram:lookups": 4.0, "pool:dram:hits": 3.0, "pool:dram:bytes_read": 1000.0,
        "pool:disk:chunks_written": 2.0, "pool:disk:failures_io": 1.0,
        "pool:redis:failures_timeout": 2.0, "pool:dram:bytes_in_use": 5000.0,
        "pool:all:save_queue_depth": 3.0, "pool:all:saves": 5.0, "pool:all:hit_tokens": 512.0,
        "kv_bytes_received": 10.0,
    }
    obs1 = {"pool:dram:load_seconds": [0.002, 0.004], "pool:disk:save_seconds": [0.03]}
    m.observe_step([], _stats(step1, obs1), 0.0)
    step2 = dict(step1)
    step2.update({"pool:dram:lookups": 10.0, "pool:disk:failures_io": 3.0,
                  "pool:dram:bytes_in_use": 1200.0,  # evictions: the gauge goes down
                  "pool:all:save_queue_depth": 0.0, "kv_bytes_received": 25.0})
    m.observe_step([], _stats(step2, {"pool:dram:load_seconds": [0.5]}), 1.0)

    s = _samples(m)
    assert _get(s, "pdkv:kv_pool_lookups_total", tier="dram") == 10.0
    assert _get(s, "pdkv:kv_pool_hits_total", tier="dram") == 3.0
    assert _get(s, "pdkv:kv_pool_bytes_read_total", tier="dram") == 1000.0
    assert _get(s, "pdkv:kv_pool_chunks_written_total", tier="disk") == 2.0
    assert _get(s, "pdkv:kv_pool_saves_total", tier="all") == 5.0
    assert _get(s, "pdkv:kv_pool_hit_tokens_total", tier="all") == 512.0
    assert _get(s, "pdkv:kv_pool_failures_total", tier="disk", kind="io") == 3.0
    assert _get(s, "pdkv:kv_pool_failures_total", tier="redis", kind="timeout") == 2.0
    assert _get(s, "pdkv:kv_pool_bytes_in_use", tier="dram") == 1200.0
    assert _get(s, "pdkv:kv_pool_save_queue_depth", tier="all") == 0.0
    assert _get(s, "pdkv:kv_pool_load_seconds_count", tier="dram") == 3.0
    assert _get(s, "pdkv:kv_pool_load_seconds_sum", tier="dram") == pytest.approx(0.506)
    assert _get(s, "pdkv:kv_pool_load_seconds_bucket", tier="dram", le="0.005") == 2.0
    assert _get(s, "pdkv:kv_pool_save_seconds_count", tier="disk") == 1.0
    # The P2P keys still work beside the pool's.
    assert _get(s, "pdkv:kv_transfer_bytes_received_total") == 25.0


def test_every_documented_pool_name_is_exported():
    m = ServerMetrics("smollm2")
    kv = {f"pool:mooncake:{name}": 7.0 for name in [*POOL_COUNTERS, *POOL_GAUGES]}
    m.observe_step([], _stats(kv), 0.0)
    s = _samples(m)
    for name in POOL_COUNTERS:
        assert _get(s, f"pdkv:kv_pool_{name}_total", tier="mooncake") == 7.0, name
    for name in POOL_GAUGES:
        assert _get(s, f"pdkv:kv_pool_{name}", tier="mooncake") == 7.0, name


def test_unknown_or_malformed_pool_keys_are_not_exported_and_do_not_crash():
    m = ServerMetrics("smollm2")
    kv = {"pool:dram:brand_new_counter": 3.0, "pool:dram": 1.0, "pool:::": 1.0,
          "pool:dram:failures_": 1.0, "pool:dram:lookups": 2.0, "lease_expirations": 1.0}
    obs = {"pool:dram:other_seconds": [0.1], "pool:load_seconds": [0.1], "p2p:x": [1.0]}
    m.observe_step([], _stats(kv, obs), 0.0)
    kv["pool:dram:brand_new_counter"] = 1.0  # goes down: still ignored
    m.observe_step([], _stats(kv), 1.0)
    text = m.render().decode()
    assert "brand_new_counter" not in text and "other_seconds" not in text
    s = _samples(m)
    assert _get(s, "pdkv:kv_pool_lookups_total", tier="dram") == 2.0
    assert _get(s, "pdkv:kv_lease_expirations_total") == 1.0
    assert not any(name == "pdkv:kv_pool_failures_total" for name, _ in s)
