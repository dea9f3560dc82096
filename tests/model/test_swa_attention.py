"""Sliding-window paged attention against a brute-force masked softmax (the query at p sees keys
p - W < k <= p): prefill without context (n below and above W), prefill with context, decode B = 1
and B > 1, windows smaller and larger than the context. Blocks that left every query's window are
filled with NaN (the manager may free them and put its null block there: they must never be read)
and the keys of the window's first block that precede the window with huge values (masked or
sliced off); the output must not change."""

from __future__ import annotations

import pytest
import torch

from pdkv.model.attention import paged_attention
from pdkv.worker.attn_metadata import build_attention_metadata

BS, KVH, H, D = 16, 2, 4, 8
HUGE = 1e4


def brute_force(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: range,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """q [n, H, D] at `positions` over all keys k, v [L, KVH, D]: masked softmax in float64."""
    rep = H // KVH
    kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kk) * scale
    p = torch.tensor(list(positions))[:, None]
    kp = torch.arange(k.shape[0])[None, :]
    mask = kp <= p
    if window is not None:
        mask &= kp > p - window
    attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", attn, vv).float()


def run_step(reqs: list[tuple[int, int]], window: int | None, garbage: bool, seed: int = 0) -> None:
    """One step over `reqs` ((cached context, new tokens) each), checked against brute force."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = 1 + sum(-(-(c + n) // BS) for c, n in reqs)
    cache = torch.zeros(2, nblocks, BS, KVH, D)
    cache[:, 0] = HUGE  # block 0 plays the null block: decode tables pad with it
    perm = (torch.randperm(nblocks - 1, generator=gen) + 1).tolist()
    step, qs, ks, vs, full = [], [], [], [], []
    start = 0
    for c, n in reqs:
        table = [perm.pop() for _ in range(-(-(c + n) // BS))]
        kk, vv = (
            torch.randn(c + n, KVH, D, generator=gen),
            torch.randn(c + n, KVH, D, generator=gen),
        )
        for p in range(c):
            cache[0, table[p // BS], p % BS], cache[1, table[p // BS], p % BS] = kk[p], vv[p]
        if garbage and window is not None:
            first = max(0, c - window + 1)  # first key the request's first query sees
            for b in table[: first // BS]:
                cache[:, b] = float("nan")
            cache[:, table[first // BS], : first % BS] = HUGE
        step.append((start, n, c, table))
        full.append((kk, vv))
        qs.append(torch.randn(n, H, D, generator=gen))
        ks.append(kk[c:])
        vs.append(vv[c:])
        start += n
    meta = build_attention_metadata(step, start, BS, torch.device("cpu"), window)
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, D**-0.5)
    for (st, n, c, _), q, (kk, vv) in zip(step, qs, full):
        want = brute_force(q, kk, vv, range(c, c + n), window, D**-0.5)
        torch.testing.assert_close(out[st : st + n], want, atol=1e-5, rtol=1e-4)


# (context, new tokens) per request; one new token = a decode.
CASES = {
    "prefill-no-context": [(0, 50), (0, 3), (0, 17)],
    "prefill-with-context": [(70, 20), (10, 30), (33, 2)],
    "decode-b1-long": [(100, 1)],
    "decode-b1-short": [(3, 1)],
    "decode-b1-block-edge": [(47, 1)],
    "decode-b4": [(100, 1), (3, 1), (47, 1), (64, 1)],
    "mixed": [(0, 45), (100, 1), (70, 20), (5, 1)],
}


@pytest.mark.parametrize("window", [None, 1, 5, 16, 40, 1000])
@pytest.mark.parametrize("case", CASES)
def test_sliding_window_paged_attention_matches_brute_force(case, window):
    run_step(CASES[case], window, garbage=window is not None)


def test_window_changes_the_brute_force_output():
    """The window is not a no-op on these shapes (so the test above checks it)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, H, D, generator=gen), torch.randn(90, KVH, D, generator=gen),
               torch.randn(90, KVH, D, generator=gen))
    windowed, dense = (
        brute_force(q, k, v, range(87, 90), 40, D**-0.5),
        brute_force(q, k, v, range(87, 90), None, D**-0.5),
    )
    assert (windowed - dense).abs().max() > 1e-2


@pytest.mark.parametrize("window", [1, 7, 40, 500])
def test_shard_attention_window_merged_over_two_ranks_matches_brute_force(window):
    """Keys interleaved over two ranks by position parity; each rank's windowed shard attention,
    merged by LSE, equals the brute-force windowed attention (a query with no key in its window
    on one rank contributes nothing there)."""
    from pdkv.model.attention_lse import ShardSeq, merge_attn_states, shard_attention

    gen = torch.Generator().manual_seed(window)
    ctx, n = 90, 6
    q = torch.randn(n, H, D, generator=gen)
    k, v = torch.randn(ctx + n, KVH, D, generator=gen), torch.randn(ctx + n, KVH, D, generator=gen)
    qpos = torch.arange(ctx, ctx + n)
    outs, lses = [], []
    for rank in range(2):
        kpos = torch.arange(rank, ctx + n, 2)
        nb = -(-len(kpos) // BS)
        cache = torch.full((2, nb, BS, KVH, D), float("nan"))
        cache[0].view(-1, KVH, D)[: len(kpos)], cache[1].view(-1, KVH, D)[: len(kpos)] = (
            k[kpos],
            v[kpos],
        )
        seq = ShardSeq(0, n, qpos, torch.arange(nb), kpos)
        o, s = shard_attention(q, cache, [seq], D**-0.5, sliding_window=window)
        outs.append(o)
        lses.append(s)
    out, _ = merge_attn_states(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(
        out, brute_force(q, k, v, range(ctx, ctx + n), window, D**-0.5), atol=1e-5, rtol=1e-4
    )
