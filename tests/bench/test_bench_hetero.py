"""`pdkv bench hetero` (issue 12, acceptance 4): the torch-free report (ratios vs the same-layout
case, the output check) and one small end-to-end run of the same-layout and re-blocking cases on
tiny-llama-kv2: equal bytes (prompt tokens x bytes per token), more read ops when re-blocked, the
same greedy tokens."""

from __future__ import annotations

import json
import math

import pytest

from pdkv.bench.hetero.report import (
    MISMATCH,
    NO_BASELINE,
    OK,
    add_ratios,
    failed_checks,
    format_table,
)
from pdkv.cli import main

TINY_KV2_TOKEN_BYTES = 4 * 2 * 2 * 32 * 4  # layers x K/V x KV heads x head_dim x fp32


def _row(
    case: str, n: int, nbytes: int, ops: int, seconds: float, outputs: list[list[int]]
) -> dict:
    return {
        "case": case,
        "p_block_size": 16,
        "d_block_size": 32 if case != "same" else 16,
        "d_tp": 1,
        "prompt_tokens": n,
        "p_blocks": n // 16,
        "needed_bytes": nbytes,
        "bytes_received": nbytes,
        "read_ops": ops,
        "transfer_s": seconds,
        "outputs": outputs,
    }


def test_report_ratios_check_and_table():
    rows = [
        _row("same", 64, 1000, 2, 0.010, [[5, 6], [5, 6]]),
        _row("reblock-d32", 64, 1000, 48, 0.025, [[5, 6], [5, 6]]),
        _row("reshard-tp2", 64, 1000, 512, 0.040, [[5, 6], [5, 7]]),  # the second repeat differs
        _row("same", 128, 2000, 1, 0.020, [[1]]),
        _row("reblock-d32", 256, 4000, 96, 0.050, [[1]]),  # no baseline at 256 tokens
    ]
    add_ratios(rows)
    same, reblock, reshard, same128, lonely = rows
    assert (same["bytes_ratio"], same["read_ops_ratio"], same["transfer_ratio"], same["check"]) == (
        1.0,
        1.0,
        1.0,
        OK,
    )
    assert reblock["bytes_ratio"] == 1.0 and reblock["read_ops_ratio"] == 24.0
    assert reblock["transfer_ratio"] == pytest.approx(2.5) and reblock["check"] == OK
    assert reshard["read_ops_ratio"] == 256.0 and reshard["check"] == MISMATCH
    assert same128["check"] == OK
    assert lonely["check"] == NO_BASELINE and math.isnan(lonely["read_ops_ratio"])
    assert failed_checks(rows) == [
        f"reshard-tp2 @ 64 tokens: {MISMATCH}",
        f"reblock-d32 @ 256 tokens: {NO_BASELINE}",
    ]
    table = format_table(
        {"rows": rows, "bytes_per_token": 16, "repeats": 2, "transfer": "tcp", "cpu_count": 2}
    )
    lines = table.splitlines()
    assert len(lines) == 1 + len(rows) + 4
    assert lines[2].split()[-4:] == ["1.00", "24.0", "2.50", OK]
    assert lines[3].split()[-1] == MISMATCH


@pytest.mark.slow
def test_same_and_reblocked_handoffs_move_equal_bytes_in_more_reads(tiny_llama_kv2, tmp_path):
    out = tmp_path / "hetero.json"
    argv = ["bench", "hetero", "--model", tiny_llama_kv2, "--prompt-lens", "48", "--repeats", "1",
            "--cases", "same,reblock-d32,reblock-p32", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = {r["case"]: r for r in result["rows"]}
    assert set(rows) == {"same", "reblock-d32", "reblock-p32"}
    assert result["bytes_per_token"] == TINY_KV2_TOKEN_BYTES
    same = rows["same"]
    for r in rows.values():
        assert r["prompt_tokens"] == 48 and r["check"] == OK
        assert r["bytes_received"] == r["needed_bytes"] == 48 * TINY_KV2_TOKEN_BYTES
        assert r["outputs"] == same["outputs"] and len(r["outputs"][0]) == result["new_tokens"]
        assert r["transfer_s"] > 0
    for name in ("reblock-d32", "reblock-p32"):
        assert rows[name]["read_ops"] > same["read_ops"] >= 1
        assert rows[name]["read_ops_ratio"] > 1


def test_cli_exits_1_on_an_output_mismatch_and_still_writes_json(monkeypatch, tmp_path, capsys):
    from pdkv.bench.hetero import cli as hetero

    rows = [
        _row("same", 64, 1000, 2, 0.01, [[5, 6]]),
        _row("reblock-d32", 64, 1000, 48, 0.02, [[5, 7]]),
    ]
    add_ratios(rows)
    monkeypatch.setattr(hetero, "run_hetero_bench", lambda *a, **k: {"rows": rows})
    out = tmp_path / "hetero.json"
    assert main(["bench", "hetero", "--prompt-lens", "64", "--json", str(out)]) == 1
    assert json.loads(out.read_text())["rows"][1]["check"] == MISMATCH
    assert f"output check failed: reblock-d32 @ 64 tokens: {MISMATCH}" in capsys.readouterr().out
    rows[1]["outputs"] = [[5, 6]]
    add_ratios(rows)
    assert main(["bench", "hetero", "--prompt-lens", "64"]) == 0
