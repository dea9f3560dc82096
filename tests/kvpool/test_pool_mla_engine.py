"""KVPoolConnector on tiny-mla (DeepSeek-V3-style MLA): cold then hot (local prefix cache
reset) equals the colocated engine; the hot run's hits come from the pool and load whole latent
blocks, bytes = hit blocks x layers x block_size x (kv_lora_rank + qk_rope_head_dim) x dtype
bytes; each stored chunk is that many bytes plus its header. Issue 11, acceptance 2 (pool) for
tiny-mla."""

from __future__ import annotations

import json

import pytest

from pdkv import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

BS, CHUNK = 16, 32
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_LENS = (100, 30)  # 30: below a chunk
# One block of the MLA group: 4 layers x 16 tokens x (latent 48 + rope 16) x fp32.
BLOCK_BYTES = 4 * BS * (48 + 16) * 4
KW = dict(cpu_linear="torch", num_kv_blocks=32, max_model_len=256, block_size=BS)


@pytest.mark.matrix("pool-dram", "hybrid-mla", model="tiny-mla")
def test_pool_cold_then_hot_equals_colocated_and_loads_the_latent_formula(tiny_mla):
    prompts = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENS]
    cfg = json.dumps(
        {
            "kv_connector": "KVPoolConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "chunk_size": CHUNK,
                "tiers": [{"name": "dram", "capacity_bytes": 1 << 26}],
            },
        }
    )
    llm = LLM(tiny_mla, max_num_batched_tokens=32, kv_transfer_config=cfg, **KW)
    try:
        def run():
            return llm.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)

        plain = LLM(tiny_mla, **KW)
        refs = [
            o.outputs[0].token_ids
            for o in plain.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)
        ]
        plain.llm_engine.shutdown()
        cold = run()
        assert [o.outputs[0].token_ids for o in cold] == refs
        store = llm.llm_engine.runner.connector.store  # type: ignore[union-attr]
        assert store.flush(30.0)
        totals = store.stats()
        assert totals["pool:dram:chunks_written"] == sum(n // CHUNK for n in PROMPT_LENS)
        per_chunk = totals["pool:dram:bytes_written"] / totals["pool:dram:chunks_written"]
        assert 0 < per_chunk - CHUNK // BS * BLOCK_BYTES < 512  # + the value's header
        assert llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
        hot = run()
        hits = [(n - 1) // CHUNK * CHUNK for n in PROMPT_LENS]
        assert [o.outputs[0].token_ids for o in hot] == refs
        assert [o.num_cached_tokens for o in hot] == hits == [96, 0]
        assert [o.kv_load_bytes.get("pool", 0) for o in hot] == [
            h // BS * BLOCK_BYTES for h in hits
        ]
        pools = llm.llm_engine.scheduler.kv_cache_manager.block_pools
        assert all(p.num_free_blocks == p.num_usable_blocks for p in pools)
    finally:
        llm.llm_engine.shutdown()
