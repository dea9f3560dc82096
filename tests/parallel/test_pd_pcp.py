"""A prefill engine with PCP 2 end to end: P (tp 1, pcp 2: two worker processes, each a full KV
replica; only PCP rank 0 runs the connector's worker half) → D at tp 1 and → D at tp 2 with dcp 2
(interleave = block size) over the P2P connector (tcp), on tiny-llama-kv1.

For prompts of 1-4 x the split size (64 tokens at PCP 2, so P's prefill is split): D's greedy
tokens equal a colocated single-rank engine's; P advertises the layout of a tp-1 engine with one
control endpoint; the bytes D received, and the bytes P sent, equal the KV formula for one
replica (prompt blocks x block size x bytes per token, from config.json), not N x; P's blocks
come back to its pool once rank 0 alone reported the grant done (lease far beyond the wait).

Issue 32, step 2 (acceptance 1, P/D)."""

from __future__ import annotations

import json
import pathlib

import pytest
from pd_tp_utils import BLOCK, GREEDY, decode, engine, kv_config, prefill, step_until

from pdkv import LLM
from pdkv.modelspec.dtypes import element_type
from pdkv.modelspec.hf_config import spec_from_hf_config

pytestmark = pytest.mark.slow  # worker processes

SLICE = 64  # the smallest run PCP 2 splits: 2 ranks x 2 chunks x 16 tokens
PROMPT_LENS = (SLICE, 2 * SLICE + 1, 3 * SLICE, 4 * SLICE - 7)  # max_model_len 256 (pd_tp_utils)


def prompts(seed: int) -> list[list[int]]:
    return [[(i * 7919 + 13 * n + seed) % 30000 + 100 for i in range(n)] for n in PROMPT_LENS]


def free(llm: LLM) -> int:
    return llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks


def replica_bytes(model: str, num_tokens: int) -> int:
    """The KV formula of one replica's blocks for a prompt: whole blocks x bytes per token."""
    cfg = json.loads((pathlib.Path(model) / "config.json").read_text())
    group = spec_from_hf_config(cfg).groups[0]
    return group.block_tokens_held(num_tokens, BLOCK) * group.token_bytes(element_type("float32"))


def test_p_pcp2_to_d_tp1_and_d_dcp2_match_colocated_with_one_replica_moved(tiny_llama_kv1):
    model = tiny_llama_kv1
    cases = {"tp1": prompts(0), "dcp2": prompts(5)}  # fresh prompts: every P prefill is split
    ref = engine(model)  # colocated, one rank
    try:
        want = {name: [list(o.outputs[0].token_ids) for o in ref.generate(
            [{"prompt_token_ids": q} for q in ps], GREEDY, use_tqdm=False)]
            for name, ps in cases.items()}
        tp1_layout = ref.llm_engine.executor.kv_layout.to_wire()
    finally:
        ref.llm_engine.shutdown()
    # A lease far beyond the waits below: only rank 0's "done" frees P's blocks.
    p = engine(model, prefill_context_parallel_size=2,
               kv_transfer_config=kv_config("kv_producer", kv_lease_duration=600))
    ds: dict[str, LLM] = {}
    try:
        assert p.llm_engine.executor.world_size == 2
        ds["tp1"] = engine(model, kv_transfer_config=kv_config("kv_consumer"))
        ds["dcp2"] = engine(model, tensor_parallel_size=2, decode_context_parallel_size=2,
                            cp_kv_cache_interleave_size=BLOCK,
                            kv_transfer_config=kv_config("kv_consumer"))
        baseline = free(p)
        sent = 0
        for name, d in ds.items():
            for prompt, expect in zip(cases[name], want[name]):
                params, p_cached = prefill(p, prompt)  # asserts tp_size 1 and one endpoint
                assert p_cached == 0 and p.llm_engine.executor.timings.pcp_comm > 0, (
                    "P's prefill was not split over its PCP ranks")
                assert params["layout"] == tp1_layout  # a tp-1 producer's layout
                out, _, _, d_hit = decode(p, d, prompt, params)
                assert list(out.outputs[0].token_ids) == expect, f"D {name}, {len(prompt)} tokens"
                assert d_hit == 0
                formula = replica_bytes(model, len(prompt))
                assert out.kv_load_bytes == {"p2p": formula}, f"D {name}, {len(prompt)} tokens"
                sent += formula
                assert p.llm_engine.scheduler.kv_stats["kv_bytes_sent"] == sent
                step_until([p], lambda: free(p) == baseline and not p.llm_engine.has_work(),
                           timeout=30)
    finally:
        for d in ds.values():
            d.llm_engine.shutdown()
        p.llm_engine.shutdown()
