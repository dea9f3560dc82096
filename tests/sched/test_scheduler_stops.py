"""Stop conditions, aborts, duplicate ids, prefix-cache accounting and queue stats of the
scheduler (pdkv/sched/scheduler.py), driven by the torch-free fake model runner of
scheduler_fakes.py. Batching, chunked prefill and preemption: test_scheduler.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from scheduler_fakes import (
    EOS,
    FakeRunner,
    Trace,
    assert_all_free,
    default_token,
    make_request,
    make_scheduler,
    prompt_of,
    run_all,
    step,
)

from pdkv.request import RequestStatus
from pdkv.sched.output import ModelRunnerOutput


def test_eos_stops_unless_ignore_eos():
    def eos_at_third_output(req_id: str, token_ids: list[int]) -> int:
        return EOS if len(token_ids) == 8 + 2 else default_token(req_id, token_ids)

    sched = make_scheduler()
    runner = FakeRunner(64, token_fn=eos_at_third_output)
    stop = make_request("stop", prompt_of(0, 8), max_tokens=10)
    ign = make_request("ignore", prompt_of(1, 8), max_tokens=10, ignore_eos=True)
    no_eos = make_request("no-eos-id", prompt_of(2, 8), eos=None, max_tokens=10)
    for r in (stop, ign, no_eos):
        sched.add_request(r)
    trace = run_all(sched, runner)
    assert stop.status == RequestStatus.FINISHED_STOPPED
    assert stop.get_finished_reason() == "stop"
    assert stop.output_token_ids[-1] == EOS and stop.num_output_tokens == 3
    assert stop.stop_reason is None
    assert ign.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert ign.num_output_tokens == 10 and ign.output_token_ids[2] == EOS
    assert no_eos.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert no_eos.num_output_tokens == 10
    assert trace.tokens["stop"] == stop.output_token_ids
    assert_all_free(sched, runner)


def test_stop_token_ids_set_stop_reason():
    def fixed(req_id: str, token_ids: list[int]) -> int:
        return {10: 50, 11: 51, 12: 77}.get(len(token_ids), 60)

    sched = make_scheduler()
    runner = FakeRunner(64, token_fn=fixed)
    a = make_request("a", prompt_of(0, 10), max_tokens=10, stop_token_ids=[77, 51])
    b = make_request("b", prompt_of(1, 10), max_tokens=10, stop_token_ids=[77])
    c = make_request("c", prompt_of(2, 10), max_tokens=10, stop_token_ids=[99])
    for r in (a, b, c):
        sched.add_request(r)
    run_all(sched, runner)
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == 51
    assert a.output_token_ids == [50, 51]
    assert b.status == RequestStatus.FINISHED_STOPPED and b.stop_reason == 77
    assert b.output_token_ids == [50, 51, 77]
    assert c.status == RequestStatus.FINISHED_LENGTH_CAPPED and c.stop_reason is None
    assert c.num_output_tokens == 10
    assert_all_free(sched, runner)


def test_min_tokens_delays_eos_and_stop_tokens():
    def always(tok: int) -> Callable[[str, list[int]], int]:
        return lambda req_id, token_ids: tok

    sched = make_scheduler()
    eos_runner = FakeRunner(64, token_fn=always(EOS))
    r = make_request("a", prompt_of(0, 5), max_tokens=10, min_tokens=4)
    sched.add_request(r)
    run_all(sched, eos_runner)
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [EOS] * 4

    sched = make_scheduler()
    stop_runner = FakeRunner(64, token_fn=always(33))
    r = make_request("b", prompt_of(0, 5), max_tokens=10, min_tokens=3, stop_token_ids=[33])
    sched.add_request(r)
    run_all(sched, stop_runner)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 33
    assert r.num_output_tokens == 3

    # Without min_tokens the first EOS stops.
    sched = make_scheduler()
    r = make_request("c", prompt_of(0, 5), max_tokens=10)
    sched.add_request(r)
    run_all(sched, FakeRunner(64, token_fn=always(EOS)))
    assert r.output_token_ids == [EOS]


def test_max_model_len_caps_generation():
    sched = make_scheduler(max_model_len=14)
    runner = FakeRunner(64)
    r = make_request("a", prompt_of(0, 10), max_tokens=100)
    sched.add_request(r)
    run_all(sched, runner)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.num_tokens == 14 and r.num_output_tokens == 4
    assert_all_free(sched, runner)


def test_abort_waiting_and_running_requests_frees_blocks():
    sched = make_scheduler(num_blocks=32, max_num_seqs=2)
    runner = FakeRunner(32)
    reqs = [make_request(f"r{i}", prompt_of(i, 9), max_tokens=20) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    trace = Trace()
    step(sched, runner, trace)
    step(sched, runner, trace)
    assert [r.request_id for r in sched.running] == ["r0", "r1"]
    free_before = sched.kv_cache_manager.num_free_blocks
    r0_blocks = len(sched.kv_cache_manager.get_block_ids("r0")[0])
    assert r0_blocks > 0

    done = sched.finish_requests(["r0", "r3", "nope"], RequestStatus.FINISHED_ABORTED)
    assert done == [reqs[0], reqs[3]]
    assert reqs[0].status == reqs[3].status == RequestStatus.FINISHED_ABORTED
    assert reqs[0].get_finished_reason() == "abort"
    assert sched.kv_cache_manager.num_free_blocks == free_before + r0_blocks
    assert sched.kv_cache_manager.get_block_ids("r0") == ([],)
    assert reqs[0] not in sched.running and reqs[3] not in sched.waiting
    assert "r0" not in sched.requests and "r3" not in sched.requests
    assert sched.get_num_unfinished_requests() == 2
    # Finishing again is a no-op.
    assert sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED) == []

    out = step(sched, runner, trace)
    # The worker drops the running request it knew; r3 was never sent to it.
    assert out.finished_req_ids == {"r0"}
    assert "r0" not in runner.states
    assert "r2" in out.num_scheduled_tokens  # r0's seat went to r2
    # Late tokens for an aborted request are ignored.
    late = sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"r0": [5]}))
    assert late == [] and reqs[0].num_output_tokens == 2

    sched.finish_requests(["r1", "r2"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert_all_free(sched, runner)
    assert reqs[3].num_output_tokens == 0


def test_duplicate_request_id_raises():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt_of(0, 5)))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", prompt_of(1, 5)))
    assert sched.get_num_unfinished_requests() == 1
    # Once finished, the id may be reused.
    runner = FakeRunner(64)
    run_all(sched, runner)
    sched.add_request(make_request("a", prompt_of(1, 5), max_tokens=2))
    run_all(sched, runner)
    assert_all_free(sched, runner)


def test_num_cached_tokens_is_the_whole_block_prefix_of_a_repeated_prompt():
    prompt = prompt_of(3, 22)  # 5 full blocks of 4 + 2 tokens
    sched = make_scheduler()
    runner = FakeRunner(64)
    first = make_request("first", prompt, max_tokens=3)
    sched.add_request(first)
    ref = run_all(sched, runner)
    assert first.num_cached_tokens == 0

    again = make_request("again", prompt, max_tokens=3)
    sched.add_request(again)
    trace = run_all(sched, runner)  # FakeRunner checks the reused KV
    assert again.num_cached_tokens == 20
    assert trace.outputs[0].scheduled_new_reqs[0].num_computed_tokens == 20
    assert trace.outputs[0].num_scheduled_tokens == {"again": 2}
    # Same context, so the same tokens as a cold run (modulo the request id in token_fn).
    assert len(trace.tokens["again"]) == len(ref.tokens["first"]) == 3

    # A whole-block prompt still leaves its last token to compute: 24 tokens -> 20 cached.
    exact = make_request("exact", prompt_of(4, 24), max_tokens=1)
    sched.add_request(exact)
    run_all(sched, runner)
    exact2 = make_request("exact2", prompt_of(4, 24), max_tokens=1)
    sched.add_request(exact2)
    run_all(sched, runner)
    assert exact2.num_cached_tokens == 20

    # A different salt does not see the cache.
    salted = make_request("salted", prompt, max_tokens=1, cache_salt="t")
    sched.add_request(salted)
    run_all(sched, runner)
    assert salted.num_cached_tokens == 0

    stats = sched.kv_cache_manager.prefix_cache_stats
    assert stats.requests == 5
    assert stats.queries == 22 + 22 + 24 + 24 + 22
    assert stats.hits == 20 + 20
    assert_all_free(sched, runner)


def test_no_cached_tokens_with_prefix_caching_disabled():
    prompt = prompt_of(3, 22)
    sched = make_scheduler(enable_prefix_caching=False)
    runner = FakeRunner(64)
    for rid in ("a", "b"):
        r = make_request(rid, prompt, max_tokens=2)
        sched.add_request(r)
        run_all(sched, runner)
        assert r.num_cached_tokens == 0
    assert sched.kv_cache_manager.prefix_cache_stats.requests == 0
    assert_all_free(sched, runner)


def test_shared_prefix_across_concurrent_requests_gives_correct_kv():
    # Requests with a common 16-token prefix arrive together; later ones hit blocks the first
    # computes in the same step, and the fake runner verifies the KV each one reads.
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    runner = FakeRunner(64)
    common = prompt_of(9, 16)
    reqs = [make_request(f"r{i}", common + prompt_of(i, 3 + i), max_tokens=4) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    run_all(sched, runner)
    assert reqs[0].num_cached_tokens == 0
    assert all(r.num_cached_tokens == 16 for r in reqs[1:])
    assert all(r.num_output_tokens == 4 for r in reqs)
    assert_all_free(sched, runner)


def test_stats_reflect_queue_state():
    sched = make_scheduler(num_blocks=16, max_num_seqs=1)
    runner = FakeRunner(16)
    sched.add_request(make_request("a", prompt_of(0, 8), max_tokens=3))
    sched.add_request(make_request("b", prompt_of(1, 8), max_tokens=3))
    s = sched.stats()
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 2, 16)
    step(sched, runner, Trace())
    s = sched.stats()
    assert (s.num_running, s.num_waiting) == (1, 1)
    assert s.num_free_blocks == 16 - 2  # 8 prompt tokens; the 9th gets room next step
    assert s.kv_cache_usage == pytest.approx(2 / 16)
