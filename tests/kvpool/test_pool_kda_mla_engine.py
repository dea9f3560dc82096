"""KVPoolConnector on tiny-kda-mla (KDA linear state + MLA latents): cold then hot (local prefix
cache reset) equals the colocated engine, and a hit of L tokens loads L / bs MLA blocks and the
one KDA slot of position L. Issue 11, acceptance 2 (pool) for tiny-kda-mla."""

from __future__ import annotations

import json

import pytest

from pdkv import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

BS, CHUNK = 16, 32
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_LENS = (45, 70, 20)
MLA_BLOCK_BYTES = 2 * BS * (48 + 16) * 4  # 2 MLA layers x 16 tokens x (latent 48 + key 16) x fp32
SLOT_BYTES = 2 * (576 + 2048) * 4  # 2 KDA layers x (conv 3 x 64 x 3 + recurrent 2 x 32 x 32) x fp32
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


@pytest.mark.matrix("pool-dram", "hybrid-mla", "hybrid-linear", model="tiny-kda-mla")
def test_pool_cold_then_hot_equals_colocated(tiny_kda_mla):
    prompts = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENS]
    plain = LLM(tiny_kda_mla, enable_prefix_caching=False, **KW)
    refs = [
        o.outputs[0].token_ids
        for o in plain.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)
    ]
    plain.llm_engine.shutdown()
    llm = LLM(tiny_kda_mla, max_num_batched_tokens=24, kv_transfer_config=CFG, **KW)
    try:
        def run():
            return llm.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)

        assert [o.outputs[0].token_ids for o in run()] == refs
        assert llm.llm_engine.runner.connector.store.flush(30.0)  # type: ignore[union-attr]
        sched = llm.llm_engine.scheduler
        assert sched.kv_cache_manager.reset_prefix_cache()
        hot = run()
        hits = [(n - 1) // CHUNK * CHUNK for n in PROMPT_LENS]
        assert [o.outputs[0].token_ids for o in hot] == refs
        assert [o.num_cached_tokens for o in hot] == hits
        loaded = [o.kv_load_bytes.get("pool", 0) for o in hot]
        assert loaded == [h // BS * MLA_BLOCK_BYTES + (SLOT_BYTES if h else 0) for h in hits]
        assert all(
            p.num_free_blocks == p.num_usable_blocks for p in sched.kv_cache_manager.block_pools
        )
    finally:
        llm.llm_engine.shutdown()
