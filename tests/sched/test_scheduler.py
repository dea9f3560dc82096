"""Continuous batching, chunked prefill, preemption and stop conditions (pdkv/sched/scheduler.py),
driven by a torch-free fake model runner."""

from __future__ import annotations

import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from pdkv.cache.single_type_manager import cdiv
from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pdkv.config import CacheConfig, SchedulerConfig
from pdkv.request import Request, RequestStatus
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


# --------------------------------------------------------------------------- tests
def test_scheduler_modules_import_without_torch():
    code = (
        "import sys\n"
        "import pdkv.sched.scheduler, pdkv.cache.kv_cache_manager, pdkv.request\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_single_request_generates_max_tokens_and_frees_everything():
    sched = make_scheduler(num_blocks=16)
    runner = FakeRunner(16)
    req = make_request("a", prompt_of(0, 10), max_tokens=5)
    sched.add_request(req)
    trace = run_all(sched, runner)
    assert req.num_output_tokens == 5
    assert req.output_token_ids == trace.tokens["a"]
    assert req.all_token_ids == req.prompt_token_ids + req.output_token_ids
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.get_finished_reason() == "length"
    # One prefill step of 10 tokens, then 4 decode steps of 1.
    assert [o.num_scheduled_tokens.get("a") for o in trace.outputs] == [10, 1, 1, 1, 1]
    assert len(trace.outputs[0].scheduled_new_reqs) == 1
    assert all(len(o.scheduled_cached_reqs) == 1 for o in trace.outputs[1:])
    assert req.times.first_scheduled is not None and req.times.finished is not None
    assert_all_free(sched, runner)


def test_chunked_prefill_splits_a_long_prompt_within_the_budget():
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=16)
    runner = FakeRunner(32)
    req = make_request("a", prompt_of(1, 50), max_tokens=3)
    sched.add_request(req)
    trace = run_all(sched, runner)
    assert [o.num_scheduled_tokens["a"] for o in trace.outputs] == [16, 16, 16, 2, 1, 1]
    # No token is sampled before the prompt is complete.
    assert req.times.first_token is not None
    assert trace.tokens["a"] == req.output_token_ids
    assert req.num_output_tokens == 3
    assert_all_free(sched, runner)


def test_token_budget_is_respected_with_many_requests():
    budget = 24
    sched = make_scheduler(num_blocks=128, max_num_batched_tokens=budget)
    runner = FakeRunner(128)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", prompt_of(i, 9 + 7 * i), max_tokens=6))
    trace = run_all(sched, runner)  # step() asserts total <= budget each step
    totals = [o.total_num_scheduled_tokens for o in trace.outputs]
    assert max(totals) == budget  # the budget is actually used up in busy steps
    assert all(len(trace.tokens[f"r{i}"]) == 6 for i in range(6))
    assert_all_free(sched, runner)


def test_chunked_prefill_disabled_waits_for_a_budget_that_fits_the_whole_prompt():
    sched = make_scheduler(
        num_blocks=64, max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False
    )
    runner = FakeRunner(64)
    sched.add_request(make_request("a", prompt_of(0, 20), max_tokens=4))
    sched.add_request(make_request("b", prompt_of(1, 20), max_tokens=4))
    trace = Trace()
    first = step(sched, runner, trace)
    assert first.num_scheduled_tokens == {"a": 20}
    second = step(sched, runner, trace)
    assert second.num_scheduled_tokens == {"a": 1, "b": 20}
    run_all(sched, runner)
    assert_all_free(sched, runner)


def test_max_num_seqs_is_respected():
    sched = make_scheduler(num_blocks=64, max_num_seqs=2)
    runner = FakeRunner(64)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", prompt_of(i, 6), max_tokens=3))
    trace = run_all(sched, runner)
    assert max(len(o.num_scheduled_tokens) for o in trace.outputs) == 2
    assert sorted(trace.tokens) == [f"r{i}" for i in range(5)]
    assert_all_free(sched, runner)


