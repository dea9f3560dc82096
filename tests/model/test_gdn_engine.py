"""tiny-gdn (Qwen3-Next-style linear attention + full attention) in the colocated engine with a
small KV cache: state slots are reused by later requests and preempted requests restart, and every
request still starts from a zeroed slot and carries its state across chunks and steps, so the
greedy output equals the roomy engine's (which equals HF's, tests/model/test_tiny_models.py);
without prefix caching a repeated prompt gets no hit; with it, a hit resumes from the state
checkpoint at its block boundary and gives the cold output. Refusals at start-up: TP / DCP and KV
connectors on a linear-state model."""

from __future__ import annotations

import pytest

from pdkv import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.matrix("preemption", model="tiny-gdn")
def test_small_cache_reuses_slots_preempts_and_matches_the_roomy_engine(tiny_gdn):
    prompts = [
        [(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in (40, 9, 33, 52, 17, 40)
    ]
    ref, _ = run(LLM(tiny_gdn, cpu_linear="torch", num_kv_blocks=64, max_model_len=64), prompts)
    # 5 blocks of 16 per group: at most ~2 requests fit at once, so the rest wait, reuse freed
    # slots (holding other requests' states) or are preempted and recomputed. No prefix caching:
    # one slot per request, no checkpoints, no hit (prompts 0 and 5 are equal).
    small = LLM(
        tiny_gdn,
        cpu_linear="torch",
        num_kv_blocks=5,
        max_model_len=64,
        max_num_batched_tokens=24,
        enable_prefix_caching=False,
    )
    got, cached = run(small, prompts)
    assert got == ref and cached == [0] * len(prompts)
    again, cached = run(small, prompts[::-1])
    assert again == ref[::-1] and cached == [0] * len(prompts)
    sched = small.llm_engine.scheduler
    assert sched.num_preemptions > 0
    assert all(b.block_hash is None for b in sched.kv_cache_manager.block_pools[1].blocks)
    assert all(p.num_free_blocks == p.num_usable_blocks for p in sched.kv_cache_manager.block_pools)


def test_prefix_hit_resumes_from_a_checkpoint_with_the_cold_output(tiny_gdn):
    base = [(i * 7919) % 40000 + 100 for i in range(40)]
    # share 35 tokens with `base` (checkpoints after 16 and 32), then diverge; one extends base
    # past its generated tokens' block (checkpoint after 48 written during decode)
    variants = [base[:35] + [500 + j] * (3 + 7 * j) for j in range(3)]
    cold, _ = run(LLM(tiny_gdn, cpu_linear="torch", num_kv_blocks=64, max_model_len=96,
                      enable_prefix_caching=False), [base, *variants])
    hot = LLM(
        tiny_gdn, cpu_linear="torch", num_kv_blocks=64, max_model_len=96, max_num_batched_tokens=24
    )
    first, cached = run(hot, [base])
    assert first == cold[:1] and cached == [0]
    got, cached = run(hot, variants)  # several hits in one step, chunked after the hit
    assert got == cold[1:]
    assert cached == [32, 32, 32]
    extended = base + first[0] + [77] * 5  # 55 tokens: blocks 0..2 were all computed by `base`
    cold_ext, _ = run(LLM(tiny_gdn, cpu_linear="torch", num_kv_blocks=64, max_model_len=96,
                          enable_prefix_caching=False), [extended])
    got, cached = run(hot, [extended])
    assert got == cold_ext and cached == [48]


def test_parallel_and_connectors_are_refused_at_start_up(tiny_gdn):
    import json

    from pdkv.model.loader import load_model
    from pdkv.parallel.context import ParallelContext
    from pdkv.parallel.layout import ParallelLayout

    with pytest.raises(ValueError, match="does not move per-request state slots"):
        LLM(
            tiny_gdn,
            cpu_linear="torch",
            num_kv_blocks=8,
            max_model_len=64,
            kv_transfer_config=json.dumps(
                {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
            ),
        )
    # tp 2 splits the 2 linear key heads (tests/parallel/test_pd_gdn_tp.py); tp 4 and DCP do not.
    with pytest.raises(
        ValueError,
        match="tensor_parallel_size=4 must divide the model's 2 linear-attention key heads",
    ):
        load_model(
            tiny_gdn,
            "float32",
            "cpu",
            ParallelContext(layout=ParallelLayout(tp_size=4), tp_ranks=(0, 1, 2, 3)),
        )
    with pytest.raises(
        ValueError, match="decode_context_parallel_size=2 is not supported with linear-attention"
    ):
        load_model(
            tiny_gdn,
            "float32",
            "cpu",
            ParallelContext(
                layout=ParallelLayout(dcp_size=2, dcp_replicated=True), dcp_ranks=(0, 1)
            ),
        )
