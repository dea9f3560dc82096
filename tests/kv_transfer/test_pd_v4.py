"""P/D on tiny-v4 (DeepSeek-V4: sliding window 24, CSA rate 4 with the indexer, HCA rate 16)
through the P2P connector over tcp: D pulls every V4 group (issue 33, step 3) and continues with
the colocated engine's greedy tokens. D resumes at n after P's token (the compressor state slot
holds the state after all n prompt tokens), so it pulls the window blocks of that position's
block boundary, every block of the compressed-KV and indexer-key groups, and one compressor
state slot; the bytes D received (its kv_bytes_received counter) equal that per-group formula,
written here from the model's shape. Block size 8 (the rate-16 windows straddle blocks; an HCA
entry every second block) and 16. No block is left held on either side."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import decode, pd_config, prefill, pump, shutdown  # noqa: E402

from pdkv import LLM, SamplingParams  # noqa: E402
from pdkv.cache.specs import window_first_block  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_LENS = (9, 32, 45, 70)  # below a block, block multiples, neither; 70 > the window
WINDOW, D, C = 24, 32, 32  # sliding window (tokens), head_dim, index_head_dim


def group_bytes(n: int, bs: int) -> dict[str, int]:
    """Bytes D pulls per group for an n-token prompt (fp32, no local hit)."""
    blocks = -(-n // bs)
    window_blocks = blocks - window_first_block(n, bs, WINDOW)
    return {
        "window": window_blocks * 4 * bs * D * 4,  # 4 layers, one plane (K = V)
        "csa_kv": blocks * 2 * (bs // 4) * D * 4,  # layers 1, 3: an entry per 4 tokens
        "hca_kv": blocks * 1 * max(1, bs // 16) * D * 4,  # layer 2: an entry per 16 tokens
        "indexer": blocks * 2 * (bs // 4) * C * 4,
        "state": 3 * (2 * 4 * 2 * D + 2 * 4 * D + 2 * 4 * 2 * C + 2 * 4 * C) * 4,  # one slot
    }


@pytest.fixture(scope="module", params=[8, 16], ids=["bs8", "bs16"])
def engines(tiny_v4, request):
    bs = request.param
    kw = dict(num_kv_blocks=64, max_model_len=128, block_size=bs)
    p = LLM(tiny_v4, max_num_batched_tokens=24, enable_prefix_caching=False, **kw,
            kv_transfer_config=pd_config("kv_both", "tcp", kv_lease_duration=600.0))
    d = LLM(tiny_v4, **kw, kv_transfer_config=pd_config("kv_consumer", "tcp"))
    try:
        prompts = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENS]
        refs = [list(o.outputs[0].token_ids)
                for o in p.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)]
        yield bs, p, d, prompts, refs
    finally:
        shutdown(p, d)


def idle(*llms: LLM) -> bool:
    return all(not e.llm_engine.has_work() and all(
        pool.num_free_blocks == pool.num_usable_blocks
        for pool in e.llm_engine.scheduler.kv_cache_manager.block_pools) for e in llms)


@pytest.mark.slow  # two engines
@pytest.mark.matrix("pd-tcp", "hybrid-v4", model="tiny-v4")
def test_pd_matches_colocated_and_moves_every_group(engines):
    bs, p, d, prompts, refs = engines
    stats = d.llm_engine.scheduler.kv_stats
    for ids, ref in zip(prompts, refs):
        prm = prefill(p, {"prompt_token_ids": ids}).kv_transfer_params
        assert prm["first_token"] == ref[0]
        assert len(prm["remote_block_ids"][-1]) == 1  # one compressor-state slot, any n
        before = stats.get("kv_bytes_received", 0.0)
        out = decode(p, d, [{"prompt_token_ids": ids}], [prm], GREEDY)[0]
        assert list(out.outputs[0].token_ids) == ref, len(ids)
        want = group_bytes(len(ids), bs)
        assert stats["kv_bytes_received"] - before == sum(want.values()), (len(ids), want)
    pump([p, d], lambda: idle(p, d))
