"""Paged attention in plain PyTorch: write new K/V into cache blocks, attend over block tables.

KV cache of one layer (a view into the group's cross-layer tensor):
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]  (0 = K, 1 = V)
The token at position p of a request lives in block `block_table[p // block_size]` at offset
`p % block_size` (its slot). A step's batch is flat: T tokens from several requests, each request
a contiguous run of query tokens. Requests with one query token (decodes, or a one-token prefill
remainder) are attended together; longer runs (prefill chunks) one by one on the reference path,
all in one call on `--attention-backend cpu_paged` (pdkv.model.paged_prefill).

Per layer, the K/V of all T tokens are written first and attention runs after, so a request may
read blocks another request fills in the same step (prefix-cache hits on blocks being computed).

Sliding window (`meta.sliding_window` = W, HF semantics): the query at position p sees keys k with
p - W < k <= p. Block-table entries whose tokens all left the window may hold any block (the
manager puts its null block there once it freed them): every path either never reads them (prefill
with context and decode tables start at the block holding the window's first key); keys of that
first block before the window are masked (prefill, decode B > 1) or sliced off (decode B == 1).
With W None every path is the dense one, with no extra work.

Quantized KV (`pdkv.model.kv_quant.QuantKVCache`, `--kv-cache-dtype int8 | fp8`): the write
quantizes and the step attends over the dequantized values of its own keys, and every cache read
dequantizes what it gathers (reference path: gather, then dequantize to the compute dtype).

Unwritten slots (the KV cache is allocated with torch.empty, and the null block is never
written) may hold anything, NaN included, and a masked NaN key or a NaN value times a zero
weight still poisons SDPA's output. So no path reads a slot that was never written: prefills
slice their keys to the written range, one decode slices its exact range, and batched decodes
gather key by key (`decode_key_blocks` / `decode_key_offsets`), every masked position pointing
at the row's newest key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pdkv.model.kv_quant import KVCacheLayer, read_kv, store_kv


@dataclass
class PrefillSeq:
    """One request's run of more than one query token.

    Attributes:
        start, end: its token range in the flat batch.
        context_len: tokens already in the cache before this run (positions start there).
        block_table: [num_blocks_needed] long, blocks covering context_len + (end - start).
    """

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    """Per-step inputs of paged attention (built by the model runner).

    Attributes:
        slot_block_ids: [T] long, block of each new token.
        slot_offsets: [T] long, offset of each new token within its block.
        prefills: runs of >1 query tokens.
        decode_token_idx: [B] long, flat index of each single-query-token request.
        decode_block_tables: [B, max_blocks] long (padded with 0). With a sliding window W,
            row i starts at the block holding the window's first key max(0, len_i - W), so
            blocks that left the window are never read.
        decode_seq_lens: [B] long, context length including the new token.
        decode_seq_lens_cpu: the same lengths as host ints (vLLM's seq_lens_cpu), so the forward
            never reads them back from the device (no host sync; see pdkv.model.host_sync).
        decode_mask: [B, 1, 1, max_blocks*block_size] bool, True where a key (of the row's
            table) is valid (None when B == 1: the key range is sliced exactly instead).
        decode_key_blocks, decode_key_offsets: [B, max_blocks*block_size] long, the block and
            offset of key j of row i (the table's key j where the mask is True, the row's newest
            key elsewhere, so padding reads only written slots); set with decode_mask.
        all_decode: every token of the step is a decode, in order (decode_token_idx == arange).
        dcp: with decode context parallelism, this rank's slots and token shard
            (pdkv.model.dcp_attention.DCPMetadata); the other fields are then unused.
        pcp: in a step split by prefill context parallelism, this rank's gathers
            (pdkv.model.pcp_attention.PCPMetadata); the other fields then describe this rank's
            own tokens (its chunks as prefill runs whose context is every earlier position).
        sliding_window: W tokens for the layers of a sliding-window KV cache group (the query
            at p sees keys p - W < k <= p), None for full attention.
        prefill_cu_seqlens: [R + 1] long, cumulative query counts of the R prefill runs (in
            flat order, over the prefill tokens only: run r is prefill tokens cu[r] .. cu[r+1]-1).
        prefill_context_lens: [R] long, each run's context_len.
        prefill_block_tables: [R, max_blocks] long, each run's block_table padded with 0.
        prefill_token_idx: [sum of run lengths] long, flat index of each prefill token; None
            when the runs are one contiguous slice of the batch (`prefill_slice`).
        prefill_slice: (first, end) flat range of the runs when contiguous, else None.
        (The prefill_* tensors are set whenever `prefills` is non-empty; the batched prefill op
        of pdkv.model.paged_prefill reads them.)
    """

    slot_block_ids: torch.Tensor
    slot_offsets: torch.Tensor
    prefills: list[PrefillSeq]
    decode_token_idx: torch.Tensor | None
    decode_block_tables: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None
    decode_mask: torch.Tensor | None
    decode_key_blocks: torch.Tensor | None = None
    decode_key_offsets: torch.Tensor | None = None
    all_decode: bool = False
    dcp: Any = None
    pcp: Any = None
    sliding_window: int | None = None
    prefill_cu_seqlens: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_token_idx: torch.Tensor | None = None
    prefill_slice: tuple[int, int] | None = None
    decode_seq_lens_cpu: tuple[int, ...] = ()


DecodeAttentionFn = Callable[[torch.Tensor, Any, AttentionMetadata, float], torch.Tensor]
"""(q [B, H, D], kv_cache, meta, scale) -> [B, H, D]: the decode half of paged_attention."""

PrefillAttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Any, AttentionMetadata, float, torch.Tensor], None]
"""(q, k, v [T, ., D] of the whole step, kv_cache with this step's K/V written, meta, scale, out
[T, H, D]) -> None: the prefill half of paged_attention, writes the rows of meta.prefills."""


WriteKVFn = Callable[
    [Any, torch.Tensor, torch.Tensor, AttentionMetadata], tuple[torch.Tensor, torch.Tensor]
]
"""(kv_cache, k, v [T, kvh, D], meta) -> (k, v as read back): the KV write of paged_attention."""


def write_kv(
    kv_cache: KVCacheLayer, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store new keys/values ([T, num_kv_heads, head_size]) into their slots; returns what a
    read of those slots gives (k, v, or their dequantized values for a quantized cache)."""
    return store_kv(kv_cache, meta.slot_block_ids, meta.slot_offsets, k, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCacheLayer,
    meta: AttentionMetadata,
    scale: float,
    decode_attention: DecodeAttentionFn | None = None,
    prefill_attention: PrefillAttentionFn | None = None,
    store: WriteKVFn | None = None,
) -> torch.Tensor:
    """Causal attention of the step's queries over their requests' cached context.

    Args:
        q: [T, num_heads, head_size] rotated queries.
        k, v: [T, num_kv_heads, head_size] this step's keys (rotated) and values.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size], or a QuantKVCache.
        meta: slots and block tables of the step.
        scale: softmax scale (1/sqrt(head_size)).
        decode_attention: the single-query-token half (None: `_decode_attention`, gather then
            SDPA; `--attention-backend cpu_paged`: pdkv.model.paged_decode, blocks read in place).
        prefill_attention: the runs of more than one query token (None: `_prefill_attention`,
            one SDPA per run; cpu_paged: pdkv.model.paged_prefill, one call for all runs).
        store: the KV write (None: `write_kv`, two indexed assignments; cpu_paged:
            pdkv.model.paged_decode.write_kv_fused, one C++ op for K and V).

    Returns:
        [T, num_heads, head_size].
    """
    if meta.dcp is not None:
        from pdkv.model.dcp_attention import dcp_attention

        return dcp_attention(q, k, v, kv_cache, meta.dcp, scale)
    if meta.pcp is not None:  # the other PCP ranks' tokens of this step first, then ours below
        from pdkv.model.pcp_attention import write_remote_kv

        write_remote_kv(k, v, kv_cache, meta.pcp)
    k, v = (store or write_kv)(kv_cache, k, v, meta)
    out = q.new_empty(q.shape)
    if meta.prefills:
        (prefill_attention or _prefill_attention)(q, k, v, kv_cache, meta, scale, out)
    decode = decode_attention or _decode_attention
    if meta.all_decode:
        return decode(q, kv_cache, meta, scale)
    if meta.decode_token_idx is not None:
        out[meta.decode_token_idx] = decode(q[meta.decode_token_idx], kv_cache, meta, scale)
    return out


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCacheLayer,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """The prefill runs of the step (reference path), one SDPA per run: a run without context
    attends over this step's k, v; a run with context gathers its keys from the blocks first.
    Writes each run's rows of `out` ([T, H, D])."""
    block_size, num_kv_heads, head_size = kv_cache.shape[-3], kv_cache.shape[-2], kv_cache.shape[-1]
    window = meta.sliding_window
    for seq in meta.prefills:
        qs = q[seq.start : seq.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        n = seq.end - seq.start
        if seq.context_len == 0 and (window is None or n <= window):
            ks = k[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
            vs = v[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            total = seq.context_len + n
            # First key any query needs: 0, or with a window the first block holding key
            # context_len - W + 1 (blocks before it may be freed: never read).
            first_block = (
                0 if window is None else max(0, seq.context_len - window + 1) // block_size
            )
            lo = first_block * block_size
            if seq.context_len == 0:  # n > W: this step's keys, no cache read
                ks, vs = k[seq.start : seq.end], v[seq.start : seq.end]
            else:
                table = seq.block_table[first_block:]
                ks = read_kv(kv_cache, 0, table).reshape(-1, num_kv_heads, head_size)[: total - lo]
                vs = read_kv(kv_cache, 1, table).reshape(-1, num_kv_heads, head_size)[: total - lo]
            q_pos = torch.arange(seq.context_len, total, device=q.device)[:, None]
            k_pos = torch.arange(lo, total, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            o = F.scaled_dot_product_attention(
                qs,
                ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )
        out[seq.start : seq.end] = o.squeeze(0).transpose(0, 1)


def _decode_attention(
    q: torch.Tensor, kv_cache: KVCacheLayer, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """One query token per request over its context (the last sliding_window keys of it with a
    window). q: [B, H, D] -> [B, H, D]."""
    assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
    bsz = q.shape[0]
    block_size, num_kv_heads, head_size = kv_cache.shape[-3], kv_cache.shape[-2], kv_cache.shape[-1]
    if meta.decode_mask is not None:  # B > 1: masked positions read the row's newest key
        assert meta.decode_key_blocks is not None and meta.decode_key_offsets is not None
        ks = read_kv(
            kv_cache, 0, meta.decode_key_blocks, meta.decode_key_offsets
        )  # [B, keys, KVH, D]
        vs = read_kv(kv_cache, 1, meta.decode_key_blocks, meta.decode_key_offsets)
    else:
        ks = read_kv(kv_cache, 0, meta.decode_block_tables).view(bsz, -1, num_kv_heads, head_size)
        vs = read_kv(kv_cache, 1, meta.decode_block_tables).view(bsz, -1, num_kv_heads, head_size)
    if meta.decode_mask is None:  # B == 1: slice the exact key range, no mask needed
        seq_len = meta.decode_seq_lens_cpu[0]
        if meta.sliding_window is None:
            ks, vs = ks[:, :seq_len], vs[:, :seq_len]
        else:  # the table starts at the window's first block (see AttentionMetadata)
            lo = max(0, seq_len - meta.sliding_window)
            shift = lo // block_size * block_size
            ks, vs = ks[:, lo - shift : seq_len - shift], vs[:, lo - shift : seq_len - shift]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, H, 1, D]
        ks.transpose(1, 2),
        vs.transpose(1, 2),
        attn_mask=meta.decode_mask,
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(2)
