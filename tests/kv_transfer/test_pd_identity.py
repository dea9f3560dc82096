"""1P1D through the P2P connector gives token-for-token the colocated engine's greedy output,
with every transfer engine, and moves exactly the prompt's blocks."""

from __future__ import annotations

import os
import sys

import pytest
from system_packages import in_ci

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import decode, free_blocks, make_pd, prefill, settle, shutdown  # noqa: E402

from pdkv import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=24)
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # layers x K/V x block tokens x KV heads x head dim x fp32


@pytest.fixture(scope="module")
def colocated_reference(parity_reference_24):
    """The colocated engine's greedy tokens (GREEDY: 24 new tokens) per parity prompt."""
    assert GREEDY.max_tokens == 24
    return [o.outputs[0].token_ids for o in parity_reference_24]


def _mooncake_available() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


TRANSFERS = [
    pytest.param("tcp", marks=pytest.mark.matrix("pd-tcp")),
    pytest.param("shm", marks=pytest.mark.matrix("pd-shm")),
    pytest.param(
        "mooncake",
        marks=[
            pytest.mark.matrix("pd-mooncake"),
            pytest.mark.skipif(
                not _mooncake_available() and not in_ci(),
                reason="mooncake-transfer-engine-non-cuda / libibverbs1 not installed",
            ),
        ],
    ),
]


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_pd_matches_colocated_and_moves_prompt_blocks(
    transfer, parity_prompts, colocated_reference
):
    # D without prefix caching so every request pulls all of its prompt's blocks. Every prompt is
    # prefilled before the first pull: a long lease keeps a slow machine from expiring them.
    p, d = make_pd(transfer, d_prefix_caching=False, p_extra={"kv_lease_duration": 600.0})
    try:
        start_p, start_d = free_blocks(p), free_blocks(d)
        prompts = [{"prompt_token_ids": ids} for ids in parity_prompts]
        params = [prefill(p, pr).kv_transfer_params for pr in prompts]
        for ids, prm in zip(parity_prompts, params):
            assert prm["do_remote_prefill"] and prm["num_tokens"] == len(ids)
            assert len(prm["remote_block_ids"][0]) == -(-len(ids) // 16)
        before = d.llm_engine.scheduler.kv_stats.get("kv_bytes_received", 0.0)
        outs = decode(p, d, prompts, params, GREEDY)
        for i, (out, ref) in enumerate(zip(outs, colocated_reference)):
            assert out.outputs[0].token_ids == ref, f"prompt {i} ({len(parity_prompts[i])} tokens)"
            assert out.num_cached_tokens == len(parity_prompts[i]) - 1
        received = d.llm_engine.scheduler.kv_stats["kv_bytes_received"] - before
        expected = sum(-(-len(ids) // 16) for ids in parity_prompts) * BLOCK_BYTES
        assert received == expected
        assert d.llm_engine.runner.kv_cache_config.block_bytes(0) == BLOCK_BYTES
        settle(p, d)
        assert free_blocks(p) == start_p and free_blocks(d) == start_d
        assert p.llm_engine.scheduler.kv_stats["kv_bytes_sent"] == expected
    finally:
        shutdown(p, d)


def test_pd_local_prefix_hits_pull_only_the_rest(parity_prompts, colocated_reference):
    p, d = make_pd("tcp", d_prefix_caching=True)
    try:
        ids = parity_prompts[0]
        first = prefill(p, {"prompt_token_ids": ids}).kv_transfer_params
        out1 = decode(p, d, [{"prompt_token_ids": ids}], [first], GREEDY)[0]
        again = prefill(p, {"prompt_token_ids": ids}).kv_transfer_params
        before = d.llm_engine.scheduler.kv_stats["kv_bytes_received"]
        out2 = decode(p, d, [{"prompt_token_ids": ids}], [again], GREEDY)[0]
        pulled = d.llm_engine.scheduler.kv_stats["kv_bytes_received"] - before
        local_blocks = (len(ids) - 1) // 16
        assert pulled == (-(-len(ids) // 16) - local_blocks) * BLOCK_BYTES
        assert out1.outputs[0].token_ids == out2.outputs[0].token_ids == colocated_reference[0]
        settle(p, d)
    finally:
        shutdown(p, d)
