"""`pdkv bench handoff`'s comparison arithmetic agrees with `pdkv plan` and judges the ratio."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from pdkv.bench.handoff.cli import capped_lengths
from pdkv.bench.handoff.compare import compare, engine_link, fixed_from_probe, format_table
from pdkv.cli import main as cli_main
from pdkv.launch.netns import rate_bytes_per_s
from pdkv.plan import links

MB = 1e6


def test_prediction_is_bytes_over_bandwidth_plus_fixed_and_ratio_judged():
    link = links.Link("custom", 1e9, 0.0, "test")
    row = compare("tcp", link, 1024, 50 * MB, measured_s=0.070, fixed_s=0.005)
    assert row.wire_s == pytest.approx(0.050)
    assert row.predicted_s == pytest.approx(
        0.055
    )  # 50 MB / 1 GB/s + 5 ms, no handshake at latency 0
    assert row.ratio == pytest.approx(0.070 / 0.055)
    assert row.within(0.30) and not row.within(0.20)
    fast = compare("tcp", link, 1024, 50 * MB, measured_s=0.030, fixed_s=0.005)
    assert not fast.within(0.30)  # faster than predicted counts as a miss too
    slow = compare("tcp", link, 1024, 50 * MB, measured_s=0.2, fixed_s=0.005)
    assert not slow.within(0.30) and slow.within(3.0)
    table = format_table([row, slow])
    assert "PASS" in table.splitlines()[2] and "FAIL" in table.splitlines()[3]


def test_fixed_cost_from_probe_removes_wire_and_handshake():
    link = links.link("tcp-loopback")  # 2.7e9 B/s, 50 µs one way
    probe_bytes = 737_280
    f = fixed_from_probe(0.004, probe_bytes, link)
    assert f == pytest.approx(0.004 - probe_bytes / 2.7e9 - 2 * 50e-6)
    assert fixed_from_probe(0.0, probe_bytes, link) == 0.0


@pytest.mark.parametrize("transfer,bandwidth,rate", [("tcp", None, None), ("shm", None, None),
                                                     ("tcp", 6e8, None), ("tcp", None, "1gbit")])
def test_plan_command_reproduces_the_prediction(transfer, bandwidth, rate):
    rate_bps = rate_bytes_per_s(rate) if rate else None
    link = engine_link(transfer, bandwidth, rate_bps, rate or "")
    row = compare(transfer, link, 4096, 188_743_680, measured_s=0.5, fixed_s=0.0042)
    argv = row.plan_command().split()[1:] + ["--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(argv) == 0
    figures = json.loads(out.getvalue())["figures"]
    assert figures["handoff_s"]["value"] == pytest.approx(row.predicted_s, rel=1e-3)
    assert figures["link_bandwidth"]["value"] == pytest.approx(link.bandwidth)


def test_link_choice_and_rates():
    assert engine_link("tcp").name == "tcp-loopback" and engine_link("shm").name == "shm"
    measured = engine_link("tcp", 6e8)
    assert measured.bandwidth == 6e8 and measured.latency == links.link("tcp-loopback").latency
    capped = engine_link("tcp", 6e8, rate_bytes_per_s("1gbit"), "1gbit")
    assert capped.bandwidth == 125e6 and capped.latency == 0.0
    assert rate_bytes_per_s("10gbit") == 1.25e9 and rate_bytes_per_s("500mbit") == 62.5e6
    assert rate_bytes_per_s("100mbps") == 100e6
    for bad in ("1gb", "fast", "0gbit"):
        with pytest.raises(ValueError):
            rate_bytes_per_s(bad)
    with pytest.raises(ValueError):
        engine_link("mooncake")
    assert capped_lengths([1024, 8192, 8191]) == [1024, 8191]
    with pytest.raises(ValueError):
        capped_lengths([])


def test_link_rate_without_root_skips_with_a_message(monkeypatch, capsys):
    from pdkv.bench.handoff import cli as handoff
    from pdkv.launch import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    result = handoff.run_handoff_bench(["tcp"], [16], link_rate="1gbit")
    assert result == {"skipped": "needs root (network namespaces and tc qdiscs)"}
    assert "skipped: needs root" in capsys.readouterr().out
    with pytest.raises(ValueError, match="only --transfer tcp"):
        handoff.run_handoff_bench(["tcp", "shm"], [16], link_rate="1gbit")
