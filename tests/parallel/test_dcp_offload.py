"""CPU offload (OffloadingConnector) on engines with worker processes: DCP 2 (replicated weights
at tp 1; vLLM mode at tp 2) and TP 2. The scheduler half stays in the engine process, on logical
blocks; each rank's worker half copies its own shard of an evicted block to its own host buffer
and back. A KV cache of 128 tokens cannot keep prompt A while prompt B runs, so A's blocks go to
the host; A sent again gets them back from there, with the single-rank engine's greedy tokens.
Each rank copies exactly its shard: its bytes = copies x (layers x 2 x tokens per rank block x
its KV heads x head size x 4 B), half of a whole logical block's KV in every case here.

Issue 31 (CPU offload of each rank's shard, per-rank metrics)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdkv import LLM, SamplingParams
from pdkv.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, ParallelConfig

BLOCK = 16
LAYERS, HEAD_SIZE, FP32 = 4, 32, 4  # tiny-llama-kv1 / -kv2 (pdkv/model/tiny.py)
MAX_LEN = 128  # the whole KV cache: 4 logical blocks of 32 tokens at dcp 2, 8 of 16 at dcp 1
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# A (90 tokens + 8 generated) fills the cache; B (100 + 8) evicts A's cached blocks; A again.
SEQUENCE = ("A", "B", "A")
PROMPTS = {name: [(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)]
           for name, n in (("A", 90), ("B", 100))}
OFFLOAD = json.dumps({
    "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 20, "eviction_mode": "save_on_evict"},
})

CASES = [  # model, parallel settings, world size, logical block tokens, KV heads: model / rank
    pytest.param("kv2", {"decode_context_parallel_size": 2}, 2, 2 * BLOCK, 2, 2,
                 id="kv2-dcp2-replicated",
                 marks=pytest.mark.matrix("dcp-offload", model="tiny-llama-kv2")),
    pytest.param("kv1", {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}, 2,
                 2 * BLOCK, 1, 1, id="kv1-tp2-dcp2",
                 marks=pytest.mark.matrix("dcp-offload", model="tiny-llama-kv1")),
    pytest.param("kv2", {"tensor_parallel_size": 2}, 2, BLOCK, 2, 1, id="kv2-tp2",
                 marks=pytest.mark.matrix("tp-offload", model="tiny-llama-kv2")),
]


def engine(model: str, **kw: Any) -> LLM:
    return LLM(model, cpu_linear="torch", block_size=BLOCK, max_model_len=MAX_LEN, **kw)


def run(llm: LLM, name: str) -> Any:
    return llm.generate([{"prompt_token_ids": PROMPTS[name]}], GREEDY, use_tqdm=False)[0]


_REFERENCE: dict[str, list[list[int]]] = {}


def reference(model: str) -> list[list[int]]:
    """The single-rank engine's greedy tokens of SEQUENCE (no offload, a cache that holds all)."""
    if model not in _REFERENCE:
        llm = engine(model, num_kv_blocks=64)
        try:
            _REFERENCE[model] = [list(run(llm, n).outputs[0].token_ids) for n in SEQUENCE]
        finally:
            llm.llm_engine.shutdown()
    return _REFERENCE[model]


def test_every_connector_is_accepted_with_worker_processes():
    def config(connector: str, extra: dict[str, object]) -> EngineConfig:
        return EngineConfig(
            ModelConfig(model="m", path="/m"), CacheConfig(block_size=BLOCK),
            parallel_config=ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2,
                                           cp_kv_cache_interleave_size=BLOCK),
            kv_transfer_config=KVTransferConfig(connector, "kv_both",
                                                kv_connector_extra_config=extra))

    for name in ("OffloadingConnector", "KVPoolConnector", "P2PConnector"):
        config(name, {})
    config("MultiConnector", {"connectors": [{"kv_connector": "KVPoolConnector"},
                                             {"kv_connector": "P2PConnector"}]})


@pytest.mark.slow  # worker processes
@pytest.mark.parametrize("which,kw,world,logical_tokens,kv_heads,rank_kv_heads", CASES)
def test_evicted_shards_come_back_from_each_rank_host(
    which, kw, world, logical_tokens, kv_heads, rank_kv_heads, tiny_llama_kv1, tiny_llama_kv2
):
    model = tiny_llama_kv1 if which == "kv1" else tiny_llama_kv2
    want = reference(model)
    if kw.get("decode_context_parallel_size", 1) > 1:
        kw = dict(kw, cp_kv_cache_interleave_size=BLOCK)  # a KV connector needs I = block size
    llm = engine(model, num_kv_blocks=MAX_LEN // logical_tokens, kv_transfer_config=OFFLOAD, **kw)
    eng = llm.llm_engine
    try:
        assert eng.connector is not None and eng.connector.scheduler is not None
        evictions: list[bytes] = []
        hook = eng.connector.scheduler.on_evict

        def on_evict(group: int, block_hash: bytes, block_id: int) -> None:
            evictions.append(block_hash)
            hook(group, block_hash, block_id)

        eng.scheduler.kv_cache_manager.set_eviction_hook(on_evict)
        outs = [run(llm, n) for n in SEQUENCE]
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        # A again: all its whole logical blocks before the last token are back (device + host).
        whole = (len(PROMPTS["A"]) - 1) // logical_tokens * logical_tokens
        assert outs[2].num_cached_tokens == whole
        stats = eng.scheduler.kv_stats
        hits = stats["offload:hits"]
        assert hits > 0 and evictions, "the workload must evict to the host and load back"
        # KV bytes of one whole logical block (every rank's share) and of one rank's share.
        logical_bytes = LAYERS * 2 * logical_tokens * kv_heads * HEAD_SIZE * FP32
        rank_bytes = LAYERS * 2 * BLOCK * rank_kv_heads * HEAD_SIZE * FP32
        assert 2 * rank_bytes == logical_bytes  # a DCP rank: half the tokens; a TP rank: heads
        for r in range(world):
            assert stats[f"offload:rank{r}:copies_d2h"] == len(evictions), r  # save_on_evict
            assert stats[f"offload:rank{r}:bytes_d2h"] == len(evictions) * rank_bytes, r
            assert stats[f"offload:rank{r}:copies_h2d"] == hits, r
            assert stats[f"offload:rank{r}:bytes_h2d"] == hits * rank_bytes, r
        # The engine-wide series: the sum over ranks.
        assert stats["offload:bytes_d2h"] == world * len(evictions) * rank_bytes
        assert stats["offload:bytes_h2d"] == world * hits * rank_bytes
        assert stats["offload:copies_h2d"] == world * hits
        for pool in eng.scheduler.kv_cache_manager.block_pools:
            assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
        assert all(i.num_pinned == 0 for i in eng.connector.scheduler.indexes)
        assert not eng.has_unfinished_requests()
    finally:
        eng.shutdown()
