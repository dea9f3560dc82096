"""The scheduler's KV connector paths (pdkv/sched/scheduler.py), part 1: remote prefill
(WAITING_FOR_REMOTE_KVS), prefix hits before a load, load failures by policy. Driven by a
torch-free fake connector (scheduler half only) and a fake worker that plays the model runner and
reports KVConnectorOutput by hand (kv_connector_fakes.py). Part 2:
test_scheduler_kv_connector_lifecycle.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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

from pdkv.cache.single_type_manager import cdiv
from pdkv.kv_transfer.connector.base import (
    KVConnectorOutput,
)
from pdkv.request import RequestStatus
from pdkv.sched.output import ModelRunnerOutput


# --------------------------------------------------------------------------- tests
def test_this_module_imports_without_torch():
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import kv_connector_fakes\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_remote_prefill_waits_for_its_kv_while_other_requests_run():
    sched, conn = make_scheduler()
    worker = FakeWorker()
    prompt = prompt_of(1, 10)
    r = remote_req("r", prompt, max_tokens=3)
    other = local_req("l", prompt_of(2, 7), max_tokens=6)
    sched.add_request(r)
    sched.add_request(other)
    assert conn.new_requests == ["r", "l"]

    out, _ = step(sched, worker)
    # r got blocks for its whole prompt and waits; l runs in the same step.
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "r" not in out.num_scheduled_tokens
    assert out.num_scheduled_tokens == {"l": 7}
    assert len(block_ids(sched, "r")) == cdiv(10, BS)
    assert r.num_computed_tokens == 0
    assert conn.alloc_calls[0] == ("r", (block_ids(sched, "r"),), 10)
    assert out.kv_connector_metadata.to_load == ["r"]
    assert sched.waiting_for_remote == {"r": r} and r not in sched.waiting
    # Loaded blocks are not in the prefix cache before the load ends.
    assert all(b.block_hash is None for b in sched.kv_cache_manager.managers[0].req_to_blocks["r"])
    stats = sched.stats()
    assert stats.num_waiting_for_remote_kv == 1 and stats.num_running == 1
    assert stats.num_waiting == 0
    assert stats.num_free_blocks == NUM_BLOCKS - 3 - 2
    assert sched.get_num_unfinished_requests() == 2
    assert sched.has_unfinished_requests() and sched.has_pending_kv_work()

    # Without finished_recving the request gets nothing, step after step.
    for _ in range(3):
        out, _ = step(sched, worker)
        assert out.num_scheduled_tokens == {"l": 1}
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # Allocated once; l's allocation reports no external tokens.
    assert conn.alloc_calls == [("r", (block_ids(sched, "r"),), 10), ("l", ([3, 4],), 0)]

    # The worker reports the load; the next step schedules exactly the last prompt token.
    worker.load(sched, r)
    step(sched, worker, KVConnectorOutput(finished_recving={"r"}))
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # resumes at the next schedule()
    out, updates = step(sched, worker)
    assert out.num_scheduled_tokens["r"] == 1
    new = next(n for n in out.scheduled_new_reqs if n.req_id == "r")
    assert new.num_computed_tokens == 9
    assert new.block_ids == sched.kv_cache_manager.get_block_ids("r")
    assert r.num_cached_tokens == 9
    assert r.status == RequestStatus.RUNNING
    assert sched.stats().num_waiting_for_remote_kv == 0
    # The fake worker verified every prompt position before sampling the first token.
    assert [u.new_token_ids for u in updates if u.request is r] == [r.output_token_ids]
    assert r.num_output_tokens == 1
    assert not conn.inflight

    drain(sched, worker)
    assert r.num_output_tokens == 3 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert other.num_output_tokens == 6
    assert_all_free(sched)
    assert not sched.has_pending_kv_work()


def test_loaded_blocks_are_registered_in_the_prefix_cache():
    sched, conn = make_scheduler()
    worker = FakeWorker()
    prompt = prompt_of(3, 10)  # 2 full blocks + 2 tokens
    r = remote_req("r", prompt, max_tokens=1)
    sched.add_request(r)
    step(sched, worker)
    loaded = sched.kv_cache_manager.managers[0].req_to_blocks["r"]
    worker.load(sched, r)
    step(sched, worker, KVConnectorOutput(finished_recving={"r"}))
    sched.schedule()  # resumes r: its full prompt blocks are cached now
    assert [b.block_hash is not None for b in loaded] == [True, True, False]
    assert sched.kv_cache_manager.managers[0].num_cached_block["r"] == 2

    # A later request with the same prompt hits both loaded blocks.
    sched2_req = local_req("again", list(prompt), max_tokens=1)
    hits, num_hit = sched.kv_cache_manager.get_computed_blocks(sched2_req)
    assert num_hit == 8
    assert hits.get_block_ids() == ([b.block_id for b in loaded[:2]],)


def test_remote_prefill_after_local_prefix_hit_loads_only_the_rest():
    sched, conn = make_scheduler()
    worker = FakeWorker()
    shared = prompt_of(4, 8)
    first = local_req("first", shared + [90, 91], max_tokens=1)
    sched.add_request(first)
    drain(sched, worker)

    r = remote_req("r", shared + [70, 71, 72, 73, 74, 75, 76])  # 15 tokens, 8 hit locally
    sched.add_request(r)
    stats = sched.kv_cache_manager.prefix_cache_stats
    queries, hits = stats.queries, stats.hits
    out, _ = step(sched, worker)
    # The local prefix lookup counts for a request that goes on to load the rest.
    assert (stats.queries - queries, stats.hits - hits) == (15, 8)
    assert out.num_scheduled_tokens == {}
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert ("r", 8) in conn.matched_calls
    table = block_ids(sched, "r")
    assert len(table) == 4
    # Only the two new blocks are given to the connector, with the 7 external tokens.
    assert conn.alloc_calls[-1] == ("r", (table[2:],), 7)
    assert r.num_computed_tokens == 8

    worker.load(sched, r)
    step(sched, worker, KVConnectorOutput(finished_recving={"r"}))
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"r": 1}
    assert r.num_cached_tokens == 14
    # 8 local hits, 6 pulled; the last prompt token is computed here (metrics: local_compute).
    assert (r.num_local_hit_tokens, r.num_external_tokens) == (8, 6)
    drain(sched, worker)
    assert_all_free(sched)
    assert (stats.queries - queries, stats.hits - hits) == (15, 8)  # not again when it resumed


def test_connector_not_ready_skips_the_request_and_asks_again():
    sched, conn = make_scheduler()
    worker = FakeWorker()
    r = remote_req("r", prompt_of(5, 6))
    b = local_req("b", prompt_of(6, 5))
    conn.not_ready.add("r")
    sched.add_request(r)
    sched.add_request(b)
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"b": 5}
    assert r.status == RequestStatus.WAITING and list(sched.waiting) == [r]
    assert block_ids(sched, "r") == []
    conn.not_ready.clear()
    step(sched, worker)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [c for c in conn.matched_calls if c[0] == "r"] == [("r", 0), ("r", 0)]


def test_remote_prefill_waits_in_queue_when_the_pool_cannot_hold_its_prompt():
    sched, conn = make_scheduler(num_blocks=6)
    worker = FakeWorker(num_blocks=6)
    hog = local_req("hog", prompt_of(7, 12), max_tokens=2)  # 3 blocks + 1 for decode
    sched.add_request(hog)
    step(sched, worker)
    r = remote_req("r", prompt_of(8, 13))  # needs 4 blocks, only 2 free
    sched.add_request(r)
    step(sched, worker)
    assert r.status == RequestStatus.WAITING and conn.alloc_calls == [("hog", ([0, 1, 2],), 0)]
    assert sched.stats().num_waiting_for_remote_kv == 0
    assert hog.status == RequestStatus.FINISHED_LENGTH_CAPPED  # its blocks are free now
    step(sched, worker)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(block_ids(sched, "r")) == 4


@pytest.mark.parametrize("failure", ["invalid_blocks", "load_error", "both", "one_block"])
def test_load_failure_with_recompute_policy_prefills_from_scratch(failure):
    sched, conn = make_scheduler(policy="recompute")
    worker = FakeWorker()
    prompt = prompt_of(9, 11)
    r = remote_req("r", prompt, max_tokens=3)
    sched.add_request(r)
    step(sched, worker)
    table = block_ids(sched, "r")
    worker.load(sched, r, garbage=True)  # whatever landed in the blocks is wrong
    invalid = {"invalid_blocks": in_group0(table), "load_error": set(), "both": in_group0(table),
               "one_block": {(0, table[0])}}[failure]
    errors = {} if failure in ("invalid_blocks", "one_block") else {"r": "peer went away"}
    step(sched, worker, KVConnectorOutput(finished_recving={"r"}, invalid_block_ids=invalid,
                                          load_errors=errors))
    out, _ = step(sched, worker)
    # Re-prefilled locally: every prompt token is scheduled, from position 0.
    assert out.num_scheduled_tokens == {"r": 11}
    new = out.scheduled_new_reqs[0]
    assert new.req_id == "r" and new.num_computed_tokens == 0
    assert r.status == RequestStatus.RUNNING and r.num_cached_tokens == 0
    assert r.num_external_tokens == 0  # nothing loaded counts as pulled
    assert len(block_ids(sched, "r")) == 3  # the failed blocks were returned, not leaked
    assert sched.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 3
    assert sched.kv_stats["kv_load_failures_recompute"] == 1
    assert not sched.kv_state.invalid_blocks and not sched.kv_state.load_errors
    # The connector is not asked for another remote load.
    assert conn.alloc_calls[-1] == ("r", (block_ids(sched, "r"),), 0)
    drain(sched, worker)  # the fake worker checks the recomputed KV at each sample
    assert r.num_output_tokens == 3 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_free(sched)


def test_load_failure_under_recompute_keeps_the_blocks_before_the_first_invalid_one():
    """vLLM's recompute semantics: blocks the connector did not report stay valid, so the
    request resumes at the first invalid block instead of prefilling from scratch."""
    sched, conn = make_scheduler(policy="recompute")
    worker = FakeWorker()
    prompt = prompt_of(9, 11)  # blocks of 4: [0..3] [4..7] [8..10]
    r = remote_req("r", prompt, max_tokens=3)
    sched.add_request(r)
    step(sched, worker)
    table = block_ids(sched, "r")
    worker.load(sched, r)  # block 0 landed; block 1 (and what follows) is reported invalid
    for p in range(BS, len(prompt)):
        worker.kv[table[p // BS]][p % BS] = (-1,)
    step(
        sched, worker, KVConnectorOutput(finished_recving={"r"}, invalid_block_ids={(0, table[1])})
    )
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"r": 11 - BS}  # recomputed from block 1 on
    assert r.num_cached_tokens == BS and block_ids(sched, "r") == table  # blocks kept
    assert r.num_external_tokens == BS  # only the valid block counts as pulled
    assert sched.kv_stats["kv_load_failures_recompute"] == 1
    drain(sched, worker)  # the fake worker checks every position's KV at each sample
    assert r.num_output_tokens == 3
    assert_all_free(sched)


@pytest.mark.parametrize("failure", ["invalid_blocks", "load_error"])
def test_load_failure_with_fail_policy_finishes_the_request_with_an_error(failure):
    sched, conn = make_scheduler(policy="fail")
    worker = FakeWorker()
    r = remote_req("r", prompt_of(10, 9))
    other = local_req("o", prompt_of(11, 5), max_tokens=10)
    sched.add_request(r)
    sched.add_request(other)
    step(sched, worker)
    table = block_ids(sched, "r")
    kv_out = (KVConnectorOutput(finished_recving={"r"}, invalid_block_ids=in_group0(table))
              if failure == "invalid_blocks"
              else KVConnectorOutput(finished_recving={"r"}, load_errors={"r": "peer went away"}))
    step(sched, worker, kv_out)

    out = sched.schedule()  # the failure is applied here
    assert "r" not in out.num_scheduled_tokens
    assert r.status == RequestStatus.FINISHED_ERROR and r.get_finished_reason() == "error"
    expected = "invalid blocks" if failure == "invalid_blocks" else "peer went away"
    assert r.error is not None and "KV load failed" in r.error and expected in r.error
    assert "r" not in sched.requests and not sched.waiting_for_remote
    assert sched.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 2  # only o's blocks
    assert conn.finished_calls == [("r", RequestStatus.FINISHED_ERROR, (table,))]
    assert sched.kv_stats["kv_load_failures_fail"] == 1
    # The update is still owed to the client: the engine must keep stepping.
    assert sched.has_pending_kv_work()

    updates = sched.update_from_output(
        out, ModelRunnerOutput(sampled_token_ids=worker.execute(out))
    )
    mine = [u for u in updates if u.request is r]
    assert len(mine) == 1
    assert mine[0].finished and mine[0].new_token_ids == []
    assert not sched.has_pending_kv_work()
    # Emitted once only.
    _, later = step(sched, worker)
    assert all(u.request is not r for u in later)
    drain(sched, worker)
    assert_all_free(sched)


def test_invalid_blocks_only_fail_the_request_that_owns_them():
    sched, conn = make_scheduler(policy="fail")
    worker = FakeWorker()
    bad = remote_req("bad", prompt_of(12, 8), max_tokens=2)
    good = remote_req("good", prompt_of(13, 8), max_tokens=2)
    sched.add_request(bad)
    sched.add_request(good)
    step(sched, worker)
    worker.load(sched, good)
    step(sched, worker, KVConnectorOutput(finished_recving={"bad", "good"},
                                          invalid_block_ids={(0, block_ids(sched, "bad")[0])}))
    out, _ = step(sched, worker)
    assert bad.status == RequestStatus.FINISHED_ERROR
    assert out.num_scheduled_tokens == {"good": 1}
    drain(sched, worker)
    assert good.status == RequestStatus.FINISHED_LENGTH_CAPPED and good.error is None
    assert_all_free(sched)


