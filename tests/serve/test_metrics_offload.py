"""CPU offload metrics on /metrics: "offload:<name>" totals in SchedulerStats.kv_transfer come
out as `pdkv:kv_offload_*` counters (grow by deltas) and gauges (follow the value, down too);
a TP/DCP rank's "offload:rank<r>:<name>" as `pdkv:kv_offload_rank_*{rank}`; unknown offload
names are not exported."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdkv.sched.output import SchedulerStats
from pdkv.serve.metrics import OFFLOAD_COUNTERS, OFFLOAD_GAUGES, ServerMetrics
from pdkv.serve.metrics_kv import OFFLOAD_RANK_NAMES


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


def _get_labelled(m: ServerMetrics, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(m.render().decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def test_per_rank_offload_values_get_a_rank_label():
    """A TP/DCP engine's worker halves report "offload:rank<r>:<name>" beside the engine-wide
    sum: `pdkv:kv_offload_rank_<name>{rank}` per rank, the engine-wide series unchanged; a
    scheduler-side name or a malformed rank is not exported per rank."""
    m = ServerMetrics("smollm2")
    step = {"offload:bytes_d2h": 3000.0, "offload:rank0:bytes_d2h": 1500.0,
            "offload:rank1:bytes_d2h": 1500.0, "offload:rank1:queue_depth": 2.0,
            "offload:rank0:hits": 1.0, "offload:rankx:bytes_d2h": 9.0,
            "offload:rank:bytes_d2h": 9.0, "offload:0:bytes_d2h": 9.0}
    m.observe_step([], _stats(step), 0.0)
    m.observe_step([], _stats(dict(step, **{"offload:rank1:bytes_d2h": 2000.0})), 1.0)
    assert _get(m, "pdkv:kv_offload_bytes_d2h_total") == 3000.0
    assert _get_labelled(m, "pdkv:kv_offload_rank_bytes_d2h_total", rank="0") == 1500.0
    assert _get_labelled(m, "pdkv:kv_offload_rank_bytes_d2h_total", rank="1") == 2000.0
    assert _get_labelled(m, "pdkv:kv_offload_rank_queue_depth", rank="1") == 2.0
    text = m.render().decode()
    assert "kv_offload_rank_hits" not in text
    assert 'rank="x"' not in text and 'rank=""' not in text
    for name in OFFLOAD_RANK_NAMES:
        assert f"pdkv:kv_offload_rank_{name}" in text, name
