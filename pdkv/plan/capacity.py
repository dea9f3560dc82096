"""P:D ratio for a target TTFT/TPOT from measured prefill and decode throughput (pure arithmetic).

Per request of n_in prompt and n_out output tokens, with one prefill instance running P tok/s and
one decode instance producing D tok/s in aggregate at its working batch:
    prefill service  s   = n_in / P                                   (seconds, one at a time)
    TTFT budget      B   = target_ttft − s − handoff                  (time a prompt may queue)
    P utilisation    ρ   = 2B / (s + 2B)     from the M/D/1 mean wait ρ·s / (2(1−ρ)) ≤ B
                           (ρ = 1 without a TTFT target; a mean, not a p99)
    P capacity       μ_P = ρ / s                                      requests/s per P instance
    D capacity       μ_D = D / n_out                                  requests/s per D instance
    P:D              = μ_D / μ_P  prefill instances per decode instance
    D streams        = D · target_tpot   concurrent streams one D holds at the target TPOT
                       (valid when D was measured at a batch at least that large)
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PDRatio:
    """Result of `pd_ratio`; `p_per_d` is None when the TTFT target cannot be met at any load."""

    prefill_s: float
    utilisation: float | None
    p_per_d: float | None
    d_streams: float | None

    def rounded(self) -> str:
        """A whole-instance ratio that meets the demand: ceil(x):1 or 1:floor(1/x)."""
        if self.p_per_d is None:
            return "n/a"
        x = self.p_per_d
        return f"{math.ceil(x - 1e-9)}:1" if x >= 1 else f"1:{max(1, math.floor(1 / x + 1e-9))}"


def pd_ratio(prompt_len: int, output_len: int, prefill_tps: float, decode_tps: float,
             handoff_s: float = 0.0, target_ttft: float | None = None,
             target_tpot: float | None = None) -> PDRatio:
    """Prefill instances needed per decode instance (formula in the module docstring).

    Raises:
        ValueError: a length or throughput <= 0.
    """
    if min(prompt_len, output_len) <= 0 or min(prefill_tps, decode_tps) <= 0:
        raise ValueError("lengths and throughputs must be > 0")
    s = prompt_len / prefill_tps
    rho: float | None = 1.0
    if target_ttft is not None:
        budget = target_ttft - s - handoff_s
        rho = None if budget < 0 else 2 * budget / (s + 2 * budget) if budget > 0 else 0.0
    streams = decode_tps * target_tpot if target_tpot is not None else None
    if not rho:
        return PDRatio(s, rho, None, streams)
    mu_p = rho / s
    mu_d = decode_tps / output_len
    return PDRatio(s, rho, mu_d / mu_p, streams)
