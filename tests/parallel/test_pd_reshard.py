"""Re-sharding end to end: P (tp 1) → D (tp 2, dcp 1) over the P2P connector (tcp), stepped
in-process. On tiny-llama-kv2 each D rank stores one of P's two KV heads and pulls only it; on
tiny-llama-kv1 both D ranks store P's one head (replicated) and each pulls whole blocks. D's
greedy tokens equal a colocated single-rank engine's (P's engine serving the prompt itself), each
rank's copy of the pulled blocks equals P's KV of its heads, and D received exactly the bytes it
stores (kv2: one copy of P's blocks in all; kv1: one per rank).

Issue 12, acceptance 2 (P tp 1 → D tp 2 on tiny-llama-kv2). One D start-up per model (two
worker processes each), small prompts."""

from __future__ import annotations

import pytest
import torch
from pd_tp_utils import BLOCK, GREEDY, decode, engine, kv_config, prefill

from pdkv import LLM

pytestmark = pytest.mark.slow  # worker processes: `pdkv matrix --quick` leaves it to the suite


def check(model: str, prompts: list[list[int]], heads: int) -> None:
    p = engine(model, kv_transfer_config=kv_config("kv_producer"))
    d: LLM | None = None
    try:
        want = [list(o.outputs[0].token_ids) for o in p.generate(
            [{"prompt_token_ids": q} for q in prompts], GREEDY, use_tqdm=False)]  # colocated, tp 1
        d = engine(model, tensor_parallel_size=2, kv_transfer_config=kv_config("kv_consumer"))
        lay = d.llm_engine.runner.layout_
        p_cache = p.llm_engine.runner.kv_cache_groups[0]
        local = lay.kv_heads_per_rank(heads)
        for prompt, expect in zip(prompts, want):
            params, _ = prefill(p, prompt)
            p_blocks = params["remote_block_ids"][0]
            p_kv = p_cache[torch.tensor(p_blocks)].clone()  # P holds them until D is done
            out, _, shards, _ = decode(p, d, prompt, params)
            assert list(out.outputs[0].token_ids) == expect
            # Bytes moved = what D stores: each rank its heads of every block P sent.
            copies = max(1, 2 // heads)
            assert out.kv_load_bytes == {"p2p": copies * p_kv.numel() * p_kv.element_size()}
            for rank, shard in enumerate(shards):
                start = lay.kv_head_start(rank, heads)
                assert shard.shape[-2] == local
                # D recomputes the last prompt token itself; every other position came from P.
                for pos in range(len(prompt) - 1):
                    blk, off = pos // BLOCK, pos % BLOCK
                    assert torch.equal(
                        shard[blk, :, :, off], p_kv[blk, :, :, off, start : start + local]
                    ), f"rank {rank}, position {pos} of a {len(prompt)}-token prompt"
    finally:
        if d is not None:
            d.llm_engine.shutdown()
        p.llm_engine.shutdown()


@pytest.mark.matrix("pd-reshard", model="tiny-llama-kv2")
def test_p_tp1_to_d_tp2_splits_kv2_heads_and_matches_colocated(tiny_llama_kv2):
    prompts = [
        [(i * 7919 + 13) % 30000 + 100 for i in range(70)],
        [(i * 31 + 7) % 30000 + 200 for i in range(21)],
    ]
    check(tiny_llama_kv2, prompts, heads=2)


@pytest.mark.matrix("pd-reshard", model="tiny-llama-kv1")
def test_p_tp1_to_d_tp2_replicates_the_kv1_head_and_matches_colocated(tiny_llama_kv1):
    check(tiny_llama_kv1, [[(i * 17 + 3) % 30000 + 300 for i in range(40)]], heads=1)


@pytest.mark.matrix("pd-reshard", model="tiny-llama-kv2")
def test_p_tp1_to_d_tp2_reshards_int8_pages_and_matches_colocated(tiny_llama_kv2):
    """int8 KV (values, then a float32 scale per token and head, in one page): each D rank pulls
    its head's values and scales; tokens equal the colocated int8 engine's and the bytes moved are
    one copy of P's quantized blocks."""
    prompt = [(i * 7919 + 13) % 30000 + 100 for i in range(50)]
    p = engine(tiny_llama_kv2, kv_cache_dtype="int8", kv_transfer_config=kv_config("kv_producer"))
    d: LLM | None = None
    try:
        want = list(
            p.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
        d = engine(tiny_llama_kv2, tensor_parallel_size=2, kv_cache_dtype="int8",
                   kv_transfer_config=kv_config("kv_consumer"))
        params, _ = prefill(p, prompt)
        out, *_ = decode(p, d, prompt, params)
        assert list(out.outputs[0].token_ids) == want
        block_bytes = p.llm_engine.runner.kv_cache_config.block_bytes(0)
        assert out.kv_load_bytes == {"p2p": len(params["remote_block_ids"][0]) * block_bytes}
    finally:
        if d is not None:
            d.llm_engine.shutdown()
        p.llm_engine.shutdown()
