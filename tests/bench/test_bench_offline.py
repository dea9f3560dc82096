"""`pdkv bench offline`: prompts are exact-length and distinct; a tiny run of both systems."""

import argparse
import math

import pytest

from pdkv.bench.offline.cli import add_cli_args, build_prompts


class _FakeTokenizer:
    """Characters as tokens: enough to check lengths and distinctness without the model."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def test_prompts_have_exact_length_and_differ_from_the_start():
    prompts = build_prompts(_FakeTokenizer(), batch_size=5, input_len=40, seed=3)
    assert [len(p) for p in prompts] == [40] * 5
    # Distinct within the first 16 tokens (one KV block): no shared prefix-cache block.
    assert len({tuple(p[:16]) for p in prompts}) == 5
    assert prompts == build_prompts(_FakeTokenizer(), batch_size=5, input_len=40, seed=3)


def test_cli_args_parse():
    parser = add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--batch-sizes", "1,8,32", "--input-len", "64", "--num-threads", "2", "--no-hf",
         "--result-json", "out.json"]
    )
    assert args.batch_sizes == [1, 8, 32]
    assert args.input_len == 64 and args.output_len == 32 and args.num_threads == 2
    assert args.include_hf is False and args.warmup is True and args.result_json == "out.json"
    with pytest.raises(SystemExit):
        parser.parse_args(["--batch-sizes", "0,2"])


@pytest.mark.slow
def test_offline_bench_small_run():
    import torch

    from pdkv.bench.offline.cli import run_offline_bench

    threads = torch.get_num_threads()
    # One thread: timings suffer far less when other processes share the (2) cores.
    result = run_offline_bench(
        batch_sizes=(1, 2), input_len=32, output_len=4, num_threads=1, include_hf=True,
        repeats=2, verbose=False,
    )
    assert torch.get_num_threads() == threads  # restored
    assert result["input_len"] == 32 and result["output_len"] == 4
    assert result["num_threads"] == 1 and result["torch_version"]
    assert [e["batch_size"] for e in result["results"]] == [1, 2]
    for e in result["results"]:
        for system in ("pdkv", "hf"):
            r = e[system]
            assert r["prefill_s"] > 0 and r["total_s"] > 0
            assert r["prefill_tok_s"] > 0
            assert r["prefill_tok_s"] == pytest.approx(e["batch_size"] * 32 / r["prefill_s"])
            # Decode throughput needs t(4 tokens) > t(1 token); a None here means noise won.
            assert r["decode_tok_s"] is not None and r["decode_tok_s"] > 0
        assert math.isclose(
            e["prefill_ratio"], e["pdkv"]["prefill_tok_s"] / e["hf"]["prefill_tok_s"], rel_tol=1e-9
        )
        assert math.isclose(
            e["decode_ratio"], e["pdkv"]["decode_tok_s"] / e["hf"]["decode_tok_s"], rel_tol=1e-9
        )
        assert e["greedy_match_requests"] == e["batch_size"]
    assert result["greedy_match"] is True
    assert "greedy match (batch 1, pdkv vs HF token ids): yes" in result["table"]


def test_llamacpp_peer_asked_for_brings_limits_workloads_and_goals_even_when_skipped():
    from pdkv.bench.offline.cli import run_offline_bench

    result = run_offline_bench(
        model="tiny-llama-kv2", batch_sizes=(1, 2), input_len=16, output_len=3, num_threads=1,
        peers=["hf", "llama.cpp"], long_prefill_len=32, warmup=False, verbose=False,
    )
    assert result["llamacpp_skipped"]  # no GGUF of a tiny random model
    lim = result["limits"]
    assert lim["read_bytes_per_s"] > 0 and lim["matmul_flop_per_s"] > 0
    assert lim["read_buffer_bytes"] == lim["model_weight_bytes"]  # a buffer the weights' size
    rows = {r["workload"]: r for r in result["workloads"]}
    assert list(rows) == ["prefill 32, batch 1", "decode, batch 1",
                          "decode, 2 sequences (aggregate)", "prefill 2 x 16 in one step"]
    b1 = rows["decode, batch 1"]
    assert b1["llamacpp"] is None and b1["limit"] == pytest.approx(
        lim["decode_limit_tok_s_batch1"])
    assert b1["pdkv_of_limit"] == pytest.approx(b1["pdkv"] / b1["limit"])
    # Only the batch-1 roofline goal is judged here (no llama.cpp, no 64-sequence row).
    assert [(g["workload"], g["measure"]) for g in result["goals"]] == [
        ("decode, batch 1", "vs_llamacpp"), ("decode, batch 1", "of_limit")]
    assert result["goals"][1]["value"] == pytest.approx(b1["pdkv_of_limit"])
    assert "limit: memory read" in result["table"] and "goals met:" in result["table"]
