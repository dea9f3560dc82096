"""A random paged-attention step for attention tests: requests of (cached context, new tokens)
over shuffled blocks, their cached prefix already in its slots, and the step's metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdkv.model.attention import AttentionMetadata, PrefillSeq


@dataclass
class PagedBatch:
    """cache [2, nblocks, bs, kvh, d]; q [T, h, d]; k, v [T, kvh, d] (the step's new tokens);
    tables: block table per request; full: (K, V) [ctx + n, kvh, d] of every request."""

    cache: torch.Tensor
    meta: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    tables: list[list[int]]
    full: list[tuple[torch.Tensor, torch.Tensor]]


def paged_batch(reqs: list[tuple[int, int]], bs: int, nblocks: int, kvh: int, h: int, d: int) -> PagedBatch:
    """One step over `reqs` ((context_len, new tokens) each; one new token = a decode)."""
    cache = torch.zeros(2, nblocks, bs, kvh, d)
    perm = torch.randperm(nblocks).tolist()
    qs, ks, vs, blk, off, prefills, tables, full = [], [], [], [], [], [], [], []
    dec_idx, dec_tables, dec_lens = [], [], []
    start = 0
    for ctx, n in reqs:
        table = [perm.pop() for _ in range(-(-(ctx + n) // bs))]
        kk, vv = torch.randn(ctx + n, kvh, d), torch.randn(ctx + n, kvh, d)
        tables.append(table)
        full.append((kk, vv))
        for p in range(ctx + n):
            if p < ctx:  # the cached prefix is already in its slots
                cache[0, table[p // bs], p % bs] = kk[p]
                cache[1, table[p // bs], p % bs] = vv[p]
            else:  # this step's tokens: the attention op writes them
                blk.append(table[p // bs])
                off.append(p % bs)
        qs.append(torch.randn(n, h, d))
        ks.append(kk[ctx:])
        vs.append(vv[ctx:])
        if n == 1:
            dec_idx.append(start)
            dec_tables.append(table)
            dec_lens.append(ctx + 1)
        else:
            prefills.append(PrefillSeq(start, start + n, ctx, torch.tensor(table)))
        start += n
    width = max(len(t) for t in dec_tables)
    lens = torch.tensor(dec_lens)
    meta = AttentionMetadata(
        slot_block_ids=torch.tensor(blk),
        slot_offsets=torch.tensor(off),
        prefills=prefills,
        decode_token_idx=torch.tensor(dec_idx),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in dec_tables]),
        decode_seq_lens=lens,
        decode_mask=(torch.arange(width * bs)[None, :] < lens[:, None])[:, None, None, :],
    )
    return PagedBatch(cache, meta, torch.cat(qs), torch.cat(ks), torch.cat(vs), tables, full)
