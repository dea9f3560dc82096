"""CPU paged decode attention: K/V read from the cache blocks where they lie (no padded copies).

`--attention-backend cpu_paged` replaces the decode half of `pdkv.model.attention.paged_attention`
(one query token per request) with a C++ op (`csrc/paged_decode.cpp`, built and cached by
`pdkv.model.paged_decode_build`). The torch path (`_decode_attention`) gathers every request's
blocks into padded [B, max_blocks * block_size, kvh, D] tensors each layer and step, then runs
SDPA with a mask; the op walks each request's block table instead:

    for each (request b, KV head h), in parallel (at::parallel_for, i.e. OpenMP, over B x kvh):
        keys p in [lo, len_b): lo = max(0, len_b - W) with a sliding window W, else 0
        table index (p - base) // block_size, offset p % block_size, where base = lo rounded
        down to a block (decode tables start at the window's first block, see
        AttentionMetadata.decode_block_tables), else 0
        for each query head of h's group (GQA): online softmax over blocks of keys in float32
        (running max m, running sum l, rescaled accumulator; FlashAttention's recurrence)
    out[b, head] = acc / l,  lse[b, head] = m + log(l)  (natural log of Σ exp(scale·q·k);
        -inf and out 0 when no key is visible)

Slots past len_b (unwritten, possibly NaN) and table padding are never read. Inputs in float32,
bfloat16 or float16 (accumulated in float32, the output in the input dtype).

The same backend writes the step's K/V with one op per layer (`csrc/kv_write.cpp`,
`write_kv_fused`, vLLM's reshape_and_cache): each token's heads are copied to their slot, K and V
together, instead of two advanced-index assignments.

Backend choice (`resolve_attention_backend`): "auto" is cpu_paged on CPU for an unquantized,
single-rank (no DCP) KV cache when the op is already built (`make setup`), torch otherwise;
"cpu_paged" builds the op if needed. Quantized KV, DCP, MLA and CUDA keep the torch path; when the
op cannot be built or loaded the engine logs one warning line and uses the torch path.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdkv.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "cpu_paged")
"""Values of `--attention-backend` (vLLM's flag name)."""


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token per request attending over its cached keys, read through its block table.

    Args:
        q: [B, H, D] rotated queries (last dim contiguous).
        kv_cache: one layer's [2, num_blocks, block_size, kvh, D] (0 = K, 1 = V), same dtype as q;
            H must be a multiple of kvh.
        block_tables: [B, max_blocks] int64; with a window W, row b starts at the block of key
            max(0, len_b - W).
        seq_lens: [B] int64, keys per request (context including the new token).
        scale: softmax scale (1/sqrt(D)).
        sliding_window: W tokens (query at p sees p - W < k <= p), None for full attention.

    Returns:
        (out [B, H, D] in q's dtype, lse [B, H] float32: log Σ_k exp(scale · q·k)).

    Raises:
        RuntimeError: the op is not loaded (`pdkv.model.paged_decode_build.load`), or shapes,
            dtypes or a block table too short for its seq len.
    """
    return torch.ops.pdkv.paged_decode(
        q, kv_cache, block_tables, seq_lens, scale, sliding_window or 0
    )


def paged_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Drop-in for `pdkv.model.attention._decode_attention`: q [B, H, D] -> [B, H, D]. A cache
    that is not one plain tensor (a quantized cache's values + scales) or lives off the CPU goes
    to the torch path: the op reads plain CPU K/V only."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.device.type != "cpu":
        from pdkv.model.attention import _decode_attention

        return _decode_attention(q, kv_cache, meta, scale)
    assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
    out, _ = paged_decode(q, kv_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                          meta.sliding_window)
    return out


def write_kv_fused(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for `pdkv.model.attention.write_kv` with one C++ op (`torch.ops.pdkv.write_kv_`):
    k, v [T, kvh, D] (each token's heads contiguous) copied to slots (meta.slot_block_ids,
    meta.slot_offsets) of kv_cache [2, blocks, block_size, kvh, D] (any strides with a slot's heads
    contiguous: the engine's per-layer views of its block-major buffer); returns (k, v). A
    quantized or non-CPU cache, or k / v / a slot in another layout, goes to `write_kv`.

    Raises:
        RuntimeError: a slot outside the cache, or shapes / dtypes that do not match it.
    """
    if (
        not isinstance(kv_cache, torch.Tensor)
        or kv_cache.device.type != "cpu"
        or not _heads_contiguous(kv_cache)
        or not _heads_contiguous(k)
        or not _heads_contiguous(v)
    ):
        from pdkv.model.attention import write_kv

        return write_kv(kv_cache, k, v, meta)
    torch.ops.pdkv.write_kv_(kv_cache, k, v, meta.slot_block_ids, meta.slot_offsets)
    return k, v


def _heads_contiguous(x: torch.Tensor) -> bool:
    """The last two dims (heads, head_size) of x are one contiguous run per token / slot."""
    return x.dim() in (3, 5) and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def resolve_attention_backend(
    requested: str, device: str, cache_dtype: str = "auto", dcp_size: int = 1, is_mla: bool = False,
    own_attention: str | None = None,
) -> str:
    """The attention backend an engine runs: "torch" or "cpu_paged" (the op then loaded).

    Args:
        requested: "auto", "torch" or "cpu_paged".
        device: the model's device ("cpu", "cuda[:N]").
        cache_dtype: the KV cache dtype ("auto" = the model dtype; quantized ones keep torch).
        dcp_size: decode context parallel ranks (> 1 keeps torch: the DCP path attends).
        is_mla: an MLA model (its own attention module; keeps torch).
        own_attention: a model whose attention the op does not know (its name, e.g.
            DeepSeek-V4's sinks and compressed entries; keeps torch), or None.

    Returns:
        "cpu_paged" when usable and loaded, else "torch" (one warning line when cpu_paged was
        asked for, or auto found the op unbuildable).

    Raises:
        ValueError: an unknown backend name.
    """
    from pdkv.model.paged_decode_build import cpu_ops_hidden, load

    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {requested!r}"
        )
    if requested == "torch":
        return "torch"
    unsupported = [
        why
        for cond, why in (
            (device != "cpu", f"device {device}"),
            (cache_dtype != "auto", f"kv cache dtype {cache_dtype}"),
            (dcp_size > 1, "decode context parallelism"),
            (is_mla, "an MLA model"),
            (own_attention is not None, f"{own_attention}'s attention"),
        )
        if cond
    ]
    if unsupported:
        if requested == "cpu_paged":
            logger.warning("attention backend cpu_paged does not support %s: using torch",
                           ", ".join(unsupported))
        return "torch"
    why = load(allow_build=requested == "cpu_paged")
    if why is None:
        return "cpu_paged"
    if requested == "cpu_paged" or not ("not built" in why or cpu_ops_hidden()):
        logger.warning("attention backend cpu_paged unavailable (%s): using torch", why)
    else:
        logger.info("attention backend auto: paged decode op %s; using torch", why)
    return "torch"