def test_fcfs_order():
    sched = make_scheduler(num_blocks=64, max_num_seqs=1)
    runner = FakeRunner(64)
    # Later requests are shorter: FCFS must still serve them in arrival order.
    for i in range(4):
        sched.add_request(make_request(f"r{i}", prompt_of(i, 12 - 2 * i), max_tokens=4 - i))
    trace = run_all(sched, runner)
    assert trace.finish_order == ["r0", "r1", "r2", "r3"]
    first_step = {}
    for n, out in enumerate(trace.outputs):
        for rid in out.num_scheduled_tokens:
            first_step.setdefault(rid, n)
    assert sorted(first_step, key=first_step.get) == ["r0", "r1", "r2", "r3"]

    # With room for everyone, admission within one step also follows arrival order.
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=20)
    for i in range(4):
        sched.add_request(make_request(f"q{i}", prompt_of(i, 8), max_tokens=2))
    out = sched.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["q0", "q1", "q2"]
    assert out.num_scheduled_tokens == {"q0": 8, "q1": 8, "q2": 4}  # q2 gets a chunk


def _workload(n: int = 6) -> list[Request]:
    return [
        make_request(f"r{i}", prompt_of(i, 7 + 3 * i), max_tokens=10 + 2 * i, ignore_eos=True)
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("num_blocks", "budget", "enable_prefix_caching"),
    [(12, 32, True), (12, 32, False), (12, 6, False), (14, 8, True)],
)
def test_preemption_when_blocks_run_out_gives_the_same_tokens(
    num_blocks, budget, enable_prefix_caching
):
    big = make_scheduler(num_blocks=256, max_num_batched_tokens=budget)
    big_runner = FakeRunner(256)
    for r in _workload():
        big.add_request(r)
    ref = run_all(big, big_runner)
    assert big.num_preemptions == 0

    # The longest request needs cdiv(22 + 20, 4) = 11 blocks; give just a bit more.
    small = make_scheduler(
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        enable_prefix_caching=enable_prefix_caching,
    )
    small_runner = FakeRunner(num_blocks)
    reqs = _workload()
    for r in reqs:
        small.add_request(r)
    got = run_all(small, small_runner)
    assert small.num_preemptions > 0
    assert small.stats().num_preemptions == small.num_preemptions
    assert any(r.num_preemptions > 0 for r in reqs)
    assert got.tokens == ref.tokens
    assert all(len(got.tokens[r.request_id]) == r.sampling_params.max_tokens for r in reqs)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert_all_free(small, small_runner)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preempted_requests_are_dropped_then_resent_in_full(enable_prefix_caching):
    sched = make_scheduler(
        num_blocks=12, max_num_batched_tokens=32, enable_prefix_caching=enable_prefix_caching
    )
    runner = FakeRunner(12)
    reqs = {r.request_id: r for r in _workload()}
    for r in reqs.values():
        sched.add_request(r)
    trace = Trace()
    preempted_seen: set[str] = set()
    pending_resend: dict[str, list[int]] = {}  # id -> its tokens when preempted
    resent_with_outputs = 0
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        before = sched.num_preemptions
        out = step(sched, runner, trace)
        for new in out.scheduled_new_reqs:
            if new.req_id in pending_resend:
                r = reqs[new.req_id]
                # Resent with everything generated so far; the prompt length is unchanged.
                assert new.num_prompt_tokens == len(r.prompt_token_ids)
                snapshot = pending_resend.pop(new.req_id)
                assert new.token_ids == snapshot
                assert snapshot[: len(r.prompt_token_ids)] == r.prompt_token_ids
                resent_with_outputs += len(snapshot) > len(r.prompt_token_ids)
        for cached in out.scheduled_cached_reqs:
            assert cached.req_id not in pending_resend
        newly = {
            rid
            for rid, r in reqs.items()
            if r.status == RequestStatus.PREEMPTED and rid not in pending_resend
        }
        assert len(newly) == sched.num_preemptions - before
        for rid in newly:
            # Preempted while planning this step: not scheduled, and the worker is told to
            # drop its state in this very step (it is resent in full when readmitted).
            assert rid not in out.num_scheduled_tokens
            assert rid in out.finished_req_ids
            assert rid not in runner.states
            preempted_seen.add(rid)
            pending_resend[rid] = list(reqs[rid].all_token_ids)
    else:
        pytest.fail("requests did not finish")
    assert preempted_seen
    assert resent_with_outputs > 0  # some were preempted during decode, not only in prefill
    assert not pending_resend
    assert sum(r.num_preemptions for r in reqs.values()) == sched.num_preemptions
    # num_cached_tokens is fixed at the first scheduling (no prompt was cached then), even
    # when a readmission hits the request's own blocks.
    assert all(r.num_cached_tokens == 0 for r in reqs.values())
    if enable_prefix_caching:
        assert sched.kv_cache_manager.prefix_cache_stats.hits > 0
    assert_all_free(sched, runner)


