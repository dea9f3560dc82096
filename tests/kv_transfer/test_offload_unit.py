"""OffloadingConnector without a model: the block pool's eviction hook, the host index (LRU,
pins), settings, and the ordering of one step's copies against the forward pass, with a fake
runner that writes each block's tokens into the KV cache after `start_load_kv` (as the model
runner does: bind → start_load_kv → forward)."""

from __future__ import annotations

import pytest
import torch

from pdkv.cache.block_pool import BlockPool
from pdkv.cache.kv_cache_manager import KVCacheManager
from pdkv.cache.kv_layout import KVLayout
from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pdkv.config import KVTransferConfig
from pdkv.kv_transfer.connector.base import KVConnectorOutput, KVConnectorRole
from pdkv.kv_transfer.connector.offload import OffloadingConnector
from pdkv.kv_transfer.connector.offload_config import OffloadConfig
from pdkv.kv_transfer.connector.offload_index import HostBlockIndex
from pdkv.kv_transfer.connector.spec import OffloadSpec, connector_spec
from pdkv.request import Request
from pdkv.sampling_params import SamplingParams
from pdkv.sched.output import SchedulerOutput

LAYOUT = KVLayout("m", "float32", 4, 1, 1, 8, "cross_layer")  # unused by these connectors

BS = 2
EMPTY_STEP = SchedulerOutput(
    scheduled_new_reqs=[],
    scheduled_cached_reqs=[],
    num_scheduled_tokens={},
    total_num_scheduled_tokens=0,
    finished_req_ids=set(),
)


# ------------------------------------------------------------------ block pool hook
def test_hook_sees_hash_and_id_before_the_block_is_handed_out():
    pool = BlockPool(2)
    seen = []

    def hook(block_hash: bytes, block_id: int) -> None:
        block = pool.blocks[block_id]
        # Still cached and free: nothing can have been scheduled to overwrite it yet.
        seen.append(
            (block_hash, block_id, pool.get_cached_block(block_hash) is block, block.ref_cnt)
        )

    pool.set_eviction_hook(hook)
    a, b = pool.get_new_blocks(2)
    assert seen == []  # uncached blocks: no hook
    pool.cache_block(a, b"h-a")
    pool.free_blocks([a, b])
    (first,) = pool.get_new_blocks(1)
    assert first is a and seen == [(b"h-a", a.block_id, True, 0)]
    assert pool.get_cached_block(b"h-a") is None and pool.num_evictions == 1
    pool.cache_block(first, b"h-c")
    pool.evict_hashes([first])  # invalid content: not offloaded
    pool.cache_block(first, b"h-d")
    pool.free_blocks([first])
    assert pool.reset_prefix_cache() is True  # forgotten, not evicted for reuse
    pool.get_new_blocks(2)
    assert len(seen) == 1


def test_manager_hook_carries_the_group():
    cfg = kv_config(num_blocks=2, groups=2)
    mgr = KVCacheManager(cfg, True, 4)
    seen = []
    mgr.set_eviction_hook(lambda g, h, b: seen.append((g, h, b)))
    req = make_request("r", [1, 2, 3])
    assert mgr.allocate_slots(req, 3) is not None
    mgr.free(req)
    other = make_request("o", [7, 8, 9])
    assert mgr.allocate_slots(other, 3) is not None
    assert sorted(g for g, _, _ in seen) == [0, 1]
    assert {h for _, h, _ in seen} == {req.block_hashes[0]}


# ------------------------------------------------------------------------ host index
def test_host_index_is_lru_and_never_reuses_a_pinned_slot():
    index = HostBlockIndex(2)
    s1, s2 = index.allocate(b"1"), index.allocate(b"2")
    assert {s1, s2} == {0, 1}
    index.touch(b"1")  # "2" is now least recently used
    assert index.allocate(b"3") == s2 and b"2" not in index and index.num_evictions == 1
    index.pin(s1)
    index.pin(s2)
    assert index.allocate(b"4") is None and b"4" not in index  # all pinned: nothing changes
    index.unpin(s2)
    assert index.allocate(b"4") == s2 and b"1" in index
    with pytest.raises(RuntimeError):
        index.unpin(s2)
    assert HostBlockIndex(0).allocate(b"x") is None


