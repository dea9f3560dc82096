"""This process's place in a TP / DCP layout and its torch.distributed process groups.

Nothing here is global: `init_distributed` returns a `ParallelContext` that the loader and the
model receive explicitly (torch.distributed's own default group is the only process-wide state,
and `destroy` tears it down). `ParallelContext.single()` is one process without torch.distributed.

Collectives: `all_reduce_tp` sums the row-parallel partial outputs (o_proj, down_proj) over the TP
group, as vLLM's `tensor_model_parallel_all_reduce`; `all_gather_dcp` concatenates a tensor over
the DCP group in DCP-rank order (vLLM's `get_dcp_group().all_gather`); `all_gather_pcp` stacks
a tensor over the PCP group in PCP-rank order (vLLM's `get_pcp_group().all_gather`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pdkv.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class ParallelContext:
    """Layout, this process's global rank and its process groups.

    Attributes:
        layout: sizes and rank mapping.
        rank: global rank of this process, in [0, layout.world_size).
        tp_group: process group of this rank's TP group; None when tp is 1.
        dcp_group: process group of this rank's DCP group; None when dcp is 1.
        tp_ranks: global ranks of the TP group (group-rank order).
        dcp_ranks: global ranks of the DCP group (group-rank order).
        pcp_group: process group of this rank's PCP group; None when pcp is 1.
        pcp_ranks: global ranks of the PCP group (group-rank order).

    A context with tp > 1 but no tp_group (built by hand, e.g. to load one rank's weight shard in
    a test) loads weights fine and raises RuntimeError on a collective.
    """

    layout: ParallelLayout
    rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    dcp_group: dist.ProcessGroup | None = None
    tp_ranks: tuple[int, ...] = (0,)
    dcp_ranks: tuple[int, ...] = (0,)
    pcp_group: dist.ProcessGroup | None = None
    pcp_ranks: tuple[int, ...] = (0,)

    @staticmethod
    def single() -> ParallelContext:
        """One process: tp 1, dcp 1, no torch.distributed."""
        return ParallelContext(layout=ParallelLayout())

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def dcp_size(self) -> int:
        return self.layout.dcp_size

    @property
    def pcp_size(self) -> int:
        return self.layout.pcp_size

    @property
    def pcp_rank(self) -> int:
        """Which PCP rank this is (which part of a split prefill it computes)."""
        return self.layout.pcp_rank(self.rank)

    @property
    def tp_rank(self) -> int:
        """Which weight shard this rank holds."""
        return self.layout.tp_rank(self.rank)

    @property
    def dcp_rank(self) -> int:
        """Which token shard of the KV this rank holds."""
        return self.layout.dcp_rank(self.rank)

    def all_reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the TP ranks (in place; returns x). Identity at tp 1.

        Raises:
            RuntimeError: tp > 1 without a TP process group.
        """
        if self.tp_size == 1:
            return x
        if self.tp_group is None:
            raise RuntimeError(
                f"tensor_parallel_size={self.tp_size} but rank {self.rank} has no TP process group"
            )
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.tp_group)
        return x

    def all_gather_dcp(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The DCP group's `x` (same shape on every rank) concatenated along `dim` in DCP-rank
        order. Identity at dcp 1.

        Raises:
            RuntimeError: dcp > 1 without a DCP process group.
        """
        if self.dcp_size == 1:
            return x
        if self.dcp_group is None:
            raise RuntimeError(
                f"decode_context_parallel_size={self.dcp_size} but rank {self.rank} has no DCP "
                "group"
            )
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in self.dcp_ranks]
        dist.all_gather(parts, x, group=self.dcp_group)
        # all_gather's list follows group ranks; order it by DCP rank.
        order = sorted(range(len(parts)), key=lambda i: self.layout.dcp_rank(self.dcp_ranks[i]))
        return torch.cat([parts[i] for i in order], dim=dim)

    def all_gather_pcp(self, x: torch.Tensor) -> torch.Tensor:
        """The PCP group's `x` (same shape on every rank) stacked in PCP-rank order:
        [pcp_size, *x.shape]. x[None] at pcp 1.

        Raises:
            RuntimeError: pcp > 1 without a PCP process group.
        """
        if self.pcp_size == 1:
            return x[None]
        if self.pcp_group is None:
            raise RuntimeError(
                f"prefill_context_parallel_size={self.pcp_size} but rank {self.rank} has no PCP "
                "group"
            )
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in self.pcp_ranks]
        dist.all_gather(parts, x, group=self.pcp_group)
        order = sorted(range(len(parts)), key=lambda i: self.layout.pcp_rank(self.pcp_ranks[i]))
        return torch.stack([parts[i] for i in order])

    def destroy(self) -> None:
        """Tear down torch.distributed (and with it this context's groups); no-op when it was not
        initialised (e.g. `single()`)."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(
    layout: ParallelLayout,
    rank: int,
    init_method: str,
    backend: str = "gloo",
    timeout_s: float = 60.0,
) -> ParallelContext:
    """Join the world of `layout.world_size` processes as `rank` and build its process groups.

    Every rank creates every group with `new_group`, TP groups, then DCP, then PCP groups, each
    in the layout's order (torch.distributed requires all ranks to call new_group identically),
    and keeps those containing `rank`.

    Args:
        layout: sizes and rank mapping.
        rank: this process's global rank.
        init_method: rendezvous address, "tcp://127.0.0.1:PORT" (rank 0 listens there).
        backend: "gloo" (CPU) or "nccl" (GPU).
        timeout_s: deadline of the rendezvous and of every collective (seconds).

    Raises:
        ValueError: rank outside [0, world_size).
        RuntimeError / DistNetworkError (from torch): rendezvous failed or timed out.
    """
    world = layout.world_size
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside the world of {world} processes")
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout
    )
    tp_group: dist.ProcessGroup | None = None
    dcp_group: dist.ProcessGroup | None = None
    tp_ranks: tuple[int, ...] = (rank,)
    dcp_ranks: tuple[int, ...] = (rank,)
    for ranks in layout.tp_groups():
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            tp_ranks = tuple(sorted(ranks))  # torch numbers group ranks by ascending global rank
            tp_group = group if len(ranks) > 1 else None
    for ranks in layout.dcp_groups():
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            dcp_ranks = tuple(sorted(ranks))
            dcp_group = group if len(ranks) > 1 else None
    pcp_group: dist.ProcessGroup | None = None
    pcp_ranks: tuple[int, ...] = (rank,)
    if layout.pcp_size > 1:  # no extra group (and no change to TP/DCP start-up) without PCP
        for ranks in layout.pcp_groups():
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if rank in ranks:
                pcp_ranks = tuple(sorted(ranks))
                pcp_group = group
    return ParallelContext(layout, rank, tp_group, dcp_group, tp_ranks, dcp_ranks, pcp_group,
                           pcp_ranks)
