"""Prefill context parallelism (PCP): which rank computes which tokens of a step; torch-free.

The split is vLLM's (`--prefill-context-parallel-size`, its PCP manager's "DualChunkSwap";
../shared/reference/ANCHORS.md §3.3): a prefill run of n tokens is padded to a multiple of 2N
(N = PCP ranks) and cut into 2N chunks of s = ceil(n / 2N) tokens; rank r computes chunk r (the
head) and chunk 2N-1-r (the tail), so every rank gets early positions (cheap causal attention) and
late ones (expensive), and the attention work is balanced. pdkv computes no padding: chunk i is
offsets [i·s, min((i+1)·s, n)) of the run, so the last chunks are shorter (or empty when N is
large) and rank 0's tail chunk is the shortest.

Where pdkv differs from vLLM, and why:
- Only runs of at least `min_split_tokens` tokens are split (default 2N × MIN_CHUNK_TOKENS, so
  every chunk but the short last ones holds at least MIN_CHUNK_TOKENS): below that the two
  all-gathers per layer cost more than the rows they save.
- Every other token of a split step (decodes, short prefill runs) is computed by rank 0 alone,
  where vLLM duplicates decodes on every rank. On the CPU a matmul's last bits depend on its row
  count, so a token computed inside different batches on different ranks could leave different
  K/V in the ranks' replicas; each rank keeps its own request state and samples for itself, so
  the ranks could then sample different tokens. With every token computed by exactly one rank and
  its K/V and final hidden state all-gathered, every replica and every rank's logits are equal bit
  for bit.
- A step with no run to split is not split at all: every rank runs the whole step (same inputs,
  same batch shapes, same bits), as decode steps do.

Local order on a rank: the step's requests in flat order; a split run contributes its head chunk
then its tail chunk; an unsplit request (rank 0 only) its whole run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIN_CHUNK_TOKENS = 16
"""Smallest head-tail chunk worth a split: runs of at least 2N × this many tokens are split."""


def head_tail_chunks(num_tokens: int, pcp_size: int) -> list[tuple[tuple[int, int], ...]]:
    """Each rank's chunks of a run of `num_tokens` tokens, as (begin, end) offsets in the run.

    Rank r gets chunk r and chunk 2N-1-r of the 2N chunks of s = ceil(n / 2N) tokens (chunk i:
    [i·s, min((i+1)·s, n)), empty chunks left out); source: vLLM's PCP partition (padded to a
    multiple of 2N; the padding is not computed here).

    Returns:
        per rank, in rank order, its non-empty chunks (head first). The chunks of all ranks
        cover [0, num_tokens) exactly once.

    Raises:
        ValueError: pcp_size < 1 or num_tokens < 0.
    """
    if pcp_size < 1 or num_tokens < 0:
        raise ValueError(f"need pcp_size >= 1 and num_tokens >= 0, got {pcp_size}, {num_tokens}")
    k = 2 * pcp_size
    s = -(-num_tokens // k)

    def chunk(i: int) -> tuple[int, int]:
        return min(i * s, num_tokens), min((i + 1) * s, num_tokens)

    out = []
    for r in range(pcp_size):
        out.append(tuple(c for c in (chunk(r), chunk(k - 1 - r)) if c[1] > c[0]))
    return out


@dataclass(frozen=True)
class LocalRun:
    """A run of consecutive tokens of one request that one rank computes.

    Attributes:
        request: index of the request in the step (flat order).
        offset: first token's offset in that request's scheduled tokens (its position is the
            request's cached tokens + offset).
        length: tokens in the run (>= 1).
        local_start: the run's first row in the rank's local batch.
    """

    request: int
    offset: int
    length: int
    local_start: int


@dataclass(frozen=True)
class PCPStepPlan:
    """Which rank computes which of a step's tokens (built by `plan_pcp_step`).

    Attributes:
        num_scheduled: tokens scheduled per request, in flat order.
        runs: per rank, its LocalRuns in local order.
    """

    num_scheduled: tuple[int, ...]
    runs: tuple[tuple[LocalRun, ...], ...]

    @property
    def pcp_size(self) -> int:
        return len(self.runs)

    def starts(self) -> list[int]:
        """Flat index of each request's first token."""
        out, at = [], 0
        for n in self.num_scheduled:
            out.append(at)
            at += n
        return out

    def num_local(self, rank: int) -> int:
        """Tokens rank `rank` computes."""
        return sum(run.length for run in self.runs[rank])

    def local_tokens(self, rank: int) -> list[int]:
        """Flat indices of the tokens rank `rank` computes, in its local order."""
        starts = self.starts()
        return [starts[run.request] + run.offset + j
                for run in self.runs[rank] for j in range(run.length)]

    def owners(self) -> tuple[list[int], list[int]]:
        """(owner rank, local row) of every flat token of the step, in flat order: the inverse
        of the per-rank `local_tokens` lists."""
        total = sum(self.num_scheduled)
        owner, row = [-1] * total, [-1] * total
        for r in range(self.pcp_size):
            for i, t in enumerate(self.local_tokens(r)):
                owner[t], row[t] = r, i
        return owner, row


def plan_pcp_step(
    num_scheduled: Sequence[int], pcp_size: int, min_split_tokens: int | None = None
) -> PCPStepPlan | None:
    """Split one step's tokens over `pcp_size` ranks (see the module docstring).

    Args:
        num_scheduled: tokens scheduled per request, in flat order (a decode is 1).
        pcp_size: N, the PCP ranks.
        min_split_tokens: a run is split only when it has at least this many tokens (None:
            2N × MIN_CHUNK_TOKENS; must be >= 2N so that every rank gets a head chunk).

    Returns:
        the plan, or None when no run is split (pcp_size 1, or every run is short): then every
        rank runs the whole step.

    Raises:
        ValueError: min_split_tokens < 2N.
    """
    if pcp_size <= 1:
        return None
    threshold = 2 * pcp_size * MIN_CHUNK_TOKENS if min_split_tokens is None else min_split_tokens
    if threshold < 2 * pcp_size:
        raise ValueError(
            f"min_split_tokens={threshold} must be >= 2 x prefill_context_parallel_size "
            f"({2 * pcp_size}): every rank needs a head chunk"
        )
    if not any(n >= threshold for n in num_scheduled):
        return None
    runs: list[list[LocalRun]] = [[] for _ in range(pcp_size)]
    sizes = [0] * pcp_size

    def add(rank: int, request: int, begin: int, end: int) -> None:
        runs[rank].append(LocalRun(request, begin, end - begin, sizes[rank]))
        sizes[rank] += end - begin

    for i, n in enumerate(num_scheduled):
        if n >= threshold:
            for r, chunks in enumerate(head_tail_chunks(n, pcp_size)):
                for begin, end in chunks:
                    add(r, i, begin, end)
        elif n > 0:
            add(0, i, 0, n)
    return PCPStepPlan(tuple(num_scheduled), tuple(tuple(r) for r in runs))
