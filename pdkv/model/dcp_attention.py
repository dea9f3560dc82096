"""Decode context parallel attention: each rank stores and attends its token shard, partial
results are merged by log-sum-exp.

Per layer and step, on every rank of a DCP group (vLLM's DCP, ../shared/reference/ANCHORS.md §3):
1. write the K/V of the step's tokens this rank owns (token p on rank (p // I) % N) into its
   local slots;
2. vLLM mode: all-gather the group's query heads (they share this rank's KV head); replicated
   mode: every rank already has the same heads;
3. attend the queries over the local shard -> (out, lse), lse = -inf where a query sees no local
   key (an empty shard contributes nothing);
4. all-gather (out, lse) over the group and merge: L = log Σ exp(lse_i),
   out = Σ exp(lse_i − L)·out_i; vLLM mode keeps its own heads. Every rank merges the same
   inputs in rank order, so all ranks hold bit-identical results.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdkv.model.attention_lse import ShardSeq, merge_attn_states, shard_attention
from pdkv.model.kv_quant import KVCacheLayer, store_kv
from pdkv.parallel.context import ParallelContext
from pdkv.parallel.layout import dcp_local_len


@dataclass
class DCPMetadata:
    """This rank's part of a step (built by `build_dcp_metadata`).

    Attributes:
        parallel: the rank's process groups and layout.
        write_idx: [W] long, flat indices of the step's tokens this rank stores.
        slot_block_ids, slot_offsets: [W] long, their physical block and offset here.
        seqs: per request, its queries and this rank's keys (pdkv.model.attention_lse).
        comm_seconds: time this step spent in the DCP all-gathers and the merge, summed over
            layers (filled by dcp_attention; the benchmark's "all-gather/merge share").
    """

    parallel: ParallelContext
    write_idx: torch.Tensor
    slot_block_ids: torch.Tensor
    slot_offsets: torch.Tensor
    seqs: list[ShardSeq]
    comm_seconds: float = 0.0


def build_dcp_metadata(
    parallel: ParallelContext,
    block_size: int,
    requests: Sequence[tuple[int, int, int, list[int]]],
    device: torch.device,
) -> DCPMetadata:
    """Slots and shard key positions of one step on this rank.

    Args:
        block_size: physical tokens per block on one rank (the logical block holds
            block_size × dcp_size tokens under the same block id).
        requests: per scheduled request (flat start, query count n, cached tokens c, logical block
            table); its queries are positions c .. c+n-1.
    """
    lay = parallel.layout
    rank, n_dcp, inter = parallel.dcp_rank, lay.dcp_size, lay.interleave
    cycle = inter * n_dcp
    write_idx, blocks, offsets, seqs = [], [], [], []
    for start, n, c, table in requests:
        table_t = torch.tensor(table, dtype=torch.long, device=device)
        pos = torch.arange(c, c + n, device=device)
        own = (pos // inter) % n_dcp == rank
        local = (pos[own] // cycle) * inter + pos[own] % inter
        write_idx.append(start + own.nonzero().flatten())
        blocks.append(table_t[local // block_size])
        offsets.append(local % block_size)
        num_keys = dcp_local_len(c + n, rank, inter, n_dcp)
        keys = torch.arange(num_keys, device=device)
        seqs.append(ShardSeq(
            start=start, end=start + n, query_positions=pos,
            block_table=table_t[: -(-num_keys // block_size)],
            key_positions=(keys // inter) * cycle + rank * inter + keys % inter,
        ))

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)

    return DCPMetadata(parallel, cat(write_idx), cat(blocks), cat(offsets), seqs)


def dcp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCacheLayer,
    meta: DCPMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of this rank's query heads over the whole context, stored across the DCP group.

    Args:
        q: [T, H_local, D]; k, v: [T, KVH_local, D] (the step's tokens, all of them).
        kv_cache: this layer's [2, num_blocks, block_size, KVH_local, D] on this rank (or a
            QuantKVCache: the shard is stored quantized and read dequantized).

    Returns:
        [T, H_local, D], equal on every rank of the group for its heads.
    """
    store_kv(kv_cache, meta.slot_block_ids, meta.slot_offsets, k[meta.write_idx], v[meta.write_idx])
    par = meta.parallel
    replicated = par.layout.dcp_replicated
    t0 = time.perf_counter()
    q_all = q if replicated else par.all_gather_dcp(q, dim=1)
    t1 = time.perf_counter()
    out, lse = shard_attention(q_all, kv_cache, meta.seqs, scale)
    t2 = time.perf_counter()
    outs = par.all_gather_dcp(out.unsqueeze(0), dim=0)
    lses = par.all_gather_dcp(lse.unsqueeze(0), dim=0)
    merged, _ = merge_attn_states(outs, lses)
    meta.comm_seconds += (t1 - t0) + (time.perf_counter() - t2)
    if replicated:
        return merged
    h = q.shape[1]
    return merged[:, par.dcp_rank * h : (par.dcp_rank + 1) * h]
