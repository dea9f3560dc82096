"""tiny-gdn (Qwen3-Next-style linear attention + full attention) in the colocated engine with a
small KV cache: state slots are reused by later requests and preempted requests restart, and every
request still starts from a zeroed slot and carries its state across chunks and steps, so the
greedy output equals the roomy engine's (which equals HF's, tests/model/test_tiny_models.py); a
repeated prompt gets no prefix hit and the cold output. Refusals at start-up: TP / DCP and KV
connectors on a linear-state model."""

from __future__ import annotations

import pytest

from pdkv import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def test_small_cache_reuses_slots_preempts_and_matches_the_roomy_engine(tiny_gdn):
    prompts = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in (40, 9, 33, 52, 17, 40)]
    ref, _ = run(LLM(tiny_gdn, cpu_linear="torch", num_kv_blocks=64, max_model_len=64), prompts)
    # 5 blocks of 16 per group: at most ~2 requests fit at once, so the rest wait, reuse freed
    # slots (holding other requests' states) or are preempted and recomputed.
    small = LLM(tiny_gdn, cpu_linear="torch", num_kv_blocks=5, max_model_len=64, max_num_batched_tokens=24)
    got, cached = run(small, prompts)
    assert got == ref
    assert cached == [0] * len(prompts)  # prompts 0 and 5 are equal: still no hit
    again, cached = run(small, prompts[::-1])
    assert again == ref[::-1] and cached == [0] * len(prompts)
    sched = small.llm_engine.scheduler
    assert sched.num_preemptions > 0
    assert all(b.block_hash is None for b in sched.kv_cache_manager.block_pools[1].blocks)


def test_parallel_and_connectors_are_refused_at_start_up(tiny_gdn):
    import json

    from pdkv.model.loader import load_model
    from pdkv.parallel.context import ParallelContext
    from pdkv.parallel.layout import ParallelLayout

    with pytest.raises(ValueError, match="does not move linear-attention state"):
        LLM(tiny_gdn, cpu_linear="torch", num_kv_blocks=8, max_model_len=64,
            kv_transfer_config=json.dumps({"kv_connector": "P2PConnector", "kv_role": "kv_producer"}))
    with pytest.raises(ValueError, match="tensor / decode context parallelism is not supported with linear"):
        load_model(tiny_gdn, "float32", "cpu", ParallelContext(layout=ParallelLayout(tp_size=2), tp_ranks=(0, 1)))
