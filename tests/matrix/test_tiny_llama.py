"""The matrix's `tiny-llama` row: a random 2-layer Llama through each feature that runs on any
Llama today; greedy output equals HF transformers' and every block returns to baseline.
Small and fast (no SmolLM2 weights): these are the cells `pdkv matrix --quick` runs."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kv_transfer"))
from pd_utils import decode, free_blocks, pd_config, prefill, settle, shutdown  # noqa: E402
from tiny_model import TINY_NEW_TOKENS  # noqa: E402

from pdkv import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=TINY_NEW_TOKENS, ignore_eos=True)
BLOCK = 16


def tiny(path: str, **kw: Any) -> LLM:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_model_len", 128)
    return LLM(path, cpu_linear="torch", **kw)


def run(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)


def tokens(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_baseline(llm: LLM) -> None:
    """Every block of every group free, ref counts 0, no request left."""
    engine = llm.llm_engine
    for pool in engine.scheduler.kv_cache_manager.block_pools:
        assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
        assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not engine.has_unfinished_requests()


@pytest.mark.matrix("colocated", model="tiny-llama")
def test_batch_matches_hf(tiny_llama, tiny_prompts, tiny_reference):
    llm = tiny(tiny_llama)
    assert tokens(run(llm, tiny_prompts)) == tiny_reference
    assert_baseline(llm)


@pytest.mark.matrix("prefix-caching", model="tiny-llama")
def test_resent_prompts_hit_whole_blocks(tiny_llama, tiny_prompts, tiny_reference):
    llm = tiny(tiny_llama)
    run(llm, tiny_prompts)
    again = run(llm, tiny_prompts)
    assert tokens(again) == tiny_reference
    assert [o.num_cached_tokens for o in again] == [
        (len(p) - 1) // BLOCK * BLOCK for p in tiny_prompts
    ]
    assert_baseline(llm)


@pytest.mark.matrix("chunked-prefill", model="tiny-llama")
def test_chunked_prefill_matches_hf(tiny_llama, tiny_prompts, tiny_reference):
    llm = tiny(tiny_llama, max_num_batched_tokens=8)  # the 50-token prompt takes several steps
    assert tokens(run(llm, tiny_prompts)) == tiny_reference
    assert_baseline(llm)


@pytest.mark.matrix("preemption", model="tiny-llama")
def test_preemption_matches_hf(tiny_llama, tiny_prompts, tiny_reference):
    llm = tiny(tiny_llama, num_kv_blocks=4, max_model_len=64)  # 64 tokens of KV for ~190 wanted
    assert tokens(run(llm, tiny_prompts)) == tiny_reference
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_baseline(llm)


@pytest.mark.parametrize("transfer", [
    pytest.param("tcp", marks=pytest.mark.matrix("pd-tcp", model="tiny-llama")),
    pytest.param("shm", marks=pytest.mark.matrix("pd-shm", model="tiny-llama")),
])
def test_pd_matches_hf(transfer, tiny_llama, tiny_prompts, tiny_reference):
    p = tiny(
        tiny_llama, kv_transfer_config=pd_config("kv_producer", transfer, kv_lease_duration=600.0)
    )
    d = tiny(tiny_llama, enable_prefix_caching=False,
             kv_transfer_config=pd_config("kv_consumer", transfer))
    try:
        start_p, start_d = free_blocks(p), free_blocks(d)
        prompts = [{"prompt_token_ids": ids} for ids in tiny_prompts]
        params = [prefill(p, pr).kv_transfer_params for pr in prompts]
        outs = decode(p, d, prompts, params, GREEDY)
        assert tokens(outs) == tiny_reference
        assert [o.num_cached_tokens for o in outs] == [len(ids) - 1 for ids in tiny_prompts]
        settle(p, d)
        assert free_blocks(p) == start_p and free_blocks(d) == start_d
    finally:
        shutdown(p, d)


@pytest.mark.parametrize("tier", [
    pytest.param("dram", marks=pytest.mark.matrix("pool-dram", model="tiny-llama")),
    pytest.param("disk", marks=pytest.mark.matrix("pool-disk", model="tiny-llama")),
])
def test_pool_cold_then_hot_matches_hf(tier, tmp_path, tiny_llama, tiny_prompts, tiny_reference):
    spec: dict[str, Any] = {"name": tier, "capacity_bytes": 1 << 26}
    if tier == "disk":
        spec["path"] = str(tmp_path)
    cfg = json.dumps({"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"chunk_size": BLOCK, "tiers": [spec]}})
    llm = tiny(tiny_llama, kv_transfer_config=cfg)
    assert tokens(run(llm, tiny_prompts)) == tiny_reference
    assert llm.llm_engine.runner.connector.store.flush(30.0)  # type: ignore[union-attr]
    assert llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
    hot = run(llm, tiny_prompts)
    assert tokens(hot) == tiny_reference
    want = [(len(p) - 1) // BLOCK * BLOCK for p in tiny_prompts]
    assert [o.num_cached_tokens for o in hot] == want
    assert llm.llm_engine.scheduler.kv_stats["pool:all:hit_tokens"] == sum(want)
    assert_baseline(llm)
    llm.llm_engine.shutdown()


@pytest.mark.matrix("offload", model="tiny-llama")
def test_offloaded_blocks_come_back_from_host(tiny_llama, tiny_prompts, tiny_reference):
    cfg = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"cpu_bytes_to_use": 16 << 20,
                                                    "eviction_mode": "save_on_evict"}})
    llm = tiny(tiny_llama, num_kv_blocks=4, max_model_len=64, kv_transfer_config=cfg)
    # One at a time: the 33-token prompt evicts most of the 50-token one's blocks to the host;
    # sent again, the 50-token prompt gets them back (device hits + host hits = 3 blocks).
    order = [4, 3, 4]
    outs = [run(llm, [tiny_prompts[i]])[0] for i in order]
    assert tokens(outs) == [tiny_reference[i] for i in order]
    assert outs[2].num_cached_tokens == (50 - 1) // BLOCK * BLOCK
    assert llm.llm_engine.scheduler.kv_stats["offload:hits"] > 0
    assert_baseline(llm)
    llm.llm_engine.shutdown()
