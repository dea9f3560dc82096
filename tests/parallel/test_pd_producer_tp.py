"""A prefill engine at tp 2 end to end: P (tp 2, two worker processes, a control server per rank)
→ D at tp 1 and → D at tp 2 (dcp 1) over the P2P connector (tcp), on tiny-llama-kv2 (one KV
head per P rank). D's greedy tokens equal a colocated tp-1 engine's; D's KV of every pulled
position equals P's (both ranks' heads, from P's workers); D received every head of every block
once (a 64-token prompt: prompt tokens × bytes per token); and P's blocks come back to its pool on
every rank (the scheduler frees them only after each P rank reported its grant done).

Issue 12 (P tp 2 → D tp 1, P tp 2 → D tp 2). Which P rank each D rank contacts is checked with
fakes in tests/kv_transfer/test_p2p_producer_tp.py."""

from __future__ import annotations

import pytest
import torch
from pd_tp_utils import BLOCK, GREEDY, decode, engine, kv_config, prefill, step_until

from pdkv import LLM

pytestmark = pytest.mark.slow  # worker processes: `pdkv matrix --quick` leaves it to the suite

HEADS = 2


def free(llm: LLM) -> int:
    return llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks


@pytest.mark.matrix("hetero-tp", model="tiny-llama-kv2")
def test_p_tp2_to_d_tp1_and_tp2_match_colocated_and_free_p_blocks(tiny_llama_kv2):
    prompts = [[(i * 7919 + 13) % 30000 + 100 for i in range(4 * BLOCK)],
               [(i * 31 + 7) % 30000 + 200 for i in range(21)]]
    ref = engine(tiny_llama_kv2)  # colocated, tp 1
    try:
        want = [list(o.outputs[0].token_ids) for o in ref.generate(
            [{"prompt_token_ids": q} for q in prompts], GREEDY, use_tqdm=False)]
    finally:
        ref.llm_engine.shutdown()
    # A lease far beyond the wait below: only "done" from every reader frees a P rank's blocks.
    p = engine(
        tiny_llama_kv2,
        tensor_parallel_size=2,
        kv_transfer_config=kv_config("kv_producer", kv_lease_duration=600),
    )
    ds: list[LLM] = []
    try:
        ds.append(engine(tiny_llama_kv2, kv_transfer_config=kv_config("kv_consumer")))
        ds.append(
            engine(
                tiny_llama_kv2, tensor_parallel_size=2, kv_transfer_config=kv_config("kv_consumer")
            )
        )
        baseline = free(p)
        for d in ds:
            d_tp = d.llm_engine.config.parallel_config.tensor_parallel_size
            for prompt, expect in zip(prompts, want):
                params, _ = prefill(p, prompt, tp=2)
                assert params["endpoints"][0] == [params["remote_host"], params["remote_port"]]
                assert (
                    len({tuple(e) for e in params["endpoints"]}) == 2
                )  # a control server per P rank
                p_blocks = params["remote_block_ids"][0]
                # P's KV of those blocks, both ranks' heads (P holds them until D is done).
                p_kv = torch.cat(p.llm_engine.runner.read_kv_blocks(p_blocks), dim=-2)
                out, _, shards, _ = decode(p, d, prompt, params)
                assert list(out.outputs[0].token_ids) == expect, (
                    f"D tp {d_tp}, {len(prompt)}-token prompt"
                )
                # Bytes moved = what D stores: every head of every block P sent, once.
                assert out.kv_load_bytes == {"p2p": p_kv.numel() * p_kv.element_size()}
                if len(prompt) % BLOCK == 0:
                    per_token = (
                        p_kv[0, :, :, 0].numel() * p_kv.element_size()
                    )  # layers × K/V × heads
                    assert out.kv_load_bytes["p2p"] == len(prompt) * per_token
                local = HEADS // d_tp
                for rank, shard in enumerate(shards):
                    # D recomputes the last prompt token itself; every other position came from P.
                    for pos in range(len(prompt) - 1):
                        blk, off = pos // BLOCK, pos % BLOCK
                        assert torch.equal(
                            shard[blk, :, :, off],
                            p_kv[blk, :, :, off, rank * local : (rank + 1) * local],
                        ), f"D tp {d_tp} rank {rank}, position {pos}"
                # P frees the request's blocks only after both P ranks' grants ended.
                step_until(
                    [p], lambda: free(p) == baseline and not p.llm_engine.has_work(), timeout=20
                )
    finally:
        for d in ds:
            d.llm_engine.shutdown()
        p.llm_engine.shutdown()
