"""P/D on tiny-kda-mla (Kimi-Linear style: KDA linear state + MLA latents, two state kinds in one
model) through the P2P connector over tcp: D pulls the MLA blocks of all n prompt tokens and the
one KDA state slot after them, takes P's token as its first output and resumes at n; greedy output
equals the colocated engine's, with bytes = ceil(n / block_size) MLA blocks + one slot. Issue 11,
acceptance 2 for tiny-kda-mla (P/D part)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import decode, pd_config, prefill, pump, shutdown  # noqa: E402

from pdkv import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
MLA_BLOCK_BYTES = 2 * BS * (48 + 16) * 4  # 2 MLA layers x 16 tokens x (latent 48 + key 16) x fp32
SLOT_BYTES = 2 * (576 + 2048) * 4  # 2 KDA layers x (conv 3 x 64 x 3 + recurrent 2 x 32 x 32) x fp32


@pytest.mark.slow  # loads the model twice
@pytest.mark.matrix("pd-tcp", "hybrid-mla", "hybrid-linear", model="tiny-kda-mla")
def test_pd_matches_colocated_and_moves_blocks_and_one_slot(tiny_kda_mla):
    kw = dict(cpu_linear="torch", num_kv_blocks=32, max_model_len=128, block_size=BS)
    p = LLM(tiny_kda_mla, enable_prefix_caching=False, **kw,
            kv_transfer_config=pd_config("kv_both", "tcp", kv_lease_duration=600.0))
    d = LLM(tiny_kda_mla, **kw, kv_transfer_config=pd_config("kv_consumer", "tcp"))
    try:
        stats = d.llm_engine.scheduler.kv_stats
        for n in (9, 32, 45):
            ids = [(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)]
            ref = list(p.generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0].token_ids)
            prm = prefill(p, {"prompt_token_ids": ids}).kv_transfer_params
            assert prm["first_token"] == ref[0]
            before = stats.get("kv_bytes_received", 0.0)
            out = decode(p, d, [{"prompt_token_ids": ids}], [prm], GREEDY)[0]
            assert list(out.outputs[0].token_ids) == ref, n
            assert stats["kv_bytes_received"] - before == -(-n // BS) * MLA_BLOCK_BYTES + SLOT_BYTES
        # Every block and slot comes back on both sides (P's after D's reads are done).
        pump([p, d], lambda: all(not e.llm_engine.has_work() and all(
            pool.num_free_blocks == pool.num_usable_blocks
            for pool in e.llm_engine.scheduler.kv_cache_manager.block_pools) for e in (p, d)))
    finally:
        shutdown(p, d)
