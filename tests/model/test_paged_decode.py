"""The C++ paged decode op (pdkv/model/paged_decode.py) against brute-force softmax and the torch
path (`_decode_attention`): random caches, shuffled block tables, GQA, sliding window, NaN in
unwritten slots; and the backend choice."""

from __future__ import annotations

import math

import pytest
import torch

from pdkv.model.attention import _decode_attention
from pdkv.model.paged_decode import paged_decode, paged_decode_attention, resolve_attention_backend
from pdkv.model.paged_decode_build import load
from pdkv.worker.attn_metadata import build_attention_metadata

BS, D, NUM_BLOCKS = 4, 16, 64


def _case(gen: torch.Generator, lens: list[int], kvh: int, group: int, window: int | None,
          dtype: torch.dtype = torch.float32, d: int = D):
    """A cache whose slots past each request's length hold NaN, shuffled block tables, and the
    step metadata (one decode token per request, context len - 1)."""
    h = kvh * group
    cache = torch.randn(2, NUM_BLOCKS, BS, kvh, d, generator=gen).to(dtype)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, reqs = [], []
    for i, n in enumerate(lens):
        nb = -(-n // BS)
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        reqs.append((i, 1, n - 1, table))
        last, used = table[-1], n - (nb - 1) * BS
        cache[:, last, used:] = float("nan")  # unwritten slots of the last block
    used_blocks = {b for t in tables for b in t}
    for b in set(range(NUM_BLOCKS)) - used_blocks:
        cache[:, b] = float("nan")  # blocks no request owns (the tables' padding reads block 0)
    meta = build_attention_metadata(reqs, len(lens), BS, torch.device("cpu"), window)
    q = torch.randn(len(lens), h, d, generator=gen).to(dtype)
    return q, cache, tables, meta


def _brute(q, cache, tables, lens, window, scale):
    """Softmax over exactly the visible keys, float64: (out [B, H, D], lse [B, H])."""
    bsz, h, d = q.shape
    kvh = cache.shape[3]
    out = torch.zeros(bsz, h, d, dtype=torch.float64)
    lse = torch.zeros(bsz, h, dtype=torch.float64)
    for b, n in enumerate(lens):
        lo = 0 if window is None else max(0, n - window)
        pos = torch.arange(lo, n)
        blocks = torch.tensor(tables[b])[pos // BS]
        k = cache[0, blocks, pos % BS].double()  # [n, kvh, D]
        v = cache[1, blocks, pos % BS].double()
        for head in range(h):
            kv = head // (h // kvh)
            s = (k[:, kv] @ q[b, head].double()) * scale
            lse[b, head] = torch.logsumexp(s, 0)
            out[b, head] = torch.softmax(s, 0) @ v[:, kv]
    return out, lse


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 6])
def test_op_equals_brute_force_and_torch_path(cpu_ops, group, window):
    gen = torch.Generator().manual_seed(group * 10 + (window or 0))
    scale = D**-0.5
    for bsz in (1, 2, 5, 8):
        lens = torch.randint(1, 5 * BS + 3, (bsz,), generator=gen).tolist()
        lens[0] = 1  # one key only
        if bsz > 1:
            lens[1] = 3 * BS  # ends exactly on a block boundary
        q, cache, tables, meta = _case(gen, lens, kvh=2, group=group, window=window)
        out, lse = paged_decode(
            q, cache, meta.decode_block_tables, meta.decode_seq_lens, scale, window
        )
        assert out.shape == q.shape and lse.dtype == torch.float32
        assert not out.isnan().any(), "NaN in unwritten slots leaked"
        ref_out, ref_lse = _brute(q, cache, tables, lens, window, scale)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)
        # The torch path over the same cache with its unwritten slots cleaned gives the same.
        clean = torch.nan_to_num(cache, nan=0.0)
        torch.testing.assert_close(paged_decode_attention(q, clean, meta, scale),
                                   _decode_attention(q, clean, meta, scale), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("d", [12, 40, 48, 64, 128])
def test_head_sizes_on_and_off_the_vector_width(cpu_ops, d):
    # float32 head sizes that fill whole vectors take the vector paths (4 keys at a time, the
    # value rows into register accumulators, with remainders of keys and of vectors); the others
    # (12, and 40 on AVX-512) the scalar loops. Lengths leave 1..3 keys past a multiple of 4.
    gen = torch.Generator().manual_seed(d)
    lens = [1, 2, 3, 5, 7, BS + 1, 2 * BS + 2, 3 * BS + 3, 4 * BS]
    q, cache, tables, meta = _case(gen, lens, kvh=2, group=3, window=None, d=d)
    scale = d**-0.5
    out, lse = paged_decode(q, cache, meta.decode_block_tables, meta.decode_seq_lens, scale)
    assert not out.isnan().any(), "NaN in unwritten slots leaked"
    ref_out, ref_lse = _brute(q, cache, tables, lens, None, scale)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)
    # A request's result does not depend on the others in the batch.
    for i in (0, 4, 8):
        one, _ = paged_decode(q[i : i + 1], cache, meta.decode_block_tables[i : i + 1],
                              meta.decode_seq_lens[i : i + 1], scale)
        assert torch.equal(one, out[i : i + 1]), i


