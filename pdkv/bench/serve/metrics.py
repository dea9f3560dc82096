"""Pure arithmetic of `pdkv bench serve`: per-request timings -> aggregate metrics.

The formulas are those of vLLM's `vllm/benchmarks/serve.py` (`calculate_metrics`):

* TPOT of a request = (E2EL - TTFT) / (output_tokens - 1), only for output_tokens > 1; the
  TPOT statistics use those requests only, while goodput treats a request with <= 1 output
  token as TPOT 0;
* ITL statistics pool the inter-chunk gaps of all successful requests;
* request throughput = completed / duration (req/s); output throughput = output tokens /
  duration (tok/s); total token throughput = (prompt + output tokens) / duration (tok/s);
* goodput = requests meeting every given SLO (value <= SLO, in ms) / duration (req/s);
* mean / median / std (population, numpy's default) / percentiles (numpy's linear
  interpolation) are reported in ms, and are 0 when there is no sample (vLLM's `x or 0`);
* peak concurrent requests: sweep over the half-open intervals [start, start + E2EL);
  peak output tokens/s: tokens (one per content chunk) bucketed into whole seconds from the
  first start.

Failed requests only count in `failed`; they are excluded from every latency statistic and
every token total.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from pdkv.bench.serve.records import RequestResult

SLO_NAMES = ("ttft", "tpot", "e2el")
MS_PER_S = 1000.0


def parse_percentiles(text: str) -> list[float]:
    """Parse "50,90,99" into [50.0, 90.0, 99.0]; each must lie in [0, 100]."""
    values = [float(p) for p in text.split(",") if p.strip()]
    for p in values:
        if not 0.0 <= p <= 100.0:
            raise ValueError(f"percentile {p} is outside [0, 100]")
    return values


def parse_goodput(pairs: Iterable[str] | None) -> dict[str, float]:
    """Parse ["ttft:500", "tpot:50"] into {"ttft": 500.0, "tpot": 50.0} (SLOs in ms)."""
    slos: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"goodput SLO {pair!r}: expected NAME:MS with NAME in {SLO_NAMES}")
        ms = float(value)
        if ms < 0:
            raise ValueError(f"goodput SLO {pair!r}: the value must be >= 0 ms")
        slos[name] = ms
    return slos


def percentile_key(p: float) -> str:
    """vLLM's key word for a percentile: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def request_tpot(result: RequestResult) -> float | None:
    """TPOT of one successful request in seconds, or None when output_tokens <= 1."""
    if result.output_tokens > 1:
        return (result.latency - result.ttft) / (result.output_tokens - 1)
    return None


def _stats_ms(
    name: str, values_s: Sequence[float], percentiles: Sequence[float]
) -> dict[str, float]:
    """mean/median/std/pXX of `values_s` (seconds) in ms, under vLLM's key names."""
    arr = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64)
    out = {
        f"mean_{name}_ms": float(np.mean(arr)) * MS_PER_S,
        f"median_{name}_ms": float(np.median(arr)) * MS_PER_S,
        f"std_{name}_ms": float(np.std(arr)) * MS_PER_S,
    }
    for p in percentiles:
        out[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p)) * MS_PER_S
    return out


def _peak_concurrency(ok: Sequence[RequestResult]) -> int:
    """Most requests in flight at once, over half-open intervals [start, start + E2EL)."""
    events = [(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok]
    events.sort()  # at equal times -1 sorts before +1: an end frees its slot first
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def _peak_output_tokens_per_s(ok: Sequence[RequestResult]) -> float:
    """Most content chunks (≈ tokens) received within one whole second from the first start."""
    if not ok:
        return 0.0
    t0 = min(r.start_time for r in ok)
    t_end = max(r.start_time + r.latency for r in ok)
    buckets = np.zeros(int(math.ceil(t_end - t0)) + 1)
    for r in ok:
        t = r.start_time + r.ttft
        times = [t]
        for gap in r.itl:
            t += gap
            times.append(t)
        for t in times:
            idx = int(t - t0)
            if 0 <= idx < len(buckets):
                buckets[idx] += 1
    return float(buckets.max())


def compute_metrics(
    request_results: Sequence[RequestResult],
    duration: float,
    selected_percentiles: Sequence[float],
    goodput_slos: Mapping[str, float] | None = None,
) -> dict[str, float | None]:
    """Aggregate per-request measurements into the benchmark metrics (see the module doc).

    Args:
        request_results: one `RequestResult` per request (times in seconds).
        duration: benchmark wall time in seconds (first dispatch to last completion).
        selected_percentiles: percentiles to report, e.g. [50, 90, 99].
        goodput_slos: SLOs in ms keyed by "ttft" / "tpot" / "e2el"; empty or None: no goodput.

    Returns:
        A flat dict with vLLM's keys: completed, failed, total_input_tokens,
        total_output_tokens, request_throughput (req/s), request_goodput (req/s or None),
        output_throughput and total_token_throughput (tok/s), {mean,median,std,pXX}_{ttft,
        tpot,itl,e2el}_ms, max_concurrent_requests, max_output_tokens_per_s, plus
        good_requests and num_usage_missing.
    """
    if duration <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration}")
    slos = dict(goodput_slos or {})
    ok = [r for r in request_results if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    itls = [gap for r in ok for gap in r.itl]
    tpots: list[float] = []
    tpots_for_goodput: list[float] = []
    for r in ok:
        tpot = request_tpot(r)
        if tpot is not None:
            tpots.append(tpot)
        tpots_for_goodput.append(0.0 if tpot is None else tpot)
    total_input = sum(r.prompt_tokens for r in ok)
    total_output = sum(r.output_tokens for r in ok)

    good = 0
    if slos:
        per_metric = {"ttft": ttfts, "tpot": tpots_for_goodput, "e2el": e2els}
        for i in range(len(ok)):
            if all(per_metric[name][i] <= slo / MS_PER_S for name, slo in slos.items()):
                good += 1

    result: dict[str, float | None] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(request_results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if slos else None,
        "good_requests": good if slos else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_concurrent_requests": _peak_concurrency(ok),
        "max_output_tokens_per_s": _peak_output_tokens_per_s(ok),
        "num_usage_missing": sum(1 for r in ok if r.usage_missing),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(_stats_ms(name, values, selected_percentiles))
    return result
