"""Re-sharding planner (pdkv/kv_transfer/reshard.py), torch-free except where a test rebuilds
bytes: every (P tp, D tp, KV heads) up to 8 that ParallelLayout.check_heads allows covers each D
rank's heads exactly once from a P rank that holds them; segmented tensors rebuild bitwise; head
copies out of P's blocks land on D's head positions. Issue 12, acceptance 1."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdkv.kv_transfer.reshard import HeadRead, plan_head_copies, plan_head_reads, plan_segment_reads
from pdkv.parallel.layout import ParallelLayout

SIZES = range(1, 9)


def allowed(tp: int, heads: int) -> bool:
    return heads % tp == 0 or tp % heads == 0


COMBOS = [
    (p, d, h)
    for p, d, h in itertools.product(SIZES, SIZES, SIZES)
    if allowed(p, h) and allowed(d, h)
]


def test_every_allowed_layout_up_to_8_is_covered():
    assert len(COMBOS) > 100  # the sweep below is not vacuous


def test_each_d_rank_gets_each_of_its_heads_exactly_once_from_a_p_rank_that_holds_it():
    for p_tp, d_tp, h in COMBOS:
        p_lay, d_lay = ParallelLayout(tp_size=p_tp), ParallelLayout(tp_size=d_tp)
        plan = plan_head_reads(p_tp, d_tp, h)
        assert sorted(plan) == list(range(d_tp))
        p_n = p_lay.kv_heads_per_rank(h)
        for d, reads in plan.items():
            need = d_lay.kv_heads_per_rank(h)
            filled = [r.d_head + i for r in reads for i in range(r.count)]
            assert sorted(filled) == list(range(need)), (p_tp, d_tp, h, d)  # exactly once
            assert sum(r.count for r in reads) == need  # region lengths = D's need
            for r in reads:
                assert 0 <= r.p_rank < p_tp and r.p_head + r.count <= p_n
                for i in range(r.count):  # the global head read is the one D stores there
                    got = p_lay.kv_head_start(r.p_rank, h) + r.p_head + i
                    assert got == d_lay.kv_head_start(d, h) + r.d_head + i, (p_tp, d_tp, h, d, r)


def test_d_ranks_needing_a_replicated_head_are_spread_over_its_holders():
    # P tp 4 on 2 heads: ranks 0, 1 hold head 0; D tp 4: ranks 0, 1 need head 0 too.
    plan = plan_head_reads(4, 4, 2)
    assert [plan[d][0].p_rank for d in range(4)] == [0, 1, 2, 3]
    assert plan_head_reads(2, 4, 1) == {0: [HeadRead(0, 0, 0, 1)], 1: [HeadRead(1, 0, 0, 1)],
                                        2: [HeadRead(0, 0, 0, 1)], 3: [HeadRead(1, 0, 0, 1)]}


def test_target_layouts_of_issue_12():
    assert plan_head_reads(1, 2, 2) == {0: [HeadRead(0, 0, 0, 1)], 1: [HeadRead(0, 1, 0, 1)]}
    assert plan_head_reads(1, 2, 1) == {0: [HeadRead(0, 0, 0, 1)], 1: [HeadRead(0, 0, 0, 1)]}
    assert plan_head_reads(2, 1, 4) == {0: [HeadRead(0, 0, 0, 2), HeadRead(1, 0, 2, 2)]}


@pytest.mark.parametrize(("p_tp", "d_tp", "heads", "words"), [
    (3, 1, 2, ["producer", "tensor_parallel_size=3", "2 KV heads"]),
    (1, 3, 4, ["consumer", "tensor_parallel_size=3", "4 KV heads"]),
    (0, 1, 4, ["tensor_parallel_size=0"]),
])
def test_layouts_check_heads_refuses_raise_naming_the_values(p_tp, d_tp, heads, words):
    with pytest.raises(ValueError) as e:
        plan_head_reads(p_tp, d_tp, heads)
    assert all(w in str(e.value) for w in words)


def shard(full: torch.Tensor, sizes: list[int], tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s local tensor: each segment split on its own, parts concatenated."""
    parts, at = [], 0
    for s in sizes:
        parts.append(full[at + rank * (s // tp) : at + (rank + 1) * (s // tp)])
        at += s
    return torch.cat(parts)


@pytest.mark.parametrize("sizes", [[8, 8, 8], [32, 8, 8], [8, 24, 8, 16]])
def test_segment_reads_rebuild_each_d_shard_bitwise(sizes):
    full = torch.arange(sum(sizes), dtype=torch.int64) * 7919 + 3  # a distinct marker per element
    for p_tp, d_tp in itertools.product([1, 2, 4, 8], repeat=2):
        p_shards = [shard(full, sizes, p_tp, p) for p in range(p_tp)]
        plan = plan_segment_reads(sizes, p_tp, d_tp)
        for d in range(d_tp):
            want = shard(full, sizes, d_tp, d)
            got = torch.full_like(want, -1)
            for r in plan[d]:
                got[r.d_offset : r.d_offset + r.length] = p_shards[r.p_rank][
                    r.p_offset : r.p_offset + r.length
                ]
            assert torch.equal(got, want), (sizes, p_tp, d_tp, d)
            assert sum(r.length for r in plan[d]) == want.numel()  # nothing read twice


def test_segment_reads_merge_contiguous_runs_and_refuse_uneven_splits():
    assert plan_segment_reads([8], 1, 2) == {0: [(0, 0, 0, 4)], 1: [(0, 4, 0, 4)]}
    assert plan_segment_reads([4, 4], 2, 1) == {
        0: [(0, 0, 0, 2), (1, 0, 2, 2), (0, 2, 4, 2), (1, 2, 6, 2)]
    }
    with pytest.raises(
        ValueError, match=r"consumer tensor_parallel_size=3 does not divide segment size\(s\) \[8"
    ):
        plan_segment_reads([6, 8], 1, 3)


# ------------------------------------------------------------------ copies out of blocks
LAYERS, BS, HD = 2, 4, 3  # head_size 3 float32 = 12 bytes


def blocks(n: int, heads: int, seed: int) -> torch.Tensor:
    return (torch.arange(n * LAYERS * 2 * BS * heads * HD, dtype=torch.float32) + seed).reshape(
        n, LAYERS, 2, BS, heads, HD
    )


def apply(copies, src: torch.Tensor, dst: torch.Tensor) -> None:
    s, t = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    for c in copies:
        t[c.local_offset : c.local_offset + c.nbytes] = s[
            c.remote_offset : c.remote_offset + c.nbytes
        ]


@pytest.mark.parametrize(("d_tp", "heads"), [(2, 2), (2, 1), (2, 4), (4, 8), (4, 2)])
def test_head_copies_fill_each_d_rank_with_its_heads_of_ps_blocks(d_tp, heads):
    p_kv = blocks(6, heads, 1000)
    p_ids, d_ids = [4, 1, 5], [2, 0, 3]
    lay = ParallelLayout(tp_size=d_tp)
    local = lay.kv_heads_per_rank(heads)
    total = 0
    for d, reads in plan_head_reads(1, d_tp, heads).items():
        d_kv = torch.zeros(5, LAYERS, 2, BS, local, HD)
        copies = plan_head_copies(p_ids, d_ids, BS, LAYERS, HD * 4, heads, local, reads)
        apply(copies, p_kv, d_kv)
        start = lay.kv_head_start(d, heads)
        for pb, db in zip(p_ids, d_ids):
            assert torch.equal(d_kv[db], p_kv[pb][..., start : start + local, :])
        assert not d_kv[1].any() and not d_kv[4].any()  # blocks outside the pairing untouched
        total += sum(c.nbytes for c in copies)
    # Bytes moved = what D stores: one full copy when D splits the heads, d_tp / heads copies when
    # D replicates them.
    assert total == len(p_ids) * p_kv[0].numel() * 4 * max(1, d_tp // heads)


def test_equal_heads_give_whole_block_copies_and_bad_reads_raise():
    bb = LAYERS * 2 * BS * 2 * HD * 4
    copies = plan_head_copies(
        [3, 4, 7], [0, 1, 2], BS, LAYERS, HD * 4, 2, 2, [HeadRead(0, 0, 0, 2)]
    )
    assert [(c.remote_offset, c.local_offset, c.nbytes) for c in copies] == [
        (3 * bb, 0, 2 * bb),
        (7 * bb, 2 * bb, bb),
    ]
    with pytest.raises(ValueError, match="outside"):
        plan_head_copies([0], [0], BS, LAYERS, HD * 4, 2, 1, [HeadRead(0, 1, 0, 2)])
    with pytest.raises(ValueError, match="2 producer blocks paired with 1"):
        plan_head_copies([0, 1], [0], BS, LAYERS, HD * 4, 2, 1, [HeadRead(0, 1, 0, 1)])


def test_head_copies_of_a_quantized_page_move_each_heads_values_and_scales():
    """Two planes per layer (values [2, BS, heads, HD] bytes, then float32 scales [2, BS, heads]):
    each D rank gets exactly its heads of both planes, and bytes moved = one copy of P's blocks."""
    heads, d_tp = 4, 2
    vals = (
        torch.arange(6 * LAYERS * 2 * BS * heads * HD, dtype=torch.int32)
        .remainder(251)
        .to(torch.uint8)
    )
    vals = vals.reshape(6, LAYERS, 2, BS, heads, HD)
    scales = (
        torch.arange(6 * LAYERS * 2 * BS * heads, dtype=torch.float32).reshape(
            6, LAYERS, 2, BS, heads
        )
        + 0.5
    )

    def pages(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # [blocks, layers, page bytes]
        n = v.shape[0]
        return torch.cat(
            [v.reshape(n, LAYERS, -1), s.reshape(n, LAYERS, -1).view(torch.uint8)], dim=-1
        )

    src = pages(vals, scales)
    p_ids, d_ids = [4, 1, 5], [2, 0, 3]
    local = heads // d_tp
    total = 0
    for d, reads in plan_head_reads(1, d_tp, heads).items():
        dst = torch.zeros(5, LAYERS, 2 * BS * local * (HD + 4), dtype=torch.uint8)
        copies = plan_head_copies(p_ids, d_ids, BS, LAYERS, (HD, 4), heads, local, reads)
        apply(copies, src, dst)
        total += sum(c.nbytes for c in copies)
        sl = slice(d * local, (d + 1) * local)
        for pb, db in zip(p_ids, d_ids):
            assert torch.equal(dst[db], pages(vals[pb : pb + 1, ..., sl, :].contiguous(),
                                              scales[pb : pb + 1, ..., sl].contiguous())[0])
        assert not dst[1].any() and not dst[4].any()
    assert total == len(p_ids) * src[0].numel()
