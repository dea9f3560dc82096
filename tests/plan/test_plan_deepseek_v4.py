"""DeepSeek-V4 state geometry in the cost model: the groups against a token-by-token count of
transformers' V4 cache (DeepseekV4HCACache / DeepseekV4CSACache), the default layer types
against DeepseekV4Config, the V4-Flash totals against a hand computation, and `pdkv plan`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pdkv.cli import main
from pdkv.modelspec.dtypes import element_type
from pdkv.modelspec.groups import (
    CompressedKV,
    CompressorState,
    IndexerKeys,
    SharedKVWindow,
    per_token_bytes,
)
from pdkv.modelspec.hf_config import CSA, HCA, SLIDING, spec_from_hf_config, v4_layer_types
from pdkv.plan.resolve import load_config

FP32, BF16 = element_type("fp32"), element_type("bf16")

#: The tiny-v4 geometry (hidden 128, 4 layers, head_dim 32, window 24, rates 4 / 16,
#: index_head_dim 32, float32), written by hand; `test_tiny_v4_dict_is_the_built_model's`
#: keeps it equal to pdkv/model/tiny.py's spec.
TINY_V4 = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "sliding_window": 24,
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "compress_rates": {CSA: 4, HCA: 16},
    "index_head_dim": 32,
    "torch_dtype": "float32",
}


@pytest.fixture(autouse=True)
def _empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDKV_CACHE", str(tmp_path / "cache"))


def by_kind(spec) -> dict:
    return {g.kind: g for g in spec.groups}


def model_bytes(spec, n: int, dt) -> dict[str, int]:
    """Bytes per group of one request at n tokens, as the planner sums them."""
    return {g.kind: g.token_bytes(dt) * g.tokens_held(n) + g.request_bytes(dt)
            for g in spec.groups}


def brute_force(cfg: dict, n: int, kv_bytes: int) -> dict[str, int]:
    """Feed n tokens one at a time through a model of transformers' V4 cache and count the
    elements it holds: the window list (K = V, one vector), each compressor's pending buffer and
    emitted entries, and the fixed slots (buffers of `rate` tokens, overlap Ca halves) as the
    shapes of buffer_kv / buffer_gate / overlap_kv / overlap_gate."""
    d, di, w = cfg["head_dim"], cfg["index_head_dim"], cfg["sliding_window"]
    rates = cfg["compress_rates"]
    out = dict.fromkeys(("v4_window_kv", "csa_compressed_kv", "csa_indexer_keys",
                         "hca_compressed_kv", "csa_compressor_state", "csa_indexer_state",
                         "hca_compressor_state"), 0)
    for t in cfg["layer_types"]:
        window: list[int] = []
        pending, entries, overlap_set = 0, 0, False
        m = rates.get(t, 0)
        for tok in range(n):
            window = ([*window, tok])[-w:]
            if t == SLIDING:
                continue
            pending += 1
            assert pending <= m  # the slot of m tokens bounds what the buffer holds
            if pending == m:  # a closed window: one entry out, buffer drained
                entries, pending, overlap_set = entries + 1, 0, True
        out["v4_window_kv"] += len(window) * d * kv_bytes
        if t == CSA:
            out["csa_compressed_kv"] += entries * d * kv_bytes
            out["csa_indexer_keys"] += entries * di * kv_bytes
            # buffer_kv + buffer_gate [m, 2·width] each; overlap_kv + overlap_gate [m, width]
            out["csa_compressor_state"] += (2 * m * 2 * d + 2 * m * d) * 4
            out["csa_indexer_state"] += (2 * m * 2 * di + 2 * m * di) * 4
            assert overlap_set == (n >= m)
        elif t == HCA:
            out["hca_compressed_kv"] += entries * d * kv_bytes
            out["hca_compressor_state"] += 2 * m * d * 4  # buffer_kv + buffer_gate [m, d]
    return out


@pytest.mark.parametrize("n", [0, 3, 4, 17, 1000])
def test_v4_groups_match_a_token_by_token_count(n):
    spec = spec_from_hf_config(TINY_V4, "tiny-v4")
    got = model_bytes(spec, n, FP32)
    assert got == brute_force(TINY_V4, n, 4)
    got16 = model_bytes(spec, n, BF16)
    want16 = brute_force(TINY_V4, n, 2)
    fixed = ("csa_compressor_state", "csa_indexer_state", "hca_compressor_state")
    assert got16 == want16  # the compressor state stays fp32 with a bf16 KV dtype
    assert all(got16[k] == got[k] for k in fixed)


def test_tiny_v4_geometry_bytes():
    """The tiny-v4 row of docs/HYBRID_STATE.md (computed, not measured)."""
    spec = spec_from_hf_config(TINY_V4, "tiny-v4")
    g = by_kind(spec)
    assert [x.num_layers for x in spec.groups] == [4, 2, 2, 1, 2, 2, 1]
    per_tok = {k: per_token_bytes(x, FP32) for k, x in g.items()}
    assert per_tok == {"v4_window_kv": 4 * 32 * 4, "csa_compressed_kv": 2 * 32 * 4 // 4,
                       "csa_indexer_keys": 2 * 32 * 4 // 4, "hca_compressed_kv": 32 * 4 // 16,
                       "csa_compressor_state": 0, "csa_indexer_state": 0,
                       "hca_compressor_state": 0}
    assert per_tok["v4_window_kv"] == 512 and per_tok["hca_compressed_kv"] == 8
    fixed = {k: x.request_bytes(FP32) for k, x in g.items() if isinstance(x, CompressorState)}
    assert fixed == {"csa_compressor_state": 2 * (4 * 2 * 64 + 2 * 4 * 32) * 4,   # 6,144
                     "csa_indexer_state": 2 * (4 * 2 * 64 + 2 * 4 * 32) * 4,      # 6,144
                     "hca_compressor_state": 16 * 2 * 32 * 4}                      # 4,096
    assert sum(fixed.values()) == 16_384
    at = {n: sum(model_bytes(spec, n, FP32).values()) for n in (131_072, 1_048_576)}
    assert at[131_072] == 512 * 24 + 64 * 131_072 + 64 * 131_072 + 8 * 131_072 + 16_384
    assert at == {131_072: 17_854_464, 1_048_576: 142_635_008}


def test_tiny_v4_dict_is_the_built_model():
    """TINY_V4 holds the shape of the tiny-v4 that pdkv builds (pdkv/model/tiny.py)."""
    from pdkv.model.tiny import TINY_MODELS

    spec = TINY_MODELS["tiny-v4"]
    assert {k: TINY_V4[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "head_dim", "sliding_window",
                                     "index_head_dim")} == {
        "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads, "head_dim": spec.head_dim,
        "sliding_window": spec.sliding_window, "index_head_dim": spec.index_head_dim}
    assert TINY_V4["layer_types"] == list(spec.layer_types)
    assert TINY_V4["compress_rates"] == {CSA: spec.csa_compress_rate, HCA: spec.hca_compress_rate}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 43, 61])
def test_default_layer_types_are_transformers(n):
    transformers = pytest.importorskip("transformers")
    want = transformers.DeepseekV4Config(num_hidden_layers=n).layer_types
    assert v4_layer_types({"model_type": "deepseek_v4"}, n) == want


def test_legacy_compress_ratios_and_rates():
    cfg = {**TINY_V4, "compress_rates": None, "layer_types": None,
           "compress_ratios": [0, 4, 128, 4, 128]}  # one extra (MTP) entry: truncated
    spec = spec_from_hf_config(cfg)
    g = by_kind(spec)
    assert (g["csa_compressed_kv"].num_layers, g["hca_compressed_kv"].num_layers) == (2, 1)
    assert (g["csa_compressed_kv"].rate, g["hca_compressed_kv"].rate) == (4, 128)
    scalar = {**TINY_V4, "compress_rates": None, "compress_rate_hca": 64}
    assert by_kind(spec_from_hf_config(scalar))["hca_compressed_kv"].rate == 64
    with pytest.raises(ValueError, match="compress_ratios"):
        spec_from_hf_config({**cfg, "compress_ratios": [0, 4, 16, 4]})
    with pytest.raises(ValueError, match="layer_types"):
        spec_from_hf_config({**TINY_V4, "layer_types": [SLIDING, "full_attention", HCA, CSA]})
    with pytest.raises(ValueError, match="names 3 layers"):
        spec_from_hf_config({**TINY_V4, "layer_types": [SLIDING, CSA, HCA]})
    with pytest.raises(ValueError, match="head_dim"):
        spec_from_hf_config({k: v for k, v in TINY_V4.items() if k != "head_dim"})
    with pytest.raises(ValueError, match="one shared KV head"):
        SharedKVWindow(4, 2, 32, window=24)


def test_only_sliding_layers_keep_only_the_window():
    spec = spec_from_hf_config({**TINY_V4, "layer_types": [SLIDING] * 4})
    assert [g.kind for g in spec.groups] == ["v4_window_kv"]
    assert spec.num_kv_heads == 1


def test_v4_state_is_replicated_over_tp():
    spec = spec_from_hf_config(TINY_V4)
    for g in spec.groups:
        assert g.token_bytes(FP32, tp=8) == g.token_bytes(FP32)
        assert g.request_bytes(FP32, tp=8) == g.request_bytes(FP32)
    assert isinstance(by_kind(spec)["csa_indexer_keys"], IndexerKeys)
    assert isinstance(by_kind(spec)["hca_compressed_kv"], CompressedKV)


def flash_hand() -> dict[int, dict[str, int]]:
    """V4-Flash (43 layers: 20 CSA, 23 HCA; head_dim 512, index_head_dim 128, window 128,
    rates 4 / 128, bf16) by hand, per group at 128k and 1M tokens."""
    fixed = {"csa_compressor_state": 20 * (4 * 2 * 1024 + 2 * 4 * 512) * 4,   # 983,040
             "csa_indexer_state": 20 * (4 * 2 * 256 + 2 * 4 * 128) * 4,       # 245,760
             "hca_compressor_state": 23 * (128 * 2 * 512) * 4}               # 12,058,624
    out = {}
    for n in (131_072, 1_048_576):
        out[n] = {"v4_window_kv": 43 * 512 * 2 * 128,
                  "csa_compressed_kv": 20 * 512 * 2 * (n // 4),
                  "csa_indexer_keys": 20 * 128 * 2 * (n // 4),
                  "hca_compressed_kv": 23 * 512 * 2 * (n // 128), **fixed}
    return out


def test_flash_totals_at_128k_and_1m():
    cfg, _ = load_config("deepseek-v4-flash")
    spec = spec_from_hf_config(cfg, "deepseek-v4-flash")
    assert (spec.num_layers, spec.dtype) == (43, "bfloat16")
    hand = flash_hand()
    for n, want in hand.items():
        assert model_bytes(spec, n, BF16) == want
    assert sum(hand[131_072].values()) == 881_901_568
    assert sum(hand[1_048_576].values()) == 6_922_747_904
    assert sum(per_token_bytes(g, BF16) for g in spec.groups) == 44_032 + 5_120 + 1_280 + 184


def test_plan_cli_prints_the_v4_rows(capsys):
    args = ["plan", "--model", "deepseek-v4-flash", "--context", "131072,1048576",
            "--link-bandwidth", "25e9"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for row in ("sliding window (K = V) KV per token: 44 kB (44,032 B)",
                "compressed CSA (1 entry / 4 tokens) KV per token: 5.12 kB (5,120 B)",
                "indexer keys (CSA, 1 entry / 4 tokens) KV per token: 1.28 kB (1,280 B)",
                "compressed HCA (1 entry / 128 tokens) KV per token: 184 B",
                "HCA compressor state per request: 12.1 MB (12,058,624 B)",
                "fixed state per request, all groups: 13.3 MB (13,287,424 B)",
                "131,072 tokens: all groups: 882 MB (881,901,568 B)",
                "1,048,576 tokens: all groups: 6.92 GB (6,922,747,904 B)",
                "1,048,576 tokens: handoff over custom: 279 ms"):
        assert row in out, row
    assert main([*args, "--json"]) == 0
    f = json.loads(capsys.readouterr().out)["figures"]
    hand = flash_hand()
    for n, want in hand.items():
        for kind, b in want.items():
            assert f[f"context_bytes.{n}.{kind}"]["value"] == b
        assert f[f"context_bytes.{n}"]["value"] == sum(want.values())
    assert f["context_handoff_s.1048576"]["value"] == pytest.approx(
        6_922_747_904 / 25e9 + 2e-3)


def test_context_flag_errors(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "deepseek-v4-flash", "--context", "1k"])
    assert "comma-separated" in capsys.readouterr().err
    assert main(["plan", "--kv-bytes", "1e9", "--context", "1024"]) == 2
    assert "--context needs --model" in capsys.readouterr().err


@pytest.mark.parametrize("block_size", [8, 16])
def test_block_rounded_compressed_bytes_are_what_pdkv_allocates(block_size):
    """The plan's whole-block bytes of the compressed groups equal the pages pdkv's KV cache
    gives a request of n tokens (pdkv.worker.kv_cache.v4_cache_groups: ceil(n / block_size)
    blocks of each CompressedKVSpec group)."""
    from pdkv.cache.specs import CompressedKVSpec
    from pdkv.model.arch_config import LlamaArchConfig
    from pdkv.modelspec.groups import CompressedKV
    from pdkv.worker.kv_cache import v4_cache_groups

    cfg = {**TINY_V4, "vocab_size": 49152, "q_lora_rank": 64, "index_n_heads": 16,
           "moe_intermediate_size": 64, "max_position_embeddings": 8192}
    folder = Path(os.environ["PDKV_CACHE"]) / "tiny-v4-config"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    arch = LlamaArchConfig.from_hf_folder(str(folder))
    groups = [g for g in v4_cache_groups(arch, block_size, "float32")
              if isinstance(g.spec, CompressedKVSpec)]
    spec = spec_from_hf_config(TINY_V4, "tiny-v4")
    # the window group stores one vector per token and layer (K = V), as the plan counts it
    from pdkv.worker.kv_cache import KVCacheSizing, make_kv_cache_config

    kv = make_kv_cache_config(arch, KVCacheSizing(block_size=block_size, dtype="float32",
                                                  max_model_len=128, num_kv_blocks=64))
    window = next(g for g in spec.groups if g.kind == "v4_window_kv")
    assert kv.block_bytes(0) == window.token_bytes(FP32) * block_size
    for n in (1, 15, 16, 17, 40, 100):
        plan = sum(g.token_bytes(FP32) * g.block_tokens_held(n, block_size)
                   for g in spec.groups if isinstance(g, CompressedKV))
        pages = sum(g.spec.page_size_bytes * len(g.layer_indices) * -(-n // block_size)
                    for g in groups)
        assert plan == pages, n
