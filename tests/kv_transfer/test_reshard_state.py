"""Linear-state slot re-sharding (pdkv/kv_transfer/reshard_state.py): a Gated DeltaNet slot whose
conv window concatenates q | k | v channels (each segment split over TP on its own) and whose
recurrent state is split per value head is rebuilt bitwise on every consumer rank, for P and D tp
in {1, 2, 4} and slot ids that differ between the sides; the geometry matches the KV cache's slot
size at each tp; the scheduler half refuses a pair the planner cannot split, naming the values.
Issue 12, acceptance 1 (state tensors with a distinct marker per segment)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdkv.kv_transfer.connector.p2p_compat import state_error
from pdkv.kv_transfer.reshard_state import StateGeometry, plan_state_copies, state_producer_ranks

KERNEL, DK, DV = 4, 3, 2
GEOM = StateGeometry(
    group=1,
    num_layers=2,
    conv_segments=(4 * DK, 4 * DK, 8 * DV),
    conv_row_bytes=(KERNEL - 1) * 4,
    rec_heads=8,
    rec_head_bytes=DK * DV * 4,
)
SLOTS = 3


def full_state(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's state of one layer: conv [channels, K - 1] and recurrent [heads, dk, dv]
    float32, each element a distinct marker (segment, layer and position encoded)."""
    c = sum(GEOM.conv_segments)
    conv = torch.arange(c * (KERNEL - 1), dtype=torch.float32).view(c, KERNEL - 1) + 1000 * layer
    rec = (
        -torch.arange(GEOM.rec_heads * DK * DV, dtype=torch.float32).view(GEOM.rec_heads, DK, DV)
        - 1000 * layer
    )
    return conv, rec


def local_slot(tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s slot bytes: per layer its [q part | k part | v part] conv rows, then its
    value heads' recurrent state (pdkv/model/qwen3_next.py's per-rank layout)."""
    pages = []
    for layer in range(GEOM.num_layers):
        conv, rec = full_state(layer)
        parts, at = [], 0
        for size in GEOM.conv_segments:
            part = size // tp
            parts.append(conv[at + rank * part : at + (rank + 1) * part])
            at += size
        heads = GEOM.rec_heads // tp
        pages += [torch.cat(parts).flatten(), rec[rank * heads : (rank + 1) * heads].flatten()]
    return torch.cat(pages).view(torch.uint8)


@pytest.mark.parametrize(("p_tp", "d_tp"), list(itertools.product([1, 2, 4], repeat=2)))
def test_every_consumer_rank_rebuilds_its_slot_bitwise(p_tp, d_tp):
    p_slot, d_slot = 2, 1  # slot ids differ between the sides
    p_regions = []
    for p in range(p_tp):
        region = torch.zeros(SLOTS * GEOM.slot_bytes(p_tp), dtype=torch.uint8)
        region[p_slot * GEOM.slot_bytes(p_tp) : (p_slot + 1) * GEOM.slot_bytes(p_tp)] = local_slot(
            p_tp, p
        )
        p_regions.append(region)
    for d in range(d_tp):
        size = GEOM.slot_bytes(d_tp)
        region = torch.full((SLOTS * size,), 0xAB, dtype=torch.uint8)
        moved = 0
        ranks = state_producer_ranks(GEOM, p_tp, d_tp)[d]
        for p in range(p_tp):
            copies = plan_state_copies(GEOM, p_tp, d_tp, d, p_slot, d_slot, p)
            assert bool(copies) == (p in ranks)
            for c in copies:
                region[c.local_offset : c.local_offset + c.nbytes] = p_regions[p][
                    c.remote_offset : c.remote_offset + c.nbytes
                ]
                moved += c.nbytes
        assert torch.equal(region[d_slot * size : (d_slot + 1) * size], local_slot(d_tp, d)), (
            p_tp,
            d_tp,
            d,
        )
        assert moved == size  # each byte read once: bytes moved = what D needs
        assert (region[: d_slot * size] == 0xAB).all() and (
            region[(d_slot + 1) * size :] == 0xAB
        ).all()


def test_equal_tp_moves_a_whole_slot_and_bad_sizes_raise():
    assert plan_state_copies(GEOM, 2, 2, 1, 5, 7) == [
        (5 * GEOM.slot_bytes(2), 7 * GEOM.slot_bytes(2), GEOM.slot_bytes(2))
    ]
    with pytest.raises(
        ValueError, match="consumer tensor_parallel_size=3 does not divide the model's 8"
    ):
        plan_state_copies(GEOM, 1, 3, 0, 0, 0)
    with pytest.raises(ValueError, match="outside tensor_parallel_size=2"):
        plan_state_copies(GEOM, 1, 2, 2, 0, 0)


def test_geometry_matches_the_kv_cache_slot_at_each_tp(tiny_gdn):
    from pdkv.model.arch_config import LlamaArchConfig
    from pdkv.worker.kv_cache import gdn_state_geometry, linear_state_spec

    arch = LlamaArchConfig.from_hf_folder(tiny_gdn)
    geom = gdn_state_geometry(arch, "float32")
    assert StateGeometry.from_layout({"linear_state": geom.to_layout()}) == geom
    for tp in (1, 2):
        spec = linear_state_spec(arch, 16, "float32", tp)
        assert geom.slot_bytes(tp) == spec.page_size_bytes * len(arch.linear_layers)
        assert geom.conv_bytes(tp) == spec.conv_bytes


def test_scheduler_half_refuses_a_tp_pair_the_state_cannot_split():
    mine = {"tp_size": 2, "linear_state": GEOM.to_layout()}
    p = {"tp_size": 1, "layout": {"linear_state": GEOM.to_layout()}}
    assert state_error(mine, p) == ""
    assert state_error(dict(mine, tp_size=3), p).startswith(
        "re-sharding the linear-state slot from producer tp_size=1 to consumer tp_size=3")
    other = dict(GEOM.to_layout(), rec_heads=4)
    assert "linear-state geometry" in state_error(
        mine, {"tp_size": 1, "layout": {"linear_state": other}}
    )
