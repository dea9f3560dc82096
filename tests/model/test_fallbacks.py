"""Every model and every `--cpu-linear` value works on the fallback paths, the ones a machine
without pdkv's C++ ops runs (no compiler, or a failed build): with the ops hidden
(PDKV_CPU_OPS=0, read only by pdkv.model.paged_decode_build.load) each tiny model and SmolLM2 run
through the offline API with the defaults and give HF transformers' greedy tokens; each
`--cpu-linear` value does on tiny-llama-kv2 and tiny-mla, hidden and (tiny-mla, whose packing
once read an attribute its class never set) with the ops built."""

from __future__ import annotations

from typing import Any

import pytest

from pdkv import LLM, SamplingParams
from pdkv.model.panel_linear import PanelWeight, panel_linear_unavailable

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

NEW_TOKENS = 12
# What tests/conftest.py's `hf_reference` generates per SmolLM2 prompt (its NUM_NEW_TOKENS; not
# imported: under xdist another folder's conftest.py may own the module name `conftest`).
SMOLLM2_NEW_TOKENS = 40
PROMPT_LENS = (20, 70)  # 70 > tiny-swa's 40-token window; both past one 16-token block
TINY = ("tiny-llama-kv1", "tiny-llama-kv2", "tiny-swa", "tiny-mla", "tiny-gdn", "tiny-kda-mla")
CPU_LINEARS = ("torch", "onednn", "auto", "panel")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def folders(
    tiny_llama_kv1, tiny_llama_kv2, tiny_swa, tiny_mla, tiny_gdn, tiny_kda_mla
) -> dict[str, str]:
    return dict(
        zip(TINY, (tiny_llama_kv1, tiny_llama_kv2, tiny_swa, tiny_mla, tiny_gdn, tiny_kda_mla))
    )


@pytest.fixture(scope="module")
def hf_tokens(folders, prompts) -> dict[str, list[list[int]]]:
    """HF transformers' greedy continuation of each prompt (batch 1, EOS not stopping)."""
    import torch
    from transformers import AutoModelForCausalLM

    refs: dict[str, list[list[int]]] = {}
    for name, folder in folders.items():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        refs[name] = []
        for p in prompts:
            with torch.inference_mode():
                seq = model.generate(
                    torch.tensor([p]),
                    attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                )
            refs[name].append(seq[0, len(p):].tolist())
    return refs


@pytest.fixture
def ops_hidden(monkeypatch) -> None:
    monkeypatch.setenv("PDKV_CPU_OPS", "0")


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_no_leak(llm: LLM) -> None:
    """Every usable block of every KV cache group is free again (a sliding-window group keeps its
    null block) and nothing is running."""
    for pool in llm.llm_engine.scheduler.kv_cache_manager.block_pools:
        assert pool.num_free_blocks == pool.num_usable_blocks, "blocks leaked"
    assert not llm.llm_engine.has_unfinished_requests()


def _packed_kinds(model: Any) -> set[str]:
    """Type names of the model's packed projections (LM head and every layer's)."""
    slots = [
        model.head_packed,
        *(p for layer in model.layers for p in getattr(layer, "packed", {}).values()),
    ]
    return {type(p).__name__ for p in slots}


def _assert_on_fallbacks(llm: LLM) -> None:
    runner: Any = llm.llm_engine.runner
    assert runner.attention_backend == "torch"
    assert runner.fused_ops is False
    assert runner.decode_layer_ops == 0
    assert "PanelWeight" not in _packed_kinds(runner.model)


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_defaults_match_hf_with_the_ops_hidden(
    name, folders, prompts, hf_tokens, ops_hidden
):
    llm = LLM(folders[name], num_kv_blocks=64, max_model_len=128)
    _assert_on_fallbacks(llm)
    assert _greedy(llm, prompts) == hf_tokens[name]
    assert_no_leak(llm)


@pytest.mark.parametrize("name", ("tiny-llama-kv2", "tiny-mla"))
@pytest.mark.parametrize("cpu_linear", CPU_LINEARS)
def test_each_cpu_linear_matches_hf_with_the_ops_hidden(
    name, cpu_linear, folders, prompts, hf_tokens, ops_hidden
):
    llm = LLM(folders[name], cpu_linear=cpu_linear, num_kv_blocks=64, max_model_len=128)
    _assert_on_fallbacks(llm)
    if cpu_linear == "torch":
        assert llm.llm_engine.runner.model.head_packed is None
    assert _greedy(llm, prompts) == hf_tokens[name]
    assert_no_leak(llm)


@pytest.mark.parametrize("cpu_linear", CPU_LINEARS)
def test_tiny_mla_each_cpu_linear_matches_hf_with_the_ops(
    cpu_linear, cpu_ops, folders, prompts, hf_tokens
):
    llm = LLM(folders["tiny-mla"], cpu_linear=cpu_linear, num_kv_blocks=64, max_model_len=128)
    model: Any = llm.llm_engine.runner.model
    if cpu_linear == "panel" and panel_linear_unavailable(model.embed) is None:
        assert isinstance(model.head_packed, PanelWeight)
    assert _greedy(llm, prompts) == hf_tokens["tiny-mla"]
    assert_no_leak(llm)


def test_smollm2_defaults_match_hf_with_the_ops_hidden(parity_prompts, hf_reference, ops_hidden):
    llm = LLM("smollm2", block_size=16, num_kv_blocks=256, max_model_len=512)
    _assert_on_fallbacks(llm)
    assert max(len(r) for r in hf_reference) <= SMOLLM2_NEW_TOKENS
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in parity_prompts],
        SamplingParams(temperature=0.0, max_tokens=SMOLLM2_NEW_TOKENS),
        use_tqdm=False,
    )
    for i, (out, ref) in enumerate(zip(outs, hf_reference)):
        assert out.outputs[0].token_ids == ref, f"prompt {i}"
    assert_no_leak(llm)
