"""Model building blocks against references: HF's RMSNorm and RoPE, dense causal attention."""

from __future__ import annotations

import math

import torch
from paged_batch import paged_batch

from pdkv.model.attention import paged_attention
from pdkv.model.llama import apply_rope, rms_norm, rope_cos_sin


def test_rms_norm_equals_hf_formula():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    ref = LlamaRMSNorm(576, eps=1e-5)
    ref.weight.data = torch.randn(576)
    x = torch.randn(7, 576) * 4
    assert torch.equal(rms_norm(x, ref.weight.data, 1e-5), ref(x))


def test_rope_equals_hf_rotary_embedding():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    d, theta = 64, 100000.0
    cos, signed_sin = rope_cos_sin(d, theta, 256, torch.device("cpu"))
    pos = torch.tensor([0, 1, 5, 17, 255])
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(pos.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    q = torch.randn(1, 4, len(pos), d)
    k = torch.randn(1, 2, len(pos), d)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, emb.cos()[None], emb.sin()[None])
    q_ours = apply_rope(q[0].transpose(0, 1).contiguous(), cos[pos, None], signed_sin[pos, None])
    k_ours = apply_rope(k[0].transpose(0, 1).contiguous(), cos[pos, None], signed_sin[pos, None])
    assert torch.equal(q_ours, q_ref[0].transpose(0, 1))
    assert torch.equal(k_ours, k_ref[0].transpose(0, 1))


def _dense_causal(q, k, v, context_len):
    """Reference attention of queries at positions context_len.. over all keys (GQA by
    repetition). q: [n, H, D]; k, v: [context_len + n, KVH, D]."""
    n, h, d = q.shape
    rep = h // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(d)
    qpos = torch.arange(context_len, context_len + n)[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def test_paged_attention_matches_dense_reference():
    """Three requests in one step: a fresh prefill, a prefill chunk after a cached prefix, and
    two decodes, over scattered (shuffled) blocks."""
    torch.manual_seed(0)
    bs, nblocks, kvh, h, d = 4, 32, 2, 6, 16
    reqs = [(0, 7), (9, 5), (13, 1), (4, 1)]  # (context_len, new tokens) per request
    batch = paged_batch(reqs, bs, nblocks, kvh, h, d)
    cache, meta = batch.cache, batch.meta
    out = paged_attention(batch.q, batch.k, batch.v, cache, meta, d**-0.5)
    start = 0
    for (ctx, n), (kk, vv) in zip(reqs, batch.full):
        ref = _dense_causal(batch.q[start : start + n], kk, vv, ctx)
        torch.testing.assert_close(out[start : start + n], ref, rtol=1e-4, atol=1e-5)
        start += n
    # The new tokens' K/V landed in their slots.
    for i, (b, o) in enumerate(zip(meta.slot_block_ids.tolist(), meta.slot_offsets.tolist())):
        assert torch.equal(cache[0, b, o], batch.k[i])
