"""The pool connector's scheduler half without an engine (torch-free): remote lookups never
block the engine thread, answer through a wakeup, and end at their deadline as a miss; load
specs map chunks to the request's new blocks."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from pdkv.config import KVTransferConfig
from pdkv.kv_transfer.connector.pool_config import PoolConnectorConfig
from pdkv.kv_transfer.connector.pool_lookup import StoreLookup
from pdkv.kv_transfer.connector.pool_scheduler import PoolConnectorScheduler
from pdkv.kv_transfer.connector.spec import connector_spec
from pdkv.kvpool.keys import chunk_hashes, chunk_key
from pdkv.kvpool.store import KVPoolStore
from pdkv.kvpool.tiers.dram import DramTier
from pdkv.request import Request
from pdkv.sampling_params import SamplingParams
from pdkv.sched.output import NewRequestData, SchedulerOutput

BS, CHUNK, FP = 4, 8, "f" * 32


class RemoteDram(DramTier):
    """A dram tier that claims to be remote and whose lookups wait for the test."""

    local_index = False

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.gate = threading.Event()

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        assert self.gate.wait(30.0)
        return super().contains_many(keys)


class Blocks:
    """The new blocks of an allocation (what KVCacheBlocks.get_block_ids returns)."""

    def __init__(self, *groups: list[int]) -> None:
        self.groups = tuple(groups)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.groups


def make(tier: DramTier, lookup_timeout_s: float = 30.0) -> PoolConnectorScheduler:
    cfg = connector_spec(KVTransferConfig(kv_connector="KVPoolConnector", kv_role="kv_both"), BS)
    pool = PoolConnectorConfig(chunk_size=CHUNK, lookup_timeout_s=lookup_timeout_s)
    return PoolConnectorScheduler(cfg, pool, StoreLookup(KVPoolStore([tier]), FP), BS, 1)


def request(n: int) -> Request:
    return Request("r", list(range(100, 100 + n)), SamplingParams(max_tokens=1), BS)


def store_prefix(tier: DramTier, req: Request, num_chunks: int) -> list[str]:
    keys = [chunk_key(FP, h) for h in chunk_hashes(req.block_hashes, BS, CHUNK, num_chunks * CHUNK)]
    for k in keys:
        tier.put(k, b"x")
    return keys


def test_remote_lookup_answers_none_until_done_then_wakes_the_engine():
    tier = RemoteDram()
    sched = make(tier)
    woken = threading.Event()
    sched.set_wakeup(woken.set)
    req = request(29)  # (29 - 1) // 8 = 3 loadable chunks
    store_prefix(tier, req, 2)
    assert sched.get_num_new_matched_tokens(req, 4) == (None, False)  # in flight, not blocking
    assert sched.next_deadline() is not None
    tier.gate.set()
    assert woken.wait(30.0)
    assert sched.get_num_new_matched_tokens(req, 4) == (16 - 4, True)
    assert sched.next_deadline() is None


def test_remote_lookup_past_its_deadline_is_a_miss_and_counted():
    tier = RemoteDram()
    sched = make(tier, lookup_timeout_s=0.0)
    req = request(29)
    store_prefix(tier, req, 3)
    first = sched.get_num_new_matched_tokens(req, 0)
    assert first in ((None, False), (0, False))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.take_scheduler_stats() == {"pool:all:lookup_timeouts": 1.0}
    tier.gate.set()


def test_load_spec_maps_chunks_to_new_blocks_and_skips_local_hits():
    tier = DramTier(1 << 20)
    sched = make(tier)
    req = request(29)
    keys = store_prefix(tier, req, 3)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 4) == (24 - 4, True)
    req.num_computed_tokens = 4  # one local block hit
    sched.update_state_after_alloc(req, Blocks([11, 12, 13, 14, 15]), 20)  # type: ignore[arg-type]
    (spec,) = sched._to_load
    assert [chunk_key(FP, c.chunk_hash) for c in spec.chunks] == keys
    assert [(c.block_ids, c.first_blocks) for c in spec.chunks] == [
        (((11,),), (1,)), (((12, 13),), (0,)), (((14, 15),), (0,))]
    assert sched.take_scheduler_stats() == {
        "pool:all:lookup_tokens": 20.0,
        "pool:all:hit_tokens": 20.0,
    }


def test_a_producer_never_looks_up_and_a_failed_load_is_not_offered_again():
    tier = DramTier(1 << 20)
    cfg = connector_spec(KVTransferConfig(kv_connector="KVPoolConnector", kv_role="kv_producer"),
                         BS)
    prod = PoolConnectorScheduler(
        cfg, PoolConnectorConfig(chunk_size=CHUNK), StoreLookup(KVPoolStore([tier]), FP), BS, 1
    )
    req = request(29)
    store_prefix(tier, req, 3)
    assert prod.get_num_new_matched_tokens(req, 0) == (0, False)
    from pdkv.kv_transfer.connector.base import KVConnectorOutput

    sched = make(tier)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (24, True)
    sched.update_state_after_alloc(req, Blocks([1, 2, 3, 4, 5, 6]), 24)  # type: ignore[arg-type]
    assert sched.request_finished(req, ([1, 2, 3, 4, 5, 6],))[0] is True  # load in flight
    sched.on_new_request(req)
    sched.update_connector_output(
        KVConnectorOutput(finished_recving={"r"}, load_errors={"r": "gone"})
    )
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)


def test_a_disk_tier_without_a_path_lives_under_pdkv_cache_kvpool(tmp_path, monkeypatch):
    from pdkv.kv_transfer.connector.pool import build_store

    monkeypatch.setenv("PDKV_CACHE", str(tmp_path))
    cfg = PoolConnectorConfig.from_extra({"tiers": [{"name": "disk"}]}, block_size=16)
    store = build_store(cfg)
    try:
        assert store.tiers[0].path == str(tmp_path / "kvpool")  # type: ignore[attr-defined]
    finally:
        store.close()


def prefill_output(req: Request, computed_before: int) -> SchedulerOutput:
    """The scheduler output of one step that computes the rest of `req`'s prompt."""
    n = req.num_prompt_tokens - computed_before
    new = NewRequestData(req_id=req.request_id, token_ids=req.all_token_ids,
                         num_prompt_tokens=req.num_prompt_tokens,
                         sampling_params=req.sampling_params,
                         block_ids=(list(range(1, 9)),), num_computed_tokens=computed_before)
    return SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=[],
                           num_scheduled_tokens={req.request_id: n},
                           total_num_scheduled_tokens=n, finished_req_ids=set())


