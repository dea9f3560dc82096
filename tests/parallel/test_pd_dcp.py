"""P/D into DCP end to end: P (tp 1) → D (tp 2, dcp 2, interleave = block size) over the P2P
connector (tcp), stepped in-process. D's greedy tokens equal a colocated single-rank engine's, and
the KV rebuilt from D's two shards (each rank's copy read through the executor) equals P's KV
position by position, also when P served part of the prompt from its prefix cache and D found a
logical block in its own (so the pull starts at P's block K0 = 2).

Issue 10, acceptance 4. One D start-up (two worker processes), small prompts."""

from __future__ import annotations

import pytest
import torch
from pd_tp_utils import BLOCK, GREEDY, decode, engine, kv_config, prefill

pytestmark = pytest.mark.slow  # worker processes: `pdkv matrix --quick` leaves it to the suite

@pytest.mark.matrix("pd-dcp", model="tiny-llama-kv1")
def test_pd_into_dcp_matches_colocated_and_rebuilds_p_kv(tiny_llama_kv1):
    base = [(i * 7919 + 13) % 30000 + 100 for i in range(70)]
    prompts = [
        base,
        [(i * 31 + 7) % 30000 + 200 for i in range(45)],
        base[:50] + [(i * 17 + 3) % 30000 + 300 for i in range(30)],
    ]  # shares 3 P blocks of base
    ref = engine(tiny_llama_kv1)
    try:
        want = [list(o.outputs[0].token_ids) for o in ref.generate(
            [{"prompt_token_ids": q} for q in prompts], GREEDY, use_tqdm=False)]
    finally:
        ref.llm_engine.shutdown()
    p = engine(tiny_llama_kv1, kv_transfer_config=kv_config("kv_producer"))
    d = engine(tiny_llama_kv1, tensor_parallel_size=2, decode_context_parallel_size=2,
               cp_kv_cache_interleave_size=BLOCK, kv_transfer_config=kv_config("kv_consumer"))
    try:
        lay = d.llm_engine.runner.layout_
        p_cache = p.llm_engine.runner.kv_cache_groups[0]
        for prompt, expect in zip(prompts, want):
            params, p_cached = prefill(p, prompt)
            p_blocks = params["remote_block_ids"][0]
            p_kv = p_cache[torch.tensor(p_blocks)].clone()  # P holds them until D is done
            out, table, shards, d_hit = decode(p, d, prompt, params)
            got = list(out.outputs[0].token_ids)
            assert got == expect
            by_dcp = {lay.dcp_rank(rank): shard for rank, shard in enumerate(shards)}
            # D recomputes the last prompt token itself; every other position came from P.
            for pos in range(len(prompt) - 1):
                blk, off = pos // BLOCK, pos % BLOCK
                mine = by_dcp[blk % 2][pos // (2 * BLOCK), :, :, off]
                assert torch.equal(mine, p_kv[blk, :, :, off]), (
                    f"position {pos} of a {len(prompt)}-token prompt"
                )
            if (
                prompt is prompts[2]
            ):  # P served 48 tokens from its cache, D one 32-token logical block
                assert p_cached == 48 and d_hit == 32
    finally:
        d.llm_engine.shutdown()
        p.llm_engine.shutdown()
