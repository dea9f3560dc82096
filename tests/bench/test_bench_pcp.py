"""`pdkv bench pcp` on tiny-llama-kv2: a tiny real run (2 prompt lengths, 1 repeat) gives a table
row per length, N=2's greedy tokens equal N=1's, all-gathers only where the prompt is split, and
the plan columns by pdkv.plan.pcp's formulas (issue 32)."""

from __future__ import annotations

import json
import re

import pytest

from pdkv.bench.pcp import measured_crossover
from pdkv.cli import main
from pdkv.plan.pcp import PcpShape, rank_work

pytestmark = pytest.mark.slow  # worker processes

NEW_TOKENS = 3


def test_measured_crossover_is_where_n_ranks_stay_faster():
    assert measured_crossover([128, 256, 512, 1024], [1.2, 0.9, 1.05, 0.8]) == 1024
    assert measured_crossover([128, 256, 512], [1.2, 0.9, 0.8]) == 256
    assert measured_crossover([128, 256], [0.9, 1.1]) is None


def test_tiny_run_rows_tokens_and_plan_columns(tiny_llama_kv2, tmp_path, capsys):
    out_json = tmp_path / "pcp.json"
    # 40 tokens: below 2N × 16 = 64, not split; 96: split into chunks of 24
    assert main(["bench", "pcp", "--model", tiny_llama_kv2, "--prompt-lens", "96,40",
                 "--repeats", "1", "--new-tokens", str(NEW_TOKENS), "--pcp-bandwidth", "1e9",
                 "--pcp-latency", "1e-4", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    for line in ("cpu: ", "load average (1 / 5 / 15 min): before ", "commit: ", "publishable: "):
        assert re.search(rf"^{re.escape(line)}", text, re.M), text
    rows = re.findall(r"^\| \S+ \| (\d+)( \(not split\))? \|(.*)\| (equal|DIFFER) \|$", text,
                      re.M)
    assert [(r[0], bool(r[1]), r[3]) for r in rows] == [("40", True, "equal"),
                                                        ("96", False, "equal")], text
    assert re.search(r"crossover measured .*, plan ", text), text
    result = json.loads(out_json.read_text())
    (m,) = result["models"]
    short, split = m["rows"]
    assert result["all_tokens_equal"] and m["dtype"] == "float32"
    for r in (short, split):
        assert len(r["tokens"]) == NEW_TOKENS and r["n1_ms"] > 0 and r["n_ms"] > 0
    assert short["comm_ms"] == 0 and short["plan_comm_ms"] == 0
    assert split["comm_ms"] > 0
    # plan, 96 tokens: 4 layers × 48 rows × 2 × 2 kv heads × 32 × 4 B + the sampled row 128 × 4 B,
    # over 1e9 B/s, plus 4 + 1 all-gathers × 1e-4 s
    want_comm = (4 * 48 * 2 * 2 * 32 * 4 + 128 * 4) / 1e9 + 5 * 1e-4
    assert split["plan_comm_ms"] == pytest.approx(want_comm * 1e3)
    # the plan is fitted to N=1 (t = t0 + FLOPs / F); an unsplit prompt runs whole on every
    # rank, each computing at F / S
    t0, f, s = m["overhead_s"], m["flops_per_s"], m["shared_speedup"]
    flops = rank_work(PcpShape(**m["shape"]), 40, 1)[0].flops
    assert short["plan_n1_ms"] == pytest.approx((t0 + flops / f) * 1e3)
    assert short["plan_n_ms"] == pytest.approx((t0 + flops * s / f) * 1e3)
    t_share, t_one = m["share_ttft_s"][0], split["n1_ttft_s"][0]
    assert s == pytest.approx((t_share - t0) / (t_one - t0) if min(t_share, t_one) > t0
                              else t_share / t_one)