def test_a_remote_lookup_also_tells_which_local_hit_chunks_need_no_save():
    tier = RemoteDram()
    tier.gate.set()
    sched = make(tier)
    woken = threading.Event()
    sched.set_wakeup(woken.set)
    req = request(29)  # chunks 0-2 are loadable and saved
    (held,) = store_prefix(tier, req, 1)
    sched.on_new_request(req)
    # Chunk 0 is a local hit; the answer may be in at once (the lookup thread runs free).
    assert sched.get_num_new_matched_tokens(req, 8) in ((None, False), (0, False))
    assert woken.wait(30.0)
    assert sched.get_num_new_matched_tokens(req, 8) == (0, False)  # chunk 1 is not held
    req.num_computed_tokens = 8
    sched.update_state_after_alloc(req, Blocks(list(range(1, 7))), 0)  # type: ignore[arg-type]
    req.num_computed_tokens = 29  # the step computed the rest of the prompt
    (save,) = sched.build_connector_meta(prefill_output(req, 8)).saves
    saved = [chunk_key(FP, c.chunk_hash) for c in save.chunks]
    assert len(saved) == 2 and held not in saved
    assert sched.take_scheduler_stats()["pool:all:save_skips"] == 1


def test_a_producer_saves_only_the_chunks_its_in_process_pool_lacks():
    tier = DramTier(1 << 20)
    cfg = connector_spec(KVTransferConfig(kv_connector="KVPoolConnector", kv_role="kv_producer"),
                         BS)
    prod = PoolConnectorScheduler(
        cfg, PoolConnectorConfig(chunk_size=CHUNK), StoreLookup(KVPoolStore([tier]), FP), BS, 1
    )
    req = request(29)
    held = store_prefix(tier, req, 2)
    prod.on_new_request(req)
    assert prod.get_num_new_matched_tokens(req, 0) == (0, False)  # a producer never loads
    req.num_computed_tokens = 29
    (save,) = prod.build_connector_meta(prefill_output(req, 0)).saves
    (saved,) = [chunk_key(FP, c.chunk_hash) for c in save.chunks]
    assert saved not in held
    assert prod.take_scheduler_stats()["pool:all:save_skips"] == 2
