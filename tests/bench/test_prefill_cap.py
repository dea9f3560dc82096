"""`--max-mixed-prefill-tokens` reaches the scheduler config, and `pdkv bench prefill-cap`'s
table compares each cap with the uncapped run (the benchmark itself is run by hand: docs/PD.md,
"Prefill cap of mixed steps")."""

from __future__ import annotations

from pdkv.bench.prefill_cap import render
from pdkv.cli import build_parser
from pdkv.engine.arg_utils import CPU_MIXED_PREFILL_TOKENS, EngineArgs, default_mixed_prefill_cap


def test_flag_reaches_the_scheduler_config():
    args = build_parser().parse_args(
        ["serve", "tiny-llama-kv2", "--max-mixed-prefill-tokens", "96"]
    )
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    assert cfg.scheduler_config.max_mixed_prefill_tokens == 96
    default = EngineArgs.from_cli_args(build_parser().parse_args(["serve", "tiny-llama-kv2"]))
    assert (
        default.create_engine_config().scheduler_config.max_mixed_prefill_tokens
        == CPU_MIXED_PREFILL_TOKENS
        == 64
    )
    off = build_parser().parse_args(["serve", "tiny-llama-kv2", "--max-mixed-prefill-tokens", "0"])
    assert (
        EngineArgs.from_cli_args(off)
        .create_engine_config()
        .scheduler_config.max_mixed_prefill_tokens
        == 0
    )


def test_default_cap_is_for_cpu_with_chunked_prefill_only():
    assert default_mixed_prefill_cap(None, "cpu", True) == CPU_MIXED_PREFILL_TOKENS
    assert default_mixed_prefill_cap(None, "cuda", True) == 0
    assert default_mixed_prefill_cap(None, "cpu", False) == 0
    assert (
        default_mixed_prefill_cap(0, "cpu", True) == 0
        and default_mixed_prefill_cap(8, "cuda", True) == 8
    )


def _row(cap: int, ttft: float, tpot: float, itl99: float) -> dict[str, float]:
    return {
        "cap": cap,
        "failed": 0,
        "mean_ttft_ms": ttft,
        "p99_ttft_ms": 2 * ttft,
        "mean_tpot_ms": tpot,
        "p99_itl_ms": itl99,
        "mean_itl_ms": tpot,
    }


def test_table_ratios_are_against_the_uncapped_row():
    table = render([_row(0, 1000.0, 300.0, 3600.0), _row(64, 1100.0, 150.0, 240.0)])
    lines = table.splitlines()
    assert lines[2] == "| none | 1000 / 2000 | 300 | 3600 | 12.00 | 1.00x | 0 |"
    assert lines[3] == "| 64 | 1100 / 2200 | 150 | 240 | 1.60 | 1.10x | 0 |"
