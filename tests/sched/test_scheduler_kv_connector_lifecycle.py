"""The scheduler's KV connector paths, part 2 (pdkv/sched/scheduler.py): delayed frees for
producers and aborted loads, KV transfer stats, many mixed outcomes, the real P2P connector's
scheduler half, and request-id reuse. Fakes: kv_connector_fakes.py."""

from __future__ import annotations

import pytest
from kv_connector_fakes import (
    BS,
    NUM_BLOCKS,
    FakeWorker,
    assert_all_free,
    block_ids,
    drain,
    in_group0,
    local_req,
    make_scheduler,
    prompt_of,
    remote_req,
    step,
)

from pdkv.cache.kv_layout import KVLayout
from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pdkv.config import CacheConfig, KVTransferConfig, SchedulerConfig
from pdkv.kv_transfer.connector.base import (
    KVConnectorOutput,
    KVConnectorRole,
)
from pdkv.kv_transfer.connector.p2p import P2PConnector
from pdkv.kv_transfer.connector.p2p_messages import P2PConnectorMetadata, prompt_digest
from pdkv.kv_transfer.connector.spec import connector_spec
from pdkv.request import Request, RequestStatus
from pdkv.sampling_params import SamplingParams
from pdkv.sched.output import ModelRunnerOutput, SchedulerOutput
from pdkv.sched.scheduler import RequestUpdate, Scheduler


def test_producer_blocks_are_held_until_finished_sending():
    sched, conn = make_scheduler()
    worker = FakeWorker()
    prompt = prompt_of(14, 10)
    p = local_req("p", prompt, max_tokens=1, do_remote_decode=True)
    sched.add_request(p)
    out, updates = step(sched, worker)
    table = list(out.scheduled_new_reqs[0].block_ids[0])
    assert p.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert updates[0].finished and updates[0].request is p
    assert conn.finished_calls == [("p", RequestStatus.FINISHED_LENGTH_CAPPED, (table,))]
    assert p.output_kv_transfer_params == {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": "fake-engine", "remote_request_id": "p",
        "remote_block_ids": [table], "num_tokens": 10,
    }
    # Finished for the client, but its blocks stay until the connector lets go.
    assert not sched.has_unfinished_requests() and sched.get_num_unfinished_requests() == 0
    assert sched.has_pending_kv_work()
    assert "p" not in sched.requests
    assert block_ids(sched, "p") == table
    stats = sched.stats()
    assert stats.num_free_blocks == NUM_BLOCKS - 3
    assert stats.num_blocks_held_for_remote == 3
    # The worker is told to drop the request at the next step anyway.
    out, _ = step(sched, worker)
    assert out.finished_req_ids == {"p"}
    for _ in range(3):  # unrelated reports do not free them
        step(sched, worker, KVConnectorOutput(finished_sending={"other"},
                                              finished_recving={"other2"}))
        assert sched.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 3

    step(sched, worker, KVConnectorOutput(finished_sending={"p"}))
    assert sched.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    assert sched.stats().num_blocks_held_for_remote == 0
    assert not sched.has_pending_kv_work()
    assert_all_free(sched)
    # The sent blocks stay in the prefix cache (freed, not evicted).
    hits, n = sched.kv_cache_manager.get_computed_blocks(local_req("x", list(prompt)))
    assert n == 8


def test_producer_request_aborted_or_without_do_remote_decode_is_freed_at_once():
    sched, conn = make_scheduler()
    worker = FakeWorker()
    plain = local_req("plain", prompt_of(15, 6), max_tokens=1)
    aborted = local_req("ab", prompt_of(16, 6), max_tokens=5, do_remote_decode=True)
    sched.add_request(plain)
    sched.add_request(aborted)
    step(sched, worker)
    assert plain.is_finished and plain.output_kv_transfer_params is None
    assert sched.finish_requests(["ab"], RequestStatus.FINISHED_ABORTED) == [aborted]
    assert aborted.output_kv_transfer_params is None
    assert sched.finish_requests(["ab", "unknown"], RequestStatus.FINISHED_ABORTED) == []
    assert [c[:2] for c in conn.finished_calls] == [
        ("plain", RequestStatus.FINISHED_LENGTH_CAPPED), ("ab", RequestStatus.FINISHED_ABORTED)
    ]
    assert_all_free(sched)
    assert not sched.has_pending_kv_work()


