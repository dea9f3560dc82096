"""Load failures as the scheduler sees them (pdkv/sched/kv_connector_state.py): invalid blocks are
named per KV cache group, and a failed pull of a request aborted during its load still counts in
the load-failure counters. Torch-free; fakes from test_scheduler_kv_connector."""

from __future__ import annotations

import msgspec
from test_scheduler_kv_connector import (
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