def test_settings_are_checked():
    assert OffloadConfig.from_extra({}).eviction_mode == "reuse"
    for bad in ({"eviction_mode": "lru"}, {"cpu_bytes_to_use": -1}, {"cpu_bytes_to_use": 1.5},
                {"num_cpu_blocks": 4}):
        with pytest.raises(ValueError):
            OffloadConfig.from_extra(bad)
    cfg = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_producer")
    with pytest.raises(ValueError, match="kv_both"):
        connector_spec(cfg, BS)
    # Slots: bytes // (one block summed over groups); block = 2 * BS * 1 * 1 * 4 bytes = 16.
    assert OffloadConfig(cpu_bytes_to_use=100).num_host_slots(kv_config(4, groups=2)) == 3


def test_host_slots_agree_across_halves_and_ranks():
    """cpu_bytes_to_use is per engine (vLLM's rule): every rank's worker half (its own blocks of
    BS tokens and its KV heads) and the scheduler half (logical blocks of BS × dcp tokens) get
    the same slot count, and the ranks' host buffers together fit cpu_bytes_to_use."""
    from pdkv.worker.kv_cache import scheduler_view

    extra = {"cpu_bytes_to_use": 1000, "eviction_mode": "reuse"}
    spec = connector_spec(KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                           kv_connector_extra_config=extra), BS)
    assert isinstance(spec, OffloadSpec)
    rank_spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=4, dtype="float32")
    per_rank = KVCacheConfig(8, (KVCacheGroupSpec((0, 1), rank_spec),))  # 2·2·BS·2·4·4 = 256 B
    cases = {  # (tp, dcp, replicated) -> world size
        (1, 1, None): 1, (2, 1, None): 2, (1, 2, True): 2, (2, 2, False): 2, (2, 2, True): 4}
    for (tp, dcp, replicated), world in cases.items():
        layout = KVLayout("m", "float32", BS, 2, 2, 4, "cross_layer", tp_size=tp, dcp_size=dcp,
                          dcp_replicated=replicated)
        assert layout.world_size == world
        sched = OffloadingConnector(spec, KVConnectorRole.SCHEDULER,
                                    scheduler_view(per_rank, dcp), layout)
        worker = OffloadingConnector(spec, KVConnectorRole.WORKER, per_rank, layout)
        assert sched.num_host_slots == worker.num_host_slots == 1000 // (256 * world)
        worker.register_kv_caches([torch.zeros(8, 2, 2, BS, 2, 4)])
        assert worker.worker is not None
        assert world * worker.worker.host[0].numel() <= 1000
        assert worker.worker.host[0].shape == (worker.num_host_slots, 256)


# ------------------------------------------------------------- ordering with a fake
def kv_config(num_blocks: int, groups: int = 1) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float32")
    return KVCacheConfig(num_blocks, tuple(KVCacheGroupSpec((g,), spec) for g in range(groups)))


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), BS)


