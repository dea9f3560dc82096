"""Sliding-window layers read from config.json as transformers applies them (Qwen2 `layer_types`
/ use_sliding_window + max_window_layers quirks, Mistral on every layer), and the KV cache groups
the worker makes of them (one per spec, order of first layer, one shared block count)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdkv.cache.specs import FullAttentionSpec, SlidingWindowSpec
from pdkv.model.arch_config import LlamaArchConfig, attention_groups
from pdkv.parallel.layout import ParallelLayout
from pdkv.worker.kv_cache import KVCacheSizing, make_kv_cache_config

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def arch_of(tmp_path, hf_cfg) -> LlamaArchConfig:
    d = hf_cfg.to_dict()
    d["architectures"] = [type(hf_cfg).__name__.replace("Config", "ForCausalLM")]
    (tmp_path / "config.json").write_text(json.dumps(d))
    return LlamaArchConfig.from_hf_folder(str(tmp_path))


QWEN2_CASES = [
    pytest.param(
        dict(
            layer_types=["sliding_attention", "full_attention"] * 2,
            sliding_window=40,
            use_sliding_window=True,
        ),
        id="layer-types",
    ),
    # use_sliding_window false: Qwen2Config drops the window, whatever layer_types says.
    pytest.param(
        dict(layer_types=["sliding_attention"] * 4, sliding_window=40, use_sliding_window=False),
        id="use-sliding-window-off",
    ),
    pytest.param(
        dict(sliding_window=40, use_sliding_window=True, max_window_layers=2),
        id="max-window-layers",
    ),
    pytest.param(
        dict(sliding_window=40, use_sliding_window=True), id="max-window-layers-default-28"
    ),
]


@pytest.mark.parametrize("kw", QWEN2_CASES)
def test_qwen2_windows_follow_transformers(tmp_path, kw):
    from transformers import Qwen2Config

    hf = Qwen2Config(**SIZES, **kw)
    arch = arch_of(tmp_path, hf)
    want = [hf.sliding_window if t == "sliding_attention" and hf.sliding_window else None
            for t in hf.layer_types]
    assert [arch.layer_window(i) for i in range(4)] == want


def test_mistral_slides_every_layer_and_llama_none(tmp_path):
    from transformers import LlamaConfig, MistralConfig

    assert [arch_of(tmp_path, MistralConfig(**SIZES, sliding_window=64)).layer_window(i)
            for i in range(4)] == [64] * 4
    assert arch_of(tmp_path, MistralConfig(**SIZES, sliding_window=None)).sliding_window is None
    assert arch_of(tmp_path, LlamaConfig(**SIZES)).sliding_window is None


def _arch(layer_types: tuple[str, ...], window: int | None) -> LlamaArchConfig:
    return LlamaArchConfig(
        architecture="Qwen2ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_layers=len(layer_types), num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4,
        rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=True, qkv_bias=True,
        bos_token_id=1, eos_token_id=2, layer_types=layer_types, sliding_window=window)


def test_kv_cache_groups_per_spec_share_one_block_count():
    f, s = "full_attention", "sliding_attention"
    arch = _arch((f, s, s, f, s), 40)
    assert attention_groups(arch) == [(None, (0, 3)), (40, (1, 2, 4))]
    page = 2 * 16 * 2 * 16 * 4  # K and V, 16 tokens, 2 heads of 16, float32
    cc = KVCacheSizing(block_size=16, dtype="float32", max_model_len=256,
                       kv_cache_memory_bytes=page * 5 * 100 + page)
    kv = make_kv_cache_config(arch, cc)
    assert [g.layer_indices for g in kv.groups] == [(0, 3), (1, 2, 4)]
    assert type(kv.groups[0].spec) is FullAttentionSpec
    assert kv.groups[1].spec == SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=16,
                                                  dtype="float32", sliding_window=40)
    assert kv.num_blocks == 100  # budget // (sum of the groups' block bytes): 5 layers' pages
    assert kv.total_bytes == 100 * 5 * page
    dense = make_kv_cache_config(
        dataclasses.replace(arch, layer_types=(f,) * 5, sliding_window=None), cc
    )
    assert dense.num_blocks == 100 and len(dense.groups) == 1
    assert (
        dense.groups[0].layer_indices == tuple(range(5))
        and type(dense.groups[0].spec) is FullAttentionSpec
    )
    with pytest.raises(
        ValueError, match="decode_context_parallel_size=2 is not supported with sliding-window"
    ):
        make_kv_cache_config(arch, dataclasses.replace(
            cc, layout=ParallelLayout(dcp_size=2, dcp_replicated=True)))
