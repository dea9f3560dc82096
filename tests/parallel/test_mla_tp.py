"""tiny-mla (MLA, latent replicated on every TP rank) at TP 2, one D engine of two worker
processes: run colocated it gives the tp 1 engine's greedy tokens (chunked prefill, then a
prefix-cache resend); as a P/D consumer of a tp 1 producer (P2P, tcp) each rank pulls P's whole
latent blocks (bytes = one copy of P's blocks per rank), its rows equal P's, and the tokens
equal colocated. The tp 1 engine equals HF transformers (tests/model/test_tiny_models.py).
Issue 11 step 2 (TP on MLA)."""

from __future__ import annotations

import pytest
import torch
from pd_tp_utils import BLOCK, GREEDY, decode, engine, kv_config, prefill

from pdkv import LLM

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # worker processes


@pytest.mark.matrix("tp", "pd-reshard", model="tiny-mla")
def test_tp2_matches_tp1_and_pulls_whole_latent_blocks_from_a_tp1_producer(tiny_mla):
    prompts = [
        [(i * 7919 + 13) % 30000 + 100 for i in range(70)],
        [(i * 31 + 7) % 30000 + 200 for i in range(21)],
    ]
    p = engine(tiny_mla, kv_transfer_config=kv_config("kv_producer"))
    d: LLM | None = None
    try:
        want = [list(o.outputs[0].token_ids) for o in p.generate(
            [{"prompt_token_ids": q} for q in prompts], GREEDY, use_tqdm=False)]  # colocated, tp 1
        d = engine(tiny_mla, tensor_parallel_size=2, max_num_batched_tokens=32,
                   kv_transfer_config=kv_config("kv_consumer"))
        for cached in ([0, 0], [64, 16]):  # 32 tokens a step, then the prefix cache
            outs = d.generate([{"prompt_token_ids": q} for q in prompts], GREEDY, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == want
            assert [o.num_cached_tokens for o in outs] == cached
        assert d.reset_prefix_cache()
        p_cache = p.llm_engine.runner.kv_cache_groups[
            0
        ]  # [blocks, layers, block_size, latent + rope]
        for prompt, expect in zip(prompts, want):
            params, _ = prefill(p, prompt)
            p_kv = p_cache[torch.tensor(params["remote_block_ids"][0])].clone()
            out, _, shards, _ = decode(p, d, prompt, params)
            assert list(out.outputs[0].token_ids) == expect
            assert out.kv_load_bytes == {"p2p": 2 * p_kv.numel() * p_kv.element_size()}
            for rank, shard in enumerate(shards):  # D recomputes the last prompt token itself
                for pos in range(len(prompt) - 1):
                    blk, off = pos // BLOCK, pos % BLOCK
                    assert torch.equal(shard[blk, :, off], p_kv[blk, :, off]), (
                        f"rank {rank}, position {pos}"
                    )
    finally:
        if d is not None:
            d.llm_engine.shutdown()
        p.llm_engine.shutdown()