def test_preemption_evicts_the_most_recently_admitted_request():
    # 4 blocks of 4 tokens; two requests of 7 prompt tokens each hold 2 blocks. The first
    # decode that needs a 3rd block for r0 must preempt r1 (admitted later), not r0, and r1
    # goes back to the front of the queue, ahead of r2 that never ran.
    sched = make_scheduler(num_blocks=4, max_num_seqs=2, max_num_batched_tokens=32)
    runner = FakeRunner(4)
    r0 = make_request("r0", prompt_of(0, 7), max_tokens=6, ignore_eos=True)
    r1 = make_request("r1", prompt_of(1, 7), max_tokens=6, ignore_eos=True)
    r2 = make_request("r2", prompt_of(2, 3), max_tokens=1)
    for r in (r0, r1, r2):
        sched.add_request(r)
    trace = Trace()
    step(sched, runner, trace)  # both prefill: 7 + 7 tokens, 2 + 2 blocks
    assert sched.kv_cache_manager.num_free_blocks == 0
    step(sched, runner, trace)  # token 8 of each fits in block 1
    out = step(sched, runner, trace)  # r0 needs block 2 -> r1 preempted
    assert sched.num_preemptions == 1
    assert r1.status == RequestStatus.PREEMPTED and r1.num_computed_tokens == 0
    assert r1.num_preemptions == 1 and r0.num_preemptions == 0
    assert r0.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {"r0": 1}
    assert list(sched.waiting) == [r1, r2]
    assert sched.running == [r0]
    # The worker drops r1 in the same step.
    assert out.finished_req_ids == {"r1"}
    assert "r1" not in runner.states
    nxt = step(sched, runner, trace)
    assert "r1" not in nxt.finished_req_ids
    run_all(sched, runner, trace)
    assert r0.num_output_tokens == r1.num_output_tokens == 6
    # Readmission follows the queue: r1 is sent to the worker before r2.
    resent = [n.req_id for o in trace.outputs[3:] for n in o.scheduled_new_reqs]
    assert resent == ["r1", "r2"]
    assert_all_free(sched, runner)


def test_eos_stops_unless_ignore_eos():
    def eos_at_third_output(req_id: str, token_ids: list[int]) -> int:
        return EOS if len(token_ids) == 8 + 2 else default_token(req_id, token_ids)

    sched = make_scheduler()
    runner = FakeRunner(64, token_fn=eos_at_third_output)
    stop = make_request("stop", prompt_of(0, 8), max_tokens=10)
    ign = make_request("ignore", prompt_of(1, 8), max_tokens=10, ignore_eos=True)
    no_eos = make_request("no-eos-id", prompt_of(2, 8), eos=None, max_tokens=10)
    for r in (stop, ign, no_eos):
        sched.add_request(r)
    trace = run_all(sched, runner)
    assert stop.status == RequestStatus.FINISHED_STOPPED
    assert stop.get_finished_reason() == "stop"
    assert stop.output_token_ids[-1] == EOS and stop.num_output_tokens == 3
    assert stop.stop_reason is None
    assert ign.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert ign.num_output_tokens == 10 and ign.output_token_ids[2] == EOS
    assert no_eos.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert no_eos.num_output_tokens == 10
    assert trace.tokens["stop"] == stop.output_token_ids
    assert_all_free(sched, runner)


