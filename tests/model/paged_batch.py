"""A random paged-attention step for attention tests: requests of (cached context, new tokens)
over shuffled blocks, their cached prefix already in its slots, every other slot NaN (as an
unwritten slot of a torch.empty cache may be), and the step's metadata (the model runner's
builder)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdkv.model.attention import AttentionMetadata
from pdkv.worker.attn_metadata import build_attention_metadata


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


def paged_batch(
    reqs: list[tuple[int, int]], bs: int, nblocks: int, kvh: int, h: int, d: int
) -> PagedBatch:
    """One step over `reqs` ((context_len, new tokens) each; one new token = a decode)."""
    cache = torch.full((2, nblocks, bs, kvh, d), float("nan"))
    perm = torch.randperm(nblocks).tolist()
    qs, ks, vs, tables, full, steps = [], [], [], [], [], []
    start = 0
    for ctx, n in reqs:
        table = [perm.pop() for _ in range(-(-(ctx + n) // bs))]
        kk, vv = torch.randn(ctx + n, kvh, d), torch.randn(ctx + n, kvh, d)
        tables.append(table)
        full.append((kk, vv))
        for p in range(ctx):  # the cached prefix is already in its slots (the op writes the rest)
            cache[0, table[p // bs], p % bs] = kk[p]
            cache[1, table[p // bs], p % bs] = vv[p]
        qs.append(torch.randn(n, h, d))
        ks.append(kk[ctx:])
        vs.append(vv[ctx:])
        steps.append((start, n, ctx, table))
        start += n
    meta = build_attention_metadata(steps, start, bs, torch.device("cpu"))
    return PagedBatch(cache, meta, torch.cat(qs), torch.cat(ks), torch.cat(vs), tables, full)
