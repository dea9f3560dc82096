"""TTFT decomposition of `pdkv bench serve`: the servers' `pdkv_timings` against client TTFT.

Pure arithmetic over the per-request results. For each successful request whose server sent
`pdkv_timings` (an engine's, pdkv.serve.timings, or a proxy's stitched one, pdkv.router.timings):

* each phase's value in seconds; a phase a request lacks (e.g. the p_* phases of a request whose
  prefill leg the proxy skipped) counts as 0, so the means of the phases add up to the mean of
  the sums;
* `client_residual` = client TTFT − the server's `total` (client ↔ server HTTP, SSE parsing,
  the client's own scheduling);
* sum / client TTFT = the server's `total` / client TTFT (the phases add up to `total`).

Reported per phase: mean, p50 and p99 in ms (numpy's linear interpolation). A proxy's
`proxy_parts` (the steps of its `proxy` phase, pdkv.router.timings) are reported the same way,
apart from the phases (they split `proxy`, they do not add to the sum).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import numpy as np

from pdkv.bench.serve.records import RequestResult
from pdkv.jsontypes import JSONObject

MS_PER_S = 1000.0
CLIENT_RESIDUAL = "client_residual"


class PhaseStats(TypedDict):
    """One phase over the requests, in ms."""

    mean_ms: float
    p50_ms: float
    p99_ms: float


class SumOverTTFT(TypedDict):
    """Sum of a request's server phases / its client TTFT: mean, min, max (None: no TTFT)."""

    mean: float | None
    min: float | None
    max: float | None


class TTFTPhases(TypedDict):
    """The "ttft_phases" of a result (see `ttft_phases`)."""

    num_requests: int
    modes: list[str]
    phases: dict[str, PhaseStats]
    proxy_parts: dict[str, PhaseStats]
    mean_phase_sum_ms: float
    mean_client_ttft_ms: float
    sum_over_ttft: SumOverTTFT


def _phases(timings: JSONObject) -> dict[str, float]:
    raw = timings.get("phases")
    if not isinstance(raw, dict):
        return {}
    return {str(k): float(v) for k, v in raw.items() if isinstance(v, (int, float))}


def _stats(values_s: list[float]) -> PhaseStats:
    values = np.asarray(values_s, dtype=np.float64)
    return {"mean_ms": float(values.mean()) * MS_PER_S,
            "p50_ms": float(np.percentile(values, 50)) * MS_PER_S,
            "p99_ms": float(np.percentile(values, 99)) * MS_PER_S}


def _total(timings: JSONObject, phases: dict[str, float]) -> float:
    total = timings.get("total")
    return float(total) if isinstance(total, (int, float)) else sum(phases.values())


def ttft_phases(results: Sequence[RequestResult]) -> TTFTPhases | None:
    """Aggregate the TTFT phases (see the module doc).

    Returns:
        None when no successful request carried `pdkv_timings`; else {"num_requests",
        "modes" (sorted), "phases": {name: {"mean_ms", "p50_ms", "p99_ms"}} in request order
        then "client_residual", "proxy_parts": {part: the same} over the requests that carry
        them ({} when none does), "mean_phase_sum_ms", "mean_client_ttft_ms", "sum_over_ttft":
        {"mean", "min", "max"} (fractions)}.
    """
    rows = [(r, r.pdkv_timings) for r in results if r.success and isinstance(r.pdkv_timings, dict)]
    if not rows:
        return None
    names: list[str] = []
    per_request: list[dict[str, float]] = []
    sums: list[float] = []
    ttfts: list[float] = []
    modes: set[str] = set()
    parts: dict[str, list[float]] = {}
    for r, t in rows:
        raw_parts = t.get("proxy_parts")
        if isinstance(raw_parts, dict):
            for k, v in raw_parts.items():
                if isinstance(v, (int, float)):
                    parts.setdefault(str(k), []).append(float(v))
        phases = _phases(t)
        for name in phases:
            if name not in names:
                names.append(name)
        total = _total(t, phases)
        phases[CLIENT_RESIDUAL] = r.ttft - total
        per_request.append(phases)
        sums.append(total)
        ttfts.append(r.ttft)
        modes.add(str(t.get("mode") or t.get("source") or "engine"))
    names.append(CLIENT_RESIDUAL)
    out_phases: dict[str, PhaseStats] = {}
    for name in names:
        out_phases[name] = _stats([p.get(name, 0.0) for p in per_request])
    ratios = [s / t for s, t in zip(sums, ttfts) if t > 0]
    return {
        "num_requests": len(rows),
        "modes": sorted(modes),
        "phases": out_phases,
        "proxy_parts": {name: _stats(values) for name, values in parts.items()},
        "mean_phase_sum_ms": float(np.mean(sums)) * MS_PER_S,
        "mean_client_ttft_ms": float(np.mean(ttfts)) * MS_PER_S,
        "sum_over_ttft": {"mean": float(np.mean(ratios)) if ratios else None,
                          "min": min(ratios) if ratios else None,
                          "max": max(ratios) if ratios else None},
    }
