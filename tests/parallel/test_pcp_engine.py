"""Prefill context parallelism (PCP 2, colocated, tp 1) gives the single-rank engine's greedy
tokens (issue 32, step 1, acceptance 1 colocated).

Prompts of 1-4 x the split threshold (2N x 16 = 64 tokens at PCP 2) and odd lengths between, in
one batch with a short prompt that is never split (its tokens, and the decodes of the prompts that
finished first, run on rank 0 inside split steps). tiny-llama-kv2 runs with chunked prefill (a
96-token budget: split chunks with a cached context) on the no-C++ path (torch attention, no
fused ops); tiny-llama-kv1 without chunked prefill on the default attention backend. One PCP
engine per model; the single-rank references run in this process."""

from __future__ import annotations

from typing import Any

import pytest

from pdkv import LLM, SamplingParams

pytestmark = pytest.mark.slow  # worker processes

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SLICE = 64  # the smallest run PCP 2 splits: 2 ranks x 2 chunks x MIN_CHUNK_TOKENS
PROMPT_LENS = (20, SLICE, 2 * SLICE + 1, 3 * SLICE, 4 * SLICE - 3)


def prompts() -> list[list[int]]:
    return [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENS]


def engine(model: str, **kw: Any) -> LLM:
    return LLM(model, cpu_linear="torch", block_size=16, num_kv_blocks=96, max_model_len=320,
               **kw)


def run(llm: LLM, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def check_pcp(model: str, **kw: Any) -> None:
    ref = engine(model, **kw)
    try:
        want = run(ref, prompts())
    finally:
        ref.llm_engine.shutdown()
    llm = engine(model, prefill_context_parallel_size=2, **kw)
    try:
        assert llm.llm_engine.executor.world_size == 2
        assert run(llm, prompts()) == want
        # a lone 96-token prompt's prefill (one step within both budgets, the last step at
        # max_tokens=1) is split: the ranks exchanged K/V
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        assert run(llm, [[7 + i for i in range(96)]], one)
        assert llm.llm_engine.executor.timings.pcp_comm > 0
        for pool in llm.llm_engine.scheduler.kv_cache_manager.block_pools:
            assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    finally:
        llm.llm_engine.shutdown()


def test_pcp2_chunked_prefill_torch_attention_kv2(tiny_llama_kv2):
    check_pcp(tiny_llama_kv2, max_num_batched_tokens=96, attention_backend="torch",
              fused_ops=False)


def test_pcp2_without_chunked_prefill_kv1(tiny_llama_kv1):
    check_pcp(tiny_llama_kv1, enable_chunked_prefill=False, max_num_batched_tokens=320)
