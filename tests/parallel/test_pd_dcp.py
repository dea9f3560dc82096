"""P/D into DCP end to end: P (tp 1) → D (tp 2, dcp 2, interleave = block size) over the P2P
connector (tcp), stepped in-process. D's greedy tokens equal a colocated single-rank engine's, and
the KV rebuilt from D's two shards (each rank's copy read through the executor) equals P's KV
position by position, also when P served part of the prompt from its prefix cache and D found a
logical block in its own (so the pull starts at P's block K0 = 2).

Issue 10, acceptance 4. One D start-up (two worker processes), small prompts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pd_tp_utils import BLOCK, GREEDY, engine, kv_config, prefill, step_until

from pdkv import LLM

pytestmark = pytest.mark.slow  # worker processes: `pdkv matrix --quick` leaves it to the suite

def decode(p: LLM, d: LLM, prompt: list[int], params: dict[str, Any]) -> tuple[list[int], list[int], list[torch.Tensor], int]:
    """D's leg: (tokens, D's block table, each rank's copy of those blocks, D's local prefix-hit
    tokens). The blocks are read once the pull ended and the request runs."""
    eng = d.llm_engine
    req, text = eng.make_request({"prompt_token_ids": prompt}, GREEDY, kv_transfer_params=params)
    eng.add_request(req, text)
    rid = req.request_id
    out: list[Any] = []

    def step() -> bool:
        out.extend(o for o in eng.step() if o.finished and o.request_id == rid)
        p.llm_engine.step()
        return bool(out)

    def pulled() -> bool:
        running = any(r.request_id == rid for r in eng.scheduler.running)
        return step() or (running and req.num_computed_tokens >= len(prompt))

    step_until([], pulled)
    assert not out, f"the request ended before its KV was inspected: {out[0].outputs[0].finish_reason}"
    table = list(eng.scheduler.kv_cache_manager.get_block_ids(rid)[0])
    shards = eng.runner.read_kv_blocks(table)
    step_until([], step)
    return list(out[0].outputs[0].token_ids), table, shards, req.num_local_hit_tokens


@pytest.mark.matrix("pd-dcp", model="tiny-llama-kv1")
def test_pd_into_dcp_matches_colocated_and_rebuilds_p_kv(tiny_llama_kv1):
    base = [(i * 7919 + 13) % 30000 + 100 for i in range(70)]
    prompts = [base, [(i * 31 + 7) % 30000 + 200 for i in range(45)],
               base[:50] + [(i * 17 + 3) % 30000 + 300 for i in range(30)]]  # shares 3 P blocks of base
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
            got, table, shards, d_hit = decode(p, d, prompt, params)
            assert got == expect
            by_dcp = {lay.dcp_rank(rank): shard for rank, shard in enumerate(shards)}
            # D recomputes the last prompt token itself; every other position came from P.
            for pos in range(len(prompt) - 1):
                blk, off = pos // BLOCK, pos % BLOCK
                mine = by_dcp[blk % 2][pos // (2 * BLOCK), :, :, off]
                assert torch.equal(mine, p_kv[blk, :, :, off]), f"position {pos} of a {len(prompt)}-token prompt"
            if prompt is prompts[2]:  # P served 48 tokens from its cache, D one 32-token logical block
                assert p_cached == 48 and d_hit == 32
    finally:
        d.llm_engine.shutdown()
        p.llm_engine.shutdown()
