"""Paged multi-head latent attention (MLA, DeepSeek-V2/V3) in plain PyTorch.

KV cache of one MLA layer (a view into the group's cross-layer tensor, pdkv.worker.kv_cache):
    kv_cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
one vector per token, no heads: the kv_a_layernorm'ed latent c_kv followed by the rope'd shared
key k_pe (what vLLM's MLA backends store). Slots, block tables, prefill runs and decode rows come
from the same `AttentionMetadata` as paged_attention (pdkv.model.attention); MLA layers never
slide (`meta.sliding_window` is None).

Form: naive (vLLM's prefill path, and HF transformers' DeepseekV3Attention): the gathered
latents are up-projected by kv_b_proj into per-head k_nope and v, k = [k_nope, k_pe] and the
queries [q_nope, q_pe] attend with one softmax over qk_nope + qk_rope dims. The absorbed form
(fold kv_b_proj's k half into q and attend as MQA over the latents, then up-project the output
with its v half) saves the per-key up-projection at decode, but it sums in another order than
HF's reference; the naive form is the simpler correct one to hold token-identical to HF's
greedy output, and at these sizes its extra matmul costs nothing measurable. Like the SDPA paths
of paged_attention it returns no log-sum-exp: it serves single-rank attention (DCP is refused on
MLA models).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdkv.model.attention import AttentionMetadata


def write_latent(
    kv_cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store the step's [T, kv_lora_rank] latents and [T, qk_rope_head_dim] rope'd keys into
    their slots (one row of kv_lora_rank + qk_rope_head_dim per token)."""
    kv_cache[meta.slot_block_ids, meta.slot_offsets] = torch.cat((latent, k_pe), dim=-1)


def expand_kv(entries: torch.Tensor, kv_b: torch.Tensor, kv_lora_rank: int, qk_nope_head_dim: int,
              v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of every head from cached entries.

    Args:
        entries: [..., S, kv_lora_rank + qk_rope_head_dim] cached rows.
        kv_b: kv_b_proj weight [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank] (this
            rank's heads).

    Returns:
        (k [..., heads, S, qk_nope + qk_rope], v [..., heads, S, v_head_dim]).
    """
    latent, k_pe = entries[..., :kv_lora_rank], entries[..., kv_lora_rank:]
    kv = F.linear(latent, kv_b)
    kv = kv.view(*kv.shape[:-1], -1, qk_nope_head_dim + v_head_dim).transpose(
        -3, -2
    )  # [..., H, S, nope+v]
    k_nope, v = kv.split([qk_nope_head_dim, v_head_dim], dim=-1)
    k_pe = k_pe.unsqueeze(-3).expand(*k_nope.shape[:-1], k_pe.shape[-1])
    return torch.cat((k_nope, k_pe), dim=-1), v


def mla_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_b: torch.Tensor,
    scale: float,
    qk_nope_head_dim: int,
    v_head_dim: int,
) -> torch.Tensor:
    """Causal MLA of the step's queries over their requests' cached latents.

    Args:
        q: [T, heads, qk_nope_head_dim + qk_rope_head_dim], the rope part already rotated.
        latent: [T, kv_lora_rank] this step's normed latents; k_pe: [T, qk_rope_head_dim] rotated.
        kv_cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim].
        meta: slots and block tables of the step (no window, no DCP).
        kv_b: kv_b_proj weight of this rank's heads (see expand_kv).
        scale: softmax scale ((qk_nope + qk_rope) ** -0.5 with default rope).

    Returns:
        [T, heads, v_head_dim].

    Raises:
        ValueError: the metadata asks for a sliding window or DCP (not MLA cases).
    """
    if meta.sliding_window is not None or meta.dcp is not None:
        raise ValueError("MLA attention has no sliding window and no DCP path")
    write_latent(kv_cache, latent, k_pe, meta)
    rank = latent.shape[-1]
    out = q.new_empty(q.shape[0], q.shape[1], v_head_dim)
    for seq in meta.prefills:
        qs = q[seq.start : seq.end].transpose(0, 1)  # [H, n, D]
        n = seq.end - seq.start
        if seq.context_len == 0:  # no cache read: this step's rows
            entries = torch.cat((latent[seq.start : seq.end], k_pe[seq.start : seq.end]), dim=-1)
            k, v = expand_kv(entries, kv_b, rank, qk_nope_head_dim, v_head_dim)
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)
        else:
            total = seq.context_len + n
            entries = kv_cache[seq.block_table].reshape(-1, kv_cache.shape[-1])[:total]
            k, v = expand_kv(entries, kv_b, rank, qk_nope_head_dim, v_head_dim)
            q_pos = torch.arange(seq.context_len, total, device=q.device)[:, None]
            mask = torch.arange(total, device=q.device)[None, :] <= q_pos
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[seq.start : seq.end] = o.transpose(0, 1)
    if meta.decode_token_idx is not None:
        dec = _decode(
            q[meta.decode_token_idx],
            kv_cache,
            meta,
            kv_b,
            rank,
            scale,
            qk_nope_head_dim,
            v_head_dim,
        )
        if meta.all_decode:
            return dec
        out[meta.decode_token_idx] = dec
    return out


def _decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_b: torch.Tensor,
    rank: int,
    scale: float,
    nope: int,
    v_dim: int,
) -> torch.Tensor:
    """One query token per request over its whole context. q: [B, H, D] -> [B, H, v_dim].
    Reads only written slots (the cache is allocated with torch.empty; see pdkv.model.attention)."""
    assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
    bsz = q.shape[0]
    if meta.decode_mask is not None:  # B > 1: masked positions read the row's newest entry
        assert meta.decode_key_blocks is not None and meta.decode_key_offsets is not None
        entries = kv_cache[meta.decode_key_blocks, meta.decode_key_offsets]  # [B, S, entry]
    else:  # B == 1: the exact key range, no mask
        entries = kv_cache[meta.decode_block_tables].view(bsz, -1, kv_cache.shape[-1])
        entries = entries[:, : meta.decode_seq_lens_cpu[0]]
    k, v = expand_kv(entries, kv_b, rank, nope, v_dim)  # [B, H, S, .]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=meta.decode_mask, scale=scale
    )
    return o.squeeze(2)
