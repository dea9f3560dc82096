"""P/D with different block sizes (P 16 -> D 32 and P 32 -> D 16) through the P2P connector over
tcp: the connector maps KV by absolute token position (pdkv/kv_transfer/reblock.py), greedy
outputs equal the colocated engine's, and a D local prefix hit pulls only the rest of the prompt
(from the middle of a P block when the sizes allow). Two kv_both engines (block sizes 16 and 32)
play P and D in both directions, so only two models load."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import decode, free_blocks, pd_config, prefill, settle, shutdown  # noqa: E402

from pdkv import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8)
TOKEN_BYTES = 30 * 2 * 3 * 64 * 4  # layers x K/V x KV heads x head dim x fp32, per token
PROMPTS = (3, 8)  # parity prompts of 63 and 97 tokens


@pytest.fixture(scope="module")
def engines(parity_prompts):
    """{block size: kv_both engine} and the colocated greedy outputs (the 16-token engine's)."""
    llms = {bs: LLM("smollm2", num_kv_blocks=64, max_model_len=512, block_size=bs,
                    kv_transfer_config=pd_config("kv_both", "tcp", kv_lease_duration=600.0))
            for bs in (16, 32)}
    try:
        prompts = [{"prompt_token_ids": parity_prompts[i]} for i in PROMPTS]
        refs = [o.outputs[0].token_ids for o in llms[16].generate(prompts, GREEDY)]
        yield llms, refs
    finally:
        shutdown(*llms.values())


@pytest.mark.matrix("pd-reblock", model="smollm2")
@pytest.mark.parametrize(("p_bs", "d_bs"), [(16, 32), (32, 16)])
def test_reblocked_pd_matches_colocated_including_a_local_prefix_hit(
    p_bs, d_bs, engines, parity_prompts
):
    llms, refs = engines
    p, d = llms[p_bs], llms[d_bs]
    for e in (p, d):
        assert e.reset_prefix_cache()
    prompts = [parity_prompts[i] for i in PROMPTS]
    start_p, start_d = free_blocks(p), free_blocks(d)
    stats = d.llm_engine.scheduler.kv_stats
    # A fresh D: every prompt is pulled whole, by token position.
    params = [prefill(p, {"prompt_token_ids": ids}).kv_transfer_params for ids in prompts]
    for ids, prm in zip(prompts, params):
        assert prm["block_size"] == p_bs and len(prm["remote_block_ids"][0]) == -(-len(ids) // p_bs)
    before = stats.get("kv_bytes_received", 0.0)
    outs = decode(p, d, [{"prompt_token_ids": ids} for ids in prompts], params, GREEDY)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == refs[i], f"prompt {i} ({len(prompts[i])} tokens)"
    assert stats["kv_bytes_received"] - before == sum(map(len, prompts)) * TOKEN_BYTES
    # Again: D's full blocks of the prompt are local hits; only the rest is pulled (63 tokens,
    # P 32 -> D 16: D holds 48, so the pull starts in the middle of P's second block).
    ids = prompts[0]
    again = prefill(p, {"prompt_token_ids": ids}).kv_transfer_params
    before = stats["kv_bytes_received"]
    out = decode(p, d, [{"prompt_token_ids": ids}], [again], GREEDY)[0]
    assert out.outputs[0].token_ids == refs[0]
    hit = (len(ids) - 1) // d_bs * d_bs
    assert out.num_cached_tokens == len(ids) - 1
    assert stats["kv_bytes_received"] - before == (len(ids) - hit) * TOKEN_BYTES
    settle(p, d)
    assert free_blocks(p) == start_p and free_blocks(d) == start_d
