"""P/D on tiny-swa (sliding window 40 on layers 0 and 2, full attention on 1 and 3) through the
P2P connector over tcp: greedy output equals the colocated engine's; D pulls every prompt block
of the full-attention group but only the sliding-window blocks its first computed token reads
(bytes per group = the spec's formula, bounded by the window whatever the prompt length); P
prefills in chunks, so it has already freed its early window-group blocks (null ids in its
kv_transfer_params); a D local prefix hit pulls only the rest. Issue 11, acceptance 2 for
tiny-swa (P/D part)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import decode, pd_config, prefill, pump, shutdown  # noqa: E402

from pdkv import LLM, SamplingParams  # noqa: E402
from pdkv.cache.block_pool import NULL_BLOCK_ID  # noqa: E402

pytestmark = pytest.mark.slow

BS, W = 16, 40
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_LENS = (30, 41, 150, 203)
# One block of one group (2 layers x K/V x 16 tokens x 2 KV heads x head dim 32 x fp32).
BLOCK_BYTES = 2 * 2 * BS * 2 * 32 * 4


def window_blocks(n: int) -> int:
    """Window-group blocks D pulls for an n-token prompt: those holding tokens B - W + 1 .. n - 1,
    B = (n - 1) // BS * BS (the window of the token D resumes at, n - 1, and of a later prefix
    hit of B tokens)."""
    return -(-n // BS) - max(0, (n - 1) // BS * BS - W + 1) // BS


@pytest.fixture(scope="module")
def engines(tiny_swa):
    """(P, D, colocated greedy outputs per prompt). P chunks its prefill (32 tokens a step)."""
    kw = dict(cpu_linear="torch", num_kv_blocks=64, max_model_len=256, block_size=BS)
    p = LLM(tiny_swa, max_num_batched_tokens=32, **kw,
            kv_transfer_config=pd_config("kv_both", "tcp", kv_lease_duration=600.0))
    d = LLM(tiny_swa, **kw, kv_transfer_config=pd_config("kv_consumer", "tcp"))
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
    """No work and every pool of every engine fully free (null blocks excluded)."""
    return all(
        not e.llm_engine.has_work()
        and all(
            pool.num_free_blocks == pool.num_usable_blocks
            for pool in e.llm_engine.scheduler.kv_cache_manager.block_pools
        )
        for e in llms
    )


@pytest.mark.matrix("pd-tcp", model="tiny-swa")
def test_pd_matches_colocated_and_pulls_only_the_window(engines):
    p, d, prompts, refs = engines
    assert p.reset_prefix_cache() and d.reset_prefix_cache()  # P computes every prompt in chunks
    stats = d.llm_engine.scheduler.kv_stats
    params = [prefill(p, {"prompt_token_ids": ids}).kv_transfer_params for ids in prompts]
    for ids, prm in zip(prompts, params):
        window, full = prm["remote_block_ids"]  # group 0: layer 0 slides
        assert len(full) == len(window) == -(-len(ids) // BS)
        # P freed the window-group blocks its last chunk no longer read (positions < 128 - 39).
        assert window.count(NULL_BLOCK_ID) == max(0, (len(ids) - 1) // 32 * 32 - W + 1) // BS
    before = stats.get("kv_bytes_received", 0.0)
    outs = decode(p, d, [{"prompt_token_ids": ids} for ids in prompts], params, GREEDY)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == refs[i], f"prompt of {len(prompts[i])} tokens"
    expect = sum((-(-len(ids) // BS) + window_blocks(len(ids))) * BLOCK_BYTES for ids in prompts)
    assert stats["kv_bytes_received"] - before == expect
    assert (
        max(window_blocks(n) for n in PROMPT_LENS) == -(-(W - 1) // BS) + 1
    )  # bounded by the window
    pump([p, d], lambda: idle(p, d))


def test_d_prefix_hit_pulls_only_the_rest(engines):
    p, d, prompts, refs = engines
    ids, ref = prompts[3], refs[3]  # 203 tokens
    decode(
        p,
        d,
        [{"prompt_token_ids": ids}],
        [prefill(p, {"prompt_token_ids": ids}).kv_transfer_params],
        GREEDY,
    )
    stats = d.llm_engine.scheduler.kv_stats
    before = stats["kv_bytes_received"]
    again = prefill(p, {"prompt_token_ids": ids}).kv_transfer_params
    out = decode(p, d, [{"prompt_token_ids": ids}], [again], GREEDY)[0]
    assert out.outputs[0].token_ids == ref
    # 192 tokens hit locally in both groups (the window group kept the window of token 192).
    assert out.metrics is not None
    assert out.num_cached_tokens - out.metrics.num_external_tokens == (len(ids) - 1) // BS * BS
    # The rest is the last block of each group.
    assert stats["kv_bytes_received"] - before == 2 * BLOCK_BYTES
    pump([p, d], lambda: idle(p, d))
