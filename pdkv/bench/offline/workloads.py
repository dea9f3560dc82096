"""The workload rows of `pdkv bench offline --peer hf,llama.cpp` and the speed goals they are
judged by.

A row is one workload measured on every system in one run (tokens / second): the batch-1 prefill
of `long_prefill_len` tokens, decode per batch size (aggregate over the sequences), and the
one-step prefill of B prompts per batch size > 1. With the machine's limits measured in the same
run (`pdkv.bench.offline.limits`) each row also carries its roofline limit and the share of it
pdkv and llama.cpp reach.

The goals are the CPU speed targets of the engine-speed issue, for float32 (`GOALS`; a bfloat16
run is judged by `BF16_GOALS`): each names
a row, what is compared (pdkv / llama.cpp, pdkv / HF, pdkv's share of the roofline limit or of the
FMA peak), the goal aimed at and the floor that must hold. They hold on whichever CPU the run
had; the report prints that CPU's flags beside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdkv.bench.offline.limits import (
    MachineLimits,
    ModelCost,
    decode_limit_tok_s,
    flop_share,
    prefill_limit_tok_s,
)

# Row keys: ("long_prefill", prompt tokens), ("decode", sequences), ("prefill_batch", prompts).
RowKey = tuple[str, int]

# What a goal compares: pdkv / llama.cpp, pdkv / HF, pdkv's share of the row's roofline limit, or
# the share of the measured fp32 FMA peak pdkv's tokens use.
MEASURES = ("vs_llamacpp", "vs_hf", "of_limit", "of_fma_peak")


@dataclass(frozen=True)
class Goal:
    """One speed target on one workload row.

    Attributes:
        key: the row (see `RowKey`).
        measure: one of MEASURES.
        goal: the value aimed at (a ratio, or a share in 0..1).
        floor: the value that must hold to call the work done (None: aimed at only).
    """

    key: RowKey
    measure: str
    goal: float
    floor: float | None


# float32, prompts of 128 tokens (the long prefill: 512), 2 threads on the benchmark's box.
GOALS: tuple[Goal, ...] = (
    Goal(("long_prefill", 512), "vs_llamacpp", 1.5, 1.3),
    Goal(("decode", 1), "vs_llamacpp", 1.05, 0.95),
    Goal(("decode", 1), "of_limit", 0.88, 0.80),
    Goal(("decode", 32), "vs_llamacpp", 1.5, 1.2),
    Goal(("decode", 64), "vs_llamacpp", 1.5, 1.2),
    Goal(("decode", 64), "of_fma_peak", 0.50, None),
    Goal(("prefill_batch", 64), "vs_hf", 1.0, 0.9),
)

# bfloat16 (`--dtype bfloat16`): the engine-speed issue's goal against llama.cpp's BF16 GGUF in
# the same run, aimed at, no floor (its other bfloat16 goal, batch-1 decode >= 1.7x pdkv's own
# float32, compares two runs: docs/SPEED.md states it beside the tables).
BF16_GOALS: tuple[Goal, ...] = (
    Goal(("decode", 1), "vs_llamacpp", 1.3, None),
)


def goals_for(dtype: str) -> tuple[Goal, ...]:
    """The goals a run of `dtype` is judged by: BF16_GOALS for "bfloat16", else GOALS."""
    return BF16_GOALS if dtype == "bfloat16" else GOALS


def ratio_or_none(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    return None if a is None or b is None or b == 0 else a / b


def row_name(key: RowKey, input_len: int) -> str:
    """The printed name of a row, e.g. "decode, 32 sequences (aggregate)"."""
    kind, n = key
    if kind == "long_prefill":
        return f"prefill {n}, batch 1"
    if kind == "decode":
        return "decode, batch 1" if n == 1 else f"decode, {n} sequences (aggregate)"
    return f"prefill {n} x {input_len} in one step"


def _row(key: RowKey, input_len: int, entry: dict[str, Any], metric: str,
         limit: float | None) -> dict[str, Any]:
    def tok_s(system: str) -> float | None:
        r = entry.get(system)
        return None if r is None else r.get(metric)

    return {
        "key": list(key),
        "workload": row_name(key, input_len),
        "pdkv": tok_s("pdkv"),
        "hf": tok_s("hf"),
        "llamacpp": tok_s("llamacpp"),
        "ratio": ratio_or_none(tok_s("pdkv"), tok_s("llamacpp")),
        "hf_ratio": ratio_or_none(tok_s("pdkv"), tok_s("hf")),
        "limit": limit,
        "pdkv_of_limit": ratio_or_none(tok_s("pdkv"), limit),
        "llamacpp_of_limit": ratio_or_none(tok_s("llamacpp"), limit),
        "same_tokens": entry.get("greedy_match_requests_all"),
        "requests": entry["batch_size"],
    }


def workload_rows(result: dict[str, Any], cost: ModelCost | None = None,
                  limits: MachineLimits | None = None) -> list[dict[str, Any]]:
    """The workload rows of a run with llama.cpp (throughputs in tokens per second).

    In order: the batch-1 prefill of result["long_prefill"] (when measured), decode per batch
    size, then the one-step prefill of B prompts per batch size > 1. Each row: "key" ([kind, n]),
    "workload" (its name), "pdkv" / "hf" / "llamacpp" (tok/s or None), "ratio" (pdkv /
    llama.cpp), "hf_ratio" (pdkv / HF), "limit" (the roofline tok/s, None without `limits`),
    "pdkv_of_limit" / "llamacpp_of_limit" (shares of it), "same_tokens" of "requests" (requests
    whose greedy tokens are equal on every system).
    """
    input_len = result["input_len"]
    context = decode_context(result)

    def lim(kind: str, b: int, prompt_len: int = input_len) -> float | None:
        if cost is None or limits is None:
            return None
        if kind == "decode":
            return decode_limit_tok_s(cost, limits, b, context)
        return prefill_limit_tok_s(cost, limits, prompt_len)

    rows = []
    lp = result.get("long_prefill")
    if lp:
        n = lp["input_len"]
        rows.append(_row(("long_prefill", n), n, lp, "prefill_tok_s", lim("prefill", 1, n)))
    for e in result["results"]:
        b = e["batch_size"]
        rows.append(_row(("decode", b), input_len, e, "decode_tok_s", lim("decode", b)))
    for e in result["results"]:
        b = e["batch_size"]
        if b > 1:
            rows.append(
                _row(("prefill_batch", b), input_len, e, "prefill_tok_s", lim("prefill", b))
            )
    return rows


def decode_context(result: dict[str, Any]) -> float:
    """Cached tokens per sequence averaged over a run's decode steps: input_len + (output_len -
    1) / 2 (the first decode step attends to input_len + 1 tokens, the last to input_len +
    output_len - 1; in the middle, the average)."""
    return result["input_len"] + (result.get("output_len", 1) - 1) / 2


def evaluate_goals(rows: list[dict[str, Any]], cost: ModelCost | None = None,
                   limits: MachineLimits | None = None,
                   goals: tuple[Goal, ...] = GOALS, context: float = 0.0) -> list[dict[str, Any]]:
    """Each goal whose row was measured, with its value and whether the goal and floor hold.

    `context` is the cached tokens per sequence of the decode rows (`decode_context`), for the
    attention FLOP of the matmul-peak share.

    Returns:
        One dict per goal in `goals` order: "workload", "measure", "value" (None when a figure is
        missing, e.g. no limits measured or decode time lost in noise), "goal", "floor", "met"
        (value >= goal) and "floor_held" (value >= floor; None without a floor), both None when
        value is None. Goals on rows that were not run are left out.
    """
    by_key = {tuple(r["key"]): r for r in rows}
    out = []
    for g in goals:
        row = by_key.get(g.key)
        if row is None:
            continue
        value: float | None
        if g.measure == "vs_llamacpp":
            value = row["ratio"]
        elif g.measure == "vs_hf":
            value = row["hf_ratio"]
        elif g.measure == "of_limit":
            value = row["pdkv_of_limit"]
        elif g.measure == "of_fma_peak":
            value = (None if cost is None or limits is None
                     else flop_share(cost, limits, row["pdkv"], context))
        else:
            raise ValueError(f"unknown goal measure {g.measure!r}; choose from {MEASURES}")
        out.append({
            "workload": row["workload"],
            "measure": g.measure,
            "value": value,
            "goal": g.goal,
            "floor": g.floor,
            "met": None if value is None else value >= g.goal,
            "floor_held": None if value is None or g.floor is None else value >= g.floor,
        })
    return out
