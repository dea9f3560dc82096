"""The prefill cap of mixed steps (`SchedulerConfig.max_mixed_prefill_tokens`): while decodes
run, a step's prompt chunks hold at most that many tokens together; a step without decodes is
not capped; outputs do not change (the fake runner checks every KV slot)."""

from __future__ import annotations

import pytest
from scheduler_fakes import (
    BS,
    FakeRunner,
    Trace,
    assert_all_free,
    make_request,
    prompt_of,
    step,
)

from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pdkv.config import CacheConfig, SchedulerConfig
from pdkv.sched.output import SchedulerOutput
from pdkv.sched.scheduler import Scheduler


def make(cap: int, budget: int = 64, num_blocks: int = 128) -> Scheduler:
    kv = KVCacheConfig(
        num_blocks, (KVCacheGroupSpec((0,), FullAttentionSpec(BS, num_kv_heads=1, head_size=8)),)
    )
    return Scheduler(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=256,
                        max_mixed_prefill_tokens=cap),
        CacheConfig(block_size=BS, num_kv_blocks=num_blocks), kv)


def prefill_tokens(
    sched: Scheduler, out: SchedulerOutput, before: dict[str, int]
) -> tuple[int, int]:
    """(prompt-chunk tokens, decode requests) of a step, from the tokens each request had left."""
    chunks = sum(n for r, n in out.num_scheduled_tokens.items() if before[r] > 1)
    decodes = sum(1 for r, n in out.num_scheduled_tokens.items() if before[r] == 1)
    return chunks, decodes


def run(
    cap: int, arrivals: dict[int, list[tuple[str, int, int]]]
) -> tuple[Trace, list[tuple[int, int]]]:
    """Step until done; `arrivals[step]` = requests (id, prompt length, max_tokens) added before
    that step. Returns the trace and (prompt tokens, decodes) per step."""
    sched = make(cap)
    runner = FakeRunner(128)
    trace = Trace()
    mix: list[tuple[int, int]] = []
    for i in range(500):
        for rid, n, m in arrivals.get(i, []):
            sched.add_request(make_request(rid, prompt_of(len(rid) + n, n), max_tokens=m))
        if not sched.has_unfinished_requests() and i > max(arrivals):
            break
        before = {
            r.request_id: r.num_tokens - r.num_computed_tokens for r in sched.requests.values()
        }
        out = step(sched, runner, trace)
        mix.append(prefill_tokens(sched, out, before))
    assert_all_free(sched, runner)
    return trace, mix


ARRIVALS = {0: [("a", 10, 30), ("b", 6, 30)], 3: [("long", 150, 4)], 4: [("long2", 90, 4)]}


def test_mixed_steps_hold_at_most_the_cap_and_outputs_do_not_change():
    ref, ref_mix = run(0, ARRIVALS)
    capped, mix = run(12, ARRIVALS)
    assert capped.tokens == ref.tokens
    # Uncapped, the long prompts share steps with decodes in big chunks ...
    assert max(p for p, d in ref_mix if d) > 12
    # ... capped, every step with a decode holds at most 12 prompt tokens, all prompts included.
    mixed = [p for p, d in mix if d]
    assert mixed and max(mixed) == 12
    assert all(p <= 12 for p in mixed)


def test_a_step_without_decodes_is_not_capped():
    _, mix = run(12, {0: [("solo", 150, 3)]})
    assert mix[0] == (64, 0)  # the whole budget, not the cap
    assert [p for p, _ in mix[:3]] == [64, 64, 22]


def test_cap_validation():
    with pytest.raises(ValueError, match="max_mixed_prefill_tokens must be >= 0"):
        SchedulerConfig(max_mixed_prefill_tokens=-1)
    with pytest.raises(ValueError, match="needs chunked prefill"):
        SchedulerConfig(
            max_mixed_prefill_tokens=64, enable_chunked_prefill=False, max_num_batched_tokens=8192
        )
