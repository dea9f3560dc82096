"""Bytes per token / per request of real configs against hand-computed values."""

from __future__ import annotations

import json
import os

import pytest

from pdkv.modelspec.dtypes import element_type
from pdkv.modelspec.groups import MLA, FullAttention, LinearState, SlidingWindow, heads_per_rank
from pdkv.modelspec.hf_config import spec_from_hf_config
from pdkv.plan.resolve import load_config

FP32, BF16 = element_type("fp32"), element_type("bf16")


def spec(name: str):
    cfg, _ = load_config(name)
    return spec_from_hf_config(cfg, name)


@pytest.fixture(autouse=True)
def _empty_cache(tmp_path, monkeypatch):
    # `smollm2` must come from the bundled config, not from whatever this box has converted.
    monkeypatch.setenv("PDKV_CACHE", str(tmp_path / "cache"))


def test_smollm2_fp32_bytes_per_token():
    (g,) = spec("smollm2").groups
    assert isinstance(g, FullAttention)
    assert g.token_bytes(FP32) == 2 * 30 * 3 * 64 * 4 == 46_080


def test_llama_70b_bf16_and_int8():
    (g,) = spec("llama-3.1-70b").groups
    assert g.token_bytes(BF16) == 2 * 80 * 8 * 128 * 2 == 327_680
    # int8: one byte per element plus a 4-byte fp32 scale per (token, layer, head, K|V) vector
    assert g.token_bytes(element_type("int8")) == 2 * 80 * 8 * (128 * 1 + 4) == 168_960


def test_glm_4_5_bf16():
    (g,) = spec("glm-4.5").groups
    assert g.token_bytes(BF16) == 2 * 92 * 8 * 128 * 2 == 376_832


def test_deepseek_v3_mla_one_latent_per_token():
    m = spec("deepseek-v3")
    (g,) = m.groups
    assert isinstance(g, MLA)
    assert g.token_bytes(BF16) == (512 + 64) * 61 * 2 == 70_272
    assert g.token_bytes(element_type("fp8")) == 61 * ((512 + 64) * 1 + 4) == 35_380
    # replicated, not split, over TP
    assert g.token_bytes(BF16, tp=8) == 70_272


def test_qwen3_next_hybrid():
    m = spec("qwen3-next-80b-a3b")
    full, lin = m.groups
    assert isinstance(full, FullAttention) and isinstance(lin, LinearState)
    assert (full.num_layers, lin.num_layers) == (12, 36)  # every 4th of 48 is full attention
    assert full.token_bytes(BF16) == 2 * 12 * 2 * 256 * 2 == 24_576
    conv = (2 * 16 * 128 + 32 * 128) * (4 - 1)  # 24,576 elements
    rec = 32 * 128 * 128  # 524,288 elements
    assert lin.request_bytes(BF16) == 36 * (conv + rec) * 2 == 39_518_208
    assert lin.token_bytes(BF16) == 0 and lin.tokens_held(10_000) == 0
    assert lin.request_bytes(BF16, tp=2) == 39_518_208 // 2


def test_kimi_linear_hybrid_mla_plus_kda():
    mla, kda = spec("kimi-linear-48b-a3b").groups
    assert isinstance(mla, MLA) and isinstance(kda, LinearState)
    assert (mla.num_layers, kda.num_layers) == (7, 20)
    assert mla.token_bytes(BF16) == 7 * (512 + 64) * 2 == 8_064
    conv = 3 * 32 * 128 * (4 - 1)  # q, k, v short convs: 36,864 elements
    rec = 32 * 128 * 128
    assert kda.request_bytes(BF16) == 20 * (conv + rec) * 2 == 22_446_080


def test_sliding_window_bounded_by_window():
    cfg = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 8, "sliding_window": 4096, "max_position_embeddings": 32768}
    (g,) = spec_from_hf_config(cfg).groups
    assert isinstance(g, SlidingWindow)
    assert g.token_bytes(BF16) == 2 * 32 * 8 * 128 * 2
    assert g.tokens_held(8192) == 4096 and g.tokens_held(100) == 100


def test_gemma_pattern_splits_full_and_sliding():
    cfg = {"text_config": {"num_hidden_layers": 12, "hidden_size": 256, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 512,
                           "sliding_window_pattern": 6}}
    full, slide = spec_from_hf_config(cfg).groups
    assert (full.num_layers, slide.num_layers) == (2, 10)


def test_tp_above_kv_heads_replicates():
    (g,) = spec("smollm2").groups
    assert heads_per_rank(3, 3) == 1 and heads_per_rank(3, 6) == 1
    assert g.token_bytes(FP32, tp=6) == 2 * 30 * 1 * 64 * 4 == 15_360
    with pytest.raises(ValueError):
        g.token_bytes(FP32, tp=2)  # 3 heads do not split over 2 ranks
    (llama,) = spec("llama-3.1-70b").groups
    assert llama.token_bytes(BF16, tp=16) == 2 * 80 * 1 * 128 * 2  # 8 heads, each on 2 ranks


def test_alias_reads_converted_folder_when_present(tmp_path, monkeypatch):
    folder = tmp_path / "c" / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    cfg, _ = load_config("smollm2")
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    monkeypatch.setenv("PDKV_CACHE", str(tmp_path / "c"))
    _, path = load_config("smollm2")
    assert path == os.path.join(str(folder), "config.json")
    assert spec("smollm2").num_layers == 2
    # the Hugging Face id resolves as `pdkv serve` resolves it
    assert load_config("HuggingFaceTB/SmolLM2-135M-Instruct")[1] == path


def test_unknown_model_and_missing_field():
    with pytest.raises(ValueError, match="unknown model"):
        load_config("no-such-model")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        spec_from_hf_config({"hidden_size": 8})


def test_a_tiny_model_resolves_to_its_built_folder_or_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PDKV_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="pdkv generate --model tiny-swa"):
        load_config("tiny-swa")
    folder = tmp_path / "models" / "tiny-swa"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "hidden_size": 128,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "use_sliding_window": True,
                "sliding_window": 40,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "torch_dtype": "float32",
            }
        )
    )
    cfg, path = load_config("tiny-swa")
    assert path == os.path.join(str(folder), "config.json")
    assert sorted(g.kind for g in spec_from_hf_config(cfg).groups) == [
        "full_attention",
        "sliding_window",
    ]
