"""Prefill context parallelism (PCP) terms: per-rank compute, all-gather bytes and time, and the
crossover prompt length (pure arithmetic; FLOPs, bytes, tokens, seconds).

A prefill of L prompt tokens (no cached prefix) on N PCP ranks, as pdkv runs it
(docs/PARALLEL_TIERS.md "Prefill context parallelism", pdkv.parallel.pcp):

    split     only when L >= 2N × MIN_CHUNK_TOKENS; rank r computes chunks r and 2N−1−r of the
              2N chunks of s = ceil(L / 2N) tokens (head_tail_chunks); a shorter prompt is not
              split: every rank runs it whole, with no communication
    compute   per rank, over the positions p it owns (0-based):
                  linear    = layers × rows_r × 2 × W           W: weights per layer (q, k, v, o,
                                                             gate, up, down; the Llama block)
                  attention = layers × Σ (p+1) × 4 × heads × head_dim   (QKᵀ and PV, causal:
                                                             query p sees p+1 keys, every key in
                                                             the rank's replica)
                  lm head   = 2 × hidden × vocab             (one sampled row, on every rank)
              the slowest rank sets the time: compute_s = max_r FLOPs_r / F_rank
    comm      per layer one all-gather of [2, rows_max, kv_heads, head_dim] (K and V, padded to the
              fullest rank's rows), then one of the sampled row's hidden state [1, hidden]:
                  bytes per rank = layers × rows_max × 2 × kv_heads × head_dim × kv_bytes × (N−1)
                                   + hidden × act_bytes × (N−1)
              (rows_max × (N−1) = L × (N−1)/N when 2N divides L); a ring all-gather costs
              (N−1) × latency + bytes / bandwidth (Thakur, Rabenseifner and Gropp, "Optimization
              of collective communication operations in MPICH", 2005), so
                  comm_s = (layers + 1) × (N−1) × latency + bytes / bandwidth
    total     pcp_s = t0 + compute_s + comm_s (no overlap: pdkv waits for each all-gather)
              single_s = t0 + FLOPs_1(L) / F
              t0: a fixed time per prefill step that splitting does not shorten (scheduling,
              Python, sampling; every rank pays it at once)

F (achieved FLOP/s of one rank alone) is calibrated from one measured single-rank prefill:
F = FLOPs_1(L0) / (t_1(L0) − t0), or F and t0 both fitted to single-rank prefills at several
lengths (fit_single_rank: least squares of t = t0 + FLOPs_1(L) / F). Ranks sharing one box's
cores (`shared_speedup` S): each rank computes at F / S, where S is how much faster one rank is
on all the cores than on its 1/N share (S = N when cores scale linearly: then the split buys no
compute and comm is pure loss); ranks on their own devices compute at F (S = 1).

Crossover: the smallest L at which pcp_s(L) < single_s(L). Found by doubling L
from 2N × MIN_CHUNK_TOKENS up to MAX_CROSSOVER_TOKENS, then bisecting between the last length
that did not gain and the first that did (the gain, quadratic minus linear in L, changes sign
once there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdkv.parallel.pcp import MIN_CHUNK_TOKENS, head_tail_chunks

MAX_CROSSOVER_TOKENS = 1 << 24
"""Longest prompt the crossover search tries (16 M tokens): beyond it, "never"."""


@dataclass(frozen=True)
class PcpShape:
    """The model dimensions PCP's terms need (a Llama-type dense decoder).

    Attributes:
        num_layers: decoder layers (one K/V all-gather each).
        hidden_size: residual width.
        num_heads: query heads.
        num_kv_heads: K/V heads (what the all-gather carries).
        head_dim: per-head width.
        intermediate_size: MLP width (gate, up, down).
        vocab_size: LM head rows (computed for the sampled row only).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> PcpShape:
        """Read the dimensions from a HF config.json (a `text_config` inside is preferred).

        Raises:
            ValueError: a dimension is missing (e.g. no intermediate_size) or not positive.
        """
        c = {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg
        try:
            heads = int(c["num_attention_heads"])
            hidden = int(c["hidden_size"])
            shape = cls(
                num_layers=int(c["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or hidden // heads),
                intermediate_size=int(c["intermediate_size"]),
                vocab_size=int(c["vocab_size"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"PCP terms need a dense decoder's config.json: {e!r}") from None
        if min(vars(shape).values()) < 1:
            raise ValueError(f"PCP terms need positive dimensions, got {shape}")
        return shape

    @property
    def layer_weights(self) -> int:
        """Weights of one decoder layer's linears: q, k, v, o and the MLP's gate, up, down."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden_size * (q + 2 * kv) + q * self.hidden_size \
            + 3 * self.hidden_size * self.intermediate_size

    def linear_flops(self, rows: int) -> int:
        """FLOPs of every layer's linears on `rows` tokens: layers × rows × 2 × layer_weights."""
        return self.num_layers * rows * 2 * self.layer_weights

    def attention_flops(self, key_pairs: int) -> int:
        """FLOPs of causal attention over `key_pairs` (query, key) pairs in every layer:
        layers × pairs × 4 × heads × head_dim (QKᵀ and PV, 2 FLOPs per multiply-add)."""
        return self.num_layers * key_pairs * 4 * self.num_heads * self.head_dim

    @property
    def lm_head_flops(self) -> int:
        """FLOPs of the logits of one sampled row: 2 × hidden × vocab."""
        return 2 * self.hidden_size * self.vocab_size


def causal_pairs(begin: int, end: int) -> int:
    """(query, key) pairs of the causal attention of positions [begin, end) of a prompt with no
    cached prefix: Σ (p + 1) for p in [begin, end) = (end(end+1) − begin(begin+1)) / 2."""
    return (end * (end + 1) - begin * (begin + 1)) // 2


@dataclass(frozen=True)
class RankWork:
    """One rank's part of a prefill (tokens and FLOPs)."""

    rows: int
    key_pairs: int
    flops: int


def split_threshold(pcp: int) -> int:
    """Shortest prompt (tokens) pdkv splits over `pcp` ranks: 2N × MIN_CHUNK_TOKENS."""
    return 2 * pcp * MIN_CHUNK_TOKENS


def rank_work(shape: PcpShape, num_tokens: int, pcp: int) -> list[RankWork]:
    """Each rank's rows, causal pairs and FLOPs for a `num_tokens` prefill on `pcp` ranks (the
    whole prompt on every rank when it is shorter than split_threshold, as pdkv runs it).

    Raises:
        ValueError: pcp < 1 or num_tokens < 1.
    """
    if pcp < 1 or num_tokens < 1:
        raise ValueError(f"need pcp >= 1 and a prompt of >= 1 token, got {pcp}, {num_tokens}")
    if pcp == 1 or num_tokens < split_threshold(pcp):
        chunks: list[tuple[tuple[int, int], ...]] = [((0, num_tokens),)] * pcp
    else:
        chunks = head_tail_chunks(num_tokens, pcp)
    out = []
    for mine in chunks:
        rows = sum(e - b for b, e in mine)
        pairs = sum(causal_pairs(b, e) for b, e in mine)
        flops = shape.linear_flops(rows) + shape.attention_flops(pairs) + shape.lm_head_flops
        out.append(RankWork(rows, pairs, flops))
    return out


def allgather_bytes(shape: PcpShape, num_tokens: int, pcp: int, kv_bytes: float,
                    act_bytes: float) -> float:
    """Bytes one rank receives in a split prefill's all-gathers (0 when it is not split):
    layers × rows_max × 2 × kv_heads × head_dim × kv_bytes × (N−1) for K/V, plus
    hidden × act_bytes × (N−1) for the sampled row (module docstring)."""
    if pcp == 1 or num_tokens < split_threshold(pcp):
        return 0.0
    rows_max = max(w.rows for w in rank_work(shape, num_tokens, pcp))
    kv = shape.num_layers * rows_max * 2 * shape.num_kv_heads * shape.head_dim * kv_bytes
    return (kv + shape.hidden_size * act_bytes) * (pcp - 1)


@dataclass(frozen=True)
class PcpCost:
    """A prefill's time on one rank and on N PCP ranks (seconds) and the all-gather bytes."""

    single_s: float
    compute_s: float
    comm_s: float
    comm_bytes: float
    overhead_s: float = 0.0

    @property
    def pcp_s(self) -> float:
        """overhead_s + compute_s + comm_s (no overlap)."""
        return self.overhead_s + self.compute_s + self.comm_s

    @property
    def speedup(self) -> float:
        """single_s / pcp_s (> 1: PCP is faster)."""
        return self.single_s / self.pcp_s


@dataclass(frozen=True)
class PcpModel:
    """Everything PCP's time terms read besides the prompt length.

    Attributes:
        shape: model dimensions.
        pcp: ranks N.
        flops_per_s: F, achieved FLOP/s of one rank alone (calibrate_flops).
        bandwidth: bytes/s one rank's all-gather receives at.
        latency: seconds per step of a ring all-gather.
        kv_bytes: bytes of one K or V element.
        act_bytes: bytes of one activation element.
        shared_speedup: S, each rank runs at F / S (1: ranks on their own devices; N: N ranks
            share the cores one rank had, linear in cores).
        overhead_s: t0, seconds per prefill that splitting does not shorten (on one rank too).
    """

    shape: PcpShape
    pcp: int
    flops_per_s: float
    bandwidth: float
    latency: float
    kv_bytes: float
    act_bytes: float
    shared_speedup: float = 1.0
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.pcp < 1:
            raise ValueError(f"pcp must be >= 1, got {self.pcp}")
        if min(self.flops_per_s, self.bandwidth, self.shared_speedup) <= 0 \
                or min(self.latency, self.overhead_s) < 0:
            raise ValueError("FLOP/s, bandwidth and shared speed-up must be > 0, latency and "
                             "overhead >= 0")

    def cost(self, num_tokens: int) -> PcpCost:
        """The prefill of `num_tokens` tokens on one rank and on N ranks (module docstring).

        Raises:
            ValueError: num_tokens < 1.
        """
        work = rank_work(self.shape, num_tokens, self.pcp)
        single = self.overhead_s + rank_work(self.shape, num_tokens, 1)[0].flops / self.flops_per_s
        rank_flops = self.flops_per_s / self.shared_speedup
        compute = max(w.flops for w in work) / rank_flops
        nbytes = allgather_bytes(self.shape, num_tokens, self.pcp, self.kv_bytes, self.act_bytes)
        comm = 0.0
        if nbytes:
            collectives = self.shape.num_layers + 1
            comm = collectives * (self.pcp - 1) * self.latency + nbytes / self.bandwidth
        return PcpCost(single, compute, comm, nbytes, self.overhead_s)

    def crossover(self) -> int | None:
        """Smallest prompt length (tokens) at which N ranks prefill faster than one; None when
        none up to MAX_CROSSOVER_TOKENS does (or pcp is 1). Search: module docstring."""
        if self.pcp == 1:
            return None

        def gains(n: int) -> bool:
            c = self.cost(n)
            return c.pcp_s < c.single_s

        lo = split_threshold(self.pcp)
        if gains(lo):
            return lo
        hi = lo * 2
        while not gains(hi):
            if hi >= MAX_CROSSOVER_TOKENS:
                return None
            lo, hi = hi, min(hi * 2, MAX_CROSSOVER_TOKENS)
        while hi - lo > 1:  # gains(hi), not gains(lo)
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if gains(mid) else (mid, hi)
        return hi


def calibrate_flops(shape: PcpShape, num_tokens: int, seconds: float,
                    overhead_s: float = 0.0) -> float:
    """F = FLOPs of a single-rank prefill of `num_tokens` tokens / (its measured `seconds` −
    t0); with t0 = 0 every second, overheads included, is charged to FLOPs.

    Raises:
        ValueError: seconds <= overhead_s, or num_tokens < 1.
    """
    if seconds <= overhead_s:
        raise ValueError(f"a measured prefill of {seconds} s leaves no compute time after "
                         f"{overhead_s} s of overhead")
    return rank_work(shape, num_tokens, 1)[0].flops / (seconds - overhead_s)


def fit_single_rank(shape: PcpShape, samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(t0 seconds, F FLOP/s) of t = t0 + FLOPs_1(L) / F fitted by least squares to single-rank
    prefills (L tokens, t seconds). t0 is kept >= 0 (a negative fit, from noise: t0 = 0 and F
    through the origin); one sample: t0 = 0.

    Raises:
        ValueError: no samples, or the fit gives no positive F (times not growing with L).
    """
    if not samples:
        raise ValueError("no single-rank prefill to fit")
    xs = [float(rank_work(shape, n, 1)[0].flops) for n, _ in samples]
    ts = [t for _, t in samples]
    t0, slope = 0.0, sum(x * t for x, t in zip(xs, ts)) / sum(x * x for x in xs)
    if len(set(xs)) > 1:
        mx, mt = sum(xs) / len(xs), sum(ts) / len(ts)
        b = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sum((x - mx) ** 2 for x in xs)
        if mt - b * mx >= 0 and b > 0:
            t0, slope = mt - b * mx, b
    if slope <= 0:
        raise ValueError(f"single-rank prefill times {ts} do not grow with the prompt")
    return t0, 1.0 / slope
