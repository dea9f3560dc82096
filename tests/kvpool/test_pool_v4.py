"""KVPoolConnector (DRAM and disk tiers) on tiny-v4 (DeepSeek-V4): cold then hot (local prefix
cache reset) equals the colocated engine (issue 33, step 3). A chunk carries every V4 group's
state at its end: the window blocks of its boundary, the compressed-KV and indexer-key blocks,
and the compressor state checkpoint of its last block; with block size 8 and 8-token chunks,
chunk ends at 24, 40 and 56 fall inside the rate-16 windows (8 tokens pending) and the state
stored with them restores them. A hot hit of L tokens loads (kv_load_bytes "pool") the
per-group formula."""

from __future__ import annotations

import json

import pytest

from pdkv import LLM, SamplingParams
from pdkv.cache.specs import window_first_block

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_LENS = (45, 70, 20, 64, 40)
WINDOW, D, C = 24, 32, 32
STATE_SLOT = 3 * (2 * 4 * 2 * D + 2 * 4 * D + 2 * 4 * 2 * C + 2 * 4 * C) * 4


def loaded_bytes(hit: int, bs: int) -> int:
    """Bytes a pool hit of `hit` tokens loads: the window blocks of that boundary, every block
    of the compressed groups, one state slot (fp32)."""
    if hit == 0:
        return 0
    blocks = hit // bs
    window = (blocks - window_first_block(hit, bs, WINDOW)) * 4 * bs * D * 4  # K = V: one plane
    compressed = blocks * (2 * (bs // 4) * D + max(1, bs // 16) * D + 2 * (bs // 4) * C) * 4
    return window + compressed + STATE_SLOT


@pytest.mark.parametrize("tier, bs, chunk", [
    pytest.param("dram", 16, 32, id="dram-bs16-chunk32",
                 marks=pytest.mark.matrix("pool-dram", model="tiny-v4")),
    pytest.param("disk", 16, 32, id="disk-bs16-chunk32",
                 marks=pytest.mark.matrix("pool-disk", "hybrid-v4", model="tiny-v4")),
    pytest.param("disk", 8, 8, id="disk-bs8-chunk8",
                 marks=pytest.mark.matrix("pool-disk", "hybrid-v4", model="tiny-v4"))])
def test_pool_cold_then_hot_equals_colocated(tiny_v4, tmp_path, tier, bs, chunk):
    kw = dict(num_kv_blocks=64, max_model_len=128, block_size=bs)
    prompts = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENS]
    plain = LLM(tiny_v4, enable_prefix_caching=False, **kw)
    refs = [o.outputs[0].token_ids
            for o in plain.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)]
    plain.llm_engine.shutdown()
    cfg = json.dumps({"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"chunk_size": chunk, "tiers": [
                          {"name": tier, "capacity_bytes": 1 << 27}
                          | ({"path": str(tmp_path)} if tier == "disk" else {})]}})
    llm = LLM(tiny_v4, max_num_batched_tokens=24, kv_transfer_config=cfg, **kw)
    try:
        def run():
            return llm.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)

        assert [o.outputs[0].token_ids for o in run()] == refs  # cold: stores chunks
        assert llm.llm_engine.runner.connector.store.flush(30.0)  # type: ignore[union-attr]
        sched = llm.llm_engine.scheduler
        assert sched.kv_cache_manager.reset_prefix_cache()
        hot = run()
        hits = [(n - 1) // chunk * chunk for n in PROMPT_LENS]
        assert [o.outputs[0].token_ids for o in hot] == refs
        assert [o.num_cached_tokens for o in hot] == hits
        if bs == 8:
            assert any(h % 16 for h in hits)  # some hit ends inside a rate-16 window
        assert [o.kv_load_bytes.get("pool", 0) for o in hot] == [loaded_bytes(h, bs)
                                                                 for h in hits]
        assert all(p.num_free_blocks == p.num_usable_blocks
                   for p in sched.kv_cache_manager.block_pools)
    finally:
        llm.llm_engine.shutdown()
