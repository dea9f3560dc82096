"""Attention with log-sum-exp and the DCP merge against dense references (issue 10, acceptance 2).

The references are computed in float64 from the full, unsharded K/V.
"""

from __future__ import annotations

import pytest
import torch
from paged_batch import paged_batch

from pdkv.model.attention import paged_attention
from pdkv.model.attention_lse import (
    ShardSeq,
    attention_with_lse,
    merge_attn_states,
    shard_attention,
)
from pdkv.parallel.layout import (
    dcp_global_position,
    dcp_local_index,
    dcp_local_len,
    dcp_owner,
)

H, KVH, D = 6, 2, 16
SCALE = D**-0.5


def _dense(q, k, v, visible):
    """float64 reference: (softmax(q·K^T·s) V, logsumexp of the visible scores), GQA by repetition.
    q [n, H, D]; k, v [m, KVH, D]; visible [n, m] bool."""
    rep = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(rep, dim=1)
    v = v.double().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    scores = scores.masked_fill(~visible[None], float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out, torch.logsumexp(scores, -1).transpose(0, 1)


# --- Acceptance 2: merge of shards equals attention over the concatenated KV -----------------


@pytest.mark.parametrize(
    "shard_lens", [[5, 0, 17, 2], [1, 30], [0, 9], [12]], ids=["4ranks", "2ranks", "empty", "1rank"]
)
def test_merge_of_shards_equals_full_attention(shard_lens):
    """Keys split over ranks at random (disjoint, unequal, one shard empty); each rank attends over
    its own keys; the merge equals attention over all keys, and the merged lse their logsumexp."""
    torch.manual_seed(len(shard_lens))
    t, m = 7, sum(shard_lens)
    q, k, v = torch.randn(t, H, D), torch.randn(m, KVH, D), torch.randn(m, KVH, D)
    owner = torch.repeat_interleave(torch.arange(len(shard_lens)), torch.tensor(shard_lens))
    owner = owner[torch.randperm(m)]  # each rank's keys are scattered over the sequence
    outs, lses = [], []
    for r in range(len(shard_lens)):
        mine = owner == r
        o, s = attention_with_lse(
            q, k[mine], v[mine], torch.ones(t, int(mine.sum()), dtype=torch.bool), SCALE
        )
        outs.append(o)
        lses.append(s)
    out, lse = merge_attn_states(torch.stack(outs), torch.stack(lses))
    ref_out, ref_lse = _dense(q, k, v, torch.ones(t, m, dtype=torch.bool))
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-5)


def test_merge_handles_large_scores_without_overflow():
    """lse values far beyond float32's exp range (exp(89) = inf): shifting every rank's lse by a
    constant shifts the merged lse by it and leaves the output unchanged."""
    torch.manual_seed(1)
    # lse on a 1/64 grid: adding ±1000 is exact in float32, so only overflow could differ.
    outs, lses = torch.randn(3, 4, H, D), torch.round(torch.randn(3, 4, H) * 3 * 64) / 64
    lses[1, 0] = float("-inf")
    out, lse = merge_attn_states(outs, lses)
    for shift in (1000.0, -1000.0):
        out_s, lse_s = merge_attn_states(outs, lses + shift)
        torch.testing.assert_close(out_s, out, rtol=0, atol=1e-6)
        torch.testing.assert_close(lse_s - shift, lse, rtol=0, atol=1e-3)  # float32 ulp at 1000


def test_merge_of_empty_ranks_is_zero_and_minus_inf():
    """A rank with lse −inf contributes nothing, even if its out holds NaN; a row with no key on
    any rank merges to out 0, lse −inf; nothing is NaN; the merge is the same run to run."""
    outs = torch.randn(3, 2, H, D)
    lses = torch.randn(3, 2, H)
    lses[1] = float("-inf")
    outs[1] = float("nan")  # an empty rank's output buffer may be anything
    lses[:, 1] = float("-inf")  # row 1: no rank has a visible key
    out, lse = merge_attn_states(outs, lses)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[1], torch.zeros(H, D)) and torch.isneginf(lse[1]).all()
    ref, ref_lse = merge_attn_states(outs[[0, 2], :1], lses[[0, 2], :1])
    torch.testing.assert_close(out[:1], ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse[:1], ref_lse, rtol=0, atol=1e-6)
    again = merge_attn_states(outs, lses)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)


def test_merge_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="outs"):
        merge_attn_states(torch.zeros(2, 3, H, D), torch.zeros(2, 4, H))


# --- N = 1: shard_attention equals today's paged_attention (SDPA) -----------------------------


def test_single_shard_equals_paged_attention():
    """Decodes (batched, with a padding mask), a fresh prefill and a chunk after cached context,
    over shuffled blocks: shard_attention with every key local equals paged_attention, and its
    lse equals the dense logsumexp."""
    torch.manual_seed(0)
    bs, nblocks = 4, 32
    reqs = [(0, 7), (9, 5), (13, 1), (4, 1), (0, 1)]  # (context_len, new tokens)
    batch = paged_batch(reqs, bs, nblocks, KVH, H, D)
    seqs, start = [], 0
    for (ctx, n), table in zip(reqs, batch.tables):
        seqs.append(
            ShardSeq(
                start,
                start + n,
                torch.arange(ctx, ctx + n),
                torch.tensor(table),
                torch.arange(ctx + n),
            )
        )
        start += n
    q = batch.q
    sdpa = paged_attention(q, batch.k, batch.v, batch.cache, batch.meta, SCALE)
    out, lse = shard_attention(q, batch.cache, seqs, SCALE)
    torch.testing.assert_close(out, sdpa, rtol=0, atol=1e-5)
    for seq, (ctx, n), (kk, vv) in zip(seqs, reqs, batch.full):
        visible = torch.arange(ctx + n)[None, :] <= torch.arange(ctx, ctx + n)[:, None]
        _, ref_lse = _dense(q[seq.start : seq.end], kk, vv, visible)
        torch.testing.assert_close(lse[seq.start : seq.end].double(), ref_lse, rtol=0, atol=1e-5)


