"""KVPoolConnector on tiny-swa (sliding window 40 on layers 0 and 2, full attention on 1 and 3):
cold then hot (local prefix cache reset) equals the colocated engine; the hot run's hits come
from the pool, and a hit of L tokens loads every full-attention block of it but only the
window-group blocks of tokens L - W + 1 .. L - 1. Chunk 32 < W - 1 reaches back a chunk for the
window; chunk 64 > W - 1 stores only each chunk's tail window. A load that fails part-way
recomputes from the local hits. Issue 11, acceptance 2 (pool)."""

from __future__ import annotations

import json

import pytest

from pdkv import LLM, SamplingParams

pytestmark = pytest.mark.slow

BS, W = 16, 40
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_LENS = (200, 30, 100)  # 30: below the window and below a chunk
# One block of one group (2 layers x K/V x 16 tokens x 2 KV heads x head dim 32 x fp32).
BLOCK_BYTES = 2 * 2 * BS * 2 * 32 * 4
KW = dict(cpu_linear="torch", num_kv_blocks=64, max_model_len=256, block_size=BS)


def window_blocks(hit: int) -> int:
    """Window-group blocks loaded for a pool hit of `hit` tokens over no local hit: those holding
    tokens hit - W + 1 .. hit - 1 (at most ceil((W - 1) / BS) + 1)."""
    return hit // BS - max(0, hit - W + 1) // BS


@pytest.fixture(scope="module")
def prompts_and_refs(tiny_swa):
    plain = LLM(tiny_swa, **KW)
    prompts = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENS]
    refs = [
        o.outputs[0].token_ids
        for o in plain.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)
    ]
    plain.llm_engine.shutdown()
    return prompts, refs


@pytest.mark.parametrize(("tier", "chunk"), [
    pytest.param("dram", 32, marks=pytest.mark.matrix("pool-dram", model="tiny-swa")),
    pytest.param("dram", 64, marks=pytest.mark.matrix("pool-dram", model="tiny-swa")),
    pytest.param("disk", 64, marks=pytest.mark.matrix("pool-disk", model="tiny-swa"))])
def test_pool_cold_then_hot_equals_colocated_and_loads_only_the_window(
    tiny_swa, prompts_and_refs, tier, chunk, tmp_path
):
    prompts, refs = prompts_and_refs
    spec = {
        "name": tier,
        "capacity_bytes": 1 << 28,
        **({"path": str(tmp_path)} if tier == "disk" else {}),
    }
    cfg = json.dumps(
        {
            "kv_connector": "KVPoolConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_size": chunk, "tiers": [spec]},
        }
    )
    llm = LLM(
        tiny_swa, max_num_batched_tokens=32, kv_transfer_config=cfg, **KW
    )  # prefill in 32-token steps
    try:
        def run():
            return llm.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)

        cold = run()
        assert [o.outputs[0].token_ids for o in cold] == refs
        assert [o.num_cached_tokens for o in cold] == [0, 0, 0]
        store = llm.llm_engine.runner.connector.store  # type: ignore[union-attr]
        assert store.flush(30.0)
        totals = store.stats()
        stored = chunk // BS - max(0, chunk - W + 1) // BS  # window blocks per chunk value
        assert totals[f"pool:{tier}:chunks_written"] == sum(n // chunk for n in PROMPT_LENS)
        per_chunk = totals[f"pool:{tier}:bytes_written"] / totals[f"pool:{tier}:chunks_written"]
        assert 0 < per_chunk - (chunk // BS + stored) * BLOCK_BYTES < 512  # + the value's header
        assert llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
        hot = run()
        hits = [(n - 1) // chunk * chunk for n in PROMPT_LENS]
        assert [o.outputs[0].token_ids for o in hot] == refs
        assert [o.num_cached_tokens for o in hot] == hits
        stats = llm.llm_engine.scheduler.kv_stats
        assert stats["pool:all:hit_tokens"] == sum(hits)
        assert stats[f"pool:{tier}:chunks_read"] == sum(h // chunk for h in hits)
        loaded = [o.kv_load_bytes.get("pool", 0) for o in hot]
        assert loaded == [(h // BS + window_blocks(h)) * BLOCK_BYTES for h in hits]
        assert max(window_blocks(h) for h in hits) <= -(-(W - 1) // BS) + 1
        sched = llm.llm_engine.scheduler
        assert all(
            p.num_free_blocks == p.num_usable_blocks for p in sched.kv_cache_manager.block_pools
        )
        if (
            chunk == 32
        ):  # a load failing at its third chunk restarts from the local hits (none here)
            (pool_tier,) = store.tiers
            reads, get = [], pool_tier.get
            pool_tier.get = lambda key: None if reads.append(key) or len(reads) == 3 else get(key)  # type: ignore[method-assign]
            assert sched.kv_cache_manager.reset_prefix_cache()
            again = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)
            assert again[0].outputs[0].token_ids == refs[0] and len(reads) == 3
            assert stats["kv_load_failures_recompute"] == 1
            assert all(
                p.num_free_blocks == p.num_usable_blocks for p in sched.kv_cache_manager.block_pools
            )
    finally:
        llm.llm_engine.shutdown()
