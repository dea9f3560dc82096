"""`pdkv bench pool` report: summary per tier, targets, chunk arithmetic, table (no engine)."""

from __future__ import annotations

import argparse

import pytest

from pdkv.bench.pool.cli import add_cli_args, format_table, max_loadable_tokens, summarize_tier


def _sample(cold: float, hot: float, hit: int = 2048, identical: bool = True) -> dict:
    return {"cold_ttft_s": cold, "hot_ttft_s": hot, "hit_tokens": hit, "bytes_read": 1e9,
            "load_s": 0.5, "identical": identical}


def test_full_hit_leaves_the_last_prompt_token():
    assert max_loadable_tokens(2049, 256) == 2048
    assert max_loadable_tokens(2048, 256) == 1792
    assert max_loadable_tokens(256, 256) == 0


def test_summary_takes_medians_and_judges_the_tier_target():
    row = summarize_tier("dram", [_sample(2.0, 0.1), _sample(4.0, 0.3), _sample(3.0, 0.9)], 2048)
    assert row["cold_ttft_ms"] == pytest.approx(3000) and row["hot_ttft_ms"] == pytest.approx(300)
    assert row["hot_cold"] == pytest.approx(0.1) and row["passed"] is True
    assert row["load_gbps"] == pytest.approx(2.0)  # 3e9 bytes / 1.5 s
    disk = summarize_tier("disk", [_sample(1.0, 0.3)], 2048)
    assert disk["target"] == 0.25 and disk["passed"] is False
    redis = summarize_tier("redis", [_sample(1.0, 0.3)], 2048)
    assert redis["target"] is None and redis["passed"] is None


def test_short_hits_and_differing_outputs_are_flagged():
    row = summarize_tier(
        "dram", [_sample(1.0, 0.05), _sample(1.0, 0.05, hit=1792, identical=False)], 2048
    )
    assert not row["hits_ok"] and not row["identical"]
    result = {"model": "smollm2", "block_size": 16, "chunk_size": 256, "prompt_len": 2049,
              "repeats": 2, "max_tokens": 8, "expected_hit_tokens": 2048, "no_pool_ttft_ms": 950.0,
              "tiers": {"dram": row, "redis": {"skipped": "redis-server not found"}}}
    table = format_table(result)
    assert "((2049-1)//256)*256 = 2048 tokens" in table
    assert "2048/1792!" in table and " NO" in table and "PASS" in table
    assert "redis    skipped: redis-server not found" in table


def test_cli_rejects_unknown_tiers():
    parser = add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args([]).tiers == ["dram", "disk"]
    assert parser.parse_args(["--tiers", "redis,mooncake"]).tiers == ["redis", "mooncake"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--tiers", "dram,nvme"])


def test_disk_fsync_mode_times_both_settings_without_an_engine(tmp_path, monkeypatch, capsys):
    from pdkv.bench.pool import cli
    from pdkv.kvpool.tiers import disk

    synced: list[int] = []
    real_fsync = disk.os.fsync
    monkeypatch.setattr(disk.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    args = add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--disk-fsync", "--fsync-writes", "3", "--fsync-value-bytes", "4096",
         "--work-dir", str(tmp_path), "--result-json", str(tmp_path / "r.json")])
    assert cli.main(args) == 0
    assert len(synced) == 3 * 2  # the fsync side only: file and directory per put
    out = capsys.readouterr().out
    assert "load average" in out and "cpu:" in out
    assert [ln.split()[0] for ln in out.splitlines()[3:5]] == ["on", "off"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # its directory is removed


def test_disk_fsync_mode_names_a_work_dir_that_does_not_exist(tmp_path):
    from pdkv.bench.pool.fsync import measure_disk_fsync

    with pytest.raises(ValueError, match="is not an existing directory"):
        measure_disk_fsync(str(tmp_path / "missing"), 4096, 1)
