"""CPU batched (varlen) paged prefill attention: every prefill run of a step in one call, K/V read
from the cache blocks where they lie.

`--attention-backend cpu_paged` replaces the prefill half of `pdkv.model.attention.paged_attention`
(`_prefill_attention`: a Python loop with one SDPA per run, and for a run with context a padded
gather of its keys and values from the blocks) with a C++ op (`csrc/paged_prefill.cpp`, built with
the decode op by `pdkv.model.paged_decode_build`):

    inputs: q [Tp, H, D] of all runs back to back; cu_seqlens [R + 1] (run r = rows cu[r] ..
        cu[r+1] - 1); context_lens [R] (run r's queries are positions ctx_r .. ctx_r + n_r - 1);
        block_tables [R, max_blocks] (key p of run r in block table[r, p // bs], offset p % bs);
        the step's K/V already written to the cache (paged_attention writes first).
    for each (run, KV head, tile of 32 query positions), in parallel (OpenMP, dynamic schedule,
        longest tiles first): the query at p sees keys max(0, p - W + 1) .. p (W the sliding
        window, else from 0; the semantics of pdkv.model.attention); per chunk of 64 keys
        (starting at multiples of 64 of the key position, gathered from their blocks), scores
        for the tile's queries of every head of the KV head's group (GQA), online softmax in
        float32 (running max m, sum l, rescaled accumulator: FlashAttention's recurrence). The
        chunks depend only on key positions, so a query's output does not depend on how its
        prompt was split into steps (chunked prefill, prefix hits) or tiles.
    out[t, head] = acc / l,  lse[t, head] = m + log(l)  (natural log of Σ exp(scale · q·k)).

Only slots of keys some query sees are read (never a slot past a run's last token, never a block
before its window): unwritten slots may hold NaN. Inputs in float32, bfloat16 or float16
(accumulated in float32, out in the input dtype). Quantized caches and non-CPU tensors go to the
torch path (`_prefill_attention`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pdkv.model.attention import AttentionMetadata


def paged_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of R prefill runs (queries back to back) over their cached keys.

    Args:
        q: [Tp, H, D] rotated queries of all runs (last dim contiguous).
        kv_cache: one layer's [2, num_blocks, block_size, kvh, D] (0 = K, 1 = V), same dtype as q,
            holding every run's keys up to its last query; H a multiple of kvh.
        cu_seqlens: [R + 1] int64, 0 = cu[0] <= ... <= cu[R] = Tp.
        context_lens: [R] int64, tokens of each run cached before its first query.
        block_tables: [R, max_blocks] int64, padded anyhow; entries before a run's window are
            never read.
        scale: softmax scale (1/sqrt(D)).
        sliding_window: W tokens (query at p sees p - W < k <= p), None for full attention.
        out: [Tp, H, D] written in place (e.g. a slice of the step's output), None: allocated.

    Returns:
        (out [Tp, H, D] in q's dtype, lse [Tp, H] float32: log Σ_k exp(scale · q·k)).

    Raises:
        RuntimeError: the op is not loaded (`pdkv.model.paged_decode_build.load`), or bad shapes
            or dtypes, a block table too short for its run, or a block id out of range.
    """
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.ops.pdkv.paged_prefill(q, kv_cache, cu_seqlens, context_lens, block_tables, scale,
                                       sliding_window or 0, out)
    return out, lse


def paged_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Drop-in for `pdkv.model.attention._prefill_attention`: writes the rows of meta.prefills in
    `out` [T, H, D] with one op call. A cache that is not one plain CPU tensor (a quantized
    cache's values + scales, a GPU cache) goes to the torch path."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.device.type != "cpu":
        from pdkv.model.attention import _prefill_attention

        _prefill_attention(q, k, v, kv_cache, meta, scale, out)
        return
    assert meta.prefill_cu_seqlens is not None and meta.prefill_context_lens is not None
    assert meta.prefill_block_tables is not None
    args = (meta.prefill_cu_seqlens, meta.prefill_context_lens, meta.prefill_block_tables, scale,
            meta.sliding_window)
    if meta.prefill_slice is not None:  # runs back to back: read q and write out in place
        lo, hi = meta.prefill_slice
        paged_prefill(q[lo:hi], kv_cache, *args, out=out[lo:hi])
    else:
        assert meta.prefill_token_idx is not None
        o, _ = paged_prefill(q.index_select(0, meta.prefill_token_idx), kv_cache, *args)
        out.index_copy_(0, meta.prefill_token_idx, o)


def install_attention_backend(model: Any, flag: str, device: str, cache_dtype: str, dcp_size: int,
                              is_mla: bool, own_attention: str | None = None) -> str:
    """Resolve `--attention-backend` `flag` (pdkv.model.paged_decode.resolve_attention_backend)
    and give every layer of `model` the decode and prefill halves and the KV write it names;
    returns "torch" or "cpu_paged" (the C++ ops write K/V to its slots and read it from the blocks
    in place)."""
    import functools

    from pdkv.model.attention import paged_attention
    from pdkv.model.paged_decode import (
        paged_decode_attention,
        resolve_attention_backend,
        write_kv_fused,
    )

    backend = resolve_attention_backend(flag, device, cache_dtype, dcp_size, is_mla,
                                        own_attention)
    if backend == "cpu_paged":
        fn = functools.partial(paged_attention, decode_attention=paged_decode_attention,
                               prefill_attention=paged_prefill_attention, store=write_kv_fused)
        for layer in model.layers:
            layer.attention = fn
    return backend
