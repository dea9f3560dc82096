"""P/D on tiny-mla (DeepSeek-V3-style MLA, pdkv/model/deepseek.py) through the P2P connector over
tcp: greedy output equals the colocated engine's; D pulls whole latent blocks, bytes = prompt
blocks x layers x block_size x (kv_lora_rank + qk_rope_head_dim) x dtype bytes; a D local prefix
hit pulls only the rest. Re-blocking and producers at tp > 1 are refused on MLA layouts.
Issue 11, acceptance 2 for tiny-mla (P/D part)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import decode, pd_config, prefill, pump, shutdown  # noqa: E402

from pdkv import LLM, SamplingParams  # noqa: E402
from pdkv.kv_transfer.connector.p2p_compat import MLA_KV_LAYOUT, shard_error  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_LENS = (30, 150)
# One block of the MLA group: 4 layers x 16 tokens x (latent 48 + rope 16) x fp32.
BLOCK_BYTES = 4 * BS * (48 + 16) * 4


@pytest.fixture(scope="module")
def engines(tiny_mla):
    """(P, D, prompts, colocated greedy outputs). P chunks its prefill (32 tokens a step)."""
    kw = dict(cpu_linear="torch", num_kv_blocks=32, max_model_len=256, block_size=BS)
    p = LLM(tiny_mla, max_num_batched_tokens=32, **kw,
            kv_transfer_config=pd_config("kv_both", "tcp", kv_lease_duration=600.0))
    d = LLM(tiny_mla, **kw, kv_transfer_config=pd_config("kv_consumer", "tcp"))
    try:
        prompts = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENS]
        refs = [
            o.outputs[0].token_ids
            for o in p.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)
        ]
        yield p, d, prompts, refs
    finally:
        shutdown(p, d)


def idle(*llms: LLM) -> bool:
    return all(
        not e.llm_engine.has_work()
        and all(
            pool.num_free_blocks == pool.num_usable_blocks
            for pool in e.llm_engine.scheduler.kv_cache_manager.block_pools
        )
        for e in llms
    )


@pytest.mark.slow  # loads the model twice
@pytest.mark.matrix("pd-tcp", "hybrid-mla", model="tiny-mla")
def test_pd_matches_colocated_and_moves_the_latent_formula(engines):
    p, d, prompts, refs = engines
    assert p.reset_prefix_cache() and d.reset_prefix_cache()
    stats = d.llm_engine.scheduler.kv_stats
    params = [prefill(p, {"prompt_token_ids": ids}).kv_transfer_params for ids in prompts]
    assert [len(prm["remote_block_ids"]) for prm in params] == [1, 1]  # one KV cache group
    assert params[0]["layout"]["kv_layout"] == MLA_KV_LAYOUT
    before = stats.get("kv_bytes_received", 0.0)
    outs = decode(p, d, [{"prompt_token_ids": ids} for ids in prompts], params, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert (
        stats["kv_bytes_received"] - before == sum(-(-n // BS) for n in PROMPT_LENS) * BLOCK_BYTES
    )
    pump([p, d], lambda: idle(p, d))
    # Again: D hits the 144 tokens it kept, pulls only the last block.
    before = stats["kv_bytes_received"]
    again = prefill(p, {"prompt_token_ids": prompts[1]}).kv_transfer_params
    out = decode(p, d, [{"prompt_token_ids": prompts[1]}], [again], GREEDY)[0]
    assert out.outputs[0].token_ids == refs[1]
    assert (
        out.metrics is not None and out.num_cached_tokens - out.metrics.num_external_tokens == 144
    )
    assert stats["kv_bytes_received"] - before == BLOCK_BYTES
    pump([p, d], lambda: idle(p, d))


def test_reblock_and_multi_rank_producer_are_refused_on_mla():
    layout = {"block_size": 16, "kv_layout": MLA_KV_LAYOUT, "num_kv_heads": 1}
    assert (
        shard_error({**layout, "tp_size": 2, "num_local_kv_heads": 1}, {"layout": layout}, 1) == ""
    )
    msg = shard_error(layout, {"layout": {**layout, "block_size": 32}}, 1)
    assert "block_size=16 differs from the producer's block_size=32 on an MLA model" in msg
    msg = shard_error(layout, {"layout": layout, "tp_size": 2}, 1)
    assert "producer at tp_size=2 on an MLA model is not supported" in msg
