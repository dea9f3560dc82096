"""The scheduler's KV connector paths (pdkv/sched/scheduler.py): remote prefill
(WAITING_FOR_REMOTE_KVS), load failures by policy, delayed frees for producers and aborted loads,
KV transfer stats. Driven by a torch-free fake connector (scheduler half only) and a fake worker
that plays the model runner and reports KVConnectorOutput by hand."""

from __future__ import annotations

import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pdkv.cache.kv_cache_manager import KVCacheBlocks
from pdkv.cache.single_type_manager import cdiv
from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from pdkv.config import CacheConfig, KVTransferConfig, SchedulerConfig
from pdkv.kv_transfer.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from pdkv.kv_transfer.connector.p2p import P2PConnector
from pdkv.kv_transfer.connector.p2p_messages import P2PConnectorMetadata, prompt_digest
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
            KVTransferConfig("Fake", "kv_both", engine_id="fake-engine"),
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
        ok = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
        if p.get("do_remote_decode") and ok and any(block_ids):
            self.held.add(rid)
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.config.engine_id,
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
        num_blocks, tuple(KVCacheGroupSpec((g,), swa if window and g else spec) for g in range(num_groups))
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


# --------------------------------------------------------------------------- tests
def test_this_module_imports_without_torch():
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_scheduler_kv_connector\n"
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
    step(sched, worker, KVConnectorOutput(finished_recving={"r"}, invalid_block_ids={(0, table[1])}))
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
    step(sched, worker, KVConnectorOutput(stats={"kv_bytes_received": 50.0, "lease_expirations": 2.0},
                                          transfer_seconds=[0.25, 0.125]))
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
    cfg = KVTransferConfig("P2PConnector", "kv_consumer", engine_id="d0")
    conn = P2PConnector(cfg, KVConnectorRole.SCHEDULER, kv_config, layout, ["127.0.0.1", 9])
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
    step(sched, worker, KVConnectorOutput(finished_recving={"a"}, invalid_block_ids=in_group0(table),
                                          load_errors={"a": "timeout"}))
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
