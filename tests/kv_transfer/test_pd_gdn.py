"""P/D on tiny-gdn (Qwen3-Next-style Gated DeltaNet linear state + full attention) through the P2P
connector over tcp: D pulls the state slot after all n prompt tokens plus every full-attention
block, takes P's sampled token as its first output token and resumes at n; greedy output equals
the colocated engine's. Bytes = ceil(n / block_size) full-attention blocks + one state slot
(independent of n); D never registers the slots it allocated but did not load. P's token ends
the request at D when it is a stop token or max_tokens=1.
No block or slot is left held on either side. Issue 11, acceptance 2 for tiny-gdn (P/D part)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import decode, pd_config, prefill, pump, shutdown  # noqa: E402

from pdkv import LLM, SamplingParams  # noqa: E402
from pdkv.kv_transfer.connector.p2p_compat import linear_state_error  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_LENS = (9, 32, 45)  # shorter than a block, an exact block multiple, neither
# Full attention: 2 layers x 2 KV heads x 32 x (K, V) x fp32 = 1,024 B a token, 16,384 B a block.
FULL_BLOCK_BYTES = 2 * 2 * 32 * 2 * 4 * BS
# Linear state slot: 2 layers x (conv 256 x 3 + recurrent 4 x 32 x 32) x fp32 = 38,912 B.
SLOT_BYTES = 2 * (256 * 3 + 4 * 32 * 32) * 4


def moved_bytes(n: int) -> int:
    """Bytes D pulls for an n-token prompt with no local hit."""
    return -(-n // BS) * FULL_BLOCK_BYTES + SLOT_BYTES


@pytest.fixture(scope="module")
def engines(tiny_gdn):
    """(P, D, prompts, colocated greedy outputs). P runs without prefix caching (one slot per
    request), D with it (a slot per block: only the last one is loaded). P chunks its prefill."""
    kw = dict(cpu_linear="torch", num_kv_blocks=32, max_model_len=128, block_size=BS)
    p = LLM(tiny_gdn, max_num_batched_tokens=24, enable_prefix_caching=False, **kw,
            kv_transfer_config=pd_config("kv_both", "tcp", kv_lease_duration=600.0))
    d = LLM(tiny_gdn, **kw, kv_transfer_config=pd_config("kv_consumer", "tcp"))
    try:
        prompts = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENS]
        refs = [list(o.outputs[0].token_ids)
                for o in p.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)]
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
@pytest.mark.matrix("pd-tcp", "hybrid-linear", model="tiny-gdn")
def test_pd_matches_colocated_and_moves_one_state_slot(engines):
    p, d, prompts, refs = engines
    stats = d.llm_engine.scheduler.kv_stats
    params = [prefill(p, {"prompt_token_ids": ids}).kv_transfer_params for ids in prompts]
    assert [prm["first_token"] for prm in params] == [r[0] for r in refs]
    assert [len(prm["remote_block_ids"][1]) for prm in params] == [1, 1, 1]  # one slot, any n
    for prm in params:  # one request at a time: bytes per request
        before = stats.get("kv_bytes_received", 0.0)
        i = params.index(prm)
        out = decode(p, d, [{"prompt_token_ids": prompts[i]}], [prm], GREEDY)[0]
        assert list(out.outputs[0].token_ids) == refs[i], PROMPT_LENS[i]
        assert stats["kv_bytes_received"] - before == moved_bytes(PROMPT_LENS[i])
    pump([p, d], lambda: idle(p, d))
    # D's own decode of the 45-token prompt wrote the checkpoint after 48 tokens (its first three
    # output tokens complete block 2): a longer prompt through it hits 48 tokens locally and
    # pulls only the rest, the full-attention block from 48 on and the one slot.
    longer = prompts[2] + refs[2][:3] + [600 + j for j in range(12)]  # 60 tokens
    ref = list(p.generate([{"prompt_token_ids": longer}], GREEDY)[0].outputs[0].token_ids)
    prm = prefill(p, {"prompt_token_ids": longer}).kv_transfer_params
    before = stats["kv_bytes_received"]
    out = decode(p, d, [{"prompt_token_ids": longer}], [prm], GREEDY)[0]
    assert list(out.outputs[0].token_ids) == ref
    assert out.metrics is not None and out.num_cached_tokens - out.metrics.num_external_tokens == 48
    assert stats["kv_bytes_received"] - before == FULL_BLOCK_BYTES + SLOT_BYTES
    pump([p, d], lambda: idle(p, d))
    # Several at once, and again the same prompts (D's cache holds full-attention blocks but no
    # checkpoint at or below n - 1 for them: everything is pulled again).
    params = [prefill(p, {"prompt_token_ids": ids}).kv_transfer_params for ids in prompts]
    outs = decode(p, d, [{"prompt_token_ids": ids} for ids in prompts], params, GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs
    pump([p, d], lambda: idle(p, d))
    # A local request on D sharing 40 tokens with the 45-token prompt: the slots D allocated for
    # blocks 0 and 1 of the loaded prompt were never written, so no checkpoint at 16 or 32 may
    # be hit (the colocated cold output; a later checkpoint D wrote itself, at 48, is not shared).
    variant = prompts[2][:40] + [500] * 6
    cold = p.generate([{"prompt_token_ids": variant}], GREEDY)[0]
    hot = d.generate([{"prompt_token_ids": variant}], GREEDY)[0]
    assert list(hot.outputs[0].token_ids) == list(cold.outputs[0].token_ids)
    assert hot.num_cached_tokens == 0
    pump([p, d], lambda: idle(p, d))


@pytest.mark.slow
def test_producer_token_can_end_the_request_at_decode(engines):
    p, d, prompts, refs = engines
    prm = prefill(p, {"prompt_token_ids": prompts[2]}).kv_transfer_params
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = decode(p, d, [{"prompt_token_ids": prompts[2]}], [prm], one)[0]
    assert (
        list(out.outputs[0].token_ids) == refs[2][:1] and out.outputs[0].finish_reason == "length"
    )
    prm = prefill(p, {"prompt_token_ids": prompts[0]}).kv_transfer_params
    stop = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[refs[0][0]])
    out = decode(p, d, [{"prompt_token_ids": prompts[0]}], [prm], stop)[0]
    assert list(out.outputs[0].token_ids) == refs[0][:1] and out.outputs[0].finish_reason == "stop"
    pump([p, d], lambda: idle(p, d))


def test_params_without_the_token_or_with_logprobs_are_refused():
    class Req:
        def __init__(self, logprobs):
            self.sampling_params = SamplingParams(logprobs=logprobs)

    assert linear_state_error(Req(None), {"first_token": 7}) == ""
    assert "first_token" in linear_state_error(Req(None), {})
    assert "logprobs are not supported" in linear_state_error(Req(2), {"first_token": 7})