def test_stop_token_ids_set_stop_reason():
    def fixed(req_id: str, token_ids: list[int]) -> int:
        return {10: 50, 11: 51, 12: 77}.get(len(token_ids), 60)

    sched = make_scheduler()
    runner = FakeRunner(64, token_fn=fixed)
    a = make_request("a", prompt_of(0, 10), max_tokens=10, stop_token_ids=[77, 51])
    b = make_request("b", prompt_of(1, 10), max_tokens=10, stop_token_ids=[77])
    c = make_request("c", prompt_of(2, 10), max_tokens=10, stop_token_ids=[99])
    for r in (a, b, c):
        sched.add_request(r)
    run_all(sched, runner)
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == 51
    assert a.output_token_ids == [50, 51]
    assert b.status == RequestStatus.FINISHED_STOPPED and b.stop_reason == 77
    assert b.output_token_ids == [50, 51, 77]
    assert c.status == RequestStatus.FINISHED_LENGTH_CAPPED and c.stop_reason is None
    assert c.num_output_tokens == 10
    assert_all_free(sched, runner)


def test_min_tokens_delays_eos_and_stop_tokens():
    def always(tok: int) -> Callable[[str, list[int]], int]:
        return lambda req_id, token_ids: tok

    sched = make_scheduler()
    eos_runner = FakeRunner(64, token_fn=always(EOS))
    r = make_request("a", prompt_of(0, 5), max_tokens=10, min_tokens=4)
    sched.add_request(r)
    run_all(sched, eos_runner)
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [EOS] * 4

    sched = make_scheduler()
    stop_runner = FakeRunner(64, token_fn=always(33))
    r = make_request("b", prompt_of(0, 5), max_tokens=10, min_tokens=3, stop_token_ids=[33])
    sched.add_request(r)
    run_all(sched, stop_runner)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 33
    assert r.num_output_tokens == 3

    # Without min_tokens the first EOS stops.
    sched = make_scheduler()
    r = make_request("c", prompt_of(0, 5), max_tokens=10)
    sched.add_request(r)
    run_all(sched, FakeRunner(64, token_fn=always(EOS)))
    assert r.output_token_ids == [EOS]


def test_max_model_len_caps_generation():
    sched = make_scheduler(max_model_len=14)
    runner = FakeRunner(64)
    r = make_request("a", prompt_of(0, 10), max_tokens=100)
    sched.add_request(r)
    run_all(sched, runner)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.num_tokens == 14 and r.num_output_tokens == 4
    assert_all_free(sched, runner)


def test_abort_waiting_and_running_requests_frees_blocks():
    sched = make_scheduler(num_blocks=32, max_num_seqs=2)
    runner = FakeRunner(32)
    reqs = [make_request(f"r{i}", prompt_of(i, 9), max_tokens=20) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    trace = Trace()
    step(sched, runner, trace)
    step(sched, runner, trace)
    assert [r.request_id for r in sched.running] == ["r0", "r1"]
    free_before = sched.kv_cache_manager.num_free_blocks
    r0_blocks = len(sched.kv_cache_manager.get_block_ids("r0")[0])
    assert r0_blocks > 0

    done = sched.finish_requests(["r0", "r3", "nope"], RequestStatus.FINISHED_ABORTED)
    assert done == [reqs[0], reqs[3]]
    assert reqs[0].status == reqs[3].status == RequestStatus.FINISHED_ABORTED
    assert reqs[0].get_finished_reason() == "abort"
    assert sched.kv_cache_manager.num_free_blocks == free_before + r0_blocks
    assert sched.kv_cache_manager.get_block_ids("r0") == ([],)
    assert reqs[0] not in sched.running and reqs[3] not in sched.waiting
    assert "r0" not in sched.requests and "r3" not in sched.requests
    assert sched.get_num_unfinished_requests() == 2
    # Finishing again is a no-op.
    assert sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED) == []

    out = step(sched, runner, trace)
    # The worker drops the running request it knew; r3 was never sent to it.
    assert out.finished_req_ids == {"r0"}
    assert "r0" not in runner.states
    assert "r2" in out.num_scheduled_tokens  # r0's seat went to r2
    # Late tokens for an aborted request are ignored.
    late = sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"r0": [5]}))
    assert late == [] and reqs[0].num_output_tokens == 2

    sched.finish_requests(["r1", "r2"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert_all_free(sched, runner)
    assert reqs[3].num_output_tokens == 0


def test_duplicate_request_id_raises():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt_of(0, 5)))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", prompt_of(1, 5)))
    assert sched.get_num_unfinished_requests() == 1
    # Once finished, the id may be reused.
    runner = FakeRunner(64)
    run_all(sched, runner)
    sched.add_request(make_request("a", prompt_of(1, 5), max_tokens=2))
    run_all(sched, runner)
    assert_all_free(sched, runner)


