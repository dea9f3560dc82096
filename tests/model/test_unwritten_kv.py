"""The KV cache is allocated with torch.empty and never cleared: slots not yet written (and the
null block of a sliding-window group, never written) may hold anything. Filled with NaN before
the first request, an engine's greedy output is token for token that of an engine whose cache
holds no NaN: batched decodes with padded tables, prefill chunks after cached context, and
sliding-window tables that start past freed blocks read only written slots."""

from __future__ import annotations

import pytest
import torch

from pdkv import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT_LENS = (
    10,
    17,
    45,
    150,
)  # decodes of different lengths in one batch; 150 > tiny-swa's window 40
NEW_TOKENS = 12
# 32 tokens a step: long prompts prefill in chunks (with context) next to running decodes.
ENGINE_KW = dict(cpu_linear="torch", num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32)


def _tokens(llm: LLM) -> list[list[int]]:
    prompts = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(("name", "kv_cache_dtype"), [
    ("tiny_llama_kv2", "auto"), ("tiny_swa", "auto"), ("tiny_mla", "auto"), ("tiny_gdn", "auto"),
    ("tiny_llama_kv2", "int8"),
])
def test_nan_in_unwritten_slots_changes_no_output(name, kv_cache_dtype, request):
    """A quantized cache is raw bytes: filled with 0xFF its float32 scales are NaN."""
    folder = request.getfixturevalue(name)
    clean = LLM(folder, kv_cache_dtype=kv_cache_dtype, **ENGINE_KW)
    for t in clean.llm_engine.runner.kv_cache_groups:
        t.zero_()
    poisoned = LLM(folder, kv_cache_dtype=kv_cache_dtype, **ENGINE_KW)
    for t in poisoned.llm_engine.runner.kv_cache_groups:
        t.fill_(255 if t.dtype == torch.uint8 else float("nan"))
    assert _tokens(poisoned) == _tokens(clean)
