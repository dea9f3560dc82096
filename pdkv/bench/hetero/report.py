"""Ratios, output check and text table of `pdkv bench hetero` (torch-free).

Each row is one (case, prompt length): the KV bytes D received (scheduler counter
"kv_bytes_received", summed over D's ranks), the read operations D's consumer submitted to the
transfer engine ("kv_read_ops", summed over ranks; the median of the repeats), the transfer
seconds of each repeat (a pull's claim to its "done" ack; at tp > 1 the slowest rank's), and D's
greedy output tokens of each repeat. Ratios are taken against the baseline case (the same-layout
handoff) at the same prompt length, measured in the same run; the check is "ok" when every
repeat's output tokens equal the baseline's first repeat's.
"""

from __future__ import annotations

import statistics
from typing import TypedDict

BASELINE = "same"
OK = "ok"
MISMATCH = "MISMATCH"
NO_BASELINE = "no-baseline"


class _MeasuredRow(TypedDict):
    case: str
    p_block_size: int
    d_block_size: int
    d_tp: int
    p_tp: int
    prompt_tokens: int
    needed_bytes: int
    p_blocks: int
    bytes_received: int
    read_ops: int
    read_ops_all: list[int]
    transfer_s: float
    transfer_s_all: list[float]
    outputs: list[list[int]]


class HeteroRow(_MeasuredRow, total=False):
    """One (case, prompt length) of `pdkv bench hetero`; `add_ratios` sets the ratios and check."""

    bytes_ratio: float
    read_ops_ratio: float
    transfer_ratio: float
    check: str


class HeteroResult(TypedDict):
    """What `run_hetero_bench` returns and `--json` writes."""

    rows: list[HeteroRow]
    baseline: str
    bytes_per_token: int
    repeats: int
    transfer: str
    cpu_count: int | None
    model: str
    prompt_lens: list[int]
    new_tokens: int
    cases: list[str]


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def median_seconds(seconds: list[float]) -> float:
    """Median of `seconds` (s).

    Raises:
        ValueError: no samples.
    """
    if not seconds:
        raise ValueError("median of no transfer times")
    return float(statistics.median(seconds))


def add_ratios(rows: list[HeteroRow], baseline: str = BASELINE) -> None:
    """Set each row's `bytes_ratio`, `read_ops_ratio`, `transfer_ratio` (median transfer seconds)
    against the `baseline` case's row at the same `prompt_tokens`, and its `check`: OK when all
    of the row's `outputs` (one token list per repeat) equal the baseline's first repeat, else
    MISMATCH; NO_BASELINE (ratios nan) when the baseline did not run at that length."""
    base_by_len = {r["prompt_tokens"]: r for r in rows if r["case"] == baseline}
    for r in rows:
        base = base_by_len.get(r["prompt_tokens"])
        if base is None:
            r["bytes_ratio"] = r["read_ops_ratio"] = r["transfer_ratio"] = float("nan")
            r["check"] = NO_BASELINE
            continue
        r["bytes_ratio"] = _ratio(r["bytes_received"], base["bytes_received"])
        r["read_ops_ratio"] = _ratio(r["read_ops"], base["read_ops"])
        r["transfer_ratio"] = _ratio(r["transfer_s"], base["transfer_s"])
        want = base["outputs"][0]
        r["check"] = OK if r["outputs"] and all(out == want for out in r["outputs"]) else MISMATCH


def failed_checks(rows: list[HeteroRow]) -> list[str]:
    """'case @ N tokens' of every row whose check is not OK (run add_ratios first)."""
    return [
        f"{r['case']} @ {r['prompt_tokens']} tokens: {r['check']}" for r in rows if r["check"] != OK
    ]


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def format_table(result: HeteroResult) -> str:
    """The table of a `run_hetero_bench` result (bytes in MiB = 2^20 bytes, times in ms) and
    the notes below it."""
    lines = [
        f"{'case':>12} {'P bs':>4} {'D bs':>4} {'D tp':>4} {'prompt':>6} {'P blks':>6} "
        f"{'MiB recv':>8} {'need MiB':>8} "
        f"{'read ops':>8} {'xfer p50 ms':>11} {'bytes x':>7} {'ops x':>7} {'time x':>6} "
        f"{'check':>8}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['case']:>12} {r['p_block_size']:>4} {r['d_block_size']:>4} {r['d_tp']:>4} "
            f"{r['prompt_tokens']:>6} "
            f"{r['p_blocks']:>6} {_mib(r['bytes_received']):>8} {_mib(r['needed_bytes']):>8} "
            f"{r['read_ops']:>8} "
            f"{r['transfer_s'] * 1e3:>11.2f} {r['bytes_ratio']:>7.2f} {r['read_ops_ratio']:>7.1f} "
            f"{r['transfer_ratio']:>6.2f} {r['check']:>8}"
        )
    lines += [
        "MiB recv: KV bytes D received per pull (all ranks); need: prompt tokens x "
        f"{result['bytes_per_token']} "
        "bytes per token (layers x K/V x KV heads x head_size x dtype bytes).",
        "P blks: P blocks pulled. read ops: ReadOps D submitted per pull (all ranks; median of the "
        "repeats); "
        "a same-layout pull reads each run of blocks consecutive on both sides at once: 1 to P "
        "blks reads.",
        f"xfer: median over {result['repeats']} pulls of claim -> done ack (the slowest rank at tp "
        "> 1). x: ratio to the same-layout case at the same prompt length. "
        "check: D's greedy tokens equal the same-layout case's.",
        f"Transfer {result['transfer']!r}, P and D on one host; {result['cpu_count']} CPUs. Every "
        "pull is whole: D's prefix cache is reset before each.",
    ]
    return "\n".join(lines)