class FakeEngine:
    """The scheduler's block manager plus both connector halves over a 4-block CPU cache. A
    step: plan (allocate; the connector's metadata) → `start_load_kv` → fake forward, which
    writes value token_id at every computed token's slot (K and V) of the step."""

    def __init__(self, mode: str, num_blocks: int = 4) -> None:
        self.cfg = kv_config(num_blocks)
        extra = {"cpu_bytes_to_use": 16 * 8, "eviction_mode": mode}
        tc = connector_spec(KVTransferConfig(kv_connector="OffloadingConnector",
                                             kv_role="kv_both", kv_connector_extra_config=extra),
                            BS)
        assert isinstance(tc, OffloadSpec)
        self.sched = OffloadingConnector(tc, KVConnectorRole.SCHEDULER, self.cfg, LAYOUT)
        self.worker = OffloadingConnector(tc, KVConnectorRole.WORKER, self.cfg, LAYOUT)
        self.mgr = KVCacheManager(self.cfg, True, num_blocks * BS)
        self.sched.bind_kv_cache_manager(self.mgr)
        self.cache = torch.zeros(num_blocks, 1, 2, BS, 1, 1)
        self.worker.register_kv_caches([self.cache])

    def run(self, req: Request) -> int:
        """Admit and run the whole request in one step (like the scheduler's waiting path with
        a synchronous load); returns the tokens loaded from the host."""
        hits, num_hit = self.mgr.get_computed_blocks(req)
        ext, load_async = self.sched.get_num_new_matched_tokens(req, num_hit)
        assert ext is not None and not load_async
        new = self.mgr.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit)
        assert new is not None
        req.num_computed_tokens = num_hit
        self.sched.update_state_after_alloc(req, new, ext)
        meta = self.sched.build_connector_meta(EMPTY_STEP)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv()
        table = self.mgr.get_block_ids(req.request_id)[0]
        for pos in range(num_hit + ext, req.num_tokens):  # the forward pass writes its tokens
            self.cache[table[pos // BS], 0, :, pos % BS] = float(req.all_token_ids[pos])
        self.worker.clear_connector_metadata()
        self.sched.update_connector_output(KVConnectorOutput())
        req.num_computed_tokens = req.num_tokens
        return ext

    def block_values(self, req: Request) -> list[list[float]]:
        table = self.mgr.get_block_ids(req.request_id)[0]
        return [self.cache[b, 0, 0, :, 0, 0].tolist() for b in table]

    def host_values(self, block_hash: bytes) -> list[float]:
        slot = self.sched.scheduler.indexes[0].slot_of(block_hash)
        assert slot is not None
        return self.worker.worker.host[0][slot].view(torch.float32).view(2, BS)[0].tolist()


def test_evicted_block_is_copied_before_its_new_owner_overwrites_it():
    """r1 fills 2 blocks and frees them; r2 (4 blocks) evicts both: the host must hold r1's
    tokens, not r2's (D2H before the forward pass). Then r1 again: host hits loaded into blocks
    that r2 held and that are evicted in the same step: D2H of r2's content first, then H2D."""
    eng = FakeEngine("reuse")
    r1 = make_request("r1", [11, 12, 13, 14, 15])
    assert eng.run(r1) == 0
    eng.mgr.free(r1)
    r2 = make_request("r2", [21, 22, 23, 24, 25, 26, 27, 28])
    assert eng.run(r2) == 0
    # Both of r1's full blocks were evicted (free queue: r1's tail, then its head, then unused).
    assert eng.host_values(r1.block_hashes[0]) == [11.0, 12.0]
    assert eng.host_values(r1.block_hashes[1]) == [13.0, 14.0]
    eng.mgr.free(r2)
    again = make_request("r1b", [11, 12, 13, 14, 15])
    assert eng.run(again) == 2 * BS  # both full blocks from the host (the last token computed)
    assert eng.block_values(again)[:2] == [[11.0, 12.0], [13.0, 14.0]]
    # The blocks it got had r2's cached content: saved before the load overwrote them.
    saved = [h for h in r2.block_hashes if eng.sched.scheduler.indexes[0].slot_of(h) is not None]
    assert saved, "r2's evicted blocks must be on the host"
    for h in saved:
        i = r2.block_hashes.index(h)
        assert eng.host_values(h) == [21.0 + 2 * i, 22.0 + 2 * i]
    eng.mgr.free(again)
    stats = eng.worker.get_stats()[0]
    assert stats["offload:copies_h2d"] == 2 and stats["offload:copies_d2h"] == 2 + len(saved)


def test_loads_pin_their_host_slots_against_same_step_stores():
    """A host as small as one request's blocks: the step that loads r1's blocks back also
    evicts r2's blocks. The stores must not take the slots being read (they are skipped)."""
    eng = FakeEngine("save_on_evict")
    eng.sched.scheduler.indexes[0] = HostBlockIndex(2)
    r1 = make_request("r1", [11, 12, 13, 14, 15])
    eng.run(r1)
    eng.mgr.free(r1)
    r2 = make_request("r2", [21, 22, 23, 24, 25, 26, 27, 28])
    eng.run(r2)
    eng.mgr.free(r2)
    again = make_request("r1b", [11, 12, 13, 14, 15])
    assert eng.run(again) == 2 * BS
    assert eng.block_values(again)[:2] == [[11.0, 12.0], [13.0, 14.0]]
    assert eng.sched.take_scheduler_stats()["offload:store_skips"] >= 1
    assert all(i.num_pinned == 0 for i in eng.sched.scheduler.indexes)
