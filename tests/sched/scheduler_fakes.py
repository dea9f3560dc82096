"""A torch-free fake model runner and request / step helpers shared by the scheduler tests
(test_scheduler.py, test_scheduler_stops.py)."""


from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from pdkv.cache.single_type_manager import cdiv
from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pdkv.config import CacheConfig, SchedulerConfig
from pdkv.request import Request
from pdkv.sampling_params import SamplingParams
from pdkv.sched.output import ModelRunnerOutput, SchedulerOutput
from pdkv.sched.scheduler import Scheduler

BS = 4
EOS = 2


def default_token(req_id: str, token_ids: list[int]) -> int:
    """Deterministic 'model': a function of the request id and the whole context (so a KV or
    bookkeeping mistake changes the output). Never EOS or a small id."""
    mix = zlib.crc32(req_id.encode()) + sum((i + 1) * t for i, t in enumerate(token_ids))
    return 100 + mix % 500


@dataclass
class _State:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[list[int]]
    num_computed_tokens: int


@dataclass
class FakeRunner:
    """Tracks request state from SchedulerOutput deltas like pdkv/worker/model_runner.py and
    simulates a paged KV cache: each slot stores the token prefix it was computed from, and a
    token is sampled only after checking that every earlier position of the request's block
    table holds the right prefix (this catches wrong prefix hits and lost blocks)."""

    num_blocks: int
    block_size: int = BS
    token_fn: Callable[[str, list[int]], int] = default_token
    states: dict[str, _State] = field(default_factory=dict)
    kv: list[list[tuple[int, ...] | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kv = [[None] * self.block_size for _ in range(self.num_blocks)]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.states, "resent without being dropped first"
            self.states[new.req_id] = _State(
                list(new.token_ids),
                new.num_prompt_tokens,
                [list(b) for b in new.block_ids],
                new.num_computed_tokens,
            )
        for cached in out.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            for blocks, new_ids in zip(state.block_ids, cached.new_block_ids, strict=True):
                blocks.extend(new_ids)
            assert cached.num_computed_tokens == state.num_computed_tokens
        assert set(out.num_scheduled_tokens) == {r.req_id for r in out.scheduled_new_reqs} | {
            r.req_id for r in out.scheduled_cached_reqs
        }

        bs = self.block_size
        to_sample = []
        # "Forward": write the KV of every scheduled token first (as a batched forward does
        # layer by layer), then read.
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            c = state.num_computed_tokens
            table = state.block_ids[0]
            assert n >= 1
            assert c + n <= len(state.token_ids)
            assert len(table) >= cdiv(c + n, bs), "block table too short"
            assert len(set(table)) == len(table)
            for p in range(c, c + n):
                self.kv[table[p // bs]][p % bs] = tuple(state.token_ids[: p + 1])
            if c + n == len(state.token_ids):
                to_sample.append(req_id)
        sampled: dict[str, list[int]] = {}
        for req_id in to_sample:
            state = self.states[req_id]
            table = state.block_ids[0]
            for p in range(len(state.token_ids)):
                assert self.kv[table[p // bs]][p % bs] == tuple(state.token_ids[: p + 1]), (
                    f"{req_id}: wrong KV at position {p}"
                )
            tok = self.token_fn(req_id, state.token_ids)
            state.token_ids.append(tok)
            sampled[req_id] = [tok]
        for req_id, n in out.num_scheduled_tokens.items():
            self.states[req_id].num_computed_tokens += n
        return ModelRunnerOutput(sampled_token_ids=sampled)


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
) -> Scheduler:
    kv_config = KVCacheConfig(
        num_blocks, (KVCacheGroupSpec((0,), FullAttentionSpec(BS, num_kv_heads=1, head_size=8)),)
    )
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
        ),
        CacheConfig(
            block_size=BS, num_kv_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching
        ),
        kv_config,
    )


def make_request(
    rid: str, prompt: list[int], eos: int | None = EOS, cache_salt: str | None = None, **params
) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(
        rid, prompt, SamplingParams(**params), BS, eos_token_id=eos, cache_salt=cache_salt
    )


def prompt_of(seed: int, n: int) -> list[int]:
    return [10 + (seed * 37 + i * 11) % 80 for i in range(n)]


@dataclass
class Trace:
    outputs: list[SchedulerOutput] = field(default_factory=list)
    finish_order: list[str] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)


def step(sched: Scheduler, runner: FakeRunner, trace: Trace) -> SchedulerOutput:
    preemptions_before = sched.num_preemptions
    out = sched.schedule()
    if sched.num_preemptions > preemptions_before:
        # No waiting (or just preempted) request is admitted in a step that preempted.
        assert out.scheduled_new_reqs == []
    cfg = sched.config
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= cfg.max_num_seqs
    assert len(sched.running) <= cfg.max_num_seqs
    # The worker's block tables agree with the manager's after applying the deltas.
    runner_out = runner.execute(out)
    for req_id in out.num_scheduled_tokens:
        assert tuple(runner.states[req_id].block_ids) == sched.kv_cache_manager.get_block_ids(
            req_id
        )
    for update in sched.update_from_output(out, runner_out):
        trace.tokens.setdefault(update.request.request_id, []).extend(update.new_token_ids)
        if update.finished:
            trace.finish_order.append(update.request.request_id)
    trace.outputs.append(out)
    return out


def run_all(
    sched: Scheduler, runner: FakeRunner, trace: Trace | None = None, max_steps: int = 2000
) -> Trace:
    trace = Trace() if trace is None else trace
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner, trace)
    else:
        pytest.fail("requests did not finish")
    return trace


def assert_all_free(sched: Scheduler, runner: FakeRunner | None = None) -> None:
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.config.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pools[0].blocks)
    assert not sched.requests and not sched.running and not sched.waiting
    if runner is not None:
        # The next (empty) step tells the worker to drop every finished request.
        out = sched.schedule()
        assert out.is_empty
        runner.execute(out)
        assert runner.states == {}