def test_abort_while_waiting_for_remote_kv_frees_blocks_after_finished_recving():
    sched, conn = make_scheduler()
    worker = FakeWorker()
    r = remote_req("r", prompt_of(17, 10))
    sched.add_request(r)
    step(sched, worker)
    table = block_ids(sched, "r")
    assert sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED) == [r]
    assert r.status == RequestStatus.FINISHED_ABORTED
    assert conn.finished_calls == [("r", RequestStatus.FINISHED_ABORTED, (table,))]
    assert not sched.waiting_for_remote and not sched.has_unfinished_requests()
    stats = sched.stats()
    assert stats.num_waiting_for_remote_kv == 0
    assert stats.num_blocks_held_for_remote == 3
    assert stats.num_free_blocks == NUM_BLOCKS - 3
    assert sched.has_pending_kv_work()
    # The worker may still be writing into them: they stay allocated until the load ends.
    for _ in range(3):
        out, _ = step(sched, worker)
        assert out.is_empty
        assert block_ids(sched, "r") == table
    step(sched, worker, KVConnectorOutput(finished_recving={"r"}, load_errors={"r": "gone"}))
    assert_all_free(sched)
    assert not sched.kv_state.load_errors and not sched.kv_state.finished_recving
    assert not sched.has_pending_kv_work()
    out, _ = step(sched, worker)
    assert out.is_empty and r.status == RequestStatus.FINISHED_ABORTED


def test_abort_while_waiting_for_remote_kv_without_delay_frees_at_once():
    sched, conn = make_scheduler(delay_inflight=False)
    worker = FakeWorker()
    r = remote_req("r", prompt_of(18, 10))
    sched.add_request(r)
    step(sched, worker)
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(sched)
    # A late finished_recving for it is ignored.
    step(sched, worker, KVConnectorOutput(finished_recving={"r"}))
    assert_all_free(sched)
    assert not sched.kv_state.finished_recving


def test_abort_before_admission_does_not_ask_to_delay():
    sched, conn = make_scheduler()
    r = remote_req("r", prompt_of(19, 10))
    sched.add_request(r)
    assert sched.get_num_unfinished_requests() == 1
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert conn.finished_calls == [("r", RequestStatus.FINISHED_ABORTED, ([],))]
    assert_all_free(sched)
    assert not sched.has_unfinished_requests() and not sched.has_pending_kv_work()


def test_kv_stats_accumulate_and_transfer_times_are_drained():
    sched, conn = make_scheduler()
    worker = FakeWorker()
    step(sched, worker, KVConnectorOutput(stats={"kv_bytes_received": 100.0, "kv_transfers": 1.0},
                                          transfer_seconds=[0.5]))
    step(
        sched,
        worker,
        KVConnectorOutput(
            stats={"kv_bytes_received": 50.0, "lease_expirations": 2.0},
            transfer_seconds=[0.25, 0.125],
        ),
    )
    step(sched, worker)  # no report: nothing changes
    expected = {"kv_bytes_received": 150.0, "kv_transfers": 1.0, "lease_expirations": 2.0}
    assert sched.kv_stats == expected
    stats = sched.stats()
    assert stats.kv_transfer == expected
    assert stats.transfer_seconds == [0.5, 0.25, 0.125]
    assert sched.stats().transfer_seconds == []  # drained by the first read
    assert sched.stats().kv_transfer == expected  # counters are cumulative
    # Every report is forwarded to the connector after the scheduler used it.
    assert len(conn.outputs) == 2


def test_failure_counters_are_added_to_kv_stats():
    sched, _ = make_scheduler(policy="recompute")
    worker = FakeWorker()
    for i in range(2):
        r = remote_req(f"r{i}", prompt_of(20 + i, 6), max_tokens=1)
        sched.add_request(r)
        step(sched, worker)
        step(sched, worker, KVConnectorOutput(finished_recving={r.request_id},
                                              load_errors={r.request_id: "x"},
                                              stats={"kv_load_failures": 1.0}))
    drain(sched, worker)
    assert sched.kv_stats == {"kv_load_failures": 2.0, "kv_load_failures_recompute": 2.0}
    assert_all_free(sched)