# --- Simulated DCP: tokens placed by pdkv.parallel.layout, per-rank attention, merge ----------


@pytest.mark.parametrize("dcp, interleave, bs", [(2, 1, 16), (2, 16, 16), (3, 4, 8)])
def test_simulated_dcp_equals_full_causal_attention(dcp, interleave, bs):
    """Every token's K/V goes to its owner rank's paged cache at its local index (same block ids
    on every rank); each rank attends with its key positions; the merge equals causal attention
    over the whole sequence. One request is shorter than the interleave, so some ranks hold none
    of it; early prefill rows see no key on some ranks. Nothing is NaN on any rank."""
    torch.manual_seed(dcp * 100 + interleave)
    nblocks = 24
    caches = [torch.full((2, nblocks, bs, KVH, D), float("nan")) for _ in range(dcp)]
    perm = torch.randperm(nblocks).tolist()
    # decode at position 40, chunk of 9 after 20 cached, fresh prefill of 12, decode within I.
    reqs = [(40, 1), (20, 9), (0, 12), (interleave - 1, 1)]
    t = sum(n for _, n in reqs)
    q = torch.randn(t, H, D)
    rank_seqs: list[list[ShardSeq]] = [[] for _ in range(dcp)]
    refs, start = [], 0
    for ctx, n in reqs:
        total = ctx + n
        kk, vv = torch.randn(total, KVH, D), torch.randn(total, KVH, D)
        local_lens = [dcp_local_len(total, r, interleave, dcp) for r in range(dcp)]
        table = [perm.pop() for _ in range(-(-max(local_lens) // bs))]
        for p in range(total):
            r, loc = dcp_owner(p, interleave, dcp), dcp_local_index(p, interleave, dcp)
            caches[r][0, table[loc // bs], loc % bs] = kk[p]
            caches[r][1, table[loc // bs], loc % bs] = vv[p]
        qpos = torch.arange(ctx, total)
        key_positions = []
        for r in range(dcp):
            kpos = torch.tensor(
                [dcp_global_position(loc, r, interleave, dcp) for loc in range(local_lens[r])],
                dtype=torch.long,
            )
            key_positions.append(kpos)
            rank_seqs[r].append(ShardSeq(start, start + n, qpos, torch.tensor(table), kpos))
        assert torch.equal(torch.cat(key_positions).sort().values, torch.arange(total))
        refs.append((start, start + n, kk, vv, torch.arange(total)[None, :] <= qpos[:, None]))
        start += n
    assert 0 in [
        dcp_local_len(interleave, r, interleave, dcp) for r in range(dcp)
    ]  # an empty shard
    partial = [shard_attention(q, caches[r], rank_seqs[r], SCALE) for r in range(dcp)]
    for o, s in partial:
        assert not o.isnan().any() and not s.isnan().any()
    out, lse = merge_attn_states(
        torch.stack([o for o, _ in partial]), torch.stack([s for _, s in partial])
    )
    assert not out.isnan().any() and not lse.isnan().any()
    for a, b, kk, vv, visible in refs:
        ref_out, ref_lse = _dense(q[a:b], kk, vv, visible)
        torch.testing.assert_close(out[a:b].double(), ref_out, rtol=0, atol=1e-5)
        torch.testing.assert_close(lse[a:b].double(), ref_lse, rtol=0, atol=1e-5)


# --- Empty shards and uncovered rows -----------------------------------------------------------


def test_shard_attention_empty_shard_and_uncovered_rows():
    """A seq with no local keys, a query that sees no local key, and rows no seq covers: out 0,
    lse −inf, no NaN (the cache is NaN outside the stored key, so a stray read would show)."""
    torch.manual_seed(3)
    cache = torch.full((2, 4, 4, KVH, D), float("nan"))
    k, v = torch.randn(KVH, D), torch.randn(KVH, D)
    cache[0, 2, 0], cache[1, 2, 0] = k, v
    q = torch.randn(6, H, D)
    seqs = [
        ShardSeq(0, 2, torch.tensor([3, 4]), torch.tensor([1]), torch.zeros(0, dtype=torch.long)),
        ShardSeq(3, 5, torch.tensor([4, 5]), torch.tensor([2]), torch.tensor([5])),
    ]
    out, lse = shard_attention(q, cache, seqs, SCALE)
    assert not out.isnan().any() and not lse.isnan().any()
    for row in (0, 1, 2, 3, 5):  # empty shard, uncovered, key in the future, uncovered
        assert torch.equal(out[row], torch.zeros(H, D)) and torch.isneginf(lse[row]).all()
    rep = H // KVH
    torch.testing.assert_close(
        out[4], v.repeat_interleave(rep, dim=0)
    )  # one visible key: its value
    scores = (q[4] * k.repeat_interleave(rep, dim=0)).sum(-1) * SCALE
    torch.testing.assert_close(lse[4], scores)
