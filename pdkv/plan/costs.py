"""Handoff time, layer-wise overlap, recompute-vs-reload break-even (pure arithmetic, seconds
and bytes).

Handoff (MISSION R11):
    handoff = bytes / effective_bandwidth + fixed − hidden
    fixed   = handshake (2 · latency per round trip) + scheduling + layout conversion
    hidden  = (L − 1)/L · min(wire, prefill_compute)          (layer-wise publishing only)
With per-layer publishing, layer i's KV can move while layers i+1..L compute. Cut prefill
compute C and wire time X into L equal slices: if X ≤ C every slice but the last hides, exposed
X/L; if X > C the link is the bottleneck and exposed X − (L−1)/L · C. Both are
X − (L−1)/L · min(X, C). Without a prefill time nothing is hidden (pdkv's connectors publish a
request's KV once prefill is done).

Recompute vs reload, for n prompt tokens, b bytes/token, S bytes/request of linear state,
prefill throughput P tok/s, bandwidth W, fixed cost F:
    recompute(n) = n / P                (linear in n: attention's n² term is left out, so long
                                         prompts cost more to recompute and the break-even is
                                         conservative)
    reload(n)    = F + (S + n · b) / W
    break-even n* = (F + S/W) / (1/P − b/W), none when b/W ≥ 1/P (loading is never faster)
A pool that holds a fraction h of a prompt's tokens saves h·n·(1/P − b/W) and costs F + S/W, so
it pays when h > (F + S/W) / (n · (1/P − b/W)).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdkv.plan.links import Link


@dataclass(frozen=True)
class FixedCosts:
    """Per-transfer costs that do not scale with bytes (seconds).

    Attributes:
        handshake_rtts: round trips before the first byte moves (D asks P for granted blocks).
        scheduling: D's scheduler starting the pull and seeing it finished (one step each;
            2 ms assumed for a GPU engine, a CPU step here is tens of ms: see --sched-overhead).
        layout: layout conversion (0 when P and D share tp, block size and dtype; a re-shard
            or re-block costs about one memcpy pass of the bytes).
    """

    handshake_rtts: float = 1.0
    scheduling: float = 2e-3
    layout: float = 0.0

    def total(self, link: Link) -> float:
        return self.handshake(link) + self.scheduling + self.layout

    def handshake(self, link: Link) -> float:
        return 2 * link.latency * self.handshake_rtts


@dataclass(frozen=True)
class Handoff:
    """One handoff's time split (seconds); `total` = wire + fixed − hidden."""

    bytes: float
    wire: float
    fixed: float
    hidden: float

    @property
    def total(self) -> float:
        return self.wire + self.fixed - self.hidden


def overlap_hidden(wire_s: float, prefill_s: float | None, num_layers: int) -> float:
    """Seconds of the transfer that layer-wise publishing hides: (L−1)/L · min(wire, compute)."""
    if prefill_s is None or num_layers <= 1:
        return 0.0
    return (num_layers - 1) / num_layers * min(wire_s, prefill_s)


def handoff(nbytes: float, link: Link, fixed: FixedCosts, num_layers: int = 1,
            prefill_s: float | None = None) -> Handoff:
    """Handoff of `nbytes` over `link`; pass prefill_s (and L) to count layer-wise overlap.

    Raises:
        ValueError: negative bytes or a non-positive bandwidth.
    """
    if nbytes < 0 or link.bandwidth <= 0:
        raise ValueError("bytes must be >= 0 and bandwidth > 0")
    wire = nbytes / link.bandwidth
    return Handoff(nbytes, wire, fixed.total(link), overlap_hidden(wire, prefill_s, num_layers))


def breakeven_tokens(bytes_per_token: float, request_bytes: float, prefill_tps: float,
                     link: Link, fixed: FixedCosts) -> float | None:
    """Prompt length (tokens) above which loading KV beats recomputing it; None if never.

    Raises:
        ValueError: prefill_tps <= 0.
    """
    if prefill_tps <= 0:
        raise ValueError("prefill throughput must be > 0")
    gain = 1.0 / prefill_tps - bytes_per_token / link.bandwidth
    if gain <= 0:
        return None
    return (fixed.total(link) + request_bytes / link.bandwidth) / gain


def pool_breakeven_hit_rate(num_tokens: int, bytes_per_token: float, request_bytes: float,
                            prefill_tps: float, link: Link, fixed: FixedCosts) -> float | None:
    """Fraction of a `num_tokens` prompt that must hit the pool for a load to pay; None if no
    hit rate pays (loading a token is slower than computing it). A value > 1 means a pool does
    not pay at this prompt length.

    Raises:
        ValueError: prefill_tps <= 0 or num_tokens <= 0.
    """
    if prefill_tps <= 0 or num_tokens <= 0:
        raise ValueError("prefill throughput and prompt length must be > 0")
    gain = num_tokens * (1.0 / prefill_tps - bytes_per_token / link.bandwidth)
    if gain <= 0:
        return None
    return (fixed.total(link) + request_bytes / link.bandwidth) / gain
