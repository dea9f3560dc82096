"""Quantized KV (int8 and fp8 e4m3, per-(token, head) scales in the page) across engines (issue 12,
acceptance 3), on tiny-llama-kv2 (4 layers, 2 KV heads of 32):
- P/D over tcp equals the colocated engine of the same kv_cache_dtype token for token, and D
  receives exactly the page formula's bytes per block (values + scales: 9,216 B against 32,768 B
  in float32, ratio 0.28125);
- a KV pool (DRAM tier) cold == hot == colocated, with whole chunks hit;
- a quantized P into an unquantized D (kv_cache_dtype auto) is converted losslessly: D reads the
  quantized blocks (the same bytes) and stores value × scale, bit for bit P's dequantized KV;
- P (block 16) into D (block 32) of the same dtype re-blocks both planes of the page (values and
  scales) by token position: D's tokens equal the colocated ones;
- an unquantized P into a quantized D is refused naming both values; dequantizing on arrival
  together with re-blocking, re-sharding or DCP is refused naming why; the pool namespace
  differs per dtype. (Quantized re-sharding P tp 1 -> D tp 2: tests/parallel/test_pd_reshard.py.)"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import decode, pd_config, prefill, pump, shutdown  # noqa: E402

from pdkv import LLM, SamplingParams  # noqa: E402
from pdkv.cache.kv_layout import KVLayout
from pdkv.kv_transfer.connector.p2p_compat import quantized_conversion_error  # noqa: E402
from pdkv.kvpool.keys import PoolNamespace  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

BS, LAYERS, HEADS, HEAD = 16, 4, 2, 32
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_LENS = (40, 97)
CHUNK = 32
# One block: per layer 1-byte K and V values, then a float32 scale per (token, head) for K and V.
BLOCK_BYTES = LAYERS * (2 * BS * HEADS * HEAD + 2 * BS * HEADS * 4)
FP32_BLOCK_BYTES = LAYERS * 2 * BS * HEADS * HEAD * 4


def pool_config() -> str:
    return json.dumps(
        {
            "kv_connector": "KVPoolConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "chunk_size": CHUNK,
                "tiers": [{"name": "dram", "capacity_bytes": 1 << 26}],
            },
        }
    )


@pytest.fixture(scope="module", params=["int8", "fp8"])
def engines(request, tiny_llama_kv2):
    """(kv_cache_dtype, P, D, pool engine, prompts, colocated greedy outputs of P)."""
    kw = dict(
        cpu_linear="torch",
        num_kv_blocks=48,
        max_model_len=256,
        block_size=BS,
        kv_cache_dtype=request.param,
    )
    p = LLM(
        tiny_llama_kv2,
        **kw,
        kv_transfer_config=pd_config("kv_both", "tcp", kv_lease_duration=600.0),
    )
    d = LLM(tiny_llama_kv2, **kw, kv_transfer_config=pd_config("kv_consumer", "tcp"))
    pool = LLM(tiny_llama_kv2, **kw, kv_transfer_config=pool_config())
    d_auto = LLM(
        tiny_llama_kv2,
        **{**kw, "kv_cache_dtype": "auto"},
        kv_transfer_config=pd_config("kv_consumer", "tcp"),
    )
    try:
        prompts = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENS]
        refs = [
            o.outputs[0].token_ids
            for o in p.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)
        ]
        yield request.param, p, d, pool, prompts, refs, d_auto
    finally:
        shutdown(p, d, pool, d_auto)


def idle(*llms: LLM) -> bool:
    return all(
        not e.llm_engine.has_work()
        and e.llm_engine.scheduler.kv_cache_manager.num_free_blocks
        == e.llm_engine.scheduler.num_blocks
        for e in llms
    )


@pytest.mark.matrix("quantized-kv", model="tiny-llama-kv2")
def test_pd_equals_colocated_and_moves_the_quantized_page_bytes(engines):
    dtype, p, d, _, prompts, refs, _ = engines
    assert p.llm_engine.runner.kv_cache_config.block_bytes(0) == BLOCK_BYTES
    assert (
        p.llm_engine.executor.kv_layout.kv_cache_dtype == {"int8": "int8", "fp8": "fp8_e4m3"}[dtype]
    )
    assert p.reset_prefix_cache() and d.reset_prefix_cache()
    stats = d.llm_engine.scheduler.kv_stats
    params = [prefill(p, {"prompt_token_ids": ids}).kv_transfer_params for ids in prompts]
    before = stats.get("kv_bytes_received", 0.0)
    outs = decode(p, d, [{"prompt_token_ids": ids} for ids in prompts], params, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    blocks = sum(-(-n // BS) for n in PROMPT_LENS)
    assert stats["kv_bytes_received"] - before == blocks * BLOCK_BYTES
    assert BLOCK_BYTES / FP32_BLOCK_BYTES == 0.28125  # (D + 4) / (4 D) with D = 32
    pump([p, d], lambda: idle(p, d))
    # A producer whose KV is stored in another dtype is refused before any byte moves.
    other = {**params[0], "layout": {**params[0]["layout"], "kv_cache_dtype": "auto"}}
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype: producer='auto' consumer='(int8|fp8_e4m3)'"
    ):
        d.llm_engine.make_request(
            {"prompt_token_ids": prompts[0]}, GREEDY, kv_transfer_params=other
        )


@pytest.mark.matrix("quantized-kv", model="tiny-llama-kv2")
def test_pool_cold_equals_hot_equals_colocated(engines):
    _, _, _, pool, prompts, refs, _ = engines
    run = lambda: pool.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)  # noqa: E731
    cold = run()
    assert [o.outputs[0].token_ids for o in cold] == refs
    assert pool.llm_engine.runner.connector.store.flush(30.0)  # type: ignore[union-attr]
    assert pool.reset_prefix_cache()
    hot = run()
    assert [o.outputs[0].token_ids for o in hot] == refs
    assert [o.num_cached_tokens for o in hot] == [(n - 1) // CHUNK * CHUNK for n in PROMPT_LENS]


def test_conversions_of_quantized_pages_are_refused_and_pool_namespaces_differ(engines):
    dtype, p, *_ = engines
    runner = p.llm_engine.runner
    mine = runner.kv_layout.to_wire()
    assert quantized_conversion_error(mine, {"layout": mine}) == ""
    # Equal dtypes: re-blocking and re-sharding convert (both planes of the page are planned).
    assert quantized_conversion_error(mine, {"layout": {**mine, "block_size": 32}}) == ""
    assert (
        quantized_conversion_error(
            {**mine, "tp_size": 2, "num_local_kv_heads": 1}, {"layout": mine}
        )
        == ""
    )
    auto = {**mine, "kv_cache_dtype": "auto"}
    assert (
        quantized_conversion_error(auto, {"layout": {**auto, "block_size": 32}}) == ""
    )  # not quantized
    # Dequantizing on arrival takes whole blocks only: not with re-blocking, re-sharding or into
    # DCP.
    msg = quantized_conversion_error(auto, {"layout": {**mine, "block_size": 32}})
    assert (
        "block_size=16" in msg
        and "block_size=32" in msg
        and "re-blocking while dequantizing" in msg
    )
    msg = quantized_conversion_error(
        {**auto, "tp_size": 2, "num_local_kv_heads": 1}, {"layout": mine}
    )
    assert "re-sharding while dequantizing" in msg and "tp_size=2" in msg
    assert "DCP" in quantized_conversion_error({**auto, "dcp_size": 2}, {"layout": mine})
    quant = PoolNamespace.from_layout(KVLayout.from_wire(mine), runner.kv_cache_config, CHUNK)
    plain_cfg = runner.kv_cache_config.__class__(
        runner.kv_cache_config.num_blocks,
        tuple(
            g.__class__(
                g.layer_indices, g.spec.__class__(**{**g.spec.__dict__, "cache_dtype": "auto"})
            )
            for g in runner.kv_cache_config.groups
        ),
    )
    plain_layout = KVLayout.from_wire({**mine, "kv_cache_dtype": "auto", "kv_quant": ""})
    plain = PoolNamespace.from_layout(plain_layout, plain_cfg, CHUNK)
    assert quant.kv_quant.startswith(mine["kv_cache_dtype"]) and plain.kv_quant == ""
    assert quant.fingerprint != plain.fingerprint


@pytest.mark.matrix("quantized-kv", model="tiny-llama-kv2")
def test_cpu_offload_brings_quantized_blocks_back(engines, tiny_llama_kv2):
    """An engine of 7 blocks runs prompts A (40 tokens), B (97), A, B: B evicts A's blocks to
    the host and A's return loads them back (and vice versa); outputs equal the colocated ones,
    and each host copy is one quantized block (values + scales)."""
    dtype, _, _, _, prompts, refs, _ = engines
    cfg = json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": 1 << 24,
                "eviction_mode": "save_on_evict",
            },
        }
    )
    llm = LLM(tiny_llama_kv2, cpu_linear="torch", num_kv_blocks=7, max_model_len=112, block_size=BS,
              kv_cache_dtype=dtype, kv_transfer_config=cfg)
    try:
        outs = [llm.generate([{"prompt_token_ids": prompts[i]}], GREEDY)[0] for i in (0, 1, 0, 1)]
        assert [o.outputs[0].token_ids for o in outs] == [refs[0], refs[1], refs[0], refs[1]]
        stats = llm.llm_engine.scheduler.kv_stats
        assert stats["offload:hits"] > 0
        assert stats["offload:bytes_h2d"] == stats["offload:copies_h2d"] * BLOCK_BYTES
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.matrix("quantized-kv", model="tiny-llama-kv2")
def test_quantized_producer_into_an_unquantized_decode_is_dequantized_on_arrival(engines):
    import torch

    from pdkv.block_hashing import hash_request_tokens
    from pdkv.model.kv_quant import dequantize

    dtype, p, _, _, prompts, _, d_auto = engines
    ids = prompts[1]
    assert p.reset_prefix_cache() and d_auto.reset_prefix_cache()
    stats = d_auto.llm_engine.scheduler.kv_stats
    before = stats.get("kv_bytes_received", 0.0)
    params = prefill(p, {"prompt_token_ids": ids}).kv_transfer_params
    out = decode(p, d_auto, [{"prompt_token_ids": ids}], [params], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert (
        stats["kv_bytes_received"] - before == -(-len(ids) // BS) * BLOCK_BYTES
    )  # quantized bytes moved
    # Every full prompt block D cached holds exactly P's values x scales, in float32.
    cached = 0
    for h in hash_request_tokens(ids, BS):
        pb = p.llm_engine.scheduler.kv_cache_manager.block_pools[0].get_cached_block(h)
        db = d_auto.llm_engine.scheduler.kv_cache_manager.block_pools[0].get_cached_block(h)
        if pb is None or db is None:
            continue
        cached += 1
        p_caches = p.llm_engine.runner.kv_caches
        for layer, d_layer in enumerate(d_auto.llm_engine.runner.kv_caches):
            q = p_caches[layer]
            want = dequantize(
                q.data[:, pb.block_id], q.scales[:, pb.block_id], q.cache_dtype, torch.float32
            )
            assert torch.equal(d_layer[:, db.block_id], want)
    assert cached == len(ids) // BS
    pump([p, d_auto], lambda: idle(p, d_auto))


@pytest.mark.matrix("quantized-kv", model="tiny-llama-kv2")
def test_reblocked_quantized_pd_equals_colocated(engines, tiny_llama_kv2):
    """P (block 16) -> D (block 32), both `dtype`: D maps values and scales rows by token
    position; tokens equal the colocated engine's, and D receives each prompt token's rows of
    both planes, every layer (all but the part D recomputes: here nothing, a fresh D)."""
    dtype, p, _, _, prompts, refs, _ = engines
    d32 = LLM(
        tiny_llama_kv2,
        cpu_linear="torch",
        num_kv_blocks=24,
        max_model_len=256,
        block_size=32,
        kv_cache_dtype=dtype,
        kv_transfer_config=pd_config("kv_consumer", "tcp"),
    )
    try:
        assert p.reset_prefix_cache()
        stats = d32.llm_engine.scheduler.kv_stats
        params = [prefill(p, {"prompt_token_ids": ids}).kv_transfer_params for ids in prompts]
        before = stats.get("kv_bytes_received", 0.0)
        outs = decode(p, d32, [{"prompt_token_ids": ids} for ids in prompts], params, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == refs
        token_bytes = (
            LAYERS * 2 * HEADS * (HEAD + 4)
        )  # values + one float32 scale per head, K and V
        assert stats["kv_bytes_received"] - before == sum(PROMPT_LENS) * token_bytes
        pump([p, d32], lambda: idle(p, d32))
    finally:
        shutdown(d32)
