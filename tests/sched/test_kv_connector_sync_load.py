"""Synchronous external KV loads (a connector answering (n, load_async=False)): the scheduler
counts the n tokens as computed, schedules only the rest, allocates slots for all of them and
tells the connector what to load; the worker loads them before the forward pass. Torch-free."""

from __future__ import annotations

from typing import Any

import msgspec
from kv_connector_fakes import BS, FakeWorker, assert_all_free, local_req, prompt_of

from pdkv.cache.kv_cache_manager import KVCacheBlocks
from pdkv.cache.single_type_manager import cdiv
from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pdkv.config import CacheConfig, SchedulerConfig
from pdkv.kv_transfer.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from pdkv.kv_transfer.connector.spec import ConnectorSpec
from pdkv.request import Request, RequestStatus
from pdkv.sched.output import ModelRunnerOutput, SchedulerOutput
from pdkv.sched.scheduler import Scheduler

NUM_BLOCKS = 32


class LoadSpec(msgspec.Struct):
    req_id: str
    block_ids: list[int]  # the request's new blocks (group 0)
    first_token: int  # position of the first token to load
    num_tokens: int


class SyncMeta(KVConnectorMetadata, kw_only=True):
    to_load: list[LoadSpec] = msgspec.field(default_factory=list)


class SyncConnector(KVConnectorBase):
    """Scheduler half of a connector with an external store that holds `external[req_id]`
    tokens of a prompt and loads them synchronously."""

    def __init__(self, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(ConnectorSpec("Fake", "kv_both", "e", "fail"),
                         KVConnectorRole.SCHEDULER, kv_cache_config, {})
        self.external: dict[str, int] = {}
        self.alloc_calls: list[tuple[str, int, int]] = []  # (id, num_computed, num_external)
        self._to_load: list[LoadSpec] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return max(0, self.external.get(request.request_id, 0) - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        self.alloc_calls.append((rid, request.num_computed_tokens, num_external_tokens))
        if num_external_tokens:
            self._to_load.append(LoadSpec(rid, blocks.get_block_ids()[0],
                                          request.num_computed_tokens, num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SyncMeta:
        meta, self._to_load = SyncMeta(to_load=self._to_load), []
        return meta

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None


def make(max_num_batched_tokens: int = 64) -> tuple[Scheduler, SyncConnector, FakeWorker]:
    kv_config = KVCacheConfig(
        NUM_BLOCKS, (KVCacheGroupSpec((0,), FullAttentionSpec(BS, num_kv_heads=1, head_size=8)),)
    )
    conn = SyncConnector(kv_config)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=128),
                      CacheConfig(block_size=BS, num_kv_blocks=NUM_BLOCKS), kv_config,
                      connector=conn)
    return sched, conn, FakeWorker()


def run_step(
    sched: Scheduler, worker: FakeWorker, prompts: dict[str, list[int]]
) -> SchedulerOutput:
    """schedule → the worker half loads what the metadata names (from the external store,
    which holds each prompt's true KV) → forward/sample (the fake worker checks every position
    of a request's block table before sampling) → update."""
    out = sched.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, SyncMeta)
    for spec in msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=SyncMeta).to_load:
        prompt = prompts[spec.req_id]
        first_block = spec.first_token // BS
        for p in range(spec.first_token, spec.first_token + spec.num_tokens):
            worker.kv[spec.block_ids[p // BS - first_block]][p % BS] = tuple(prompt[: p + 1])
    sampled = worker.execute(out)
    sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return out


def test_synchronous_external_tokens_are_computed_not_rescheduled():
    sched, conn, worker = make()
    prompt = prompt_of(70, 14)
    r = local_req("r", prompt, max_tokens=3)
    conn.external["r"] = 8
    sched.add_request(r)
    out = run_step(sched, worker, {"r": prompt})
    assert out.num_scheduled_tokens == {"r": 6}  # 14 - 8 loaded
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 8
    assert len(new.block_ids[0]) == cdiv(14, BS)  # slots for the loaded and computed tokens
    assert conn.alloc_calls == [("r", 0, 8)]
    assert out.kv_connector_metadata.to_load == [LoadSpec("r", new.block_ids[0], 0, 8)]
    assert r.num_cached_tokens == 8
    assert r.num_computed_tokens == 14 and r.status == RequestStatus.RUNNING
    assert r.num_output_tokens == 1  # sampled after the fake worker verified every position
    # The loaded blocks are final: a later request with the same prompt hits them.
    _, num_hit = sched.kv_cache_manager.get_computed_blocks(local_req("x", list(prompt)))
    assert num_hit == 12
    for _ in range(5):
        if sched.has_unfinished_requests():
            run_step(sched, worker, {"r": prompt})
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_output_tokens == 3
    assert_all_free(sched)


def test_synchronous_load_never_covers_the_last_prompt_token():
    sched, conn, worker = make()
    prompt = prompt_of(71, 12)
    r = local_req("r", prompt, max_tokens=1)
    conn.external["r"] = 12  # the store holds the whole prompt
    sched.add_request(r)
    out = run_step(sched, worker, {"r": prompt})
    assert out.num_scheduled_tokens == {"r": 1}
    assert conn.alloc_calls == [("r", 0, 11)]
    assert out.scheduled_new_reqs[0].num_computed_tokens == 11
    assert r.num_cached_tokens == 11
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_free(sched)


def test_synchronous_load_after_local_prefix_hits_loads_only_the_rest():
    sched, conn, worker = make()
    shared = prompt_of(72, 8)
    first = local_req("first", shared + [90, 91], max_tokens=1)
    sched.add_request(first)
    run_step(sched, worker, {"first": first.prompt_token_ids})
    prompt = shared + prompt_of(73, 9)  # 17 tokens: 8 hit locally, the store holds 12
    r = local_req("r", prompt, max_tokens=2)
    conn.external["r"] = 12
    sched.add_request(r)
    out = run_step(sched, worker, {"r": prompt})
    assert conn.alloc_calls[-1] == ("r", 8, 4)
    assert out.num_scheduled_tokens == {"r": 5}
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 12
    assert out.kv_connector_metadata.to_load == [LoadSpec("r", new.block_ids[0][2:], 8, 4)]
    assert r.num_cached_tokens == 12
    assert (r.num_local_hit_tokens, r.num_external_tokens) == (8, 4)  # the split metrics export
    assert sched.kv_cache_manager.prefix_cache_stats.hits == 8  # local hits only
    run_step(sched, worker, {"r": prompt})
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_free(sched)


def test_synchronous_load_with_a_chunked_prefill():
    sched, conn, worker = make(max_num_batched_tokens=5)
    prompt = prompt_of(74, 20)
    r = local_req("r", prompt, max_tokens=1)
    conn.external["r"] = 8
    sched.add_request(r)
    out = run_step(sched, worker, {"r": prompt})
    assert out.num_scheduled_tokens == {"r": 5}  # the budget, after the 8 loaded tokens
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert len(out.kv_connector_metadata.to_load) == 1
    for n in (5, 2):
        out = run_step(sched, worker, {"r": prompt})
        assert out.num_scheduled_tokens == {"r": n}
        assert out.kv_connector_metadata.to_load == []  # loaded once
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_free(sched)