def test_many_remote_requests_mixed_outcomes_leave_no_block_behind():
    """A longer run: loads that succeed, fail (recompute) and get aborted, interleaved with
    local requests and a producer request, under a small pool."""
    sched, conn = make_scheduler(policy="recompute", max_num_batched_tokens=16)
    worker = FakeWorker()
    reqs = {}
    for i in range(9):
        kind = ("remote", "remote_fail", "remote_abort", "local", "producer")[i % 5]
        prompt = prompt_of(30 + i, 5 + 3 * i)
        if kind.startswith("remote"):
            reqs[f"{kind}{i}"] = remote_req(f"{kind}{i}", prompt, max_tokens=3)
        elif kind == "local":
            reqs[f"{kind}{i}"] = local_req(f"{kind}{i}", prompt, max_tokens=3)
        else:
            reqs[f"{kind}{i}"] = local_req(f"{kind}{i}", prompt, max_tokens=1,
                                           do_remote_decode=True)
        sched.add_request(reqs[f"{kind}{i}"])
    kv_out: KVConnectorOutput | None = None
    for _ in range(300):
        if not (sched.has_unfinished_requests() or sched.has_pending_kv_work()):
            break
        _, _ = step(sched, worker, kv_out)
        kv_out = KVConnectorOutput()
        for rid, req in list(sched.waiting_for_remote.items()):
            if rid.startswith("remote_abort"):
                sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                kv_out.finished_recving.add(rid)
                kv_out.load_errors[rid] = "aborted"
            elif rid.startswith("remote_fail"):
                kv_out.finished_recving.add(rid)
                kv_out.load_errors[rid] = "boom"
            else:
                worker.load(sched, req)
                kv_out.finished_recving.add(rid)
        kv_out.finished_sending.update(conn.held)
    else:
        pytest.fail("did not settle")
    for rid, req in reqs.items():
        if rid.startswith("remote_abort"):
            assert req.status == RequestStatus.FINISHED_ABORTED
        else:
            assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED, rid
    assert_all_free(sched)


def test_real_p2p_connector_scheduler_half_drives_a_remote_prefill():
    """The P2P connector's scheduler half (torch-free) with the scheduler: the RecvSpec covers
    exactly the request's blocks, and the renewal entry is dropped once pulling starts."""
    kv_config = KVCacheConfig(
        NUM_BLOCKS, (KVCacheGroupSpec((0,), FullAttentionSpec(BS, num_kv_heads=1, head_size=8)),)
    )
    layout = {"model_digest": "m", "dtype": "float32", "block_size": BS, "num_layers": 1,
              "num_kv_heads": 1, "head_size": 8, "kv_layout": "cross_layer"}
    cfg = connector_spec(KVTransferConfig("P2PConnector", "kv_consumer", engine_id="d0"), BS)
    conn = P2PConnector(cfg, KVConnectorRole.SCHEDULER, kv_config, KVLayout.from_wire(layout),
                        ["127.0.0.1", 9])
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=128),
                      CacheConfig(block_size=BS, num_kv_blocks=NUM_BLOCKS), kv_config,
                      connector=conn, kv_load_failure_policy="recompute")
    prompt = prompt_of(40, 10)
    params = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_request_id": "p-r",
              "remote_block_ids": [[20, 21, 22]], "remote_host": "10.0.0.2", "remote_port": 7,
              "block_size": BS, "num_tokens": 10, "layout": dict(layout),
              "remote_nonce": "n0", "prompt_digest": prompt_digest(prompt, None)}
    r = Request("r", prompt, SamplingParams(max_tokens=2), BS, kv_transfer_params=params)
    conn.validate_request(r)
    sched.add_request(r)
    assert conn.has_pending_work()
    out = sched.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, P2PConnectorMetadata)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [(s.request_id, s.local_block_ids, s.remote_block_ids) for s in meta.reqs_to_recv] == [
        ("r", (block_ids(sched, "r"),), ([20, 21, 22],))
    ]
    worker = FakeWorker()
    worker.execute(out)
    worker.load(sched, r)
    sched.update_from_output(out, ModelRunnerOutput(
        sampled_token_ids={}, kv_connector_output=KVConnectorOutput(finished_recving={"r"})))
    assert not conn.has_pending_work()
    out, _ = step_any(sched, worker)
    assert out.num_scheduled_tokens == {"r": 1}
    assert out.kv_connector_metadata.reqs_to_recv == []
    while sched.has_unfinished_requests():
        step_any(sched, worker)
    assert r.output_kv_transfer_params is None
    assert_all_free(sched)


