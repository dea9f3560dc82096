"""KV bytes per rank, step-time statistics, ratios and the text table of `pdkv bench dcp`.

KV per rank (docs/ARCHITECTURE.md "TP and DCP"): a rank stores, per token it owns,
bytes_per_token = layers × 2 (K and V) × local KV heads × head_size × dtype bytes; DCP rank r of N
owns dcp_local_len(tokens, r, I, N) of a request's tokens (pdkv.parallel.layout), rank 0 the
most. Torch-free.
"""

from __future__ import annotations

import math
import statistics
from typing import TypedDict

from pdkv.parallel.layout import dcp_local_len

MS = 1e3


class StepStats(TypedDict):
    """Decode-step statistics of one context (`step_stats`)."""

    step_median_ms: float
    step_p90_ms: float
    forward_median_ms: float
    dcp_comm_median_ms: float
    comm_share: float


class Measured(StepStats):
    """What one request of one context measured (ms, bytes, tokens; per-step samples in s)."""

    prompt_tokens: int
    context_tokens: int
    kv_tokens_per_rank: int
    kv_bytes_per_token_per_rank: int
    kv_bytes_per_rank: int
    blocks: int
    block_bytes_per_rank: int
    kv_measured_bytes_per_rank: int
    pool_bytes_per_rank: int
    prefill_s: float
    decode_steps: int
    step_s: list[float]
    forward_s: list[float]
    dcp_comm_s: list[float]


class _ConfigRow(Measured):
    config: str
    baseline: str
    model: str
    tp: int
    dcp: int
    interleave: int
    context_len: int


class DcpRow(_ConfigRow, total=False):
    """One (config, context length) of `pdkv bench dcp`; `add_ratios` sets the ratios."""

    kv_ratio: float
    kv_measured_ratio: float
    step_ratio: float


class DcpResult(TypedDict):
    """What `run_dcp_bench` returns and `--json` writes."""

    rows: list[DcpRow]
    baselines: dict[str, str]
    note: str
    cpu_count: int | None
    context_lens: list[int]
    decode_steps: int
    model: str
    vllm_model: str
    block_size: int
    interleave: int


def kv_bytes_per_token(
    num_layers: int, local_kv_heads: int, head_size: int, dtype_bytes: int
) -> int:
    """Bytes one rank stores per token it owns: layers × 2 × local KV heads × head_size × dtype
    bytes."""
    return num_layers * 2 * local_kv_heads * head_size * dtype_bytes


def kv_tokens_per_rank(num_tokens: int, interleave: int, dcp_size: int) -> int:
    """Tokens of a `num_tokens` context stored on the fullest DCP rank (rank 0), by the placement
    (p // I) % N of pdkv.parallel.layout."""
    return max(dcp_local_len(num_tokens, r, interleave, dcp_size) for r in range(dcp_size))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile `q` (0..100) of `values`.

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    k = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return ordered[k]


def step_stats(step_s: list[float], forward_s: list[float], comm_s: list[float]) -> StepStats:
    """Decode-step statistics: median / p90 engine.step() wall time (ms), the DCP all-gather +
    merge time per step (median ms) and its share of the forward pass (sum comm / sum forward)."""
    fwd = sum(forward_s)
    return {
        "step_median_ms": statistics.median(step_s) * MS,
        "step_p90_ms": percentile(step_s, 90) * MS,
        "forward_median_ms": statistics.median(forward_s) * MS,
        "dcp_comm_median_ms": statistics.median(comm_s) * MS,
        "comm_share": sum(comm_s) / fwd if fwd > 0 else 0.0,
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def add_ratios(rows: list[DcpRow]) -> None:
    """Set each row's `kv_ratio` (computed and measured KV bytes per rank) and `step_ratio`
    (median decode step) against the row of its `baseline` config at the same context length; a
    row without a baseline (or whose baseline did not run) gets 1.0 for itself / nan."""
    by_key = {(r["config"], r["context_len"]): r for r in rows}
    for r in rows:
        base = by_key.get((r["baseline"] or r["config"], r["context_len"]))
        if base is None:
            r["kv_ratio"] = r["kv_measured_ratio"] = r["step_ratio"] = float("nan")
            continue
        r["kv_ratio"] = _ratio(r["kv_bytes_per_rank"], base["kv_bytes_per_rank"])
        r["kv_measured_ratio"] = _ratio(
            r["kv_measured_bytes_per_rank"], base["kv_measured_bytes_per_rank"]
        )
        r["step_ratio"] = _ratio(r["step_median_ms"], base["step_median_ms"])


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f}"


def format_table(result: DcpResult) -> str:
    """The table of a `run_dcp_bench` result (KV in MiB = 2^20 bytes, times in ms) and its note."""
    lines = [
        f"{'config':>9} {'context':>7} {'KV tok':>6} {'KV/rank MiB':>11} {'measured':>9} "
        f"{'KV ratio':>8} "
        f"{'step p50 ms':>11} {'p90 ms':>8} {'step ratio':>10} {'comm ms':>8} {'comm %':>7}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['config']:>9} {r['context_len']:>7} {r['context_tokens']:>6} "
            f"{_mib(r['kv_bytes_per_rank']):>11} "
            f"{_mib(r['kv_measured_bytes_per_rank']):>9} {r['kv_ratio']:>8.3f} "
            f"{r['step_median_ms']:>11.2f} {r['step_p90_ms']:>8.2f} {r['step_ratio']:>10.2f} "
            f"{r['dcp_comm_median_ms']:>8.2f} {100 * r['comm_share']:>6.1f}%"
        )
    lines += [
        "context: prompt tokens asked for; KV tok: prompt (capped to the model's length) + decode "
        "tokens held. "
        "KV/rank: tokens on the fullest rank x layers x 2 x local KV heads x head_size x dtype "
        "bytes; measured: blocks the request holds x physical block bytes per rank. Ratios: "
        + ", ".join(f"{c} relative to {b}" for c, b in result["baselines"].items() if b)
        + ".",
        "comm: DCP all-gathers + LSE merge per decode step (rank 0), % of the forward pass.",
        result["note"],
    ]
    return "\n".join(lines)
