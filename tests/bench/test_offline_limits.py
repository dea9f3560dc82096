"""The machine limits of `pdkv bench offline`: a model's weight bytes and matmul parameters from
its safetensors headers (against the tensors themselves), and the measurement's plumbing."""

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from pdkv.bench.offline.limits import (
    MachineLimits,
    ModelCost,
    decode_limit_tok_s,
    flop_share,
    format_limits,
    limits_dict,
    measure_bf16_dot_peak,
    measure_fma_peak,
    measure_limits,
    model_cost,
    prefill_limit_tok_s,
)


def _folder(tmp_path, tied):
    tmp_path.mkdir()
    tensors = {
        "model.embed_tokens.weight": torch.zeros(100, 8),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(8, 24),
        "model.layers.0.input_layernorm.weight": torch.zeros(8),
        "model.norm.weight": torch.zeros(8),
    }
    if not tied:
        tensors["lm_head.weight"] = torch.zeros(100, 8)
    save_file(dict(list(tensors.items())[:3]), str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(dict(list(tensors.items())[3:]), str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    return str(tmp_path)


def test_model_cost_counts_what_a_decode_step_reads(tmp_path):
    tied = model_cost(_folder(tmp_path / "t", tied=True), "float32")
    # Tied: the embedding is read once, as the LM head (800 params), + 64 + 192 + two norms.
    assert tied.matmul_params == 800 + 64 + 192
    assert tied.weight_bytes == 4 * (800 + 64 + 192 + 16)
    untied = model_cost(_folder(tmp_path / "u", tied=False), "bfloat16")
    # Untied: the input embedding table is gathered by rows, not streamed; lm_head is.
    assert untied.matmul_params == 800 + 64 + 192
    assert untied.weight_bytes == 2 * (800 + 64 + 192 + 16)
    assert untied.dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        model_cost(str(tmp_path / "u"), "int4")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .safetensors"):
        model_cost(str(tmp_path / "empty"), "float32")


def test_model_cost_of_a_real_folder_matches_its_tensors():
    from safetensors.torch import load_file

    from pdkv.model.registry import resolve_model

    path = resolve_model("tiny-llama-kv2")

    tensors = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, f)))
    with open(os.path.join(path, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    counted = {k: v for k, v in tensors.items() if tied or not k.endswith("embed_tokens.weight")}
    cost = model_cost(path, "float32")
    assert cost.weight_bytes == 4 * sum(v.numel() for v in counted.values())
    assert cost.matmul_params == sum(v.numel() for v in counted.values() if v.dim() == 2)
    # K/V per token: 2 x layers x KV heads x head dim x 4 bytes; attention 4 x layers x heads x D.
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    assert cost.kv_bytes_per_token == 2 * layers * cfg["num_key_value_heads"] * d * 4
    assert cost.attn_flop_per_ctx_token == 4 * layers * cfg["num_attention_heads"] * d


def test_roofline():
    cost = ModelCost(weight_bytes=400_000_000, matmul_params=100_000_000, dtype="float32")
    lim = MachineLimits(read_bytes_per_s=20e9, read_buffer_bytes=400_000_000,
                        matmul_flop_per_s=100e9, matmul_n=1024, threads=2)
    assert decode_limit_tok_s(cost, lim, 1) == pytest.approx(50.0)  # 20 ms of reads per step
    assert decode_limit_tok_s(cost, lim, 10) == pytest.approx(500.0)  # where the two meet
    assert decode_limit_tok_s(cost, lim, 64) == pytest.approx(500.0)  # compute bound
    assert prefill_limit_tok_s(cost, lim) == pytest.approx(500.0)
    assert flop_share(cost, lim, 250.0) == pytest.approx(0.5)
    assert flop_share(cost, lim, None) is None
    # With K/V reads and attention: 1 MB of K/V per cached token and 1 MFLOP per attended token.
    kv = ModelCost(weight_bytes=400_000_000, matmul_params=100_000_000, dtype="float32",
                   kv_bytes_per_token=1_000_000, attn_flop_per_ctx_token=1_000_000)
    # Batch 1 at 100 cached tokens: (400 + 100) MB / 20 GB/s = 25 ms -> 40 tok/s.
    assert decode_limit_tok_s(kv, lim, 1, 100) == pytest.approx(40.0)
    # 64 sequences: bytes 400 MB + 6.4 GB = 340 ms; FLOP 64 x 0.3 GFLOP = 192 ms -> bytes bound.
    assert decode_limit_tok_s(kv, lim, 64, 100) == pytest.approx(64 / 0.34)
    # A 200-token prompt: each token attends to 100 on average, 0.3 GFLOP -> 333 tok/s.
    assert prefill_limit_tok_s(kv, lim, 200) == pytest.approx(100e9 / 0.3e9)
    assert flop_share(kv, lim, 100.0, 100) == pytest.approx(0.3)
    text = format_limits(limits_dict(cost, lim))
    assert "memory read 20.0 GB/s (torch.sum over 400 MB" in text
    assert "batch-1 decode <= 50.0 tok/s" in text and "<= 500.0 tok/s" in text


def test_the_fma_peak_is_the_compute_ceiling_where_measured():
    cost = ModelCost(weight_bytes=400_000_000, matmul_params=100_000_000, dtype="float32")
    mm = MachineLimits(read_bytes_per_s=20e9, read_buffer_bytes=400_000_000,
                       matmul_flop_per_s=100e9, matmul_n=1024, threads=2)
    fma = MachineLimits(read_bytes_per_s=20e9, read_buffer_bytes=400_000_000,
                        matmul_flop_per_s=100e9, matmul_n=1024, threads=2, fma_flop_per_s=200e9)
    assert mm.peak_flop_per_s == 100e9 and fma.peak_flop_per_s == 200e9
    assert prefill_limit_tok_s(cost, fma) == pytest.approx(1000.0)
    assert decode_limit_tok_s(cost, fma, 64) == pytest.approx(1000.0)
    assert flop_share(cost, fma, 250.0) == pytest.approx(0.25)
    assert "FMA peak 200.0 GFLOP/s" in format_limits(limits_dict(cost, fma))
    assert "FMA peak not measured" in format_limits(limits_dict(cost, mm))


def test_a_bfloat16_run_is_bounded_by_the_bf16_dot_product_peak():
    # VDPBF16PS does twice an FMA's work: a bfloat16 run's compute ceiling is its measured peak;
    # a float32 run, or a CPU without it (None), keeps the float32 FMA peak.
    f32 = ModelCost(weight_bytes=400_000_000, matmul_params=100_000_000, dtype="float32")
    b16 = ModelCost(weight_bytes=200_000_000, matmul_params=100_000_000, dtype="bfloat16")
    both = MachineLimits(read_bytes_per_s=20e9, read_buffer_bytes=400_000_000,
                         matmul_flop_per_s=100e9, matmul_n=1024, threads=2,
                         fma_flop_per_s=200e9, bf16_dot_flop_per_s=400e9)
    assert both.compute_peak("bfloat16") == 400e9 and both.compute_peak("float32") == 200e9
    assert prefill_limit_tok_s(b16, both) == pytest.approx(2000.0)
    assert prefill_limit_tok_s(f32, both) == pytest.approx(1000.0)
    assert decode_limit_tok_s(b16, both, 64) == pytest.approx(64 / max(0.01, 64 * 0.2 / 400))
    assert flop_share(b16, both, 1000.0) == pytest.approx(0.5)
    no_bf16 = dataclasses.replace(both, bf16_dot_flop_per_s=None)
    assert no_bf16.compute_peak("bfloat16") == 200e9
    assert "bf16 dot-product peak 400.0 GFLOP/s" in format_limits(limits_dict(b16, both))
    assert "bf16 dot-product peak" not in format_limits(limits_dict(f32, both))


def test_bf16_dot_peak_op_counts_its_flop(monkeypatch):
    from pdkv.model.paged_decode_build import load

    if load() is not None or not hasattr(torch.ops.pdkv, "bf16_dot_peak"):
        assert measure_bf16_dot_peak(repeats=1, iters=1000) is None
        pytest.skip("no AVX512-BF16 build: the op is not defined and the peak is None")
    flop, checksum = torch.ops.pdkv.bf16_dot_peak(1000).tolist()
    # 12 chains x 16 lanes x 2 products x 2 FLOP x 1000 rounds per thread
    assert flop == 12 * 64 * 1000 * torch.get_num_threads()
    assert checksum == checksum and checksum > 0
    assert measure_bf16_dot_peak(repeats=1, iters=1000) > 0
    with pytest.raises(RuntimeError, match="iters must be positive"):
        torch.ops.pdkv.bf16_dot_peak(0)
    monkeypatch.setenv("PDKV_CPU_OPS", "0")
    assert measure_bf16_dot_peak(repeats=1, iters=1000) is None


def test_fma_peak_op_counts_its_flop(monkeypatch):
    from pdkv.model.paged_decode_build import load

    if load() is not None:
        pytest.skip(f"pdkv's extension not loaded: {load()}")
    flop, checksum = torch.ops.pdkv.fma_peak(1000).tolist()
    # 12 chains x lanes x 2 FLOP x 1000 rounds per thread; 8 lanes with AVX2, 16 with AVX-512.
    lanes = flop / (2 * 12 * 1000 * torch.get_num_threads())
    assert lanes in (4, 8, 16)
    assert checksum == checksum and checksum > 0  # not NaN: the loop ran on real values
    assert measure_fma_peak(repeats=1, iters=1000) > 0
    with pytest.raises(RuntimeError, match="iters must be positive"):
        torch.ops.pdkv.fma_peak(0)
    monkeypatch.setenv("PDKV_CPU_OPS", "0")
    assert measure_fma_peak(repeats=1, iters=1000) is None


def test_measure_limits_reports_what_it_measured():
    lim = measure_limits(4_000_003, repeats=1, matmul_n=64)
    assert lim.read_buffer_bytes == 4_000_000  # whole float32 elements
    assert lim.read_bytes_per_s > 0 and lim.matmul_flop_per_s > 0
    assert lim.matmul_n == 64 and lim.threads == torch.get_num_threads()
    for bad in ({"read_bytes": 2}, {"read_bytes": 64, "repeats": 0},
                {"read_bytes": 64, "matmul_n": 8}):
        with pytest.raises(ValueError, match="bad limits sizes"):
            measure_limits(**bad)
