"""Per-tier summary, targets and the text table of a `pdkv bench pool` result (pure functions:
no engine, no torch).

Times are milliseconds in the table and seconds in the samples; bandwidth is GB/s with
GB = 1e9 bytes.
"""

from __future__ import annotations

import statistics
from typing import TypedDict, final

GB = 1e9
TARGETS: dict[str, float] = {"dram": 0.10, "disk": 0.25}
"""Issue 8's targets: hot TTFT at most this fraction of cold TTFT (other tiers: reported only)."""


class ColdHot(TypedDict):
    """One cold + hot run of a prompt: TTFTs (s), the hot run's hit tokens, pool bytes read
    and summed get seconds."""

    cold_ttft_s: float
    hot_ttft_s: float
    cold_cached_tokens: int
    hit_tokens: int
    bytes_read: float
    load_s: float


class PoolSample(ColdHot):
    """One repeat of one tier; `identical`: cold, hot and no-pool outputs token-identical."""

    identical: bool


class _Summary(TypedDict):
    cold_ttft_ms: float
    hot_ttft_ms: float
    hot_cold: float
    hit_tokens: list[int]
    hits_ok: bool
    identical: bool
    bytes_read: float
    load_s: float
    load_gbps: float
    target: float | None
    passed: bool | None


@final
class TierSummary(_Summary, total=False):
    """Medians and checks of one tier (`summarize_tier`), with its samples."""

    samples: list[PoolSample]


@final
class SkippedTier(TypedDict):
    """A tier whose server could not start."""

    skipped: str


class _Settings(TypedDict):
    model: str
    block_size: int
    chunk_size: int
    prompt_len: int
    repeats: int
    max_tokens: int
    seed: int
    expected_hit_tokens: int
    tiers: dict[str, TierSummary | SkippedTier]


class PoolResult(_Settings, total=False):
    """What `run_pool_bench` returns: the settings, the no-pool peer's TTFT, each tier and `ok`."""

    no_pool_ttft_ms: float
    no_pool_ttft_s: list[float]
    ok: bool


def max_loadable_tokens(num_prompt_tokens: int, chunk_size: int) -> int:
    """Tokens a full pool hit covers: ((n-1)//C)*C (the last prompt token is never loaded)."""
    return (num_prompt_tokens - 1) // chunk_size * chunk_size


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def summarize_tier(tier: str, samples: list[PoolSample], expected_hit: int) -> TierSummary:
    """Medians and checks of one tier's repeats.

    Args:
        tier: tier name (selects the target, if any).
        samples: one dict per repeat with cold_ttft_s, hot_ttft_s (s), hit_tokens (tokens),
            bytes_read (bytes), load_s (s: the pool's summed get times of the hot run),
            identical (bool: cold, hot and no-pool outputs token-identical).
        expected_hit: ((n-1)//C)*C.

    Returns:
        cold_ttft_ms, hot_ttft_ms (medians), hot_cold (ratio of the medians), hit_tokens
        (list), hits_ok, identical, load_gbps (total bytes / total load seconds), target
        (fraction or None) and passed (bool or None when no target).
    """
    cold = statistics.median(s["cold_ttft_s"] for s in samples)
    hot = statistics.median(s["hot_ttft_s"] for s in samples)
    ratio = _ratio(hot, cold)
    load_s = sum(s["load_s"] for s in samples)
    nbytes = sum(s["bytes_read"] for s in samples)
    target = TARGETS.get(tier)
    return {
        "cold_ttft_ms": cold * 1000,
        "hot_ttft_ms": hot * 1000,
        "hot_cold": ratio,
        "hit_tokens": [s["hit_tokens"] for s in samples],
        "hits_ok": all(s["hit_tokens"] == expected_hit for s in samples),
        "identical": all(s["identical"] for s in samples),
        "bytes_read": nbytes,
        "load_s": load_s,
        "load_gbps": _ratio(nbytes, load_s) / GB,
        "target": target,
        "passed": None if target is None else bool(ratio <= target),
    }


def format_table(result: PoolResult) -> str:
    """The result as text: a header stating the chunk arithmetic, one row per tier (skipped
    tiers with their reason) and the no-pool engine's TTFT."""
    n, c = result["prompt_len"], result["chunk_size"]
    lines = [
        f"pdkv bench pool: {result['model']}, block {result['block_size']}, chunk {c} tokens, "
        f"prompt {n} tokens, {result['repeats']} repeats (medians), {result['max_tokens']} output "
        "tokens",
        f"full hit = ((n-1)//C)*C = (({n}-1)//{c})*{c} = {result['expected_hit_tokens']} tokens "
        "(the last prompt token is never loaded)",
        f"no pool: TTFT {result['no_pool_ttft_ms']:.0f} ms (same prompts, same run)",
        "",
        f"{'tier':<9}{'cold ms':>9}{'hot ms':>9}{'hot/cold':>9}{'target':>8}{'result':>8}"
        f"{'hit tok':>9}{'load GB/s':>11}{'identical':>11}",
    ]
    for tier, row in result["tiers"].items():
        if "skipped" in row:
            lines.append(f"{tier:<9}skipped: {row['skipped']}")
            continue
        target = "-" if row["target"] is None else f"<={row['target']:.0%}"
        verdict = "-" if row["passed"] is None else ("PASS" if row["passed"] else "FAIL")
        hits = row["hit_tokens"]
        hit = str(hits[0]) if len(set(hits)) == 1 else "/".join(map(str, hits))
        if not row["hits_ok"]:
            hit += "!"
        lines.append(
            f"{tier:<9}{row['cold_ttft_ms']:>9.0f}{row['hot_ttft_ms']:>9.0f}{row['hot_cold']:>9.1%}"
            f"{target:>8}{verdict:>8}{hit:>9}{row['load_gbps']:>11.2f}"
            f"{'yes' if row['identical'] else 'NO':>11}"
        )
    lines += [
        "",
        "cold: the prompt's first run (its chunks are queued for the pool); hot: the same prompt",
        "after the save queue is flushed and the engine's prefix cache reset. load GB/s = bytes",
        "read / summed pool get seconds (read + checksum, one chunk at a time). identical: cold,",
        "hot and no-pool greedy outputs token-identical.",
    ]
    return "\n".join(lines)
