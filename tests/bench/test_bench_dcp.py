"""`pdkv bench dcp --quick` on tiny-llama-kv2: at dcp 2 each rank holds half the KV of dcp 1
(computed and allocated, ±1 block), the DCP all-gather/merge share of the forward is in (0, 1) at
dcp 2 and 0 at dcp 1, and the JSON rows are complete. Issue 10, acceptance 7 (the benchmark)."""

from __future__ import annotations

import json

from pdkv.bench.dcp.cli import BLOCK_TOKENS, QUICK_CONTEXT_LENS, QUICK_DECODE_STEPS, sizes
from pdkv.bench.dcp.report import kv_bytes_per_token, kv_tokens_per_rank, percentile
from pdkv.cli import main

ROW_KEYS = {
    "config",
    "baseline",
    "tp",
    "dcp",
    "context_len",
    "prompt_tokens",
    "context_tokens",
    "kv_tokens_per_rank",
    "kv_bytes_per_token_per_rank",
    "kv_bytes_per_rank",
    "blocks",
    "block_bytes_per_rank",
    "kv_measured_bytes_per_rank",
    "step_median_ms",
    "step_p90_ms",
    "dcp_comm_median_ms",
    "comm_share",
    "kv_ratio",
    "kv_measured_ratio",
    "step_ratio",
    "step_s",
    "forward_s",
    "dcp_comm_s",
}


def test_kv_per_rank_arithmetic():
    # tiny-llama-kv2, float32: 4 layers x K/V x 2 KV heads x 32 x 4 bytes per token.
    assert kv_bytes_per_token(4, 2, 32, 4) == 2048
    assert kv_tokens_per_rank(100, 1, 1) == 100
    assert kv_tokens_per_rank(101, 1, 2) == 51  # rank 0 holds the odd token
    assert kv_tokens_per_rank(40, 16, 2) == 24  # 0-15 and 32-39 on rank 0, 16-31 on rank 1
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0, 6.0, 7.0, 8.0, 9.0, 10.0], 90) == 9.0
    # 8192 tokens + 32 decode steps do not fit the model's 8192 positions: the prompt shrinks.
    assert sizes([1024, 8192], 32, 8192) == (8192, [1024, 8158])


def test_quick_dcp2_halves_kv_per_rank(tiny_llama_kv2, tmp_path):
    out = tmp_path / "dcp.json"
    assert main(["bench", "dcp", "--quick", "--model", tiny_llama_kv2, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["config"], r["context_len"]): r for r in result["rows"]}
    assert set(rows) == {(c, n) for c in ("dcp1", "dcp2") for n in QUICK_CONTEXT_LENS}
    for r in rows.values():
        assert set(r) >= ROW_KEYS, ROW_KEYS - set(r)
        assert len(r["step_s"]) == len(r["dcp_comm_s"]) == r["decode_steps"] == QUICK_DECODE_STEPS
        assert r["context_tokens"] == r["prompt_tokens"] + QUICK_DECODE_STEPS
        # the model-config arithmetic agrees with the allocated block's size
        assert r["block_bytes_per_rank"] == BLOCK_TOKENS * r["kv_bytes_per_token_per_rank"]
        assert 0 < r["step_median_ms"] <= r["step_p90_ms"]
        assert r["kv_measured_bytes_per_rank"] >= r["kv_bytes_per_rank"]
    for n in QUICK_CONTEXT_LENS:
        one, two = rows["dcp1", n], rows["dcp2", n]
        block = two["block_bytes_per_rank"]
        assert (
            one["kv_bytes_per_token_per_rank"] == two["kv_bytes_per_token_per_rank"]
        )  # weights replicated
        for key in ("kv_bytes_per_rank", "kv_measured_bytes_per_rank"):
            assert abs(two[key] - one[key] / 2) <= block, (key, one[key], two[key])
        assert abs(two["kv_ratio"] - 0.5) <= block / one["kv_bytes_per_rank"]
        assert one["comm_share"] == 0 and all(s == 0 for s in one["dcp_comm_s"])
        assert 0 < two["comm_share"] < 1
    assert "not a speed-up measurement" in result["note"]
