"""Attention that returns the log-sum-exp of its scores, and the LSE merge of partial results.

The reference path of the attention op of docs/ARCHITECTURE.md "Three decisions" §1:
`shard_attention` attends each request's queries over the keys this rank stores and returns
(out, lse); `merge_attn_states` combines the partial results of N ranks that hold disjoint key
sets (decode context parallelism, DCP) into the result over all keys.

Keys need not be contiguous positions: each request gives the global position of every local key
(under DCP, `pdkv.parallel.layout.dcp_global_position` of local indices 0..dcp_local_len-1), and
causality is decided by global position. Scores and softmax are computed in float32. This module
uses no torch.distributed; the caller gathers the partial (out, lse) pairs.

Merge (FlashAttention's split-KV combine, vLLM's `correct_attn_out` / `cp_lse_ag_out_rs` of DCP;
../shared/reference/ANCHORS.md §3.3):
    L = log Σ_i exp(lse_i),   out = Σ_i exp(lse_i − L) · out_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdkv.model.kv_quant import KVCacheLayer, read_kv


@dataclass
class ShardSeq:
    """One request's queries of this step, attending over the keys this rank stores.

    Attributes:
        start, end: its query rows [start, end) of the flat batch.
        query_positions: [end - start] long, global token positions of the queries.
        block_table: [num_blocks] long, this rank's blocks; local key l is in
            block_table[l // block_size] at offset l % block_size.
        key_positions: [num_keys] long, global position of local keys 0..num_keys-1
            (num_keys may be 0: an empty shard).
    """

    start: int
    end: int
    query_positions: torch.Tensor
    block_table: torch.Tensor
    key_positions: torch.Tensor


def gather_keys(
    kv_cache: KVCacheLayer, block_table: torch.Tensor, num_keys: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local keys and values 0..num_keys-1 of one request.

    Args:
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size] (0 = K, 1 = V), or a
            QuantKVCache (then dequantized to its compute dtype).
        block_table: [nb] long; local key l is in block_table[l // block_size], offset
            l % block_size.
        num_keys: how many local keys (tokens) to read.

    Returns:
        k, v: [num_keys, num_kv_heads, head_size] each.

    Raises:
        IndexError: the block table covers fewer than num_keys tokens.
    """
    block_size = kv_cache.shape[2]
    local = torch.arange(num_keys, device=kv_cache.device)
    blocks = block_table.to(kv_cache.device)[local // block_size]
    offsets = local % block_size
    return read_kv(kv_cache, 0, blocks, offsets), read_kv(kv_cache, 1, blocks, offsets)


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of n queries over m keys, with the log-sum-exp of the visible scores.

    Args:
        q: [n, H, D] queries.
        k, v: [m, KVH, D] keys and values (GQA: query head h uses KV head h // (H // KVH)).
        visible: [n, m] bool, True where query i may attend to key j.
        scale: softmax scale (1/sqrt(head_size)).

    Returns:
        out [n, H, D] in q's dtype, lse [n, H] float32 = log Σ_j exp(scale · q·k_j) over visible
        keys. A query with no visible key (or m == 0) gets out 0 and lse −inf, never NaN.
    """
    n, num_heads, _ = q.shape
    if k.shape[0] == 0:
        return torch.zeros_like(q), q.new_full((n, num_heads), float("-inf"), dtype=torch.float32)
    rep = num_heads // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale  # [H, n, m]
    scores = scores.masked_fill(~visible.to(scores.device)[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, n]; -inf for rows with no visible key
    # Subtract a finite stand-in where lse is -inf, so exp(-inf - 0) = 0 instead of NaN.
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("hqk,khd->qhd", probs, vf)
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def shard_attention(
    q: torch.Tensor,
    kv_cache: KVCacheLayer,
    seqs: list[ShardSeq],
    scale: float,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each request's queries over the keys this rank stores.

    A key is visible to a query iff key_position <= query_position (global positions), and with
    a sliding window W also key_position > query_position - W (HF semantics), so the same
    function serves decodes, prefill chunks, and DCP shards whose keys are interleaved.
    The keys of this step must already be in `kv_cache` (write before attending).

    Args:
        q: [T, H, D] queries of the flat batch.
        kv_cache: [2, num_blocks, block_size, KVH, D] (0 = K, 1 = V) or a QuantKVCache; GQA:
            query head h uses KV head h // (H // KVH).
        seqs: the requests; their row ranges must not overlap.
        scale: softmax scale (1/sqrt(head_size)).
        sliding_window: W in tokens, or None for full causal attention.

    Returns:
        out [T, H, D] in q's dtype and lse [T, H] float32 (log Σ_j exp(scale · q·k_j) over
        visible keys). Rows with no visible key, and rows not covered by any seq: out 0, lse −inf.

    Raises:
        IndexError: a block table covers fewer tokens than its key_positions.
    """
    out = torch.zeros_like(q)
    lse = q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
    for seq in seqs:
        num_keys = int(seq.key_positions.numel())
        if num_keys == 0 or seq.end == seq.start:
            continue
        k, v = gather_keys(kv_cache, seq.block_table, num_keys)
        qpos = seq.query_positions.to(q.device)
        kpos = seq.key_positions.to(q.device)
        visible = kpos[None, :] <= qpos[:, None]
        if sliding_window is not None:
            visible &= kpos[None, :] > qpos[:, None] - sliding_window
        o, s = attention_with_lse(q[seq.start : seq.end], k, v, visible, scale)
        out[seq.start : seq.end] = o
        lse[seq.start : seq.end] = s
    return out, lse


def merge_attn_states(
    outs: torch.Tensor, lses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine N ranks' partial attention over disjoint key sets into attention over all keys.

    L = log Σ_i exp(lse_i), out = Σ_i exp(lse_i − L) · out_i, computed against the per-row
    maximum of lse_i so large scores do not overflow. Ranks with lse −inf contribute nothing
    (whatever their out holds); a row where every rank has −inf gets out 0 and lse −inf (no
    NaN). Sums run in rank order, so every rank that merges the same inputs gets bit-identical
    results.
    Source: FlashAttention's split-KV LSE combine; vLLM DCP's `correct_attn_out` /
    `cp_lse_ag_out_rs` (../shared/reference/ANCHORS.md §3.3).

    Args:
        outs: [N, T, H, D] partial outputs (any float dtype).
        lses: [N, T, H] their log-sum-exps (float32 or wider).

    Returns:
        out [T, H, D] in outs' dtype, lse [T, H] float32.

    Raises:
        ValueError: outs and lses disagree on N, T or H, or N is 0.
    """
    if outs.dim() != 4 or lses.shape != outs.shape[:3] or outs.shape[0] == 0:
        raise ValueError(
            f"merge_attn_states needs outs [N, T, H, D] and lses [N, T, H] with N >= 1; "
            f"got {tuple(outs.shape)} and {tuple(lses.shape)}"
        )
    lses = lses.float()
    peak = lses.amax(dim=0)  # [T, H]
    peak = torch.where(torch.isinf(peak), 0.0, peak)  # all -inf rows: weights come out 0
    weights = torch.exp(lses - peak)  # [N, T, H], in [0, 1]
    total = torch.zeros_like(peak)
    for i in range(lses.shape[0]):
        total = total + weights[i]
    lse = peak + torch.log(total)  # log(0) = -inf where no rank has a key
    # total >= 1 wherever some rank is finite (its peak weighs exp(0)); clamping only avoids 0/0.
    scale = weights / total.clamp_min(1.0)
    out = torch.zeros(outs.shape[1:], dtype=torch.float32, device=outs.device)
    for i in range(outs.shape[0]):
        # where, not a product: an empty rank's out may be garbage (even NaN); it adds exactly 0.
        empty = torch.isneginf(lses[i])[..., None]
        out = out + torch.where(empty, 0.0, scale[i, ..., None] * outs[i].float())
    return out.to(outs.dtype), lse