def step_any(sched: Scheduler, worker: FakeWorker) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    out = sched.schedule()
    return out, sched.update_from_output(
        out, ModelRunnerOutput(sampled_token_ids=worker.execute(out))
    )


# ------------------------------------------------------------- regressions
def test_invalid_blocks_of_an_aborted_load_do_not_poison_later_loads():
    sched, conn = make_scheduler(policy="fail", num_blocks=3)
    worker = FakeWorker(num_blocks=3)
    a = remote_req("a", prompt_of(50, 12))  # takes the whole pool
    sched.add_request(a)
    step(sched, worker)
    table = block_ids(sched, "a")
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    # Its pull then fails: the worker reports it as received, with its blocks invalid.
    step(
        sched,
        worker,
        KVConnectorOutput(
            finished_recving={"a"}, invalid_block_ids=in_group0(table), load_errors={"a": "timeout"}
        ),
    )
    assert sched.kv_cache_manager.num_free_blocks == 3
    b = remote_req("b", prompt_of(51, 12))
    sched.add_request(b)
    step(sched, worker)
    assert sorted(block_ids(sched, "b")) == sorted(table)  # the same blocks, reused
    worker.load(sched, b)
    step(sched, worker, KVConnectorOutput(finished_recving={"b"}))  # b's load succeeded
    out, _ = step(sched, worker)
    assert b.status == RequestStatus.RUNNING, b.error
    assert out.num_scheduled_tokens == {"b": 1}


def test_reused_request_id_does_not_inherit_a_stale_finished_recving():
    sched, conn = make_scheduler(policy="fail")
    worker = FakeWorker()
    first = remote_req("x", prompt_of(52, 10))
    sched.add_request(first)
    step(sched, worker)
    worker.load(sched, first)
    step(sched, worker, KVConnectorOutput(finished_recving={"x"}))  # load done...
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)  # ...aborted before resuming
    assert sched.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    again = remote_req("x", prompt_of(53, 10))  # same id, new request (e.g. X-Request-Id)
    sched.add_request(again)
    step(sched, worker)
    step(sched, worker)  # no finished_recving for the new load has arrived
    assert again.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert again.num_computed_tokens == 0


def test_reusing_the_id_of_a_request_whose_blocks_are_held_is_refused_until_released():
    """The connector names held blocks by request id, so a second request with that id is
    refused while the first one's blocks are held, and accepted once they are released."""
    sched, conn = make_scheduler()
    worker = FakeWorker()
    prompt = prompt_of(54, 12)
    p = local_req("same", prompt, max_tokens=1, do_remote_decode=True)
    sched.add_request(p)
    step(sched, worker)
    assert p.status == RequestStatus.FINISHED_LENGTH_CAPPED
    held = block_ids(sched, "same")
    assert sched.stats().num_blocks_held_for_remote == 3
    again = local_req("same", list(prompt), max_tokens=1, do_remote_decode=True)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(again)
    # The refused request left no trace: nothing queued, the held blocks untouched.
    assert not sched.requests and not sched.waiting and conn.new_requests == ["same"]
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {}
    assert block_ids(sched, "same") == held
    assert sched.stats().num_blocks_held_for_remote == 3

    step(sched, worker, KVConnectorOutput(finished_sending={"same"}))  # the first one's release
    assert sched.stats().num_blocks_held_for_remote == 0
    sched.add_request(again)  # the id is free now
    step(sched, worker)
    assert again.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert again.output_kv_transfer_params is not None
    assert sched.stats().num_blocks_held_for_remote == 3  # the second one's blocks
    step(sched, worker, KVConnectorOutput(finished_sending={"same"}))
    assert_all_free(sched)
