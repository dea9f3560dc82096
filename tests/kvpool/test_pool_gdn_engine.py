"""KVPoolConnector on tiny-gdn (Gated DeltaNet linear state on layers 0 and 2, full attention on 1
and 3): cold then hot (local prefix cache reset) equals the colocated engine; a chunk's pool value
holds its full-attention blocks and one state slot (the checkpoint at the chunk's end), and a hit
of L tokens loads L / bs full-attention blocks and the one slot of position L, whatever L. A load
that fails part-way recomputes from the local hits. Refused without prefix caching. Issue 11,
acceptance 2 (pool) for tiny-gdn."""

from __future__ import annotations

import json

import pytest

from pdkv import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

BS, CHUNK = 16, 32
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_LENS = (45, 70, 20, 64)  # 20: below a chunk; 64: an exact chunk multiple
FULL_BLOCK_BYTES = 2 * 2 * 32 * 2 * 4 * BS  # 2 layers x 2 KV heads x 32 x K/V x fp32 x 16 tokens
SLOT_BYTES = 2 * (256 * 3 + 4 * 32 * 32) * 4  # 2 layers x (conv + recurrent) x fp32
KW = dict(cpu_linear="torch", num_kv_blocks=64, max_model_len=128, block_size=BS)
CFG = json.dumps(
    {
        "kv_connector": "KVPoolConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "chunk_size": CHUNK,
            "tiers": [{"name": "dram", "capacity_bytes": 1 << 26}],
        },
    }
)


@pytest.mark.matrix("pool-dram", "hybrid-linear", model="tiny-gdn")
def test_pool_cold_then_hot_equals_colocated_and_loads_one_slot(tiny_gdn):
    prompts = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENS]
    plain = LLM(tiny_gdn, enable_prefix_caching=False, **KW)
    refs = [
        o.outputs[0].token_ids
        for o in plain.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)
    ]
    plain.llm_engine.shutdown()
    llm = LLM(
        tiny_gdn, max_num_batched_tokens=24, kv_transfer_config=CFG, **KW
    )  # 24: chunk ends mid-step
    try:
        def run():
            return llm.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)

        cold = run()
        assert [o.outputs[0].token_ids for o in cold] == refs
        store = llm.llm_engine.runner.connector.store  # type: ignore[union-attr]
        assert store.flush(30.0)
        totals = store.stats()
        assert totals["pool:dram:chunks_written"] == sum(n // CHUNK for n in PROMPT_LENS)
        per_chunk = totals["pool:dram:bytes_written"] / totals["pool:dram:chunks_written"]
        assert 0 < per_chunk - (CHUNK // BS * FULL_BLOCK_BYTES + SLOT_BYTES) < 512  # + the header
        sched = llm.llm_engine.scheduler
        assert sched.kv_cache_manager.reset_prefix_cache()
        hot = run()
        hits = [(n - 1) // CHUNK * CHUNK for n in PROMPT_LENS]
        assert [o.outputs[0].token_ids for o in hot] == refs
        assert [o.num_cached_tokens for o in hot] == hits
        loaded = [o.kv_load_bytes.get("pool", 0) for o in hot]
        assert loaded == [h // BS * FULL_BLOCK_BYTES + (SLOT_BYTES if h else 0) for h in hits]
        assert all(
            p.num_free_blocks == p.num_usable_blocks for p in sched.kv_cache_manager.block_pools
        )
        # A load failing at its second chunk restarts from the local hits (none here).
        (tier,) = store.tiers
        reads, get = [], tier.get
        tier.get = lambda key: None if reads.append(key) or len(reads) == 2 else get(key)  # type: ignore[method-assign]
        assert sched.kv_cache_manager.reset_prefix_cache()
        again = llm.generate([{"prompt_token_ids": prompts[1]}], GREEDY)
        assert again[0].outputs[0].token_ids == refs[1] and len(reads) == 2
        assert sched.kv_stats["kv_load_failures_recompute"] == 1
        assert all(
            p.num_free_blocks == p.num_usable_blocks for p in sched.kv_cache_manager.block_pools
        )
    finally:
        llm.llm_engine.shutdown()
    with pytest.raises(ValueError, match="needs prefix caching"):
        LLM(tiny_gdn, enable_prefix_caching=False, kv_transfer_config=CFG, **KW)
