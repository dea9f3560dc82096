"""PCP attention of a split step (pdkv/model/pcp_attention.py through paged_attention) against
brute-force softmax: N ranks simulated in one process (the K/V all-gather served by a stand-in
context), each computing its head-tail chunks of the long runs (rank 0 also the decodes and short
runs). Every rank's output rows equal full causal attention over the request's keys, and every
rank's cache ends as a full replica of the step's K/V. Torch paths and, when built, the cpu_paged
C++ ops."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from system_packages import require_reason

from pdkv.model.attention import paged_attention
from pdkv.model.paged_decode import resolve_attention_backend
from pdkv.parallel.context import ParallelContext
from pdkv.parallel.layout import ParallelLayout
from pdkv.parallel.pcp import plan_pcp_step
from pdkv.worker.attn_metadata import build_pcp_step

BS, D, KVH, GROUP, NUM_BLOCKS = 4, 16, 2, 2, 64
# (query tokens n, cached tokens c) per request in flat order: a decode, a long run without
# context, a short run, a long run with context (a prefill chunk / prefix hit), a decode.
RUNS = [(1, 9), (21, 0), (3, 5), (17, 6), (1, 30)]


@dataclass(frozen=True)
class SimulatedPCP(ParallelContext):
    """Rank `rank` of N PCP ranks in one process: all_gather_pcp returns what every rank sends in
    a K/V gather ([2, rows, KVH, D] each, `sent`), this rank's own padded tensor in its place."""

    sent: tuple[torch.Tensor, ...] = ()

    def all_gather_pcp(self, x: torch.Tensor) -> torch.Tensor:
        parts = []
        for r, kv in enumerate(self.sent):
            if r == self.rank:
                parts.append(x)
            else:
                pad = x.new_zeros((2, x.shape[1] - kv.shape[1], *kv.shape[2:]))
                parts.append(torch.cat([kv, pad], dim=1))
        return torch.stack(parts)


def _backend(name: str):
    if name == "torch":
        return paged_attention
    if resolve_attention_backend("cpu_paged", "cpu") != "cpu_paged":
        require_reason("the cpu_paged C++ ops are not built here")  # (fails under CI)
    from pdkv.model.paged_decode import paged_decode_attention, write_kv_fused
    from pdkv.model.paged_prefill import paged_prefill_attention

    return functools.partial(paged_attention, decode_attention=paged_decode_attention,
                             prefill_attention=paged_prefill_attention, store=write_kv_fused)


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
@pytest.mark.parametrize("pcp", [2, 3])
def test_split_step_attention_equals_brute_force_and_leaves_full_replicas(pcp, backend):
    attend = _backend(backend)
    gen = torch.Generator().manual_seed(32 + pcp)
    h = KVH * GROUP
    scale = D**-0.5
    perm = torch.randperm(NUM_BLOCKS - 1, generator=gen).add(1).tolist()
    base = torch.full((2, NUM_BLOCKS, BS, KVH, D), float("nan"))  # unwritten slots: NaN
    full = base.clone()  # every request's keys 0 .. c+n-1 written: what each replica must hold
    reqs, keys, start = [], [], 0
    for n, c in RUNS:
        table = [perm.pop() for _ in range(-(-(c + n) // BS))]
        kv = torch.randn(2, c + n, KVH, D, generator=gen)  # K/V of every position
        pos = torch.arange(c + n)
        blocks, offs = torch.tensor(table)[pos // BS], pos % BS
        full[:, blocks, offs] = kv
        base[:, blocks[:c], offs[:c]] = kv[:, :c]  # the cached context
        reqs.append((start, n, c, table))
        keys.append(kv)
        start += n
    q = torch.randn(start, h, D, generator=gen)
    k = torch.cat([kv[0, c:] for kv, (_, _, c, _) in zip(keys, reqs)])
    v = torch.cat([kv[1, c:] for kv, (_, _, c, _) in zip(keys, reqs)])

    min_split = 2 * pcp * 2  # chunks of >= 2 tokens: both long runs split, the rest on rank 0
    plan = plan_pcp_step([n for n, _ in RUNS], pcp, min_split)
    assert plan is not None
    local = [plan.local_tokens(r) for r in range(pcp)]
    sent = tuple(torch.stack([k[idx], v[idx]]) for idx in local)
    out = torch.full_like(q, float("nan"))
    for r in range(pcp):
        par = SimulatedPCP(layout=ParallelLayout(pcp_size=pcp), rank=r, sent=sent)
        split = build_pcp_step(par, reqs, [], BS, torch.device("cpu"), min_split)
        assert split is not None
        idx, meta = split
        assert idx.tolist() == local[r]
        cache = base.clone()
        out[idx] = attend(q[idx], k[idx], v[idx], cache, meta, scale)
        assert torch.equal(cache.nan_to_num(7.0), full.nan_to_num(7.0)), f"rank {r}'s replica"

    heads = torch.arange(h) // GROUP
    for (start, n, c, _), kv in zip(reqs, keys):
        for i in range(n):
            p = c + i  # sees keys 0 .. p
            s = torch.einsum("khd,hd->hk", kv[0, : p + 1].double()[:, heads],
                             q[start + i].double()) * scale
            want = torch.einsum("hk,khd->hd", torch.softmax(s, 1),
                                kv[1, : p + 1].double()[:, heads])
            torch.testing.assert_close(out[start + i].double(), want, atol=2e-5, rtol=1e-5)
