"""The C++ batched paged prefill op (pdkv/model/paged_prefill.py) against brute-force softmax and
the torch path (`_prefill_attention`): several runs of different lengths in one call, context > 0
(prefix hits, chunked prefill), GQA, sliding window, shuffled block tables with holes, NaN in every
slot no query may read, decodes interleaved with the runs; and paged_attention with both halves."""

from __future__ import annotations

import pytest
import torch

from pdkv.model.attention import _prefill_attention, paged_attention
from pdkv.model.paged_decode import paged_decode_attention
from pdkv.model.paged_prefill import paged_prefill, paged_prefill_attention
from pdkv.worker.attn_metadata import build_attention_metadata

BS, D, NUM_BLOCKS = 4, 16, 96


def _case(
    gen: torch.Generator,
    runs: list[tuple[int, int]],
    kvh: int,
    group: int,
    window: int | None,
    dtype: torch.dtype = torch.float32,
):
    """Requests (query count n, context c) in flat order; a cache whose every slot no query may
    read holds NaN (past each request's last token, unowned blocks, table holes left of a
    window); returns q, cache, tables, step requests and metadata."""
    h = kvh * group
    cache = torch.full((2, NUM_BLOCKS, BS, kvh, D), float("nan"), dtype=dtype)
    perm = torch.randperm(NUM_BLOCKS - 1, generator=gen).add(1).tolist()  # block 0: never owned
    reqs, tables, start = [], [], 0
    for n, c in runs:
        total = c + n
        nb = -(-total // BS)
        # With a window, blocks wholly before the first query's window are holes (block 0).
        first = 0 if window is None else max(0, c - window + 1) // BS
        table = [0 if i < first else perm.pop() for i in range(nb)]
        for i in range(first, nb):
            used = min(BS, total - i * BS)
            cache[:, table[i], :used] = torch.randn(2, used, kvh, D, generator=gen).to(dtype)
        reqs.append((start, n, c, table))
        tables.append(table)
        start += n
    meta = build_attention_metadata(reqs, start, BS, torch.device("cpu"), window)
    q = torch.randn(start, h, D, generator=gen).to(dtype)
    return q, cache, tables, reqs, meta


def _brute(q, cache, reqs, window, scale):
    """Softmax over exactly the visible keys in float64: (out [T, H, D], lse [T, H]); rows of
    decodes (n == 1) included."""
    t, h, _ = q.shape
    kvh = cache.shape[3]
    out = torch.zeros(t, h, D, dtype=torch.float64)
    lse = torch.zeros(t, h, dtype=torch.float64)
    for start, n, c, table in reqs:
        for i in range(n):
            p = c + i
            pos = torch.arange(0 if window is None else max(0, p - window + 1), p + 1)
            blocks = torch.tensor(table)[pos // BS]
            heads = torch.arange(h) // (h // kvh)  # GQA: the KV head of each query head
            k = cache[0, blocks, pos % BS].double()[:, heads]  # [keys, H, D]
            v = cache[1, blocks, pos % BS].double()[:, heads]
            s = torch.einsum("khd,hd->hk", k, q[start + i].double()) * scale
            lse[start + i] = torch.logsumexp(s, 1)
            out[start + i] = torch.einsum("hk,khd->hd", torch.softmax(s, 1), v)
    return out, lse


CASES = [
    [(7, 0)],  # one run, no context
    [(5, 0), (9, 3), (2, 8), (21, 0), (3, 13)],  # several lengths, prefix hits / chunks
    [(33, 17), (16, 0), (4, 4)],  # tiles of 16, context at block boundaries
    [(70, 61), (45, 100)],  # keys across several 64-key chunks, context off chunk boundaries
]


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 6])
def test_op_equals_brute_force_and_torch_path(cpu_ops, group, window):
    gen = torch.Generator().manual_seed(group * 10 + (window or 0))
    scale = D**-0.5
    for runs in CASES:
        q, cache, tables, reqs, meta = _case(gen, runs, kvh=2, group=group, window=window)
        assert meta.prefill_slice == (0, q.shape[0]) and meta.prefill_token_idx is None
        ref_out, ref_lse = _brute(q, cache, reqs, window, scale)
        out, lse = paged_prefill(q, cache, meta.prefill_cu_seqlens, meta.prefill_context_lens,
                                 meta.prefill_block_tables, scale, window)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)
        # The torch path reads no NaN slot either and agrees (k, v: this step's, from the cache).
        slots = (meta.slot_block_ids, meta.slot_offsets)
        k, v = cache[0][slots], cache[1][slots]
        ref = torch.zeros_like(q)
        _prefill_attention(q, k, v, cache, meta, scale, ref)
        got = torch.zeros_like(q)
        paged_prefill_attention(q, k, v, cache, meta, scale, got)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_bfloat16_and_strided_q(cpu_ops):
    gen = torch.Generator().manual_seed(7)
    q, cache, _, reqs, meta = _case(gen, [(12, 5), (6, 0)], kvh=2, group=2, window=None)
    args = (meta.prefill_cu_seqlens, meta.prefill_context_lens, meta.prefill_block_tables, 0.25)
    ref, _ = _brute(q, cache, reqs, None, 0.25)
    qkv = torch.cat([q, torch.zeros_like(q)], dim=1)  # q as a non-contiguous view, as after a split
    out, _ = paged_prefill(qkv[:, : q.shape[1]], cache, *args)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    out16, _ = paged_prefill(q.bfloat16(), cache.bfloat16(), *args)
    torch.testing.assert_close(out16.double(), ref, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_with_decodes_between_runs(cpu_ops, window):
    """A step mixing decodes and runs (runs not back to back: the index path) gives the reference
    path's output, with the step's K/V written by paged_attention itself."""
    gen = torch.Generator().manual_seed(3)
    runs = [(1, 9), (6, 2), (1, 4), (11, 0), (1, 15), (3, 6)]
    q, cache, _, reqs, meta = _case(gen, runs, kvh=2, group=3, window=window)
    assert meta.prefill_slice is None and meta.prefill_token_idx is not None
    ref_out, _ = _brute(q, cache, reqs, window, D**-0.5)
    slots = (meta.slot_block_ids, meta.slot_offsets)
    k, v = cache[0][slots].clone(), cache[1][slots].clone()
    cache[:, meta.slot_block_ids, meta.slot_offsets] = float("nan")  # written by the call below
    outs = []
    for kw in (
        {},
        {"decode_attention": paged_decode_attention, "prefill_attention": paged_prefill_attention},
    ):
        outs.append(paged_attention(q, k, v, cache.clone(), meta, D**-0.5, **kw))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(outs[1].double(), ref_out, atol=2e-5, rtol=1e-4)


def test_bad_inputs_raise(cpu_ops):
    q = torch.randn(5, 2, D)
    cache = torch.randn(2, 4, BS, 1, D)
    cu, ctx = torch.tensor([0, 5]), torch.tensor([0])
    with pytest.raises(RuntimeError, match="too short"):
        paged_prefill(q, cache, cu, ctx, torch.tensor([[0]]), 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        paged_prefill(q, cache, cu, ctx, torch.tensor([[0, 9]]), 1.0)
    with pytest.raises(RuntimeError, match="from 0 to T"):
        paged_prefill(q, cache, torch.tensor([0, 4]), ctx, torch.tensor([[0, 1]]), 1.0)


def test_backend_bench_prefill_table_and_cases():
    from pdkv.bench.offline.backends import format_backend_table
    from pdkv.bench.offline.cli import parse_prefill_cases

    assert parse_prefill_cases("1x512, 32x128") == ((1, 512), (32, 128))
    assert parse_prefill_cases("") == ()
    with pytest.raises(ValueError, match="BxL"):
        parse_prefill_cases("512")
    result = {
        "model": "smollm2",
        "dtype": "float32",
        "num_threads": 2,
        "input_len": 128,
        "output_len": 32,
        "host_cpu": "cpu",
        "backends": ["torch", "cpu_paged"],
        "backends_used": {"torch": "torch", "cpu_paged": "cpu_paged"},
        "results": [],
        "prefill": [
            {
                "batch_size": 32,
                "input_len": 128,
                "torch": {"prefill_tok_s": 1000.0},
                "cpu_paged": {"prefill_tok_s": 1500.0},
                "prefill_ratio": {"torch": 1.0, "cpu_paged": 1.5},
                "greedy_equal": {"torch": True, "cpu_paged": False},
            }
        ],
        "host_load_avg_1m": [3.5, 3.9],
        "host_cpu_count": 2,
    }
    table = format_backend_table(result)
    assert (
        "| prefill B x L | torch prefill tok/s | cpu_paged prefill tok/s | cpu_paged / torch |"
        in table
    )
    assert "| 32 x 128 | 1000.0 | 1500.0 | 1.50x | NO |" in table


def test_backend_bench_runs_decode_and_prefill_cases_on_a_tiny_model():
    """The comparison itself, end to end on a tiny model: both engines decode and prefill the
    same tokens (it once unpacked run_pdkv's three values into two and failed on every prefill
    case)."""
    from pdkv.bench.offline.backends import run_backend_bench

    result = run_backend_bench(model="tiny-llama-kv2", backends=("torch", "cpu_paged"),
                               batch_sizes=(2,), input_len=8, output_len=3, num_threads=1,
                               prefill_cases=((2, 16),), verbose=False)
    (case,) = result["prefill"]
    assert (case["batch_size"], case["input_len"]) == (2, 16)
    assert case["greedy_equal"] == {"torch": True, "cpu_paged": True}
    assert case["cpu_paged"]["prefill_tok_s"] > 0
    assert result["results"][0]["greedy_equal"] == {"torch": True, "cpu_paged": True}


@pytest.mark.parametrize("window", [None, 70])
def test_a_querys_output_does_not_depend_on_how_its_prompt_was_split(cpu_ops, window):
    # The op's online softmax steps over 64-key chunks at fixed key positions: the same prompt
    # as one run, or as a prefix hit / chunked prefill (context 61, 99, 128) followed by the rest,
    # gives every query the same output and LSE bits.
    gen = torch.Generator().manual_seed(5)
    q, cache, tables, _, meta = _case(gen, [(150, 0)], kvh=2, group=3, window=window)
    scale = D**-0.5
    whole, whole_lse = paged_prefill(q, cache, meta.prefill_cu_seqlens, meta.prefill_context_lens,
                                     meta.prefill_block_tables, scale, window)
    table = torch.tensor([tables[0]])
    for ctx in (61, 99, 128):
        part, part_lse = paged_prefill(q[ctx:], cache, torch.tensor([0, 150 - ctx]),
                                       torch.tensor([ctx]), table, scale, window)
        assert torch.equal(part, whole[ctx:]), ctx
        assert torch.equal(part_lse, whole_lse[ctx:]), ctx
