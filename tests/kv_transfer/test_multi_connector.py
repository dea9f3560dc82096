"""MultiConnector with fake children (torch-free): per-child delayed frees, chained loads
(pool part, then P's rest), completion only when every part is done, per-child failure policy."""

from __future__ import annotations

from typing import Any

import pytest

from pdkv.cache.kv_layout import KVLayout
from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pdkv.config import CacheConfig, KVTransferConfig, SchedulerConfig
from pdkv.kv_transfer.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from pdkv.kv_transfer.connector.multi import MultiConnector
from pdkv.kv_transfer.connector.spec import ConnectorSpec, MultiSpec, connector_spec
from pdkv.kv_transfer.connector.startup import ConnectorStartup
from pdkv.request import Request, RequestStatus
from pdkv.sampling_params import SamplingParams
from pdkv.sched.scheduler import Scheduler

LAYOUT = KVLayout("m", "float32", 4, 1, 1, 8, "cross_layer")  # unused by these connectors

BS, NUM_BLOCKS = 4, 32
KV_CONFIG = KVCacheConfig(NUM_BLOCKS, (KVCacheGroupSpec((0,), FullAttentionSpec(block_size=BS)),))


class FakeChild(KVConnectorBase):
    """A child connector whose answers the test sets. `offer` = tokens it can load (None = ask
    again); `delay_free` = whether request_finished delays; worker reports come from
    `sending`/`recving`/`errors`, drained by the worker half's calls."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, *_: Any) -> None:
        super().__init__(config, role, KV_CONFIG, {})
        self.offer: int | None = 0
        self.delay_free = False
        self.allocs: list[tuple[str, list[int], int, int]] = []  # rid, blocks, start, n
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.errors: dict[str, str] = {}
        self.bad: set[tuple[int, int]] = set()
        self.bound: Any = None

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.bound = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.offer is None:
            return None, False
        n = min(self.offer, request.num_tokens - num_computed_tokens)
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        self.allocs.append((request.request_id, list(blocks.get_block_ids()[0]),
                            request.num_computed_tokens, num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.delay_free, ({"from": self.spec.kv_connector} if self.delay_free else None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        s, r, self.sending, self.recving = self.sending, self.recving, set(), set()
        return s, r

    def get_load_errors(self) -> dict[str, str]:
        e, self.errors = self.errors, {}
        return e

    def get_block_ids_with_load_errors(self) -> set[tuple[int, int]]:
        b, self.bad = self.bad, set()
        return b


def make(
    monkeypatch, policies: tuple[str, str] = ("", "")
) -> tuple[Scheduler, MultiConnector, MultiConnector]:
    def fake_child(spec: ConnectorSpec, role: KVConnectorRole, *args: object) -> FakeChild:
        return FakeChild(spec, role)

    cfg = connector_spec(KVTransferConfig("MultiConnector", "kv_both", kv_connector_extra_config={
        "connectors": [
            {"kv_connector": "KVPoolConnector", "kv_load_failure_policy": policies[0]},
            {"kv_connector": "P2PConnector", "kv_load_failure_policy": policies[1]}]}), BS)
    assert isinstance(cfg, MultiSpec)
    sched_half = MultiConnector(cfg, KVConnectorRole.SCHEDULER, KV_CONFIG, LAYOUT,
                                ConnectorStartup(), fake_child)
    worker_half = MultiConnector(cfg, KVConnectorRole.WORKER, KV_CONFIG, LAYOUT, ConnectorStartup(),
                                 fake_child)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64),
                      CacheConfig(block_size=BS), KV_CONFIG, connector=sched_half,
                      kv_load_failure_policy="recompute")
    return sched, sched_half, worker_half


def step(sched: Scheduler, worker: MultiConnector) -> KVConnectorOutput:
    out = sched.schedule()
    worker.bind_connector_metadata(out.kv_connector_metadata)
    sending, recving = worker.get_finished(set())
    kv = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                           invalid_block_ids=worker.get_block_ids_with_load_errors(),
                           load_errors=worker.get_load_errors(),
                           load_failure_policies=worker.get_load_failure_policies())
    worker.clear_connector_metadata()
    from pdkv.sched.output import ModelRunnerOutput

    sampled = {rid: [7] for rid, n in out.num_scheduled_tokens.items()
               if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens}
    sched.update_from_output(
        out, ModelRunnerOutput(sampled_token_ids=sampled, kv_connector_output=kv)
    )
    return kv


def request(rid: str, n: int, max_tokens: int = 1) -> Request:
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=max_tokens), BS)


def free(sched: Scheduler) -> int:
    return sched.kv_cache_manager.num_free_blocks


def test_every_child_gets_the_schedulers_block_manager(monkeypatch):
    """(An offload child installs its eviction hook there, a push child reads block tables.)"""
    sched, sched_half, _ = make(monkeypatch)
    assert [c.bound for c in sched_half.children] == [sched.kv_cache_manager] * 2


def test_child_specs_inherit_role_and_engine_id_and_reject_bad_specs():
    cfg = KVTransferConfig(
        "MultiConnector",
        "kv_consumer",
        engine_id="e1",
        kv_connector_extra_config={
            "connectors": [
                {"kv_connector": "KVPoolConnector"},
                {"kv_connector": "P2PConnector", "kv_role": "kv_producer"},
            ]
        },
    )
    multi = connector_spec(cfg, BS)
    assert isinstance(multi, MultiSpec)
    pool, p2p = multi.children
    assert (pool.kv_role, pool.engine_id, pool.load_failure_policy) == (
        "kv_consumer",
        "e1",
        "recompute",
    )
    assert (p2p.kv_role, p2p.load_failure_policy) == ("kv_producer", "fail")
    for bad in ({"connectors": []}, {"connectors": [{"kv_connector": "MultiConnector"}]},
                {"connectors": [{"kv_connector": "P2PConnector", "typo": 1}]},
                {"connectors": [{"kv_connector": "P2PConnector"}], "extra": 1}):
        with pytest.raises(ValueError):
            connector_spec(
                KVTransferConfig("MultiConnector", "kv_both", kv_connector_extra_config=bad), BS
            )


@pytest.mark.parametrize("order", ["in_order", "reversed", "early"])
def test_a_delayed_free_waits_for_every_child_that_asked(monkeypatch, order):
    sched, multi, worker = make(monkeypatch)
    for child in multi.children:
        child.delay_free = True  # type: ignore[attr-defined]
    sched.add_request(request("r", 10))
    if order == "early":  # a child reports before the expectation reached the worker
        worker.children[1].sending.add("r")  # type: ignore[attr-defined]
    step(sched, worker)  # prefill + sample: finished, both children delay the free
    assert sched.requests == {} and "r" in sched.kv_state.delayed_free
    held = NUM_BLOCKS - free(sched)
    assert held == 3
    first, second = (0, 1) if order == "in_order" else (1, 0)
    if order != "early":
        worker.children[first].sending.add("r")  # type: ignore[attr-defined]
    step(sched, worker)
    assert NUM_BLOCKS - free(sched) == held  # one child is done, the other still reads
    worker.children[0 if order == "early" else second].sending.add("r")  # type: ignore[attr-defined]
    step(sched, worker)
    assert free(sched) == NUM_BLOCKS and not sched.kv_state.delayed_free


def test_loads_chain_pool_part_then_the_rest_and_finish_only_when_both_are_done(monkeypatch):
    sched, multi, worker = make(monkeypatch)
    pool, p2p = multi.children
    pool.offer, p2p.offer = 8, 100  # type: ignore[attr-defined]
    sched.add_request(request("r", 14))
    step(sched, worker)
    assert sched.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (rid, pool_blocks, pool_start, pool_n), = pool.allocs  # type: ignore[attr-defined]
    (_, p2p_blocks, p2p_start, p2p_n), = p2p.allocs  # type: ignore[attr-defined]
    assert (pool_start, pool_n, p2p_start, p2p_n) == (0, 8, 8, 6)
    assert len(pool_blocks) == 2 and len(p2p_blocks) == 2 and not set(pool_blocks) & set(p2p_blocks)
    worker.children[0].recving.add("r")  # type: ignore[attr-defined]
    step(sched, worker)
    assert sched.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS  # P's part pending
    worker.children[1].recving.add("r")  # type: ignore[attr-defined]
    step(sched, worker)  # resumed: only the last token is computed
    step(sched, worker)
    assert "r" not in sched.requests and free(sched) == NUM_BLOCKS


def test_a_later_part_that_is_only_the_last_token_is_dropped_and_the_child_told(monkeypatch):
    sched, multi, worker = make(monkeypatch)
    pool, p2p = multi.children
    pool.offer, p2p.offer = 8, 100  # type: ignore[attr-defined]
    sched.add_request(request("r", 9))  # pool holds 8 of 9: P would only add the last token
    step(sched, worker)
    assert pool.allocs[0][3] == 8  # type: ignore[attr-defined]
    assert p2p.allocs == [("r", [], 0, 0)]  # type: ignore[attr-defined]  # told: nothing to pull


@pytest.mark.parametrize("policies,failing,expect", [
    (("", ""), 0, "recompute"), (("", ""), 1, "fail"), (("fail", "recompute"), 0, "fail")])
def test_each_child_failure_is_handled_by_its_own_policy(monkeypatch, policies, failing, expect):
    sched, multi, worker = make(monkeypatch, policies)
    pool, p2p = multi.children
    pool.offer, p2p.offer = 8, 100  # type: ignore[attr-defined]
    sched.add_request(request("r", 14))
    step(sched, worker)
    blocks = sched.kv_cache_manager.get_block_ids("r")[0]
    for i, child in enumerate(worker.children):
        child.recving.add("r")  # type: ignore[attr-defined]
        if i == failing:
            child.errors["r"] = "gone"  # type: ignore[attr-defined]
            child.bad.update((0, b) for b in blocks[2 * i:])  # type: ignore[attr-defined]
    step(sched, worker)  # the reports arrive
    sched._update_waiting_for_remote_kv()  # what the next schedule does first
    assert sched.kv_stats[f"kv_load_failures_{expect}"] == 1
    if expect == "fail":
        assert "r" not in sched.requests
    else:
        assert sched.requests["r"].num_computed_tokens == (0 if failing == 0 else 8)
    pool.offer = p2p.offer = 0  # type: ignore[attr-defined]  # real children never offer a failed load again
    for _ in range(3):
        step(sched, worker)
    assert free(sched) == NUM_BLOCKS