def test_num_cached_tokens_is_the_whole_block_prefix_of_a_repeated_prompt():
    prompt = prompt_of(3, 22)  # 5 full blocks of 4 + 2 tokens
    sched = make_scheduler()
    runner = FakeRunner(64)
    first = make_request("first", prompt, max_tokens=3)
    sched.add_request(first)
    ref = run_all(sched, runner)
    assert first.num_cached_tokens == 0

    again = make_request("again", prompt, max_tokens=3)
    sched.add_request(again)
    trace = run_all(sched, runner)  # FakeRunner checks the reused KV
    assert again.num_cached_tokens == 20
    assert trace.outputs[0].scheduled_new_reqs[0].num_computed_tokens == 20
    assert trace.outputs[0].num_scheduled_tokens == {"again": 2}
    # Same context, so the same tokens as a cold run (modulo the request id in token_fn).
    assert len(trace.tokens["again"]) == len(ref.tokens["first"]) == 3

    # A whole-block prompt still leaves its last token to compute: 24 tokens -> 20 cached.
    exact = make_request("exact", prompt_of(4, 24), max_tokens=1)
    sched.add_request(exact)
    run_all(sched, runner)
    exact2 = make_request("exact2", prompt_of(4, 24), max_tokens=1)
    sched.add_request(exact2)
    run_all(sched, runner)
    assert exact2.num_cached_tokens == 20

    # A different salt does not see the cache.
    salted = make_request("salted", prompt, max_tokens=1, cache_salt="t")
    sched.add_request(salted)
    run_all(sched, runner)
    assert salted.num_cached_tokens == 0

    stats = sched.kv_cache_manager.prefix_cache_stats
    assert stats.requests == 5
    assert stats.queries == 22 + 22 + 24 + 24 + 22
    assert stats.hits == 20 + 20
    assert_all_free(sched, runner)


def test_no_cached_tokens_with_prefix_caching_disabled():
    prompt = prompt_of(3, 22)
    sched = make_scheduler(enable_prefix_caching=False)
    runner = FakeRunner(64)
    for rid in ("a", "b"):
        r = make_request(rid, prompt, max_tokens=2)
        sched.add_request(r)
        run_all(sched, runner)
        assert r.num_cached_tokens == 0
    assert sched.kv_cache_manager.prefix_cache_stats.requests == 0
    assert_all_free(sched, runner)


def test_shared_prefix_across_concurrent_requests_gives_correct_kv():
    # Requests with a common 16-token prefix arrive together; later ones hit blocks the first
    # computes in the same step, and the fake runner verifies the KV each one reads.
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    runner = FakeRunner(64)
    common = prompt_of(9, 16)
    reqs = [make_request(f"r{i}", common + prompt_of(i, 3 + i), max_tokens=4) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    run_all(sched, runner)
    assert reqs[0].num_cached_tokens == 0
    assert all(r.num_cached_tokens == 16 for r in reqs[1:])
    assert all(r.num_output_tokens == 4 for r in reqs)
    assert_all_free(sched, runner)


def test_stats_reflect_queue_state():
    sched = make_scheduler(num_blocks=16, max_num_seqs=1)
    runner = FakeRunner(16)
    sched.add_request(make_request("a", prompt_of(0, 8), max_tokens=3))
    sched.add_request(make_request("b", prompt_of(1, 8), max_tokens=3))
    s = sched.stats()
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 2, 16)
    step(sched, runner, Trace())
    s = sched.stats()
    assert (s.num_running, s.num_waiting) == (1, 1)
    assert s.num_free_blocks == 16 - 2  # 8 prompt tokens; the 9th gets room next step
    assert s.kv_cache_usage == pytest.approx(2 / 16)
