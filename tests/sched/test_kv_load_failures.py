"""Load failures as the scheduler sees them (pdkv/sched/kv_connector_state.py): invalid blocks are
named per KV cache group, and a failed pull of a request aborted during its load still counts in
the load-failure counters. Torch-free; fakes from test_scheduler_kv_connector."""

from __future__ import annotations

import msgspec
import pytest
from kv_connector_fakes import (
    NUM_BLOCKS,
    FakeWorker,
    assert_all_free,
    make_scheduler,
    prompt_of,
    remote_req,
    step,
)

from pdkv.kv_transfer.connector.base import KVConnectorOutput
from pdkv.request import RequestStatus


def test_invalid_block_of_one_group_fails_only_the_request_that_owns_it_in_that_group():
    sched, conn = make_scheduler(policy="fail", num_groups=2)
    worker = FakeWorker()
    kv = sched.kv_cache_manager
    # Shift group 1's allocation by three blocks, so that the same block id belongs to
    # different requests in the two groups.
    spacer = kv.block_pools[1].get_new_blocks(3)
    a = remote_req("a", prompt_of(60, 12), max_tokens=2)
    b = remote_req("b", prompt_of(61, 12), max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, worker)
    assert kv.get_block_ids("a") == ([0, 1, 2], [3, 4, 5])
    assert kv.get_block_ids("b") == ([3, 4, 5], [6, 7, 8])
    worker.load(sched, a)
    # Block 3 of group 0 (b's) failed; a owns block 3 of group 1. The report crosses the wire.
    report = KVConnectorOutput(finished_recving={"a", "b"}, invalid_block_ids={(0, 3)},
                               load_errors={})
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(report), type=KVConnectorOutput)
    assert wire.invalid_block_ids == {(0, 3)}
    step(sched, worker, wire)
    out, _ = step(sched, worker)
    assert b.status == RequestStatus.FINISHED_ERROR and "invalid blocks" in (b.error or "")
    assert a.status == RequestStatus.RUNNING and a.error is None
    assert out.num_scheduled_tokens == {"a": 1}
    assert sched.kv_stats["kv_load_failures_fail"] == 1
    assert not sched.kv_state.invalid_blocks
    for _ in range(10):
        if not sched.has_unfinished_requests():
            break
        step(sched, worker)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    kv.block_pools[1].free_blocks(spacer)
    assert_all_free(sched)
    assert kv.block_pools[1].num_free_blocks == NUM_BLOCKS



@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("report", ["load_error", "invalid_blocks", "success"])
def test_failed_pull_of_a_request_aborted_during_its_load_is_counted(policy, report):
    sched, conn = make_scheduler(policy=policy)
    worker = FakeWorker()
    r = remote_req("r", prompt_of(64, 10))
    sched.add_request(r)
    step(sched, worker)
    table = sched.kv_cache_manager.get_block_ids("r")[0]
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert "r" in sched.kv_state.delayed_free  # the pull is still writing into its blocks
    kv_out = KVConnectorOutput(finished_recving={"r"}, stats={"kv_load_failures": 1.0})
    if report == "load_error":
        kv_out.load_errors["r"] = "peer went away"
    elif report == "invalid_blocks":
        kv_out.invalid_block_ids.update((0, b) for b in table)
    else:
        kv_out.stats.clear()
    step(sched, worker, kv_out)
    failures = sched.kv_stats.get("kv_load_failures_" + policy, 0.0)
    assert failures == (0.0 if report == "success" else 1.0)
    step(sched, worker)  # counted once only
    assert sched.kv_stats.get("kv_load_failures_" + policy, 0.0) == failures
    assert not sched.kv_state.load_errors and not sched.kv_state.invalid_blocks
    assert_all_free(sched)


def test_late_load_error_of_a_freed_request_is_counted_and_does_not_fail_a_reused_id():
    sched, conn = make_scheduler(policy="fail", delay_inflight=False)
    worker = FakeWorker()
    first = remote_req("x", prompt_of(65, 10))
    sched.add_request(first)
    step(sched, worker)
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)  # blocks freed at once
    # The first load's failure arrives later, for a request that is gone.
    step(sched, worker, KVConnectorOutput(load_errors={"x": "peer went away"}))
    assert sched.kv_stats["kv_load_failures_fail"] == 1
    assert not sched.kv_state.load_errors
    again = remote_req("x", prompt_of(66, 10))  # then the id is reused (e.g. X-Request-Id)
    sched.add_request(again)
    step(sched, worker)
    assert again.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    worker.load(sched, again)
    step(sched, worker, KVConnectorOutput(finished_recving={"x"}))  # the new load succeeded
    out, _ = step(sched, worker)
    assert again.status == RequestStatus.RUNNING and again.error is None
    assert out.num_scheduled_tokens == {"x": 1}
    assert sched.kv_stats["kv_load_failures_fail"] == 1


def test_a_partly_failed_load_with_a_window_group_restarts_from_the_local_hits():
    """With a sliding-window group, D loads only the window of the last prompt token, so blocks
    before the first invalid one do not make a valid prefix: the request starts over."""
    sched, conn = make_scheduler(policy="recompute", num_groups=2, window=6)
    worker = FakeWorker()
    r = remote_req("r", prompt_of(9, 11), max_tokens=2)
    sched.add_request(r)
    step(sched, worker)
    full_table = sched.kv_cache_manager.get_block_ids("r")[0]
    worker.load(sched, r)
    step(
        sched,
        worker,
        KVConnectorOutput(finished_recving={"r"}, invalid_block_ids={(0, full_table[2])}),
    )
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"r": 11}  # not 8: blocks 0-1 of the window group never came
    assert sched.kv_stats["kv_load_failures_recompute"] == 1