def test_bf16_and_strided_inputs(cpu_ops):
    """bf16 accumulates in float32; a q that is a strided view and a per-layer cache view of a
    cross-layer tensor ([blocks, layers, 2, bs, kvh, D]) are read through their strides."""
    gen = torch.Generator().manual_seed(7)
    lens = [5, 17, 9]
    q, cache, tables, meta = _case(gen, lens, kvh=2, group=3, window=None)
    cache = torch.nan_to_num(cache, nan=0.0)
    cross = torch.randn(NUM_BLOCKS, 3, 2, BS, 2, D, generator=gen)
    cross[:, 1] = cache.transpose(0, 1)
    layer = cross[:, 1].transpose(0, 1)  # [2, blocks, bs, kvh, D], not contiguous
    wide = torch.randn(len(lens), 8, D, generator=gen)
    wide[:, :6] = q
    qv = wide[:, :6]
    scale = D**-0.5
    out, _ = paged_decode(qv, layer, meta.decode_block_tables, meta.decode_seq_lens, scale)
    torch.testing.assert_close(out.double(), _brute(q, cache, tables, lens, None, scale)[0],
                               atol=2e-5, rtol=1e-4)
    out16, _ = paged_decode(q.bfloat16(), cache.bfloat16(), meta.decode_block_tables,
                            meta.decode_seq_lens, scale)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out, atol=3e-2, rtol=3e-2)
    # against float64 attention over the same (exactly widened) bfloat16 values: float32 sums,
    # then one rounding to bfloat16 (half an ulp, 2^-9 relative) - the vector path widens K/V
    q16, cache16 = q.bfloat16().double(), cache.bfloat16().double()
    ref16, ref_lse16 = _brute(q16, cache16, tables, lens, None, scale)
    _, lse16 = paged_decode(q.bfloat16(), cache.bfloat16(), meta.decode_block_tables,
                            meta.decode_seq_lens, scale)
    torch.testing.assert_close(out16.double(), ref16, atol=1e-5, rtol=2.0**-8)
    torch.testing.assert_close(lse16.double(), ref_lse16, atol=1e-4, rtol=1e-5)


def test_lse_merges_like_dcp(cpu_ops):
    """Two halves of one request's keys, merged by log-sum-exp, equal attention over all keys
    (the lse DCP needs)."""
    gen = torch.Generator().manual_seed(3)
    q, cache, _, meta = _case(gen, [4 * BS], kvh=1, group=3, window=None)
    table, lens = meta.decode_block_tables, meta.decode_seq_lens
    full, _ = paged_decode(q, cache, table, lens, 0.25)
    o1, l1 = paged_decode(q, cache, table[:, :2], torch.tensor([2 * BS]), 0.25)
    o2, l2 = paged_decode(q, cache, table[:, 2:], torch.tensor([2 * BS]), 0.25)
    lse = torch.logaddexp(l1, l2)
    merged = o1 * (l1 - lse).exp()[..., None] + o2 * (l2 - lse).exp()[..., None]
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-4)
    assert math.isfinite(float(lse.max()))


def test_short_block_table_is_an_error(cpu_ops):
    q = torch.randn(1, 2, D)
    cache = torch.zeros(2, 4, BS, 1, D)
    with pytest.raises(RuntimeError, match="too short"):
        paged_decode(q, cache, torch.tensor([[0]]), torch.tensor([BS + 1]), 1.0)


def test_backend_choice(cpu_ops):
    assert resolve_attention_backend("torch", "cpu") == "torch"
    assert resolve_attention_backend("auto", "cpu") == "cpu_paged"
    assert resolve_attention_backend("cpu_paged", "cpu") == "cpu_paged"
    for kw in ({"device": "cuda"}, {"device": "cpu", "cache_dtype": "int8"},
               {"device": "cpu", "dcp_size": 2}, {"device": "cpu", "is_mla": True}):
        assert resolve_attention_backend("auto", **kw) == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_attention_backend("flash", "cpu")


def test_unbuilt_op_falls_back(tmp_path, monkeypatch, caplog):
    """auto never compiles inside an engine: with an empty cache it picks torch; a recorded
    build failure makes cpu_paged fall back with one warning line."""
    monkeypatch.setenv("PDKV_CACHE", str(tmp_path))
    assert load(allow_build=False) is not None
    from pdkv.model.paged_decode_build import build_paths

    paths = build_paths()
    paths.directory.mkdir(parents=True)
    paths.failed.write_text("error: no compiler\n")
    with caplog.at_level("WARNING", logger="pdkv.model.paged_decode"):
        assert resolve_attention_backend("cpu_paged", "cpu") == "torch"
    assert len(caplog.records) == 1 and "earlier build failed" in caplog.records[0].getMessage()


def test_flag_and_config():
    import argparse

    from pdkv.config import ModelConfig
    from pdkv.engine.arg_utils import EngineArgs

    args = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--attention-backend", "cpu_paged"]
    )
    assert EngineArgs.from_cli_args(args).attention_backend == "cpu_paged"
    with pytest.raises(ValueError, match="attention_backend"):
        ModelConfig(model="m", path="p", attention_backend="flash")


def test_backend_table_names_ratio_and_load():
    from pdkv.bench.offline.backends import format_backend_table

    tp = {"decode_tok_s": 100.0}
    result = {
        "model": "smollm2",
        "dtype": "float32",
        "num_threads": 2,
        "input_len": 128,
        "output_len": 32,
        "host_cpu": "cpu",
        "backends": ["torch", "cpu_paged"],
        "backends_used": {"torch": "torch", "cpu_paged": "cpu_paged"},
        "results": [
            {
                "batch_size": 32,
                "torch": tp,
                "cpu_paged": {"decode_tok_s": 150.0},
                "decode_ratio": {"torch": 1.0, "cpu_paged": 1.5},
                "greedy_equal": {"torch": True, "cpu_paged": True},
            }
        ],
        "host_load_avg_1m": [3.5, 3.9],
        "host_cpu_count": 2,
    }
    table = format_backend_table(result)
    assert "| 32 | 100.0 | 150.0 | 1.50x | yes |" in table
    assert "3.50 / 3.90 on 2 CPUs" in table
