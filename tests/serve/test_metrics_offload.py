"""CPU offload metrics on /metrics: "offload:<name>" totals in SchedulerStats.kv_transfer come
out as `pdkv:kv_offload_*` counters (grow by deltas) and gauges (follow the value, down too);
unknown offload names are not exported."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdkv.sched.output import SchedulerStats
from pdkv.serve.metrics import OFFLOAD_COUNTERS, OFFLOAD_GAUGES, ServerMetrics


def _stats(kv: dict[str, float]) -> SchedulerStats:
    return SchedulerStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=8,
                          num_preemptions=0, kv_transfer=kv)


def _get(m: ServerMetrics, name: str) -> float | None:
    for family in text_string_to_metric_families(m.render().decode()):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


def test_offload_counters_and_gauges():
    m = ServerMetrics("smollm2")
    step1 = {"offload:copies_d2h": 3.0, "offload:bytes_d2h": 3000.0, "offload:hits": 2.0,
             "offload:exposed_wait_seconds": 0.25, "offload:queue_depth": 5.0,
             "offload:brand_new": 1.0, "kv_bytes_received": 10.0}
    m.observe_step([], _stats(step1), 0.0)
    step2 = dict(step1, **{"offload:copies_d2h": 7.0, "offload:queue_depth": 0.0,
                           "offload:recompute_tokens_avoided": 64.0})
    m.observe_step([], _stats(step2), 1.0)
    assert _get(m, "pdkv:kv_offload_copies_d2h_total") == 7.0
    assert _get(m, "pdkv:kv_offload_bytes_d2h_total") == 3000.0
    assert _get(m, "pdkv:kv_offload_hits_total") == 2.0
    assert _get(m, "pdkv:kv_offload_exposed_wait_seconds_total") == 0.25
    assert _get(m, "pdkv:kv_offload_recompute_tokens_avoided_total") == 64.0
    assert _get(m, "pdkv:kv_offload_queue_depth") == 0.0
    assert "brand_new" not in m.render().decode()
    assert _get(m, "pdkv:kv_transfer_bytes_received_total") == 10.0


def test_every_documented_offload_name_is_exported():
    m = ServerMetrics("smollm2")
    m.observe_step(
        [], _stats({f"offload:{n}": 7.0 for n in [*OFFLOAD_COUNTERS, *OFFLOAD_GAUGES]}), 0.0
    )
    for name in OFFLOAD_COUNTERS:
        assert _get(m, f"pdkv:kv_offload_{name}_total") == 7.0, name
    for name in OFFLOAD_GAUGES:
        assert _get(m, f"pdkv:kv_offload_{name}") == 7.0, name
