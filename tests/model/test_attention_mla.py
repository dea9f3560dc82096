"""MLA attention op (pdkv/model/attention_mla.py) against brute force: per-head softmax over
keys [kv_b(latent)_nope, k_pe] and values kv_b(latent)_v of every position up to the query, in
float64, for a prefill without context, a prefill chunk over a cached prefix in scattered blocks,
batched decodes (masked) and a lone decode (sliced)."""

from __future__ import annotations

import pytest
import torch

from pdkv.model.attention_mla import mla_attention
from pdkv.worker.attn_metadata import build_attention_metadata

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H, RANK, ROPE, NOPE, V, BS = 3, 12, 4, 8, 6, 4


def brute(
    q: torch.Tensor, lat: torch.Tensor, pe: torch.Tensor, kv_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [n, H, NOPE+ROPE] at the last n positions of lat [S, RANK] / pe [S, ROPE]."""
    kv = (lat.double() @ kv_b.double().T).view(-1, H, NOPE + V)
    k = torch.cat((kv[..., :NOPE], pe.double()[:, None].expand(-1, H, ROPE)), -1)  # [S, H, D]
    v = kv[..., NOPE:]
    s, n = lat.shape[0], q.shape[0]
    out = []
    for i in range(n):
        p = s - n + i
        w = torch.softmax(torch.einsum("hd,shd->hs", q[i].double(), k[: p + 1]) * scale, -1)
        out.append(torch.einsum("hs,shd->hd", w, v[: p + 1]))
    return torch.stack(out).float()


@pytest.mark.parametrize(
    "lens",
    [((0, 9),), ((6, 7),), ((13, 1), (4, 1), (21, 1)), ((8, 1),), ((5, 6), (10, 1))],
    ids=["prefill", "prefill-with-context", "decodes", "decode-alone", "mixed"],
)
def test_mla_attention_matches_brute_force(lens):
    g = torch.Generator().manual_seed(len(lens) * 7 + lens[0][0])
    num_blocks = 24
    cache = torch.zeros(num_blocks, BS, RANK + ROPE)
    kv_b = torch.randn(H * (NOPE + V), RANK, generator=g) * 0.3
    free = list(torch.randperm(num_blocks - 1, generator=g).add(1).tolist())  # scattered blocks
    reqs, qs, lats, pes, ctx_lat, ctx_pe = [], [], [], [], [], []
    start = 0
    for c, n in lens:
        table = [free.pop() for _ in range(-(-(c + n) // BS))]
        lat_all, pe_all = (
            torch.randn(c + n, RANK, generator=g),
            torch.randn(c + n, ROPE, generator=g),
        )
        for p in range(c):  # the cached prefix
            cache[table[p // BS], p % BS] = torch.cat((lat_all[p], pe_all[p]))
        reqs.append((start, n, c, table))
        qs.append(torch.randn(n, H, NOPE + ROPE, generator=g))
        lats.append(lat_all[c:])
        pes.append(pe_all[c:])
        ctx_lat.append(lat_all)
        ctx_pe.append(pe_all)
        start += n
    meta = build_attention_metadata(reqs, start, BS, torch.device("cpu"))
    scale = (NOPE + ROPE) ** -0.5
    out = mla_attention(
        torch.cat(qs), torch.cat(lats), torch.cat(pes), cache, meta, kv_b, scale, NOPE, V
    )
    assert out.shape == (start, H, V)
    at = 0
    for (_, n), q, lat, pe in zip(lens, qs, ctx_lat, ctx_pe):
        torch.testing.assert_close(
            out[at : at + n], brute(q, lat, pe, kv_b, scale), atol=1e-5, rtol=1e-4
        )
        at += n
    for (_, n, c, table), lat, pe in zip(reqs, ctx_lat, ctx_pe):  # every new row landed in its slot
        for p in range(c, c + n):
            torch.testing.assert_close(cache[table[p // BS], p % BS], torch.cat((lat[p], pe[p])))


def test_window_or_dcp_metadata_is_refused():
    meta = build_attention_metadata([(0, 2, 0, [1])], 2, BS, torch.device("cpu"), sliding_window=8)
    with pytest.raises(ValueError, match="no sliding window and no DCP"):
        mla_attention(
            torch.zeros(2, H, NOPE + ROPE),
            torch.zeros(2, RANK),
            torch.zeros(2, ROPE),
            torch.zeros(4, BS, RANK + ROPE),
            meta,
            torch.zeros(H * (NOPE + V), RANK),
            1.0,
            NOPE,
            V,
        )
