"""`pdkv compare`: the pure parts (topology names, counter deltas, summary rows, Markdown table,
report paths) and one end-to-end `pdkv compare --quick` run on the real model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from pdkv.bench.compare.args import report_paths
from pdkv.bench.compare.report import (
    counter_deltas,
    engine_counters,
    format_bytes,
    markdown_table,
    summarize_run,
)
from pdkv.bench.compare.topologies import TopologySpec, parse_topologies, unsupported_reason

METRICS = """# TYPE pdkv:kv_transfer_bytes_received_total counter
pdkv:kv_transfer_bytes_received_total{model_name="smollm2"} 1000.0
# TYPE pdkv:kv_pool_bytes_read_total counter
pdkv:kv_pool_bytes_read_total{model_name="smollm2",tier="disk"} 300.0
pdkv:kv_pool_bytes_read_total{model_name="smollm2",tier="redis"} 200.0
# TYPE pdkv:prefix_cache_queries_total counter
pdkv:prefix_cache_queries_total{model_name="smollm2"} 512.0
# TYPE pdkv:prefix_cache_hits_total counter
pdkv:prefix_cache_hits_total{model_name="smollm2"} 128.0
# TYPE pdkv:kv_pool_save_queue_depth gauge
pdkv:kv_pool_save_queue_depth{model_name="smollm2",tier="all"} 3.0
"""

RESULT = {"completed": 6, "failed": 0, "mean_ttft_ms": 1234.4, "p99_ttft_ms": 2000.0,
          "mean_tpot_ms": 150.25, "p99_itl_ms": 300.0, "mean_e2el_ms": 4000.0,
          "request_throughput": 0.5}


def test_parse_topologies_names_modes_pools_and_instances():
    specs = parse_topologies("colocated, pd,pd+pool,pd+pool+skip,colocated+pool,colocated2+pool")
    assert specs == [
        TopologySpec("colocated", "colocated", False),
        TopologySpec("pd", "pd", False),
        TopologySpec("pd+pool", "pd", True),
        TopologySpec("pd+pool+skip", "pd", True, 1, True),
        TopologySpec("colocated+pool", "colocated", True),
        TopologySpec("colocated2+pool", "colocated", True, 2),
    ]
    for bad in (
        "pdd",
        "pd2",
        "colocated,colocated",
        "",
        "colocated0",
        "pd+skip",
        "colocated+pool+skip",
    ):
        with pytest.raises(ValueError):
            parse_topologies(bad)


def test_unsupported_topologies_are_named_with_a_reason():
    two = TopologySpec("colocated2+pool", "colocated", True, 2)
    assert "--num-instances" in (unsupported_reason(two, "disk", instances_ok=False) or "")
    assert unsupported_reason(two, "disk", instances_ok=True) is None
    skip = TopologySpec("pd+pool+skip", "pd", True, 1, True)
    assert "--skip-prefill-on-pool-hit" in (
        unsupported_reason(skip, "disk", True, skip_ok=False) or ""
    )
    assert "dram" in (unsupported_reason(TopologySpec("pd+pool", "pd", True), "dram", True) or "")
    assert (
        unsupported_reason(TopologySpec("colocated+pool", "colocated", True), "dram", False) is None
    )


def test_engine_counters_sum_label_sets_and_read_the_save_queue():
    c = engine_counters(METRICS)
    assert c == {"p2p_bytes": 1000.0, "pool_bytes_read": 500.0, "prefix_queries": 512.0,
                 "prefix_hits": 128.0, "save_queue_depth": 3.0}


def test_counter_deltas_take_a_series_missing_before_as_zero():
    before = {"d": {"p2p_bytes": 100.0}, "p": {}}
    after = {"d": {"p2p_bytes": 350.0, "pool_hit_tokens": 64.0, "save_queue_depth": 2.0}, "p": {}}
    assert counter_deltas(before, after) == {
        "d": {"p2p_bytes": 250.0, "pool_hit_tokens": 64.0},
        "p": {},
    }


def test_summarize_run_sums_paths_over_engines_and_keeps_hit_rates_per_engine():
    deltas = {"prefill0": {"p2p_bytes": 0.0, "pool_bytes_written": 4096.0, "prefix_queries": 512.0,
                           "prefix_hits": 128.0},
              "decode0": {"p2p_bytes": 2048.0, "pool_bytes_read": 1024.0, "pool_hit_tokens": 384.0,
                          "prefix_queries": 0.0}}
    row = summarize_run("pd+pool", "hot", RESULT, deltas)
    assert row["p2p_bytes"] == 2048.0 and row["pool_bytes_read"] == 1024.0
    assert row["pool_bytes_written"] == 4096.0 and row["pool_hit_tokens"] == 384.0
    assert row["pool_lookup_tokens"] is None  # no engine exported it
    assert row["prefix_hit_rates"] == {"prefill0": 0.25, "decode0": None}
    assert row["mean_ttft_ms"] == 1234.4 and row["completed"] == 6


def test_markdown_table_has_a_header_and_one_line_per_row():
    rows = [
        summarize_run("colocated", "cold", RESULT, {"engine": {"p2p_bytes": 0.0}}),
        summarize_run(
            "pd",
            "hot",
            RESULT,
            {
                "prefill0": {"prefix_queries": 10.0, "prefix_hits": 5.0},
                "decode0": {"p2p_bytes": 3.0 * 2**20},
            },
        ),
    ]
    lines = markdown_table(rows).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| topology | prompt | conc | cache |")
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert cells[:6] == ["pd", "-", "-", "hot", "6", "1234"]
    assert "3.0 MiB" in cells and "prefill0 50%" in cells
    assert cells[-3] == "prefill0 50%"  # decode0 had no query: not listed
    assert (
        format_bytes(None) == "-"
        and format_bytes(512) == "512 B"
        and format_bytes(1536) == "1.5 KiB"
    )


def test_report_paths_for_a_file_and_a_folder():
    assert report_paths("docs/COMPARE.md") == (
        "docs/COMPARE.md",
        "docs/compare",
        "docs/compare/compare.json",
    )
    assert report_paths("out") == ("out/COMPARE.md", "out", "out/compare.json")


@pytest.mark.slow
def test_compare_quick_end_to_end(tmp_path):
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "pdkv.cli", "compare", "--quick", "--disable-tqdm",
           "--out", str(out), "--log-dir", str(tmp_path / "logs")]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (out / "COMPARE.md").read_text()
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| topology")
    ]
    table = [tuple(c.strip() for c in r.strip("|").split("|")[:5]) for r in rows[:6]]
    assert table == [(t, n, "2", cache, "2") for t in ("colocated", "pd")
                     for n, cache in (("16", "cold"), ("64", "cold"), ("64", "hot"))]
    data = json.loads((out / "compare.json").read_text())
    by = {(r["topology"], r["input_len"], r["cache"]): r for r in data["rows"]}
    # P/D moves the prompt's KV from P to D in both runs (P's prefix cache is reset for hot too).
    assert by[("pd", 64, "cold")]["p2p_bytes"] > 0 and by[("pd", 64, "hot")]["p2p_bytes"] > 0
    assert by[("colocated", 64, "cold")]["p2p_bytes"] == 0
    # the phases came back from the servers and the plan's prediction sits beside the measurement
    pd = by[("pd", 64, "cold")]
    assert pd["phase_groups"]["prefill"] > 0 and pd["phase_groups"]["transfer"] > 0
    assert pd["pred_handoff_ms"] > 0 and pd["meas_handoff_ms"] > 0
    assert len(pd["tpots_ms"]) == 2 and pd["itls_ms"]
    for section in (
        "## TTFT phases",
        "## Plan vs measured",
        "## Break-even",
        "## When it does not pay",
        "P/D TTFT",
    ):
        assert section in text
    assert "pdkv compare --quick" in text and "CPUs" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in text
    else:
        for name in ("phases", "tpot_itl", "bytes"):
            assert (out / f"compare_{name}.png").stat().st_size > 0
        # hit rates: drawn only when a pool or a prefix-cache hit showed up in some run
        rates = any(r.get("pool_hit_tokens") or any((r.get("prefix_hit_rates") or {}).values())
                    for r in data["rows"])
        assert (out / "compare_hit_rates.png").exists() == rates
    # no pool topology ran: no pool break-even lines, pool-load note or pool settings
    assert "prompts over the pool-" not in text and "pool tier `pool-" not in text
    assert "plan pool load: pool bytes read" not in text and "pool read / req" not in text
    assert "warm pd run(s)" in text  # F is calibrated on the runs after the first
    print(f"pdkv compare --quick took {elapsed:.0f} s")


def test_offload_topology_and_its_exposed_wait_share():
    from pdkv.bench.compare.topologies import with_flag

    (spec,) = parse_topologies("colocated+offload")
    assert (spec.mode, spec.offload, spec.pool, spec.instances) == ("colocated", True, False, 1)
    for bad in ("pd+offload", "colocated2+offload", "colocated+pool+offload"):
        with pytest.raises(ValueError):
            parse_topologies(bad)
    assert with_flag(["--num-kv-blocks", "512", "--x"], "--num-kv-blocks", "160") == [
        "--x", "--num-kv-blocks", "160"]
    result = dict(RESULT, duration=20.0)
    row = summarize_run("colocated+offload", "hot", result,
                        {"engine": {"offload_wait_s": 0.5, "offload_bytes_h2d": 1024.0}})
    assert row["offload_wait_share"] == pytest.approx(0.025) and row["offload_bytes_h2d"] == 1024.0
    assert "2.50%" in markdown_table([row])
    assert summarize_run("colocated", "hot", result, {"engine": {}})["offload_wait_share"] is None
