"""Handoff, overlap, break-even, P:D and DCP arithmetic."""

from __future__ import annotations

import pytest

from pdkv.modelspec.hf_config import spec_from_hf_config
from pdkv.plan.afd import activation_traffic
from pdkv.plan.capacity import pd_ratio
from pdkv.plan.costs import (
    FixedCosts,
    breakeven_tokens,
    handoff,
    overlap_hidden,
    pool_breakeven_hit_rate,
)
from pdkv.plan.links import PRESETS, Link
from pdkv.plan.planner import PlanInputs, check_parallel, make_plan
from pdkv.plan.resolve import load_config

FAST = Link("t", 1e9, 0.0, "")
NO_FIXED = FixedCosts(scheduling=0.0)


def figures(**kw):
    return {f.key: f.value for f in make_plan(PlanInputs(**kw))}


def test_seed_example_20gb_at_25gbps_is_at_least_0_8_s():
    h = handoff(20e9, Link("c", 25e9, 0.0, ""), FixedCosts())
    assert h.wire == pytest.approx(0.8)
    assert h.total >= 0.8
    assert h.total == pytest.approx(0.8 + 2e-3)  # + the stated scheduling constant


def test_fixed_costs_add_up():
    link = Link("l", 1e9, 1e-3, "")
    f = FixedCosts(handshake_rtts=2, scheduling=0.01, layout=0.1)
    assert f.total(link) == pytest.approx(2 * 2 * 1e-3 + 0.01 + 0.1)


def test_layerwise_overlap_hides_at_most_l_minus_1_over_l():
    # wire 1 s, compute 2 s, 4 layers: all but the last layer's slice hides
    assert overlap_hidden(1.0, 2.0, 4) == pytest.approx(0.75)
    # wire 2 s, compute 1 s: bounded by compute; exposed = 2 − 3/4·1 = 1.25
    h = handoff(2e9, FAST, NO_FIXED, num_layers=4, prefill_s=1.0)
    assert h.total == pytest.approx(1.25)
    assert overlap_hidden(1.0, None, 4) == 0.0 and overlap_hidden(1.0, 5.0, 1) == 0.0


def test_breakeven_tokens():
    f = FixedCosts(scheduling=0.01)
    # 1/P − b/W = 1e-3 − 1000/1e9 = 0.000999 s/token; n* = 0.01 / 0.000999 = 10.01
    assert breakeven_tokens(1000, 0, 1000, FAST, f) == pytest.approx(0.01 / 0.000999)
    # a per-request state S adds S/W to the fixed part: (0.01 + 1e6/1e9) / 0.000999
    assert breakeven_tokens(1000, 1e6, 1000, FAST, f) == pytest.approx(0.011 / 0.000999)
    # loading a token as slow as computing it: never
    assert breakeven_tokens(1e6, 0, 1000, FAST, f) is None


def test_pool_breakeven_hit_rate():
    f = FixedCosts(scheduling=0.01)
    assert pool_breakeven_hit_rate(1000, 1000, 0, 1000, FAST, f) == pytest.approx(
        0.01 / (1000 * 0.000999))
    assert pool_breakeven_hit_rate(5, 1000, 0, 1000, FAST, f) > 1  # too short to pay
    assert pool_breakeven_hit_rate(1000, 1e6, 0, 1000, FAST, f) is None


def test_pd_ratio():
    # s = 1000/1000 = 1 s per prompt; a D finishes 100 tok/s / 100 tokens = 1 req/s
    assert pd_ratio(1000, 100, 1000, 100).p_per_d == pytest.approx(1.0)
    # TTFT 2 s: B = 1 s, ρ = 2·1/(1 + 2·1) = 2/3, μ_P = 2/3 req/s → 1.5 P per D
    r = pd_ratio(1000, 100, 1000, 100, target_ttft=2.0, target_tpot=0.05)
    assert r.utilisation == pytest.approx(2 / 3)
    assert r.p_per_d == pytest.approx(1.5) and r.rounded() == "2:1"
    assert r.d_streams == pytest.approx(5.0)
    assert pd_ratio(1000, 100, 1000, 400).rounded() == "4:1"  # a D finishing 4 req/s needs 4 P
    assert pd_ratio(1000, 100, 1000, 25).rounded() == "1:4"
    assert pd_ratio(1000, 100, 1000, 100, handoff_s=0.6, target_ttft=1.5).p_per_d is None


def test_dcp_per_rank_deepseek_tp8_dcp8():
    cfg, _ = load_config("deepseek-v3")
    m = spec_from_hf_config(cfg)
    got = figures(link=PRESETS["rdma-400"], model=m, prompt_len=32768, tp=8, dcp=8)
    assert got["rank_tokens"] == 4096
    assert got["rank_bytes"] == 70_272 * 4096 == 287_834_112
    assert got["request_bytes"] == 70_272 * 32768
    assert got["wire_s"] == pytest.approx(287_834_112 / 40e9)


def test_parallel_rules():
    cfg, _ = load_config("llama-3.1-70b")
    llama = spec_from_hf_config(cfg)
    with pytest.raises(ValueError, match="divide"):
        check_parallel(llama, 8, 3)
    with pytest.raises(ValueError, match="kv_heads"):
        check_parallel(llama, 8, 2)  # 8 heads on 8 ranks: nothing replicated to shard tokens over
    check_parallel(llama, 16, 2)


def test_kv_bytes_mode_breakeven_from_prompt_len():
    got = figures(link=Link("c", 25e9, 0.0, ""), kv_bytes=20e9, prompt_len=100_000,
                  prefill_tps=10_000.0)
    assert got["handoff_s"] >= 0.8
    # b = 200 kB/token: 1/P − b/W = 1e-4 − 8e-6 = 9.2e-5 s/token; n* = 2e-3 / 9.2e-5 ≈ 21.7
    assert got["breakeven_tokens"] == 22


def test_activation_traffic():
    t = activation_traffic(7168, 1, 61, 2, top_k=8)
    assert t.per_layer_direction == 7168 * 2 and t.per_layer_both == 2 * 7168 * 2
    assert t.model_both == 2 * 61 * 7168 * 2 and t.moe_dispatch_upper == 8 * 7168 * 2
