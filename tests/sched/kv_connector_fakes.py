"""Fakes shared by the scheduler's KV connector tests (tests/sched/test_scheduler_kv_connector*.py,
test_kv_load_failures.py, ...): a torch-free fake connector (scheduler half only), a fake worker
that plays the model runner and reports KVConnectorOutput by hand, and request / step helpers."""


from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from pdkv.cache.kv_cache_manager import KVCacheBlocks
from pdkv.cache.single_type_manager import cdiv
from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from pdkv.config import CacheConfig, SchedulerConfig
from pdkv.kv_transfer.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from pdkv.kv_transfer.connector.spec import ConnectorSpec
from pdkv.request import Request, RequestStatus
from pdkv.sampling_params import SamplingParams
from pdkv.sched.output import ModelRunnerOutput, SchedulerOutput
from pdkv.sched.scheduler import RequestUpdate, Scheduler

BS = 4
NUM_BLOCKS = 32


# --------------------------------------------------------------------------- fakes
class FakeMeta(KVConnectorMetadata, kw_only=True):
    step: int
    to_load: list[str] = msgspec.field(default_factory=list)


class FakeConnector(KVConnectorBase):
    """Scheduler half of a connector that behaves like the P2P consumer/producer, and records
    every call.

    * A waiting request with `kv_transfer_params["do_remote_prefill"]` gets "every prompt token
      beyond the local hits is external, loaded asynchronously"; after the allocation the
      transfer is marked consumed (do_remote_prefill = False), so a later recompute prefills
      locally.
    * A request whose load is in flight asks for delay_free when it finishes.
    * A FINISHED_STOPPED / FINISHED_LENGTH_CAPPED request with `do_remote_decode` asks for
      delay_free and returns params for the decode side.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, delay_inflight: bool = True) -> None:
        super().__init__(
            ConnectorSpec("Fake", "kv_both", "fake-engine", "fail"),
            KVConnectorRole.SCHEDULER,
            kv_cache_config,
            {},
        )
        self.delay_inflight = delay_inflight
        self.not_ready: set[str] = set()  # get_num_new_matched_tokens answers None for these
        self.new_requests: list[str] = []
        self.matched_calls: list[tuple[str, int]] = []
        self.alloc_calls: list[tuple[str, tuple[list[int], ...], int]] = []
        self.finished_calls: list[tuple[str, RequestStatus, tuple[list[int], ...]]] = []
        self.outputs: list[KVConnectorOutput] = []
        self.metas: list[FakeMeta] = []
        self.inflight: set[str] = set()
        self.held: set[str] = set()
        self._to_load: list[str] = []

    def on_new_request(self, request: Request) -> None:
        self.new_requests.append(request.request_id)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.matched_calls.append((request.request_id, num_computed_tokens))
        if request.request_id in self.not_ready:
            return None, False
        p = request.kv_transfer_params
        if not (p and p.get("do_remote_prefill")):
            return 0, False
        n = request.num_prompt_tokens - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.alloc_calls.append((request.request_id, blocks.get_block_ids(), num_external_tokens))
        if num_external_tokens > 0:
            self.inflight.add(request.request_id)
            self._to_load.append(request.request_id)
            assert request.kv_transfer_params is not None
            request.kv_transfer_params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FakeMeta:
        meta = FakeMeta(step=len(self.metas), to_load=self._to_load)
        self._to_load = []
        self.metas.append(meta)
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.outputs.append(output)
        self.inflight -= output.finished_recving
        self.held -= output.finished_sending

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self.finished_calls.append((rid, request.status, tuple(list(g) for g in block_ids)))
        if rid in self.inflight:
            return self.delay_inflight, None
        p = request.kv_transfer_params or {}
        ok = request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        )
        if p.get("do_remote_decode") and ok and any(block_ids):
            self.held.add(rid)
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.spec.engine_id,
                "remote_request_id": rid,
                "remote_block_ids": [list(g) for g in block_ids],
                "num_tokens": request.num_prompt_tokens,
            }
        return False, None

    def has_pending_work(self) -> bool:
        return bool(self.inflight or self.held)


def model_token(req_id: str, token_ids: list[int]) -> int:
    """Deterministic 'model' output: a function of the whole context; never a small id."""
    mix = zlib.crc32(req_id.encode()) + sum((i + 1) * t for i, t in enumerate(token_ids))
    return 100 + mix % 500


@dataclass
class _State:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class FakeWorker:
    """Plays the model runner: tracks requests from SchedulerOutput deltas and keeps a fake
    paged KV cache where each slot holds the token prefix it was computed from. Before sampling
    it checks every position of the request's block table, so a wrongly 'loaded' block, a lost
    block or a skipped recompute is caught. `load` plays the connector's worker half."""

    num_blocks: int = NUM_BLOCKS
    states: dict[str, _State] = field(default_factory=dict)
    kv: list[list[tuple[int, ...] | None]] = field(default_factory=list)
    scheduled: list[dict[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kv = [[None] * BS for _ in range(self.num_blocks)]

    def load(self, sched: Scheduler, request: Request, garbage: bool = False) -> None:
        """Write the request's prompt KV into its blocks (as a finished pull would). With
        `garbage`, write wrong content (a failed / torn transfer)."""
        table = sched.kv_cache_manager.get_block_ids(request.request_id)[0]
        prompt = request.prompt_token_ids
        assert len(table) == cdiv(len(prompt), BS)
        for p in range(request.num_computed_tokens, len(prompt)):
            self.kv[table[p // BS]][p % BS] = (-1,) if garbage else tuple(prompt[: p + 1])

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        self.scheduled.append(dict(out.num_scheduled_tokens))
        for rid in out.finished_req_ids:
            self.states.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.states
            self.states[new.req_id] = _State(
                list(new.token_ids), list(new.block_ids[0]), new.num_computed_tokens
            )
        for cached in out.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            state.block_ids.extend(cached.new_block_ids[0])
            assert cached.num_computed_tokens == state.num_computed_tokens
        to_sample = []
        for rid, n in out.num_scheduled_tokens.items():
            state = self.states[rid]
            c, table = state.num_computed_tokens, state.block_ids
            assert n >= 1 and c + n <= len(state.token_ids)
            assert len(table) >= cdiv(c + n, BS), "block table too short"
            for p in range(c, c + n):
                self.kv[table[p // BS]][p % BS] = tuple(state.token_ids[: p + 1])
            if c + n == len(state.token_ids):
                to_sample.append(rid)
        sampled = {}
        for rid in to_sample:
            state = self.states[rid]
            for p in range(len(state.token_ids)):
                assert self.kv[state.block_ids[p // BS]][p % BS] == tuple(
                    state.token_ids[: p + 1]
                ), f"{rid}: wrong KV at position {p}"
            tok = model_token(rid, state.token_ids)
            state.token_ids.append(tok)
            sampled[rid] = [tok]
        for rid, n in out.num_scheduled_tokens.items():
            self.states[rid].num_computed_tokens += n
        return sampled


def make_scheduler(
    policy: str = "fail",
    num_blocks: int = NUM_BLOCKS,
    max_num_batched_tokens: int = 64,
    delay_inflight: bool = True,
    num_groups: int = 1,
    window: int | None = None,
) -> tuple[Scheduler, FakeConnector]:
    """`window`: groups after the first are sliding-window groups of that many tokens."""
    spec = FullAttentionSpec(BS, num_kv_heads=1, head_size=8)
    swa = SlidingWindowSpec(BS, num_kv_heads=1, head_size=8, sliding_window=window or 1)
    kv_config = KVCacheConfig(
        num_blocks,
        tuple(KVCacheGroupSpec((g,), swa if window and g else spec) for g in range(num_groups)),
    )
    conn = FakeConnector(kv_config, delay_inflight=delay_inflight)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=128),
        CacheConfig(block_size=BS, num_kv_blocks=num_blocks, enable_prefix_caching=True),
        kv_config,
        connector=conn,
        kv_load_failure_policy=policy,
    )
    return sched, conn


def prompt_of(seed: int, n: int) -> list[int]:
    return [10 + (seed * 37 + i * 11) % 80 for i in range(n)]


def local_req(rid: str, prompt: list[int], max_tokens: int = 4, **kv: Any) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), BS, eos_token_id=None,
                   kv_transfer_params=dict(kv) if kv else None)


def remote_req(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return local_req(rid, prompt, max_tokens, do_remote_prefill=True)


def step(
    sched: Scheduler, worker: FakeWorker, kv_out: KVConnectorOutput | None = None
) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    out = sched.schedule()
    assert isinstance(out.kv_connector_metadata, FakeMeta)
    sampled = worker.execute(out)
    updates = sched.update_from_output(
        out, ModelRunnerOutput(sampled_token_ids=sampled, kv_connector_output=kv_out)
    )
    return out, updates


def drain(sched: Scheduler, worker: FakeWorker, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        step(sched, worker)
    pytest.fail("requests did not finish")


def in_group0(blocks: list[int]) -> set[tuple[int, int]]:
    """KVConnectorOutput.invalid_block_ids for these block ids of KV cache group 0."""
    return {(0, b) for b in blocks}


def block_ids(sched: Scheduler, rid: str) -> list[int]:
    return sched.kv_cache_manager.get_block_ids(rid)[0]


def assert_all_free(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == NUM_BLOCKS
    assert all(b.ref_cnt == 0 for b in kv.block_pools[0].blocks)
    assert not sched.requests and not sched.waiting and not sched.running
    assert not sched.waiting_for_remote and not sched.kv_state.delayed_free
    assert sched.stats().num_blocks_held_for_remote == 0
