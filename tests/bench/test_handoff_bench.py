"""End to end: a 1k-token prompt's P→D handoff over the tcp engine (P and D as processes) moves
every block of the prompt and is compared with `pdkv plan`'s prediction for the bytes D received,
with the link bandwidth measured on this machine just before by the transfer benchmark (the
preset's figure comes from another run and a shared box moves by more than 2× between runs)."""

from __future__ import annotations

import pytest

from pdkv.bench.handoff.cli import run_handoff_bench
from pdkv.bench.transfer.runner import run_transfer_bench

pytestmark = pytest.mark.slow

PROMPT = 1024
KV_BYTES = PROMPT * 46_080  # SmolLM2 fp32: 30 layers x K/V x 3 heads x 64 x 4 B per token


def measure() -> dict:
    """One measurement: the link bandwidth now, then the handoff against the plan for it."""
    bench = run_transfer_bench(sizes_mib=(45,), repeats=3, engines=("tcp",), print_table=False)
    bandwidth = bench["sizes"][0]["methods"]["tcp"]["median_gbps"] * 1e9
    # The prediction includes the per-pull fixed cost (claim, "done") measured by a one-block
    # probe: without it a fast box's 1k wire time (~20 ms at 2 GB/s) is as small as that fixed
    # cost and the ratio sits at the 2× edge by luck.
    result = run_handoff_bench(["tcp"], [PROMPT], bandwidths={"tcp": bandwidth}, fixed_s=None,
                               tolerance=1.0, print_table=False, repeats=3)
    (row,) = result["rows"]
    assert row["nbytes"] == KV_BYTES  # every block of the prompt, nothing else (every pull)
    assert len(row["pulls_s"]) == 3 and row["measured_s"] == sorted(row["pulls_s"])[1]
    assert row["bandwidth"] == bandwidth and row["fixed_s"] > 0
    assert result["probes"]["tcp"]["seconds"] > 0
    return dict(row)


def test_1k_tcp_handoff_moves_every_block_and_reports_the_plan_ratio():
    """One measurement end to end: D receives exactly the prompt's KV bytes, the prediction is
    `pdkv plan`'s for those bytes and the measured bandwidth, and the row's PASS is the
    tolerance rule applied to its own ratio. Whether the ratio lands within 2× is a timing
    claim: it is `pdkv bench handoff`'s to print (README "Tests"), not this test's to assert,
    since the suite shares two cores with another worker."""
    row = measure()
    assert row["measured_s"] > 0 and row["predicted_s"] > row["wire_s"] > 0
    assert row["ratio"] == pytest.approx(row["measured_s"] / row["predicted_s"])
    assert row["pass"] == (abs(row["measured_s"] - row["predicted_s"]) <= 1.0 * row["predicted_s"])
    assert row["plan_command"].startswith(f"pdkv plan --kv-bytes {KV_BYTES}")
    print(f"1k tcp handoff / plan = {row['ratio']:.2f}")
