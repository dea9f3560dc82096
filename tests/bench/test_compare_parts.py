"""`pdkv compare`'s pure parts beyond the table: the sweep, TTFT phase groups, the plan's
predictions and break-even, the generated "does not pay" text, the capped-link topology rewrite
and the plots."""

from __future__ import annotations

import argparse
import json

import pytest

from pdkv.bench.compare.args import add_cli_args, parse_int_list, resolve_args, sweep
from pdkv.bench.compare.explain import explain, measured_noise, pool_hit_rate
from pdkv.bench.compare.netns import cap_topology, inner_argv, strip_inner
from pdkv.bench.compare.phases import PHASE_GROUPS, latency_samples, phase_groups
from pdkv.bench.compare.plan import (
    PlanContext,
    breakeven_lines,
    calibrate_fixed,
    measured_prefill_tps,
    predict_row,
)
from pdkv.bench.netns import NetnsPair
from pdkv.plan import costs, links

PD_PHASES = {
    "proxy": 1,
    "p_input": 2,
    "p_queue": 3,
    "p_kv_wait": 0,
    "p_prefill": 400,
    "p_output": 4,
    "p_residual": 5,
    "proxy_between": 6,
    "d_input": 7,
    "d_queue": 8,
    "transfer": 50,
    "d_first_step": 30,
    "d_output": 9,
    "d_residual": 10,
    "client_residual": 11,
}


def _ttft(phases: dict[str, float]) -> dict:
    return {"phases": {k: {"mean_ms": float(v), "p99_ms": float(v)} for k, v in phases.items()}}


def _row(
    topology: str, n: int, cache: str, ttft: float, tpot: float = 100.0, c: int = 1, **kw
) -> dict:
    return dict({"topology": topology, "input_len": n, "max_concurrency": c, "cache": cache,
                 "completed": 4, "mean_ttft_ms": ttft, "mean_tpot_ms": tpot}, **kw)


