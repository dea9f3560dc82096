"""A linear-state model's remote prefill as the scheduler sees it (pdkv/sched/kv_connector_state.py,
scheduler._take_handed_over_tokens): a load that reaches the prompt's end appends P's token
(kv_transfer_params "first_token") as output 0 and resumes at n, decoding that token next; a
token that ends the request (max_tokens=1) finishes it at once; a failed load under "recompute"
prefills locally and samples the first token itself; with prefix caching the slots the load
allocated but did not write are freed, never cached. Torch-free; fakes from
test_scheduler_kv_connector (the fake worker checks group 0's KV at every sample)."""

from __future__ import annotations

from kv_connector_fakes import BS, FakeConnector, FakeWorker, in_group0, prompt_of, step

from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, LinearStateSpec
from pdkv.config import CacheConfig, SchedulerConfig
from pdkv.kv_transfer.connector.base import KVConnectorOutput
from pdkv.request import Request, RequestStatus
from pdkv.sampling_params import SamplingParams
from pdkv.sched.scheduler import Scheduler

NUM_BLOCKS = 32
P_TOKEN = 7  # the fake model never samples an id below 100


def make(policy: str = "fail") -> tuple[Scheduler, FakeConnector]:
    groups = (
        KVCacheGroupSpec((1,), FullAttentionSpec(BS, num_kv_heads=1, head_size=8)),
        KVCacheGroupSpec((0,), LinearStateSpec(BS, conv_shape=(8, 3), recurrent_shape=(1, 4, 4))),
    )
    kv_config = KVCacheConfig(NUM_BLOCKS, groups)
    conn = FakeConnector(kv_config)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128),
        CacheConfig(block_size=BS, num_kv_blocks=NUM_BLOCKS, enable_prefix_caching=True),
        kv_config,
        connector=conn,
        kv_load_failure_policy=policy,
    )
    return sched, conn


def remote(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), BS, eos_token_id=None,
                   kv_transfer_params={"do_remote_prefill": True, "first_token": P_TOKEN})


def all_free(sched: Scheduler) -> bool:
    return (
        all(p.num_free_blocks == p.num_usable_blocks for p in sched.kv_cache_manager.block_pools)
        and not sched.requests
        and not sched.kv_state.delayed_free
    )


def test_a_full_load_resumes_at_n_with_the_producers_token_first():
    sched, _ = make()
    worker = FakeWorker()
    r = remote("r", prompt_of(1, 10), max_tokens=3)
    sched.add_request(r)
    step(sched, worker)
    kv = sched.kv_cache_manager
    assert [len(t) for t in kv.get_block_ids("r")] == [3, 3]  # a checkpoint slot per block
    slots = kv.get_block_ids("r")[1]
    worker.load(sched, r)
    step(sched, worker, KVConnectorOutput(finished_recving={"r"}))
    out, updates = step(sched, worker)
    assert [(u.request.request_id, u.new_token_ids) for u in updates][0] == ("r", [P_TOKEN])
    assert out.num_scheduled_tokens == {"r": 1}  # P's token, at position n
    assert out.scheduled_new_reqs[0].num_computed_tokens == 10
    # Only the last slot (the state after 10 tokens) was loaded: the others were freed, unhashed.
    assert kv.get_block_ids("r")[1] == [0, 0, slots[2]]
    assert all(kv.block_pools[1].blocks[b].block_hash is None for b in slots[:2])
    while sched.has_unfinished_requests():
        step(sched, worker)
    assert r.output_token_ids[0] == P_TOKEN and r.num_output_tokens == 3
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert all_free(sched)


def test_the_producers_token_can_finish_the_request_without_a_step():
    sched, _ = make()
    worker = FakeWorker()
    r = remote("r", prompt_of(2, 9), max_tokens=1)
    sched.add_request(r)
    step(sched, worker)
    worker.load(sched, r)
    step(sched, worker, KVConnectorOutput(finished_recving={"r"}))
    out, updates = step(sched, worker)
    assert out.num_scheduled_tokens == {}
    assert [(u.new_token_ids, u.finished) for u in updates] == [([P_TOKEN], True)]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.output_token_ids == [P_TOKEN]
    assert all_free(sched)


def test_a_failed_load_under_recompute_prefills_locally_without_the_producers_token():
    sched, _ = make(policy="recompute")
    worker = FakeWorker()
    r = remote("r", prompt_of(3, 10), max_tokens=2)
    sched.add_request(r)
    step(sched, worker)
    table = sched.kv_cache_manager.get_block_ids("r")[0]
    worker.load(sched, r)
    # Only the last block is reported bad: blocks 0 and 1 of group 0 hold good KV, but the load
    # wrote no state slot for their end, so the request starts over.
    step(
        sched,
        worker,
        KVConnectorOutput(finished_recving={"r"}, invalid_block_ids=in_group0(table[-1:])),
    )
    out, _ = step(sched, worker)
    assert (
        out.num_scheduled_tokens == {"r": 10} and out.scheduled_new_reqs[0].num_computed_tokens == 0
    )
    while sched.has_unfinished_requests():
        step(sched, worker)
    assert P_TOKEN not in r.output_token_ids and r.num_output_tokens == 2
    assert all_free(sched)
