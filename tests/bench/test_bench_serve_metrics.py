"""`pdkv bench serve` pure parts: compute_metrics on hand-made timings, arrivals, parsers."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from pdkv.bench.results import write_result_json
from pdkv.bench.serve.client import build_payload, chunk_text, parse_endpoint
from pdkv.bench.serve.config import BenchConfig
from pdkv.bench.serve.datasets import WordTokenizer, ids_to_prompt, sample_lengths
from pdkv.bench.serve.metrics import compute_metrics, parse_goodput, parse_percentiles
from pdkv.bench.serve.phases import ttft_phases
from pdkv.bench.serve.records import RequestResult, SampleRequest
from pdkv.bench.serve.report import build_result, format_result_table
from pdkv.bench.serve.runner import arrival_times
from pdkv.bench.serve.server_metrics import (
    combine_deltas,
    counter_deltas,
    parse_counters,
    parse_samples,
    select_counters,
)


def _ok(ttft, itl, latency, out, prompt=10, start=0.0, usage_missing=False):
    return RequestResult(success=True, ttft=ttft, itl=list(itl), latency=latency,
                         output_tokens=out, prompt_tokens=prompt, prompt_len=prompt,
                         start_time=start, usage_missing=usage_missing,
                         num_content_chunks=len(itl) + 1)


def _failed(msg="HTTP 400: bad"):
    return RequestResult(success=False, error=msg, prompt_tokens=7, prompt_len=7)


def test_compute_metrics_hand_made():
    results = [
        _ok(0.100, [0.020, 0.030], 0.200, out=5, prompt=10, start=0.0),
        _ok(0.300, [0.050], 0.500, out=3, prompt=20, start=0.5),
        _ok(0.050, [], 0.050, out=1, prompt=30, start=1.0),  # 1 token: no TPOT
        _failed(),
    ]
    m = compute_metrics(results, duration=2.0, selected_percentiles=[50, 99.9])
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 60  # the failed request's 7 is excluded
    assert m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["request_goodput"] is None and m["good_requests"] is None
    # TTFT: 100, 300, 50 ms.
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 300, 50]))
    assert m["p50_ttft_ms"] == pytest.approx(100.0)
    assert m["p99.9_ttft_ms"] == pytest.approx(np.percentile([100, 300, 50], 99.9))
    # TPOT = (E2EL - TTFT) / (out - 1): (200-100)/4 = 25 ms, (500-300)/2 = 100 ms.
    assert m["mean_tpot_ms"] == pytest.approx(62.5)
    assert m["median_tpot_ms"] == pytest.approx(62.5)
    # ITL pools the gaps of all requests: 20, 30, 50 ms.
    assert m["mean_itl_ms"] == pytest.approx(100.0 / 3)
    assert m["median_itl_ms"] == pytest.approx(30.0)
    # E2EL: 200, 500, 50 ms.
    assert m["mean_e2el_ms"] == pytest.approx(250.0)
    assert m["p50_e2el_ms"] == pytest.approx(200.0)
    # Intervals [0, .2), [.5, 1.0), [1.0, 1.05): never two at once.
    assert m["max_concurrent_requests"] == 1
    assert m["num_usage_missing"] == 0


def test_goodput_counts_requests_meeting_every_slo():
    results = [
        _ok(0.100, [0.020], 0.200, out=5),  # tpot 25 ms
        _ok(0.300, [0.050], 0.500, out=3),  # tpot 100 ms
        _ok(0.050, [], 0.050, out=1),  # tpot counts as 0 for goodput (vLLM)
        _failed(),
    ]
    assert compute_metrics(results, 2.0, [99], {"ttft": 200})["good_requests"] == 2
    m = compute_metrics(results, 2.0, [99], {"ttft": 200, "tpot": 20})
    assert m["good_requests"] == 1 and m["request_goodput"] == pytest.approx(0.5)
    assert compute_metrics(results, 2.0, [99], {"e2el": 500})["good_requests"] == 3
    # SLO boundary is inclusive: value <= SLO is good.
    assert compute_metrics(results, 2.0, [99], {"tpot": 25})["good_requests"] == 2
    assert compute_metrics(results, 2.0, [99], {"ttft": 10})["request_goodput"] == 0.0


def test_no_success_gives_zero_stats_and_peak_concurrency_overlaps():
    m = compute_metrics([_failed(), _failed()], 1.0, [50, 99])
    assert m["completed"] == 0 and m["failed"] == 2
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0 and m["total_input_tokens"] == 0
    overlapping = [_ok(0.1, [0.1], 1.0, 3, start=s) for s in (0.0, 0.2, 0.4, 1.2)]
    m = compute_metrics(overlapping, 3.0, [50])
    assert m["max_concurrent_requests"] == 3
    with pytest.raises(ValueError):
        compute_metrics(overlapping, 0.0, [50])


def test_usage_missing_is_counted():
    m = compute_metrics([_ok(0.1, [0.1], 0.2, 2, usage_missing=True)], 1.0, [50])
    assert m["num_usage_missing"] == 1


def test_parsers():
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    with pytest.raises(ValueError):
        parse_percentiles("50,101")
    assert parse_goodput(["ttft:500", "TPOT:50", "e2el:2000"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_poisson_arrivals_are_seeded_and_scaled():
    a = arrival_times(200, request_rate=10.0, seed=3)
    assert a == arrival_times(200, request_rate=10.0, seed=3)
    assert a != arrival_times(200, request_rate=10.0, seed=4)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert a[-1] == pytest.approx(200 / 10.0)  # vLLM rescales the last arrival to n / rate
    gaps = np.diff([0.0] + a)
    assert gaps.mean() == pytest.approx(0.1, rel=1e-9)
    # Exponential gaps: coefficient of variation near 1 (0.1 would mean uniform spacing).
    assert 0.7 < gaps.std() / gaps.mean() < 1.3
    assert arrival_times(5, math.inf, seed=0) == [0.0] * 5
    # Large burstiness: nearly constant gaps.
    steady = np.diff(arrival_times(100, 10.0, seed=0, burstiness=1000.0))
    assert steady.std() / steady.mean() < 0.1


def test_sample_lengths_range():
    rng = np.random.default_rng(0)
    lens = sample_lengths(rng, 2000, 100, 0.25)
    assert min(lens) == 75 and max(lens) == 125
    assert sample_lengths(rng, 3, 10, 0.0) == [10, 10, 10]
    with pytest.raises(ValueError):
        sample_lengths(rng, 3, 10, 1.0)


class _LossyTokenizer:
    """Decode drops ids 100..109 (like bytes that vanish): re-encoding comes out short."""

    name = "lossy"

    async def encode(self, text):
        return [int(w[1:]) for w in text.split()]

    async def decode(self, ids):
        return " ".join(f"w{i}" for i in ids if not 100 <= i < 110)


def test_ids_to_prompt_tops_up_to_the_target_length():
    rng = np.random.default_rng(0)
    ids = [100, 101, 102, 500, 600, 103, 700, 800]
    text, n = asyncio.run(ids_to_prompt(_LossyTokenizer(), ids, 8, rng, vocab_size=49152))
    assert n == 8 and len(text.split()) == 8
    assert text.startswith("w500 w600 w700 w800")


def test_word_tokenizer_round_trips():
    tok = WordTokenizer()
    text = asyncio.run(tok.decode([100, 101, 5000]))
    assert len(text.split()) == 3
    assert asyncio.run(tok.decode(asyncio.run(tok.encode(text)))) == text


def test_prometheus_parsing_and_deltas():
    text = (
        "# TYPE pdkv:prefix_cache_queries_total counter\n"
        'pdkv:prefix_cache_queries_total{engine="0"} 100\n'
        'pdkv:prefix_cache_queries_total{engine="1"} 50\n'
        "pdkv:prefix_cache_hits_total 30\n"
        "vllm:prefix_cache_hits_total 999\n"
    )
    picked = select_counters(parse_counters(text))
    assert picked == {"prefix_cache_queries": 150.0, "prefix_cache_hits": 30.0}
    vllm = select_counters(parse_counters(
        "vllm:prefix_cache_queries_total 10\nvllm:prefix_cache_hits_total 5\n"))
    assert vllm == {"prefix_cache_queries": 10.0, "prefix_cache_hits": 5.0}
    after = {
        "prefix_cache_queries": 350.0,
        "prefix_cache_hits": 110.0,
        "kv_p2p_bytes_received": 8.0,
    }
    d = counter_deltas(picked, after)
    assert d == {
        "prefix_cache_queries": 200.0,
        "prefix_cache_hits": 80.0,
        "kv_p2p_bytes_received": 8.0,
        "prefix_cache_hit_rate": 0.4,
    }  # kv bytes absent before: counted from 0
    assert counter_deltas(picked, picked)["prefix_cache_hit_rate"] is None
    assert counter_deltas(None, after) is None
    assert counter_deltas({}, {}) == {}


def test_report_table_and_strict_json(tmp_path):
    results = [_ok(0.1, [0.02, 0.03], 0.2, 4, start=0.0), _failed("HTTP 400: nope")]
    cfg = BenchConfig(base_url="http://x:1/", num_prompts=2, request_rate=math.inf,
                      api_key="secret", goodput={"ttft": 500})
    metrics = compute_metrics(results, 1.0, cfg.percentiles, cfg.goodput)
    result = build_result(cfg, "m", "server", metrics, results, {"prefix_cache_hit_rate": 0.5})
    table = format_result_table(result)
    assert "Serving Benchmark Result" in table and "P90 TTFT (ms):" in table
    assert "Request goodput (req/s):" in table and "Prefix cache hit rate (%):" in table
    path = tmp_path / "r.json"
    write_result_json(result, str(path))

    def no_constants(name):
        raise AssertionError(f"non-strict JSON constant {name}")

    data = json.loads(path.read_text(), parse_constant=no_constants)
    assert data["config"]["api_key"] == "<redacted>" and data["request_rate"] == "inf"
    assert data["config"]["api_url"] == "http://x:1/v1/completions"
    assert data["errors"] == ["", "HTTP 400: nope"]
    assert data["ttfts"] == [0.1, None] and data["output_lens"] == [4, 0]
    assert data["tpots"][0] == pytest.approx((0.2 - 0.1) / 3)


def test_chunk_text_and_payload():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    assert chunk_text(role, "chat") == ""
    assert chunk_text({"choices": [{"delta": {"content": "hi"}}]}, "chat") == "hi"
    assert chunk_text({"choices": [{"delta": {"reasoning_content": "hm"}}]}, "chat") == "hm"
    assert chunk_text({"choices": [{"text": ""}]}, "completions") == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}, "completions") is None
    assert parse_endpoint("/v1/chat/completions") == "chat"
    assert parse_endpoint("completions") == "completions"
    with pytest.raises(ValueError):
        parse_endpoint("embeddings")
    p = build_payload("completions", "m", SampleRequest("x y", 2, 9), ignore_eos=False)
    assert p["prompt"] == "x y" and p["max_tokens"] == 9 and "ignore_eos" not in p


def _timed(ttft, timings):
    r = _ok(ttft, [], ttft, 1)
    r.pdkv_timings = timings
    return r


def test_ttft_phases_mean_p99_and_sum_against_client_ttft():
    pd = {"mode": "pd", "total": 0.9, "phases": {"proxy": 0.1, "p_prefill": 0.5, "transfer": 0.3}}
    skip = {"mode": "pd_skip_prefill", "total": 0.4, "phases": {"proxy": 0.1, "transfer": 0.3}}
    results = [_timed(1.0, pd), _timed(0.5, skip), _ok(0.2, [], 0.2, 1), _failed()]
    ph = ttft_phases(results)
    assert ph["num_requests"] == 2 and ph["modes"] == ["pd", "pd_skip_prefill"]
    assert list(ph["phases"]) == ["proxy", "p_prefill", "transfer", "client_residual"]
    assert ph["phases"]["p_prefill"]["mean_ms"] == pytest.approx(250.0)  # absent counts as 0
    assert ph["phases"]["p_prefill"]["p99_ms"] == pytest.approx(np.percentile([500, 0], 99))
    assert ph["phases"]["client_residual"]["mean_ms"] == pytest.approx(100.0)
    assert ph["mean_phase_sum_ms"] == pytest.approx(650.0)
    assert ph["mean_client_ttft_ms"] == pytest.approx(750.0)
    assert sum(v["mean_ms"] for v in ph["phases"].values()) == pytest.approx(750.0)
    assert ph["sum_over_ttft"] == pytest.approx({"mean": 0.85, "min": 0.8, "max": 0.9})
    assert ttft_phases([_ok(0.2, [], 0.2, 1)]) is None
    cfg = BenchConfig(num_prompts=2)
    result = build_result(
        cfg, "m", "server", compute_metrics(results, 1.0, cfg.percentiles), results, None
    )
    assert result["ttft_phases"] == ph and result["pdkv_timings"][:3] == [pd, skip, None]
    table = format_result_table(result)
    assert (
        "TTFT Phases" in table
        and "client_residual" in table
        and "Sum / client TTFT, mean (%):" in table
    )


def test_ttft_phases_p50_and_the_proxy_parts_apart_from_the_sum():
    def pd(proxy_ms, length_ms):
        return {"mode": "pd", "total": 0.5,
                "phases": {"proxy": proxy_ms / 1e3, "p_prefill": 0.5 - proxy_ms / 1e3},
                "proxy_parts": {"body": (proxy_ms - length_ms) / 1e3, "length": length_ms / 1e3}}

    results = [_timed(0.5, pd(2.0, 1.0)), _timed(0.5, pd(4.0, 1.0)), _timed(0.5, pd(30.0, 27.0))]
    ph = ttft_phases(results)
    assert ph["phases"]["proxy"]["p50_ms"] == pytest.approx(4.0)
    assert ph["phases"]["proxy"]["p99_ms"] == pytest.approx(np.percentile([2, 4, 30], 99))
    assert list(ph["proxy_parts"]) == ["body", "length"]
    assert ph["proxy_parts"]["length"] == pytest.approx(
        {"mean_ms": 29 / 3, "p50_ms": 1.0, "p99_ms": np.percentile([1, 1, 27], 99)})
    assert ph["mean_phase_sum_ms"] == pytest.approx(500.0)  # the parts add nothing to the sum
    lines = format_result_table(build_result(
        BenchConfig(num_prompts=3), "m", "server",
        compute_metrics(results, 1.0, BenchConfig().percentiles), results, None)).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("proxy "))
    assert lines[at + 1].split()[0] == "proxy.body" and lines[at + 2].split()[0] == "proxy.length"
    assert lines[at + 3].startswith("p_prefill")
    assert lines[at + 2].split()[2] == "1.00"  # the p50 column


PD_METRICS = """\
# TYPE pdkv:kv_transfer_bytes_received counter
pdkv:kv_transfer_bytes_received_total{model_name="m"} 4096.0
pdkv:kv_transfer_bytes_received_created{model_name="m"} 1.7e9
# TYPE pdkv:kv_pool_bytes_read counter
pdkv:kv_pool_bytes_read_total{model_name="m",tier="dram"} 100.0
pdkv:kv_pool_bytes_read_total{model_name="m",tier="disk"} 20.0
# TYPE pdkv:proxy_requests counter
pdkv:proxy_requests_total{backend="http://p",leg="prefill"} 3.0
pdkv:proxy_requests_total{backend="http://d",leg="decode"} 5.0
"""


def test_real_kv_byte_names_proxy_legs_and_several_targets():
    picked = select_counters(parse_samples(PD_METRICS))
    assert picked == {"kv_p2p_bytes_received": 4096.0, "kv_pool_bytes_read": 120.0,
                      "proxy_prefill_legs": 3.0, "proxy_decode_legs": 5.0, "proxy_whole_legs": 0.0}
    before = {
        "a": {"kv_p2p_bytes_received": 100.0, "proxy_decode_legs": 1.0},
        "b": {"kv_p2p_bytes_received": 0.0, "prefix_cache_queries": 10.0, "prefix_cache_hits": 0.0},
        "c": None,
    }
    after = {
        "a": {"kv_p2p_bytes_received": 300.0, "proxy_decode_legs": 3.0},
        "b": {
            "kv_p2p_bytes_received": 50.0,
            "prefix_cache_queries": 30.0,
            "prefix_cache_hits": 5.0,
        },
        "c": {"kv_p2p_bytes_received": 1e9},
    }
    d = combine_deltas(before, after)
    assert d["kv_p2p_bytes_received"] == 250.0 and d["proxy_decode_legs"] == 2.0
    assert d["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert d["sources"]["c"] is None and d["sources"]["a"] == {"kv_p2p_bytes_received": 200.0,
                                                               "proxy_decode_legs": 2.0}
    assert combine_deltas({"a": None}, {"a": {}}) is None