def test_sweep_lists_give_every_point_its_own_seed_and_quick_is_small():
    assert parse_int_list("128, 1024,128", "--input-lens", 1) == [128, 1024]
    for bad in ("", "a", "0"):
        with pytest.raises(ValueError):
            parse_int_list(bad, "--input-lens", 1)
    points = sweep([128, 1024], [1, 4], seed=7)
    assert [(p.input_len, p.max_concurrency, p.seed) for p in points] == [
        (128, 1, 7), (128, 4, 8), (1024, 1, 9), (1024, 4, 10)]
    assert all(p.caches == ("cold", "hot") for p in points)
    quick = sweep([16, 64], [2], seed=0, hot_longest_only=True)
    assert [(p.input_len, p.caches) for p in quick] == [(16, ("cold",)), (64, ("cold", "hot"))]
    args = resolve_args(add_cli_args(argparse.ArgumentParser()).parse_args(["--quick"]))
    assert args.input_lens == [16, 64] and args.max_concurrency == [2] and args.num_prompts == 2
    args = resolve_args(add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--input-len", "256", "--max-concurrency", "0,2", "--link-rate", "1gbit"]))
    assert (
        args.input_lens == [256] and args.max_concurrency == [0, 2] and args.link_rate_bps == 1.25e8
    )
    with pytest.raises(ValueError, match="shm transfer engine refuses it"):
        resolve_args(add_cli_args(argparse.ArgumentParser()).parse_args(
            ["--kv-transfer", "shm", "--link-rate", "1gbit"]))


def test_phase_groups_fold_pd_and_colocated_phases_and_add_up():
    g = phase_groups(_ttft(PD_PHASES))
    assert g is not None and list(g) == list(PHASE_GROUPS)
    assert g == {"queue": 6.0, "prefill": 400.0, "hold": 15.0, "transfer": 50.0, "d_queue": 15.0,
                 "d_first_step": 30.0, "residual": 30.0}
    assert sum(g.values()) == sum(PD_PHASES.values())
    colo = phase_groups(_ttft({"input": 1, "queue": 2, "kv_wait": 3, "prefill": 4, "output": 5,
                               "client_residual": 6, "something_new": 7}))
    assert colo == {"queue": 3.0, "prefill": 4.0, "hold": 0.0, "transfer": 3.0, "d_queue": 0.0,
                    "d_first_step": 0.0, "residual": 18.0}
    assert phase_groups(None) is None
    s = latency_samples({"tpots": [0.1, None], "itls": [[0.05, 0.15], []]})
    assert s == {"tpots_ms": [100.0], "itls_ms": [50.0, 150.0]}


def test_plan_predictions_use_the_calibrated_fixed_cost_and_the_tier_bandwidth():
    ctx = PlanContext("tcp", "disk")
    link = links.link("tcp-loopback")
    # The first pd run after start-up (here the short prompt) paid first-use costs: left out.
    first = _row("pd", 16, "cold", 500.0, p2p_bytes=4 * 737280.0, raw_phases={"transfer": 60.0})
    short = _row("pd", 16, "hot", 500.0, p2p_bytes=4 * 737280.0, raw_phases={"transfer": 8.0})
    long_ = _row(
        "pd",
        1024,
        "cold",
        9000.0,
        p2p_bytes=4 * 47185920.0,
        raw_phases={"transfer": 90.0},
        phase_groups={"transfer": 90.0},
    )
    mid = _row("pd", 1024, "hot", 9000.0, p2p_bytes=4 * 47185920.0, raw_phases={"transfer": 30.0})

    def f_of(r: dict) -> float:
        return max(
            0.0,
            r["raw_phases"]["transfer"] / 1e3
            - r["p2p_bytes"] / 4 / link.bandwidth
            - 2 * link.latency,
        )

    f, why = calibrate_fixed([first, short, long_, mid], ctx)
    assert f == pytest.approx(
        sorted(map(f_of, (short, long_, mid)))[1]
    )  # the median of the warm runs
    assert f < f_of(first)
    assert "median over 3 warm pd run(s) (12 handoffs" in why and "first pd run left out" in why
    only, why = calibrate_fixed([first], ctx)
    assert only == pytest.approx(f_of(first)) and "no warm run" in why
    p = predict_row(long_, ctx, f)
    assert p["p2p_bytes_per_request"] == 47185920.0
    assert p["pred_handoff_ms"] == pytest.approx(
        1e3 * (47185920.0 / link.bandwidth + 2 * link.latency + f)
    )
    assert (
        p["meas_handoff_ms"] == 90.0 and p["meas_transfer_ms"] == 90.0 and p["pred_pool_ms"] is None
    )
    pool = predict_row(_row("colocated+pool", 1024, "hot", 900.0, pool_bytes_read=4e9,
                            phase_groups={"transfer": 700.0}), ctx)
    assert pool["pred_pool_ms"] == pytest.approx(1000.0)  # 1e9 B per request at the assumed 1 GB/s
    assert pool["pred_handoff_ms"] is None and pool["meas_transfer_ms"] == 700.0
    capped = predict_row(
        dict(long_, link_rate="1gbit"), PlanContext("tcp", "disk", "1gbit", 1.25e8), 0.0
    )
    assert capped["pred_handoff_ms"] == pytest.approx(1e3 * 47185920.0 / 1.25e8)
    assert (
        predict_row(_row("colocated", 1024, "cold", 1.0, p2p_bytes=0.0), ctx)["pred_transfer_ms"]
        is None
    )


def test_breakeven_lines_come_from_the_planner_with_the_measured_prefill_rate():
    from pdkv.bench.compare.output import plan_model

    rows = [_row("colocated", 1024, "cold", 0.0, phase_groups={"prefill": 10240.0}),
            _row("colocated", 128, "cold", 0.0, phase_groups={"prefill": 2000.0}),
            _row("pd", 1024, "cold", 0.0, phase_groups={"prefill": 1.0})]
    tps, how = measured_prefill_tps(rows)
    assert tps == pytest.approx(100.0) and "colocated cold" in how
    lines = breakeven_lines(
        plan_model("smollm2"), [128, 1024], (tps, how), PlanContext("tcp", "disk"), fixed_s=0.05
    )
    b = 46080.0  # SmolLM2 fp32: 2 · 30 layers · 3 KV heads · 64 · 4 B
    link = links.link("tcp-loopback")
    fixed = costs.FixedCosts(scheduling=0.05)
    n_star = costs.breakeven_tokens(b, 0.0, 100.0, link, fixed)
    assert any(f"above {int(-(-n_star // 1))} tokens" in x and "tcp-loopback" in x for x in lines)
    h = costs.pool_breakeven_hit_rate(128, b, 0.0, 100.0, costs_link := __import__(
        "pdkv.bench.compare.plan", fromlist=["tier_link"]).tier_link("disk"), fixed)
    assert costs_link.bandwidth == 1e9
    assert any(x.startswith("128-token prompts") and f"{h:.3g}" in x for x in lines)
    assert (
        "no cold run"
        in breakeven_lines(plan_model("smollm2"), [128], None, PlanContext("tcp", "disk"))[0]
    )
    no_pool = breakeven_lines(
        plan_model("smollm2"),
        [128, 1024],
        (tps, how),
        PlanContext("tcp", "disk"),
        fixed_s=0.05,
        pool_ran=False,
    )
    assert not any("pool" in x for x in no_pool) and any("tcp-loopback" in x for x in no_pool)


def test_explanations_follow_the_measured_rows():
    rows = [
        _row("colocated", 128, "cold", 500.0, tpot=100.0),
        _row("pd", 128, "cold", 900.0, tpot=100.0, phase_groups={"hold": 10, "transfer": 40}),
        _row("colocated", 1024, "cold", 9000.0, tpot=300.0),
        _row("pd", 1024, "cold", 5000.0, tpot=100.0),
        _row("colocated+pool", 128, "cold", 520.0),
        _row("colocated+pool", 128, "hot", 510.0, pool_hit_tokens=0.0),
        _row("colocated+pool", 1024, "cold", 9100.0),
        _row("colocated+pool", 1024, "hot", 2000.0, pool_hit_tokens=4 * 896.0),
    ]
    text = explain(rows)
    pd_short = next(x for x in text if x.startswith("128-token prompts"))
    assert "+80%, slower" in pd_short and "does not pay" in pd_short and "= 50 ms" in pd_short
    pd_long = next(x for x in text if x.startswith("1024-token prompts"))
    assert "P/D pays on TTFT here" in pd_long
    pool_short = next(x for x in text if "`colocated+pool`, 128" in x)
    assert "cannot pay at this length" in pool_short and "hit rate 0%" in pool_short
    pool_long = next(x for x in text if "`colocated+pool`, 1024" in x)
    assert "hit rate 88%" in pool_long and "The pool pays here." in pool_long
    assert pool_hit_rate(rows[-1]) == pytest.approx(0.875)
    flipped = explain([_row("colocated", 1024, "cold", 5000.0), _row("pd", 1024, "cold", 5200.0)])
    assert "±10%" in flipped[0]
    assert "no clear difference" in flipped[1] and "does not pay" in flipped[1]
    # the threshold is the run's own noise: a control topology's hot vs cold gap (30% here)
    noisy = [_row("colocated", 1024, "cold", 5000.0), _row("colocated", 1024, "hot", 6500.0),
             _row("pd", 1024, "cold", 4000.0)]
    assert measured_noise(noisy) == pytest.approx(0.30)
    text = explain(noisy)
    assert "±30%" in text[0] and "no clear difference (-20%)" in text[1]
    weak = explain([_row("colocated", 1024, "cold", 5000.0), _row("pd", 1024, "cold", 4000.0),
                    _row("pd@1gbit", 1024, "cold", 6000.0, link_rate="1gbit", meas_handoff_ms=400.0,
                         pred_handoff_ms=380.0)])
    assert any("over this link does not pay" in x and "plan 380 ms" in x for x in weak)


def test_cap_topology_moves_prefill_into_p_namespace():
    from pdkv.bench.compare.topologies import TopologySpec, launcher_args
    from pdkv.launch import launcher

    args = argparse.Namespace(
        model="smollm2",
        kv_transfer="tcp",
        threads_per_engine=1,
        routing="round_robin",
        engine_args=["--num-kv-blocks", "64"],
    )
    topo = launcher.build_topology(
        launcher_args(TopologySpec("pd@1gbit", "pd", False, link_rate="1gbit"), args, "/tmp/x"),
        None,
    )
    pair = NetnsPair(prefix="pdkvc", rate="1gbit")
    old = next(c.url for c in topo.children if c.name == "prefill0")
    cap_topology(topo, pair)
    p = next(c for c in topo.children if c.name == "prefill0")
    assert p.cmd[:4] == ["ip", "netns", "exec", "pdkvc-p"]
    assert p.cmd[p.cmd.index("--host") + 1] == "10.77.0.1" and p.url == old.replace(
        "127.0.0.1", "10.77.0.1"
    )
    extra = json.loads(p.cmd[p.cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["kv_host"] == extra["kv_advertise_host"] == "10.77.0.1"
    proxy = next(c for c in topo.children if c.name == "proxy")
    assert proxy.cmd[proxy.cmd.index("--prefill") + 1] == p.url
    d = next(c for c in topo.children if c.name == "decode0")
    assert d.cmd[0] != "ip" and "127.0.0.1" in d.url
    argv = inner_argv("py", ["--link-rate", "1gbit", "--", "--num-kv-blocks", "64"], "pdkvc")
    assert argv == [
        "py",
        "-m",
        "pdkv.cli",
        "compare",
        "--netns-inner",
        "pdkvc",
        "--link-rate",
        "1gbit",
        "--",
        "--num-kv-blocks",
        "64",
    ]
    assert strip_inner(argv[4:]) == ["--link-rate", "1gbit", "--", "--num-kv-blocks", "64"]


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from pdkv.bench.compare.plots import write_plots

    rows = [
        _row(
            "pd",
            128,
            "cold",
            900.0,
            phase_groups=phase_groups(_ttft(PD_PHASES)),
            tpots_ms=[1.0, 2.0],
            itls_ms=[1.0, 3.0],
            p2p_bytes=2.0**20,
            prefix_hit_rates={"d": 0.5},
        ),
        _row("colocated", 128, "hot", 500.0, pool_hit_tokens=64.0),
    ]
    names = write_plots(rows, str(tmp_path), "c_")
    assert names == ["c_phases.png", "c_tpot_itl.png", "c_bytes.png", "c_hit_rates.png"]
    assert all((tmp_path / n).stat().st_size > 1000 for n in names)
    # However many runs, every plot fits a guide's width: one panel per (length, concurrency).
    many = [dict(r, input_len=n, max_concurrency=c, topology=f"{r['topology']}{t}")
            for r in rows for n in (128, 512) for c in (1, 2) for t in range(5)]
    for name in write_plots(many, str(tmp_path / "many"), "c_"):
        head = (tmp_path / "many" / name).read_bytes()[16:24]
        assert int.from_bytes(head[:4], "big") <= 900, name  # PNG IHDR width, px
    # No pool and no hit anywhere: no empty hit-rate axis.
    quiet = [dict(r, pool_hit_tokens=None, prefix_hit_rates={"d": 0.0}) for r in rows]
    assert write_plots(quiet, str(tmp_path / "q"), "c_") == [
        "c_phases.png",
        "c_tpot_itl.png",
        "c_bytes.png",
    ]
