"""Layer-wise push between different block sizes (issue 29): D grants its own blocks (D's block
size) and accepts only whole (D block, layer) units; P pushes a D block once it has computed every
token in it, gathering each layer's K and V rows of its tokens from P's blocks into one unit. Two
engines in one process (tiny-llama-kv2), P 16 -> D 32 and P 32 -> D 16, chunked prefill of 24
tokens a step so D blocks complete across steps and straddle P's (plain and int8 pages): D's
greedy tokens equal the colocated engine's, D received D blocks granted x D block bytes, nothing
refused. A D prefix hit
shrinks the window to the D blocks after it. What is not re-blocked (MLA latent blocks,
sliding-window groups, more than one KV cache group) is refused at P, naming both block
sizes."""

from __future__ import annotations

import os
import sys
from typing import Any

import msgspec
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import pump, shutdown  # noqa: E402
from test_pd_push import (  # noqa: E402
    GREEDY,
    config,
    finish,
    grant_of,
    idle,
    open_windows,
    prompts_for,
    push_prefill,
)

from pdkv import LLM, SamplingParams  # noqa: E402
from pdkv.kv_transfer.connector.p2p_push_scheduler import push_block_sizes  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KW = dict(cpu_linear="torch", num_kv_blocks=48, max_model_len=256, max_num_batched_tokens=24)


def pair(path: str, p_bs: int, d_bs: int, **kw: Any) -> tuple[LLM, LLM]:
    p = LLM(path, **KW, **kw, block_size=p_bs, kv_transfer_config=config("kv_producer", "push"))
    d = LLM(path, **KW, **kw, block_size=d_bs, kv_transfer_config=config("kv_consumer", "push"))
    return p, d


def reports(llm: LLM) -> str:
    """What GET /kv_layout says of the engine's `push_block_sizes` (the server's computation)."""
    groups = llm.llm_engine.executor.kv_cache_config.groups
    return push_block_sizes(llm.llm_engine.executor.kv_layout,
                            tuple(getattr(g.spec, "sliding_window", None) for g in groups),
                            tuple(g.spec.kind == "linear_state" for g in groups))


@pytest.mark.parametrize(("p_bs", "d_bs", "kv_dtype"),
                         [(16, 32, "auto"), (32, 16, "auto"), (32, 16, "int8")])
def test_push_across_block_sizes_matches_colocated_and_moves_d_blocks(tiny_llama_kv2, p_bs,
                                                                      d_bs, kv_dtype):
    """int8: a quantized page's two planes (values, then scales) are gathered row by row too;
    the reference is the colocated engine of the same kv_cache_dtype."""
    p, d = pair(tiny_llama_kv2, p_bs, d_bs, kv_cache_dtype=kv_dtype)
    try:
        assert reports(p) == reports(d) == "any"
        short, long_ = prompts_for((30, 150))
        extended = long_[:100] + prompts_for((60,))[0]  # D's cache holds long_'s first blocks
        prompts = [short, long_, extended]
        refs = [list(o.outputs[0].token_ids)
                for o in p.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)]
        assert p.reset_prefix_cache()
        stats, p_stats = d.llm_engine.scheduler.kv_stats, p.llm_engine.scheduler.kv_stats
        bb = d.llm_engine.runner.kv_cache_config.block_bytes(0)
        layers = len(d.llm_engine.runner.kv_cache_config.groups[0].layer_indices)
        blocks = 0
        for batch, ref in (([short, long_], refs[:2]), ([extended], refs[2:])):
            ids = open_windows(d, batch)  # (the second batch after D cached long_)
            grants = [grant_of(d, r) for r in ids]
            for prompt, grant in zip(batch, grants):
                assert grant.block_size == d_bs
                need = -(-len(prompt) // d_bs) - grant.first_block
                assert len(grant.block_ids[0]) == need > 0
                blocks += need
                push_prefill(p, prompt, grant)
            assert finish(d, ids) == ref
        assert grants[0].first_block == 100 // d_bs  # D's prefix hit: whole D blocks
        pump([p, d], lambda: idle(p, d), timeout=30)
        counts = {k: stats.get(k, 0.0) + p_stats.get(k, 0.0)
                  for k in ("kv_bytes_received", "kv_bytes_pushed", "kv_push_writes",
                            "kv_push_refused", "kv_push_failures")}
        assert counts == {"kv_bytes_received": blocks * bb, "kv_bytes_pushed": blocks * bb,
                          "kv_push_writes": blocks * layers, "kv_push_refused": 0,
                          "kv_push_failures": 0}
    finally:
        shutdown(p, d)


@pytest.mark.parametrize(("family", "why"), [
    ("tiny_mla", "MLA latent blocks"),
    ("tiny_swa", "sliding-window group"),
    ("tiny_gdn", "one full-attention KV cache group"),
])
def test_what_is_not_re_blocked_is_refused_naming_both_block_sizes(family, why, request):
    p, d = pair(request.getfixturevalue(family), 16, 32)
    try:
        assert reports(p) == reports(d) == "equal"
        prompt = prompts_for((40,))[0]
        (rid,) = open_windows(d, [prompt])
        with pytest.raises(ValueError) as e:
            p.llm_engine.make_request(
                {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1),
                kv_transfer_params={"do_remote_decode": True,
                                    "push_grant": msgspec.to_builtins(grant_of(d, rid))})
        assert "prefill block_size=16 and decode block_size=32" in str(e.value)
        assert why in str(e.value)
    finally:
        shutdown(p, d)
