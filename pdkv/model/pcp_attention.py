"""Prefill context parallel attention: each rank computes its part of a split step, and every
rank's KV cache receives the whole step's K/V.

Per layer of a split step (pdkv.parallel.pcp says which rank computes which tokens), on every PCP
rank (vLLM's PCP with "partial query, full key/value": ../shared/reference/ANCHORS.md §3.3):
1. all-gather the K/V of the tokens each rank computed (one all-gather of [2, rows, KVH, D] per
   layer, rows padded to the largest rank's count) and write the other ranks' tokens into this
   rank's cache (`write_remote_kv`); paged attention then writes this rank's own tokens, so every
   rank holds a full replica of the step's K/V;
2. attend this rank's queries over its cache: a chunk of a split run is a prefill run whose
   context is every earlier position (the cached prefix and the earlier chunks, now all written),
   so paged attention's causal mask by position is exact (no log-sum-exp merge is needed: every
   key a query sees is in the local replica);
3. after the last layer, all-gather the final hidden states of the rows whose logits are sampled
   (`gather_logit_rows`), so every rank computes the same logits and samples the same tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pdkv.model.kv_quant import KVCacheLayer, store_kv
from pdkv.parallel.context import ParallelContext


@dataclass
class PCPMetadata:
    """This rank's part of a split step (built by pdkv.worker.attn_metadata.build_pcp_step).

    Attributes:
        parallel: the rank's context (its PCP group).
        width: rows every rank sends in the K/V all-gather (the largest rank's token count).
        remote_idx: [R] long, rows of the flattened gather ([N·width]) holding the tokens other
            ranks computed.
        remote_slot_blocks, remote_slot_offsets: [R] long, those tokens' slots in this rank's
            cache (the same block ids on every rank: replicas).
        logits_rows: [S_local] long, this rank's local rows whose logits are sampled.
        logits_width: rows every rank sends in the hidden-state all-gather (the largest S_local).
        logits_idx: [S] long, rows of the flattened hidden-state gather ([N·logits_width]) in
            the order of the runner's logits indices.
        comm_seconds: time spent in this step's all-gathers (summed over layers).
    """

    parallel: ParallelContext
    width: int
    remote_idx: torch.Tensor
    remote_slot_blocks: torch.Tensor
    remote_slot_offsets: torch.Tensor
    logits_rows: torch.Tensor
    logits_width: int
    logits_idx: torch.Tensor
    comm_seconds: float = 0.0


def gather_padded(parallel: ParallelContext, x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`x` of every PCP rank, padded with zeros to `width` rows along `dim`, stacked in rank order
    and flattened: [N·width, ...] for dim 0 (rank r's row i at r·width + i).

    Raises:
        ValueError: x has more than `width` rows.
    """
    rows = x.shape[dim]
    if rows > width:
        raise ValueError(f"{rows} rows do not fit the gather width {width}")
    if rows < width:
        pad = list(x.shape)
        pad[dim] = width - rows
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    gathered = parallel.all_gather_pcp(x)  # [N, ...]
    return gathered.movedim(0, dim).flatten(dim, dim + 1)


def write_remote_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: KVCacheLayer, meta: PCPMetadata
) -> None:
    """Write the K/V of the tokens the other PCP ranks computed into this rank's cache.

    Args:
        k, v: [T_local, KVH, D], this rank's tokens (rotated keys, values).
        kv_cache: this layer's [2, num_blocks, block_size, KVH, D] (or a QuantKVCache).
    """
    t0 = time.perf_counter()
    kv = gather_padded(meta.parallel, torch.stack([k, v]), meta.width, dim=1)  # [2, N·width, ...]
    meta.comm_seconds += time.perf_counter() - t0
    remote = kv[:, meta.remote_idx]
    store_kv(kv_cache, meta.remote_slot_blocks, meta.remote_slot_offsets, remote[0], remote[1])


def gather_logit_rows(hidden: torch.Tensor, meta: PCPMetadata) -> torch.Tensor:
    """Final hidden states of the step's sampled rows, from the ranks that computed them.

    Args:
        hidden: [T_local, hidden] this rank's rows after the last layer.

    Returns:
        [S, hidden], in the order of the runner's logits indices, equal on every rank.
    """
    if meta.logits_idx.numel() == 0:
        return hidden[:0]
    t0 = time.perf_counter()
    rows = gather_padded(meta.parallel, hidden[meta.logits_rows], meta.logits_width, dim=0)
    meta.comm_seconds += time.perf_counter() - t0
    return rows[meta.logits_idx]
