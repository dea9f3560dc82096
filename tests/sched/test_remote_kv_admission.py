"""Admission of remote (asynchronous) KV loads under a watermark (pdkv/sched/scheduler.py): a
burst of decode legs into a small decode engine must not take the blocks its running decodes
need next, so no preemption is caused by admitted loads. Torch-free; fakes from
test_scheduler_kv_connector."""

from __future__ import annotations

import pytest
from kv_connector_fakes import (
    FakeWorker,
    local_req,
    make_scheduler,
    prompt_of,
    remote_req,
    step,
)

from pdkv.config import SchedulerConfig
from pdkv.kv_transfer.connector.base import KVConnectorOutput
from pdkv.request import Request, RequestStatus
from pdkv.sched.scheduler import Scheduler

SMALL_POOL = 24
LOAD_STEPS = 3  # a pull takes this many steps


def run_burst(sched: Scheduler, worker: FakeWorker, legs: list[Request]) -> int:
    """Step until every request finished; a load completes LOAD_STEPS steps after it started.
    Returns the largest number of loads in flight at once."""
    started: dict[str, int] = {}
    most_loading = 0
    kv_out = None
    for n in range(400):
        if not (sched.has_unfinished_requests() or sched.has_pending_kv_work()):
            return most_loading
        step(sched, worker, kv_out)
        kv_out = KVConnectorOutput()
        for rid, req in sched.waiting_for_remote.items():
            started.setdefault(rid, n)
            if n - started[rid] >= LOAD_STEPS:
                worker.load(sched, req)
                kv_out.finished_recving.add(rid)
        most_loading = max(most_loading, len(sched.waiting_for_remote))
    pytest.fail(f"did not settle: {sched.stats()}")


def test_32_decode_legs_into_a_small_pool_cause_no_preemption():
    sched, conn = make_scheduler(num_blocks=SMALL_POOL)
    worker = FakeWorker(num_blocks=SMALL_POOL)
    # Four running decodes: 7-token prompts (2 blocks) that need a third block at token 9.
    decodes = [local_req(f"d{i}", prompt_of(80 + i, 7), max_tokens=5) for i in range(4)]
    for r in decodes:
        sched.add_request(r)
    step(sched, worker)
    assert all(r.status == RequestStatus.RUNNING for r in decodes)
    # 32 decode legs: 6-token prompts (2 blocks), each needs a third block at its 3rd token.
    legs = [remote_req(f"leg{i}", prompt_of(100 + i, 6), max_tokens=4) for i in range(32)]
    for r in legs:
        sched.add_request(r)
    most_loading = run_burst(sched, worker, legs)

    assert sched.num_preemptions == 0
    assert all(r.num_preemptions == 0 for r in decodes + legs)
    assert 1 < most_loading < 32  # loads overlapped, but the pool held only some at a time
    for r in decodes:
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_output_tokens == 5
    for r in legs:  # the fake worker checked every loaded position before sampling
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_output_tokens == 4
    assert sched.kv_cache_manager.num_free_blocks == SMALL_POOL
    assert all(b.ref_cnt == 0 for b in sched.kv_cache_manager.block_pools[0].blocks)
    assert not sched.kv_state.delayed_free and not sched.waiting_for_remote


def test_a_load_held_back_by_the_watermark_holds_later_loads_but_not_local_requests():
    sched, conn = make_scheduler(num_blocks=12)
    worker = FakeWorker(num_blocks=12)
    running = [local_req(f"d{i}", prompt_of(90 + i, 11), max_tokens=8) for i in range(2)]
    for r in running:
        sched.add_request(r)
    step(sched, worker)  # 2 x 3 blocks; 6 free
    leg = remote_req("leg", prompt_of(95, 16))  # 4 blocks would leave 2 < reserve 1 + 2 + 1
    leg2 = remote_req("leg2", prompt_of(98, 3))  # would fit, but loads start in order
    small = local_req("small", prompt_of(96, 3), max_tokens=1)
    sched.add_request(leg)
    sched.add_request(leg2)
    sched.add_request(small)
    out, _ = step(sched, worker)
    assert leg.status == RequestStatus.WAITING and list(sched.waiting) == [leg, leg2]
    assert "small" in out.num_scheduled_tokens and small.is_finished
    # Once the decodes finish the leg is admitted.
    for _ in range(20):
        if leg.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
        step(sched, worker)
    assert leg.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert leg2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert all(r.is_finished for r in running)  # their growth used the blocks it left free
    assert sched.num_preemptions == 0


def test_a_lone_load_is_admitted_even_when_it_fills_the_pool():
    sched, conn = make_scheduler(num_blocks=4)
    worker = FakeWorker(num_blocks=4)
    leg = remote_req("leg", prompt_of(97, 16), max_tokens=1)
    sched.add_request(leg)
    step(sched, worker)
    assert leg.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sched.kv_cache_manager.num_free_blocks == 0


def test_remote_kv_watermark_is_validated():
    assert SchedulerConfig().remote_kv_watermark == 0.01
    with pytest.raises(ValueError, match="remote_kv_watermark"):
        SchedulerConfig(remote_kv_watermark=1.0)
    with pytest.raises(ValueError, match="remote_kv_watermark"):
        SchedulerConfig(remote_kv_watermark=-0.1)
