"""Rank layout of tensor parallelism (TP), decode context parallelism (DCP) and prefill context
parallelism (PCP); torch-free.

Two DCP modes (docs/ARCHITECTURE.md "TP and DCP"):

- **vLLM mode** (`dcp_replicated=False`): DCP is carved out of TP, as in vLLM
  (`--decode-context-parallel-size` with `-tp`): world size = tp; the DCP group of a rank is the
  `dcp` consecutive TP ranks that hold the same KV head (vLLM's rule: tp ≥ dcp × KV heads, so each
  rank holds one KV head, replicated dcp times). Their query heads differ: a rank gathers the
  group's queries, attends them over its token shard and keeps its own heads after the merge.
- **Replicated mode** (`dcp_replicated=True`, the default when tp is 1): each DCP rank holds a
  whole TP shard of the weights (the whole model at tp 1), world size = tp × dcp, rank =
  dcp_rank × tp + tp_rank. Every rank of a DCP group computes the same heads; only the KV is split.

Token placement (vLLM's `cp_kv_cache_interleave_size`, I; N = dcp size): token p lives on DCP rank
(p // I) % N at local index (p // (I·N))·I + p % I of that rank's sequence. The scheduler's logical
block covers block_size × N tokens; its local indices on each rank fill exactly one physical block
of block_size tokens (I must divide block_size), so every rank uses the same block ids.

PCP (vLLM's `--prefill-context-parallel-size`, world = TP × PCP in vLLM): built for tp 1 and dcp 1
only, where every rank is a PCP rank holding the whole model and a full replica of the KV cache
(rank = pcp rank); how a step's tokens are split is `pdkv.parallel.pcp`. As in vLLM (PR #52779:
PCP producers hold identical replicas and one rank publishes), only PCP rank 0 runs a KV connector
worker half (`publishes_kv`): to a KV peer the engine looks like one rank at tp 1.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes and rank mapping of one engine's worker processes.

    Attributes:
        tp_size: tensor-parallel ranks (weights and attention heads sharded).
        dcp_size: decode-context-parallel ranks sharing one request's KV (tokens sharded).
        interleave: consecutive tokens placed on one DCP rank (I).
        dcp_replicated: replicated mode (see module docstring) instead of vLLM mode.
        pcp_size: prefill-context-parallel ranks (each a whole model with a full KV replica).

    Raises:
        ValueError: a size below 1, dcp not dividing tp in vLLM mode, pcp > 1 with tp or dcp
            above 1 (not built).
    """

    tp_size: int = 1
    dcp_size: int = 1
    interleave: int = 1
    dcp_replicated: bool = False
    pcp_size: int = 1

    def __post_init__(self) -> None:
        if self.pcp_size < 1:
            raise ValueError(f"prefill_context_parallel_size={self.pcp_size} must be >= 1")
        if self.pcp_size > 1 and (self.tp_size > 1 or self.dcp_size > 1):
            raise ValueError(
                f"prefill_context_parallel_size={self.pcp_size} is built only with "
                f"tensor_parallel_size=1 and decode_context_parallel_size=1 (got "
                f"{self.tp_size} and {self.dcp_size}): PCP with TP or DCP is not built yet"
            )
        if self.tp_size < 1 or self.dcp_size < 1 or self.interleave < 1:
            raise ValueError(
                f"tensor_parallel_size={self.tp_size}, "
                f"decode_context_parallel_size={self.dcp_size} and "
                f"cp_kv_cache_interleave_size={self.interleave} must all be >= 1"
            )
        if not self.dcp_replicated and self.tp_size % self.dcp_size:
            raise ValueError(
                f"decode_context_parallel_size={self.dcp_size} must divide "
                f"tensor_parallel_size={self.tp_size} (vLLM carves DCP out of TP); with "
                "tensor_parallel_size=1 or --dcp-replicate-weights, DCP ranks replicate the "
                "weights instead (world size tp x dcp)"
            )

    @property
    def world_size(self) -> int:
        """Worker processes."""
        return self.tp_size * (self.dcp_size if self.dcp_replicated else 1) * self.pcp_size

    def pcp_rank(self, rank: int) -> int:
        """Position of `rank` in its PCP group (vLLM: the outermost index, rank // (tp × dcp
        ranks)); 0 without PCP."""
        return rank // (self.world_size // self.pcp_size)

    @property
    def kv_publishers(self) -> int:
        """Ranks that run a KV connector worker half and report to the engine: every rank, but
        with PCP only PCP rank 0 (the replicas are identical, so one publishes; the others
        register nothing and report nothing)."""
        return self.world_size // self.pcp_size

    def publishes_kv(self, rank: int) -> bool:
        """Whether `rank` runs a KV connector worker half (see kv_publishers): its PCP rank is 0."""
        return self.pcp_rank(rank) == 0

    def pcp_groups(self) -> list[list[int]]:
        """Every PCP group's ranks, in PCP-rank order (one group: PCP is built at tp 1, dcp 1)."""
        return [list(range(self.pcp_size))]

    def tp_rank(self, rank: int) -> int:
        """Position of `rank` in its TP group (which weight shard it holds)."""
        return rank % self.tp_size

    def dcp_rank(self, rank: int) -> int:
        """Position of `rank` in its DCP group (which token shard it holds)."""
        return rank // self.tp_size if self.dcp_replicated else rank % self.dcp_size

    def tp_groups(self) -> list[list[int]]:
        """Every TP group's ranks (create process groups in this order on every rank)."""
        if self.dcp_replicated:
            return [
                [d * self.tp_size + t for t in range(self.tp_size)] for d in range(self.dcp_size)
            ]
        return [list(range(self.tp_size))]

    def dcp_groups(self) -> list[list[int]]:
        """Every DCP group's ranks, in DCP-rank order."""
        if self.dcp_replicated:
            return [
                [d * self.tp_size + t for d in range(self.dcp_size)] for t in range(self.tp_size)
            ]
        n = self.dcp_size
        return [list(range(g * n, (g + 1) * n)) for g in range(self.tp_size // n)]

    def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """vLLM's head constraints for this layout.

        Raises:
            ValueError: tp does not divide the query heads; tp and the KV heads do not divide one
                another; vLLM-mode DCP whose group would span KV heads (needs tp / KV heads to be a
                multiple of dcp). The message names the values.
        """
        tp = self.tp_size
        if num_heads % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} must divide the model's {num_heads} attention heads"
            )
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size={tp} and the model's {num_kv_heads} KV heads must divide "
                "one another"
            )
        if (
            self.dcp_size > 1
            and not self.dcp_replicated
            and (tp < num_kv_heads or (tp // num_kv_heads) % self.dcp_size)
        ):
            raise ValueError(
                f"decode_context_parallel_size={self.dcp_size} (vLLM mode) needs "
                "tensor_parallel_size / KV heads to be a multiple of it; got "
                f"tensor_parallel_size={tp} with {num_kv_heads} KV heads (use "
                "tensor_parallel_size=1 for DCP ranks that replicate the weights)"
            )

    def kv_heads_per_rank(self, num_kv_heads: int) -> int:
        """KV heads each rank stores (1 when tp exceeds them: replicated)."""
        return max(1, num_kv_heads // self.tp_size)

    def kv_head_start(self, rank: int, num_kv_heads: int) -> int:
        """First KV head of `rank` (tp / KV heads consecutive ranks share one head when tp
        exceeds them)."""
        tp = self.tp_size
        if tp <= num_kv_heads:
            return self.tp_rank(rank) * (num_kv_heads // tp)
        return self.tp_rank(rank) // (tp // num_kv_heads)


def dcp_owner(pos: int, interleave: int, dcp_size: int) -> int:
    """DCP rank that stores token position `pos`: (pos // I) % N."""
    return (pos // interleave) % dcp_size


def dcp_local_index(pos: int, interleave: int, dcp_size: int) -> int:
    """Index of position `pos` in its owner's local sequence: (pos // (I·N))·I + pos % I."""
    return (pos // (interleave * dcp_size)) * interleave + pos % interleave


def dcp_global_position(local: int, dcp_rank: int, interleave: int, dcp_size: int) -> int:
    """Inverse of dcp_local_index on rank `dcp_rank`: the token position of local index `local`."""
    return (
        (local // interleave) * interleave * dcp_size + dcp_rank * interleave + local % interleave
    )


def dcp_local_len(num_tokens: int, dcp_rank: int, interleave: int, dcp_size: int) -> int:
    """How many of positions [0, num_tokens) rank `dcp_rank` stores (0 = an empty shard)."""
    cycle = interleave * dcp_size
    full, rem = divmod(num_tokens, cycle)
    return full * interleave + min(max(rem - dcp_rank * interleave, 0), interleave)
