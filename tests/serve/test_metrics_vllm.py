"""vLLM's metric set on /metrics (pdkv/serve/metrics.py), driven by hand-made RequestOutputs:
names, types, buckets and labels as vLLM's PrometheusStatLogger; per-request histograms from
RequestMetrics; prompt tokens split by source so that P/D sums correctly."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pdkv.sched.output import SchedulerStats
from pdkv.serve.metrics import (
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    ServerMetrics,
    token_buckets,
)

# vLLM's families and types (vllm/v1/metrics/loggers.py), under the pdkv: prefix.
VLLM_FAMILIES = {
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge",
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    "num_preemptions": "counter",
    "prompt_tokens": "counter",
    "prompt_tokens_by_source": "counter",
    "prompt_tokens_cached": "counter",
    "generation_tokens": "counter",
    "request_success": "counter",
    "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram",
    "request_max_num_generation_tokens": "histogram",
    "request_params_max_tokens": "histogram",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "time_per_output_token_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram",
}


def _stats(**kw: float) -> SchedulerStats:
    base = dict(
        num_running=1, num_waiting=0, kv_cache_usage=0.25, num_free_blocks=48, num_preemptions=0
    )
    return SchedulerStats(**{**base, **kw})  # type: ignore[arg-type]


def _out(rid: str, n_prompt: int, new: list[int], so_far: list[int], m: RequestMetrics, *,
         cached: int = 0, reason: str | None = None) -> RequestOutput:
    comp = CompletionOutput(
        index=0, text="", token_ids=so_far, finish_reason=reason, delta_token_ids=new
    )
    return RequestOutput(
        request_id=rid,
        prompt=None,
        prompt_token_ids=list(range(n_prompt)),
        outputs=[comp],
        finished=reason is not None,
        num_cached_tokens=cached,
        metrics=m,
    )


def _metrics(**kw: float) -> RequestMetrics:
    base = dict(
        arrival_time=100.0,
        first_scheduled_time=None,
        first_token_time=None,
        last_token_time=None,
        finished_time=None,
    )
    return RequestMetrics(**{**base, **kw})  # type: ignore[arg-type]


def _samples(m: ServerMetrics) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _value(samples: dict[str, list], name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples.get(name, [])
        if all(s.labels.get(k) == v for k, v in labels.items())
    )


def _buckets(samples: dict[str, list], name: str) -> list[float]:
    return [float(s.labels["le"]) for s in samples[name + "_bucket"] if s.labels["le"] != "+Inf"]


def _run_request(
    m: ServerMetrics,
    rid: str,
    n_prompt: int,
    cached: int,
    external: int,
    max_tokens: int,
    token_times: list[float],
    kv_wait: float = 0.0,
) -> None:
    """One request through three kinds of step: first token, more tokens, finish."""
    timing = dict(first_scheduled_time=100.5, first_token_time=token_times[0], kv_wait_time=kv_wait,
                  num_external_tokens=external, max_tokens_param=max_tokens)
    so_far: list[int] = []
    for i, t in enumerate(token_times):
        so_far = so_far + [i]
        last = i == len(token_times) - 1
        mt = _metrics(**timing, last_token_time=t, num_output_tokens=len(so_far),
                      finished_time=t if last else None)
        m.observe_step([_out(rid, n_prompt, [i], list(so_far), mt, cached=cached,
                             reason="length" if last else None)], _stats(), t)


def test_families_types_buckets_and_labels_are_vllms():
    m = ServerMetrics("smollm2", max_model_len=1024, engine_index=0)
    _run_request(m, "a", 10, 0, 0, 3, [101.0, 101.05, 101.15])
    types = {f.name: f.type for f in text_string_to_metric_families(m.render().decode())}
    for name, kind in VLLM_FAMILIES.items():
        assert types.get(f"pdkv:{name}") == kind, name
    s = _samples(m)
    assert _buckets(s, "pdkv:time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds",
                 "request_time_per_output_token_seconds"):
        assert _buckets(s, f"pdkv:{name}") == list(TOKEN_LATENCY_BUCKETS), name
    assert TOKEN_LATENCY_BUCKETS[0] == 0.01 and TOKEN_LATENCY_BUCKETS[-1] == 80.0
    for name in (
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
    ):
        assert _buckets(s, f"pdkv:{name}") == list(REQUEST_LATENCY_BUCKETS), name
    assert REQUEST_LATENCY_BUCKETS[0] == 0.3 and REQUEST_LATENCY_BUCKETS[-1] == 7680.0
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
                 "request_max_num_generation_tokens"):
        assert _buckets(s, f"pdkv:{name}") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000], name
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100] and token_buckets(0) == []
    # Every sample of every family carries model_name and engine (KV metrics included).
    for name, samples in s.items():
        for sample in samples:
            assert sample.labels.get("model_name") == "smollm2", name
            assert sample.labels.get("engine") == "0", name
    # Finish reasons and prompt sources exist from the start (a rate() has a series to read).
    fresh = _samples(ServerMetrics("m"))
    for reason in ("stop", "length", "abort", "error"):
        assert any(
            x.labels["finished_reason"] == reason for x in fresh["pdkv:request_success_total"]
        )
    assert {x.labels["source"] for x in fresh["pdkv:prompt_tokens_by_source_total"]} == {
        "local_compute", "local_cache_hit", "external_kv_transfer"}


def test_request_histograms_follow_its_timestamps():
    m = ServerMetrics("smollm2", max_model_len=1024)
    # Arrival 100.0, admitted 100.5, waits 0.2 s for KV, tokens at 101.0, 101.1, 101.4.
    _run_request(m, "a", 10, 0, 0, 16, [101.0, 101.1, 101.4], kv_wait=0.2)
    s = _samples(m)
    approx = {
        "pdkv:time_to_first_token_seconds_sum": 1.0,
        "pdkv:request_queue_time_seconds_sum": 0.5,
        "pdkv:request_kv_wait_time_seconds_sum": 0.2,
        "pdkv:request_prefill_time_seconds_sum": 0.3,  # 101.0 - 100.5 - 0.2
        "pdkv:request_decode_time_seconds_sum": 0.4,
        "pdkv:request_inference_time_seconds_sum": 0.7,
        "pdkv:e2e_request_latency_seconds_sum": 1.4,
        "pdkv:request_time_per_output_token_seconds_sum": 0.2,  # 0.4 / 2
        "pdkv:inter_token_latency_seconds_sum": 0.4,  # 0.1 + 0.3
        "pdkv:time_per_output_token_seconds_sum": 0.4,
    }
    for name, want in approx.items():
        assert abs(_value(s, name) - want) < 1e-9, (name, _value(s, name))
    assert _value(s, "pdkv:inter_token_latency_seconds_count") == 2
    assert _value(s, "pdkv:request_time_per_output_token_seconds_count") == 1
    assert _value(s, "pdkv:request_generation_tokens_sum") == 3
    assert _value(s, "pdkv:request_max_num_generation_tokens_sum") == 3
    assert _value(s, "pdkv:request_params_max_tokens_sum") == 16
    assert _value(s, "pdkv:request_prompt_tokens_sum") == 10
    assert _value(s, "pdkv:generation_tokens_total") == 3
    assert _value(s, "pdkv:request_success_total", finished_reason="length") == 1
    # A one-token request has no TPOT sample (vLLM would record 0 and drag the percentiles).
    _run_request(m, "b", 4, 0, 0, 1, [102.0])
    s = _samples(m)
    assert _value(s, "pdkv:request_time_per_output_token_seconds_count") == 1
    assert _value(s, "pdkv:request_decode_time_seconds_count") == 2


def test_prompt_tokens_by_source_sum_over_prefill_and_decode_engines():
    """1P1D, a 40-token prompt: P had 16 tokens in its prefix cache and computed 24; D already
    held 8 (counted as its hits), pulled 31 and recomputed the last one. Summed over both
    engines, local_compute is what the deployment computed (24 + 1); pulled tokens are never
    counted as computed."""
    p, d = ServerMetrics("m"), ServerMetrics("m")
    _run_request(p, "r", 40, cached=16, external=0, max_tokens=1, token_times=[101.0])
    _run_request(d, "r", 40, cached=39, external=31, max_tokens=4, token_times=[101.5, 101.6])
    sp, sd = _samples(p), _samples(d)

    def src(s: dict[str, list], source: str) -> float:
        return _value(s, "pdkv:prompt_tokens_by_source_total", source=source)

    assert (
        src(sp, "local_compute"),
        src(sp, "local_cache_hit"),
        src(sp, "external_kv_transfer"),
    ) == (24, 16, 0)
    assert (
        src(sd, "local_compute"),
        src(sd, "local_cache_hit"),
        src(sd, "external_kv_transfer"),
    ) == (1, 8, 31)
    for s in (sp, sd):
        total = _value(s, "pdkv:prompt_tokens_total")
        assert (
            total
            == 40
            == sum(src(s, x) for x in ("local_compute", "local_cache_hit", "external_kv_transfer"))
        )
        assert _value(s, "pdkv:prompt_tokens_cached_total") == total - src(s, "local_compute")
    assert src(sp, "local_compute") + src(sd, "local_compute") == 25


def test_prompt_tokens_counted_once_at_the_first_token_not_for_requests_without_one():
    m = ServerMetrics("m")
    _run_request(m, "a", 12, 0, 0, 5, [101.0, 101.1, 101.2, 101.3])
    assert _value(_samples(m), "pdkv:prompt_tokens_total") == 12
    # Aborted before its first token: a finish, no prompt tokens, no TTFT, no phase durations.
    mt = _metrics(first_scheduled_time=100.2, finished_time=100.4, max_tokens_param=8)
    m.observe_step([_out("gone", 30, [], [], mt, reason="abort")], _stats(), 100.4)
    s = _samples(m)
    assert _value(s, "pdkv:prompt_tokens_total") == 12
    assert _value(s, "pdkv:time_to_first_token_seconds_count") == 1
    assert _value(s, "pdkv:request_success_total", finished_reason="abort") == 1
    assert _value(s, "pdkv:request_prefill_time_seconds_count") == 1
    assert _value(s, "pdkv:request_prompt_tokens_count") == 2
    assert _value(s, "pdkv:e2e_request_latency_seconds_count") == 2


def test_scheduler_gauges_and_cumulative_counters():
    m = ServerMetrics("m")
    m.observe_step(
        [], _stats(prefix_cache_queries=40, prefix_cache_hits=16, num_preemptions=1), 1.0
    )
    m.observe_step(
        [],
        _stats(
            num_running=0,
            num_waiting=3,
            kv_cache_usage=0.5,
            num_free_blocks=7,
            prefix_cache_queries=100,
            prefix_cache_hits=16,
            num_preemptions=2,
        ),
        2.0,
    )
    s = _samples(m)
    assert _value(s, "pdkv:prefix_cache_queries_total") == 100
    assert _value(s, "pdkv:prefix_cache_hits_total") == 16
    assert _value(s, "pdkv:num_preemptions_total") == 2
    assert (_value(s, "pdkv:num_requests_running"), _value(s, "pdkv:num_requests_waiting")) == (
        0,
        3,
    )
    assert (_value(s, "pdkv:kv_cache_usage_perc"), _value(s, "pdkv:num_free_blocks")) == (0.5, 7)
