"""ParallelLayout rank mapping and DCP token placement, checked by brute force."""

from __future__ import annotations

import pytest

from pdkv.parallel.layout import (
    ParallelLayout,
    dcp_global_position,
    dcp_local_index,
    dcp_local_len,
    dcp_owner,
)


@pytest.mark.parametrize("interleave,n", [(1, 1), (1, 2), (16, 2), (4, 3), (2, 4)])
def test_token_placement_is_a_bijection(interleave, n):
    total = 5 * interleave * n + 3
    seen: dict[int, list[int]] = {r: [] for r in range(n)}
    for p in range(total):
        r = dcp_owner(p, interleave, n)
        local = dcp_local_index(p, interleave, n)
        assert local == len(seen[r]), "local indices are dense and in position order"
        seen[r].append(p)
        assert dcp_global_position(local, r, interleave, n) == p
    for r in range(n):
        for length in range(total + 1):
            assert dcp_local_len(length, r, interleave, n) == sum(1 for p in seen[r] if p < length)


@pytest.mark.parametrize("block_size,interleave,n", [(16, 1, 2), (16, 16, 2), (16, 4, 4)])
def test_logical_block_fills_one_physical_block_per_rank(block_size, interleave, n):
    for j in range(3):
        for p in range(j * block_size * n, (j + 1) * block_size * n):
            assert dcp_local_index(p, interleave, n) // block_size == j


def test_vllm_mode_groups_share_a_kv_head():
    lay = ParallelLayout(tp_size=4, dcp_size=2)
    assert (
        lay.world_size == 4
        and lay.dcp_groups() == [[0, 1], [2, 3]]
        and lay.tp_groups() == [[0, 1, 2, 3]]
    )
    lay.check_heads(num_heads=8, num_kv_heads=2)
    for group in lay.dcp_groups():
        assert len({lay.kv_head_start(r, 2) for r in group}) == 1
    assert [lay.dcp_rank(r) for r in range(4)] == [0, 1, 0, 1]


def test_replicated_mode_ranks():
    lay = ParallelLayout(tp_size=2, dcp_size=2, dcp_replicated=True)
    assert lay.world_size == 4
    assert lay.tp_groups() == [[0, 1], [2, 3]] and lay.dcp_groups() == [[0, 2], [1, 3]]
    assert [(lay.tp_rank(r), lay.dcp_rank(r)) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_kv_heads_replicated_when_tp_exceeds_them():
    lay = ParallelLayout(tp_size=2)
    assert lay.kv_heads_per_rank(1) == 1 and [lay.kv_head_start(r, 1) for r in (0, 1)] == [0, 0]
    assert lay.kv_heads_per_rank(2) == 1 and [lay.kv_head_start(r, 2) for r in (0, 1)] == [0, 1]
    assert [ParallelLayout(tp_size=3).kv_head_start(r, 3) for r in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("kw,heads,match", [
    ({"tp_size": 2}, (9, 3), "must divide the model's 9 attention heads"),
    ({"tp_size": 3}, (9, 2), "must divide one another"),
    ({"tp_size": 2, "dcp_size": 2}, (4, 2), "multiple of it"),
])
def test_head_constraints_name_the_values(kw, heads, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout(**kw).check_heads(*heads)


def test_dcp_must_divide_tp_in_vllm_mode():
    with pytest.raises(ValueError, match="must divide tensor_parallel_size=3"):
        ParallelLayout(tp_size=3, dcp_size=2)
    assert ParallelLayout(tp_size=1, dcp_size=2, dcp_replicated=True).world_size == 2


@pytest.mark.parametrize("kw", [{}, {"tp_size": 2}, {"tp_size": 2, "dcp_size": 2},
                                {"dcp_size": 2, "dcp_replicated": True}, {"pcp_size": 2},
                                {"pcp_size": 3}])
def test_only_pcp_rank_0_publishes_kv(kw):
    lay = ParallelLayout(**kw)
    publishing = [r for r in range(lay.world_size) if lay.publishes_kv(r)]
    assert publishing == ([0] if lay.pcp_size > 1 else list(range(lay.world_size)))
    assert lay.kv_publishers == len(publishing)
