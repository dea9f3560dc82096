"""Continuous batching, chunked prefill and preemption (pdkv/sched/scheduler.py), driven by the
torch-free fake model runner of scheduler_fakes.py. Stop conditions and the rest:
test_scheduler_stops.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
from scheduler_fakes import (
    FakeRunner,
    Trace,
    assert_all_free,
    make_request,
    make_scheduler,
    prompt_of,
    run_all,
    step,
)

from pdkv.request import Request, RequestStatus


# --------------------------------------------------------------------------- tests
def test_scheduler_modules_import_without_torch():
    code = (
        "import sys\n"
        "import pdkv.sched.scheduler, pdkv.cache.kv_cache_manager, pdkv.request\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_single_request_generates_max_tokens_and_frees_everything():
    sched = make_scheduler(num_blocks=16)
    runner = FakeRunner(16)
    req = make_request("a", prompt_of(0, 10), max_tokens=5)
    sched.add_request(req)
    trace = run_all(sched, runner)
    assert req.num_output_tokens == 5
    assert req.output_token_ids == trace.tokens["a"]
    assert req.all_token_ids == req.prompt_token_ids + req.output_token_ids
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.get_finished_reason() == "length"
    # One prefill step of 10 tokens, then 4 decode steps of 1.
    assert [o.num_scheduled_tokens.get("a") for o in trace.outputs] == [10, 1, 1, 1, 1]
    assert len(trace.outputs[0].scheduled_new_reqs) == 1
    assert all(len(o.scheduled_cached_reqs) == 1 for o in trace.outputs[1:])
    assert req.times.first_scheduled is not None and req.times.finished is not None
    assert_all_free(sched, runner)


def test_chunked_prefill_splits_a_long_prompt_within_the_budget():
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=16)
    runner = FakeRunner(32)
    req = make_request("a", prompt_of(1, 50), max_tokens=3)
    sched.add_request(req)
    trace = run_all(sched, runner)
    assert [o.num_scheduled_tokens["a"] for o in trace.outputs] == [16, 16, 16, 2, 1, 1]
    # No token is sampled before the prompt is complete.
    assert req.times.first_token is not None
    assert trace.tokens["a"] == req.output_token_ids
    assert req.num_output_tokens == 3
    assert_all_free(sched, runner)


def test_token_budget_is_respected_with_many_requests():
    budget = 24
    sched = make_scheduler(num_blocks=128, max_num_batched_tokens=budget)
    runner = FakeRunner(128)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", prompt_of(i, 9 + 7 * i), max_tokens=6))
    trace = run_all(sched, runner)  # step() asserts total <= budget each step
    totals = [o.total_num_scheduled_tokens for o in trace.outputs]
    assert max(totals) == budget  # the budget is actually used up in busy steps
    assert all(len(trace.tokens[f"r{i}"]) == 6 for i in range(6))
    assert_all_free(sched, runner)


def test_chunked_prefill_disabled_waits_for_a_budget_that_fits_the_whole_prompt():
    sched = make_scheduler(
        num_blocks=64, max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False
    )
    runner = FakeRunner(64)
    sched.add_request(make_request("a", prompt_of(0, 20), max_tokens=4))
    sched.add_request(make_request("b", prompt_of(1, 20), max_tokens=4))
    trace = Trace()
    first = step(sched, runner, trace)
    assert first.num_scheduled_tokens == {"a": 20}
    second = step(sched, runner, trace)
    assert second.num_scheduled_tokens == {"a": 1, "b": 20}
    run_all(sched, runner)
    assert_all_free(sched, runner)


def test_max_num_seqs_is_respected():
    sched = make_scheduler(num_blocks=64, max_num_seqs=2)
    runner = FakeRunner(64)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", prompt_of(i, 6), max_tokens=3))
    trace = run_all(sched, runner)
    assert max(len(o.num_scheduled_tokens) for o in trace.outputs) == 2
    assert sorted(trace.tokens) == [f"r{i}" for i in range(5)]
    assert_all_free(sched, runner)


def test_fcfs_order():
    sched = make_scheduler(num_blocks=64, max_num_seqs=1)
    runner = FakeRunner(64)
    # Later requests are shorter: FCFS must still serve them in arrival order.
    for i in range(4):
        sched.add_request(make_request(f"r{i}", prompt_of(i, 12 - 2 * i), max_tokens=4 - i))
    trace = run_all(sched, runner)
    assert trace.finish_order == ["r0", "r1", "r2", "r3"]
    first_step = {}
    for n, out in enumerate(trace.outputs):
        for rid in out.num_scheduled_tokens:
            first_step.setdefault(rid, n)
    assert sorted(first_step, key=first_step.get) == ["r0", "r1", "r2", "r3"]

    # With room for everyone, admission within one step also follows arrival order.
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=20)
    for i in range(4):
        sched.add_request(make_request(f"q{i}", prompt_of(i, 8), max_tokens=2))
    out = sched.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["q0", "q1", "q2"]
    assert out.num_scheduled_tokens == {"q0": 8, "q1": 8, "q2": 4}  # q2 gets a chunk


def _workload(n: int = 6) -> list[Request]:
    return [
        make_request(f"r{i}", prompt_of(i, 7 + 3 * i), max_tokens=10 + 2 * i, ignore_eos=True)
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("num_blocks", "budget", "enable_prefix_caching"),
    [(12, 32, True), (12, 32, False), (12, 6, False), (14, 8, True)],
)
def test_preemption_when_blocks_run_out_gives_the_same_tokens(
    num_blocks, budget, enable_prefix_caching
):
    big = make_scheduler(num_blocks=256, max_num_batched_tokens=budget)
    big_runner = FakeRunner(256)
    for r in _workload():
        big.add_request(r)
    ref = run_all(big, big_runner)
    assert big.num_preemptions == 0

    # The longest request needs cdiv(22 + 20, 4) = 11 blocks; give just a bit more.
    small = make_scheduler(
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        enable_prefix_caching=enable_prefix_caching,
    )
    small_runner = FakeRunner(num_blocks)
    reqs = _workload()
    for r in reqs:
        small.add_request(r)
    got = run_all(small, small_runner)
    assert small.num_preemptions > 0
    assert small.stats().num_preemptions == small.num_preemptions
    assert any(r.num_preemptions > 0 for r in reqs)
    assert got.tokens == ref.tokens
    assert all(len(got.tokens[r.request_id]) == r.sampling_params.max_tokens for r in reqs)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert_all_free(small, small_runner)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preempted_requests_are_dropped_then_resent_in_full(enable_prefix_caching):
    sched = make_scheduler(
        num_blocks=12, max_num_batched_tokens=32, enable_prefix_caching=enable_prefix_caching
    )
    runner = FakeRunner(12)
    reqs = {r.request_id: r for r in _workload()}
    for r in reqs.values():
        sched.add_request(r)
    trace = Trace()
    preempted_seen: set[str] = set()
    pending_resend: dict[str, list[int]] = {}  # id -> its tokens when preempted
    resent_with_outputs = 0
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        before = sched.num_preemptions
        out = step(sched, runner, trace)
        for new in out.scheduled_new_reqs:
            if new.req_id in pending_resend:
                r = reqs[new.req_id]
                # Resent with everything generated so far; the prompt length is unchanged.
                assert new.num_prompt_tokens == len(r.prompt_token_ids)
                snapshot = pending_resend.pop(new.req_id)
                assert new.token_ids == snapshot
                assert snapshot[: len(r.prompt_token_ids)] == r.prompt_token_ids
                resent_with_outputs += len(snapshot) > len(r.prompt_token_ids)
        for cached in out.scheduled_cached_reqs:
            assert cached.req_id not in pending_resend
        newly = {
            rid
            for rid, r in reqs.items()
            if r.status == RequestStatus.PREEMPTED and rid not in pending_resend
        }
        assert len(newly) == sched.num_preemptions - before
        for rid in newly:
            # Preempted while planning this step: not scheduled, and the worker is told to
            # drop its state in this very step (it is resent in full when readmitted).
            assert rid not in out.num_scheduled_tokens
            assert rid in out.finished_req_ids
            assert rid not in runner.states
            preempted_seen.add(rid)
            pending_resend[rid] = list(reqs[rid].all_token_ids)
    else:
        pytest.fail("requests did not finish")
    assert preempted_seen
    assert resent_with_outputs > 0  # some were preempted during decode, not only in prefill
    assert not pending_resend
    assert sum(r.num_preemptions for r in reqs.values()) == sched.num_preemptions
    # num_cached_tokens is fixed at the first scheduling (no prompt was cached then), even
    # when a readmission hits the request's own blocks.
    assert all(r.num_cached_tokens == 0 for r in reqs.values())
    if enable_prefix_caching:
        assert sched.kv_cache_manager.prefix_cache_stats.hits > 0
    assert_all_free(sched, runner)


def test_preemption_evicts_the_most_recently_admitted_request():
    # 4 blocks of 4 tokens; two requests of 7 prompt tokens each hold 2 blocks. The first
    # decode that needs a 3rd block for r0 must preempt r1 (admitted later), not r0, and r1
    # goes back to the front of the queue, ahead of r2 that never ran.
    sched = make_scheduler(num_blocks=4, max_num_seqs=2, max_num_batched_tokens=32)
    runner = FakeRunner(4)
    r0 = make_request("r0", prompt_of(0, 7), max_tokens=6, ignore_eos=True)
    r1 = make_request("r1", prompt_of(1, 7), max_tokens=6, ignore_eos=True)
    r2 = make_request("r2", prompt_of(2, 3), max_tokens=1)
    for r in (r0, r1, r2):
        sched.add_request(r)
    trace = Trace()
    step(sched, runner, trace)  # both prefill: 7 + 7 tokens, 2 + 2 blocks
    assert sched.kv_cache_manager.num_free_blocks == 0
    step(sched, runner, trace)  # token 8 of each fits in block 1
    out = step(sched, runner, trace)  # r0 needs block 2 -> r1 preempted
    assert sched.num_preemptions == 1
    assert r1.status == RequestStatus.PREEMPTED and r1.num_computed_tokens == 0
    assert r1.num_preemptions == 1 and r0.num_preemptions == 0
    assert r0.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {"r0": 1}
    assert list(sched.waiting) == [r1, r2]
    assert sched.running == [r0]
    # The worker drops r1 in the same step.
    assert out.finished_req_ids == {"r1"}
    assert "r1" not in runner.states
    nxt = step(sched, runner, trace)
    assert "r1" not in nxt.finished_req_ids
    run_all(sched, runner, trace)
    assert r0.num_output_tokens == r1.num_output_tokens == 6
    # Readmission follows the queue: r1 is sent to the worker before r2.
    resent = [n.req_id for o in trace.outputs[3:] for n in o.scheduled_new_reqs]
    assert resent == ["r1", "r2"]
    assert_all_free(sched, runner)


