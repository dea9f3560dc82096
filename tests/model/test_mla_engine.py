"""tiny-mla (DeepSeek-V3-style MLA, pdkv/model/deepseek.py): the folder has the documented
shape; one MLA KV cache group of latent + rope rows; the decoder's greedy output equals HF
transformers' alone (one decode a step); DCP is refused. Plain / chunked / prefix-cache parity and
greedy margins: tests/model/test_tiny_models.py; TP 2: tests/parallel/test_mla_tp.py.
Issue 11, acceptance 1 for tiny-mla."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from pdkv import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in (20, 70)]


@pytest.fixture(scope="module")
def hf_tokens(tiny_mla, prompts) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_mla, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = []
    for p in prompts:
        with torch.inference_mode():
            seq = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
        out.append(seq[0, len(p):].tolist())
    return out


def tokens(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def test_config_has_the_documented_shape(tiny_mla):
    with open(os.path.join(tiny_mla, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (128, 4, 4)
    assert (
        cfg["kv_lora_rank"],
        cfg["qk_rope_head_dim"],
        cfg["qk_nope_head_dim"],
        cfg["v_head_dim"],
    ) == (48, 16, 32, 32)
    assert (cfg["q_lora_rank"], cfg["first_k_dense_replace"], cfg["rope_interleave"]) == (
        None,
        4,
        True,
    )
    assert cfg["rope_parameters"]["rope_type"] == "default" and cfg["vocab_size"] == 49152


def test_one_mla_group_of_latent_rows(tiny_mla):
    from pdkv.cache.specs import MLASpec

    llm = LLM(tiny_mla, cpu_linear="torch", num_kv_blocks=8, max_model_len=128)
    runner: Any = llm.llm_engine.runner
    (group,) = runner.kv_cache_config.groups
    assert group.layer_indices == (0, 1, 2, 3)
    assert group.spec == MLASpec(
        block_size=16, kv_lora_rank=48, qk_rope_head_dim=16, dtype="float32"
    )
    assert (
        runner.kv_cache_config.block_bytes(0) == 4 * 16 * (48 + 16) * 4
    )  # layers x tokens x entry x fp32
    assert tuple(runner.kv_cache_groups[0].shape) == (8, 4, 16, 64)
    assert tuple(runner.kv_caches[1].shape) == (8, 16, 64)


@pytest.mark.slow  # loads HF's model
def test_alone_matches_hf(tiny_mla, prompts, hf_tokens):
    """One request at a time: decodes of batch 1 (the exact-slice path) after an uncached and a
    prefix-cached chunked prefill."""
    llm = LLM(
        tiny_mla, cpu_linear="torch", num_kv_blocks=32, max_model_len=128, max_num_batched_tokens=16
    )
    for p, ref in zip(prompts, hf_tokens):
        assert tokens(llm, [p])[0] == [ref]
    again, cached = tokens(llm, prompts[1:])
    assert again == hf_tokens[1:] and cached == [64]


def test_dcp_is_refused_on_an_mla_model(tiny_mla):
    from pdkv.engine.arg_utils import EngineArgs

    with pytest.raises(
        ValueError, match="decode_context_parallel_size=2 is not supported with multi-head latent"
    ):
        EngineArgs(model=tiny_mla, decode_context_parallel_size=2).create_engine_config()


def test_quantized_kv_is_refused_on_an_mla_model(tiny_mla):
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported with MLA"):
        LLM(tiny_mla, cpu_linear="torch", num_kv_blocks=8, max_model_len=128, kv_cache_dtype="int8")
