"""Continuous-batching scheduler (torch-free), after vLLM v1's unified scheduler.

Every request carries `num_computed_tokens`; a step gives each scheduled request
`num_tokens - num_computed_tokens` new tokens (a prefill chunk or one decode token) within the
token budget. Running requests go first (FCFS); when the pool runs out of blocks the most
recently admitted running request is preempted (its blocks are freed and it is recomputed
later). Waiting requests are admitted only in steps without preemption. An asynchronous
(remote) KV load is admitted only when the blocks left free still cover the
`remote_kv_watermark` plus one next-decode block per running or loading request; a load held
back holds the later loads (FCFS) but not the other requests behind it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable

from pdkv.cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pdkv.cache.specs import KVCacheConfig
from pdkv.config import CacheConfig, SchedulerConfig
from pdkv.kv_events.schema import Event
from pdkv.request import Request, RequestStatus
from pdkv.sched.kv_connector_api import SchedulerConnector
from pdkv.sched.kv_connector_state import KVConnectorState
from pdkv.sched.output import (
    ModelRunnerOutput,
    RequestUpdate,
    SchedulerOutput,
    SchedulerStats,
)
from pdkv.sched.step_plan import StepPlan
from pdkv.sched.utils import check_stop


class Scheduler:
    """Decides, each step, which tokens of which requests run.

    Args:
        scheduler_config: budgets (max_num_seqs, max_num_batched_tokens, max_model_len).
        cache_config: block size and prefix caching switch.
        kv_cache_config: KV cache groups and block count (from the worker).
        connector: scheduler half of a KV connector, or None.
        kv_load_failure_policy: "recompute" or "fail" when a KV load fails.
        enable_kv_cache_events: the block pools record KV cache events (`take_kv_events`).

    Called from the engine loop thread only; no method blocks.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_config: KVCacheConfig,
        connector: SchedulerConnector | None = None,
        kv_load_failure_policy: str = "fail",
        enable_kv_cache_events: bool = False,
    ) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.num_blocks = kv_cache_config.num_blocks
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config, cache_config.enable_prefix_caching, self.max_model_len,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Ids the worker must drop at its next step (finished, aborted or preempted).
        self.finished_req_ids: set[str] = set()
        self._handed_over: list[RequestUpdate] = []  # producer tokens emitted by update_from_output
        # Ids whose state the worker holds (sent once in full, then as deltas).
        self._worker_known: set[str] = set()
        self.num_preemptions = 0
        self.connector = connector
        self.kv_load_failure_policy = kv_load_failure_policy
        self.kv_state = KVConnectorState(self.kv_cache_manager, connector, kv_load_failure_policy)
        if connector is not None:
            connector.bind_kv_cache_manager(self.kv_cache_manager)

    @property
    def waiting_for_remote(self) -> dict[str, Request]:
        """Request id -> request whose asynchronous KV load is in flight."""
        return self.kv_state.waiting_for_remote

    @property
    def kv_stats(self) -> dict[str, float]:
        """Cumulative KV transfer counters (bytes, events, kv_load_failures_<policy>)."""
        return self.kv_state.stats

    @property
    def _delayed_free(self) -> dict[str, Request]:
        return self.kv_state.delayed_free

    # ----------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queue a validated request (FCFS).

        Raises:
            ValueError: the request id is already in use.
        """
        if request.request_id in self.requests or request.request_id in self.kv_state.delayed_free:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.connector is not None:
            self.connector.on_new_request(request)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus
    ) -> list[Request]:
        """Finish requests from outside the step (abort, stop string); frees their blocks.

        Unknown or already finished ids are ignored. Returns the requests finished.
        """
        done = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            self.kv_state.abandon_load(request)
            request.status = status
            self._free_request(request)
            done.append(request)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_remote)

    def has_pending_kv_work(self) -> bool:
        """Blocks held for a connector or transfers in flight: keep stepping."""
        return self.kv_state.has_pending_work()

    def needs_step(self) -> bool:
        """Work a step does at once: requests to schedule, outputs of requests finished outside
        a step, load results to apply, or connector metadata for the worker."""
        return bool(self.waiting or self.running or self.kv_state.needs_step())

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_remote)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_stats.queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_stats.hits,
            num_waiting_for_remote_kv=len(self.waiting_for_remote),
            num_blocks_held_for_remote=self.kv_state.num_blocks_held(),
            kv_transfer=dict(self.kv_state.stats),
            transfer_seconds=self.kv_state.drain_transfer_seconds(),
            kv_observations=self.kv_state.drain_observations(),
        )

    # ----------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Plan one step. Advances num_computed_tokens of scheduled requests as if the step ran
        (the worker executes exactly this plan before the next call)."""
        preempted = False
        now = time.monotonic()
        self._update_waiting_for_remote_kv()
        plan = StepPlan.start(self.config, self.running)

        # 1. Running requests, oldest first.
        idx = 0
        while idx < len(self.running) and plan.tokens_left > 0:
            request = self.running[idx]
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = plan.fit(remaining)
            if num_new <= 0:
                idx += 1
                continue
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_blocks is None:
                break
            plan.add(
                request,
                new_blocks.get_block_ids(),
                self.kv_cache_manager.get_block_ids,
                self._worker_known,
            )
            plan.spend(request.request_id, num_new, prefill=remaining > 1)
            idx += 1

        # 2. Waiting requests, in order, while nothing was preempted this step.
        skipped: list[Request] = []
        loads_blocked = False
        while not preempted and self.waiting and plan.tokens_left > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            hits: KVCacheBlocks | None = None
            num_hit = 0
            num_external, load_async = 0, False
            resumed_remote = request.num_computed_tokens > 0  # its KV was loaded by a connector
            if not resumed_remote:
                hits, num_hit = self.kv_cache_manager.get_computed_blocks(request)
                if self.connector is not None:
                    ext, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
                    if ext is None:  # not ready: ask again next step
                        skipped.append(self.waiting.popleft())
                        continue
                    num_external = ext
                    if request.sampling_params.prompt_logprobs is not None:
                        # Every prompt position is computed here: its logits are the output.
                        num_external, load_async = 0, False
                    if not load_async:
                        # Loaded by the worker before this step's forward pass. The last
                        # token is always computed here (its logits give the next token).
                        num_external = max(0, min(num_external, request.num_tokens - 1 - num_hit))
            if load_async and num_external > 0:
                new_blocks = None if loads_blocked else self.kv_cache_manager.allocate_slots(
                    request, 0, hits, num_hit, num_external_computed_tokens=num_external,
                    num_reserved_blocks=self._remote_load_reserve(),
                )
                if new_blocks is None:
                    # Not now; later remote loads wait too (FCFS among them), other requests
                    # behind it may still start.
                    loads_blocked = True
                    skipped.append(self.waiting.popleft())
                    continue
                self.waiting.popleft()
                # Counted once, at this first admission (its resumption skips the count).
                self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit)
                request.num_local_hit_tokens = num_hit
                request.num_computed_tokens = num_hit
                if request.times.first_scheduled is None:
                    request.times.first_scheduled = now
                self.kv_state.start_load(request, num_external)
                assert self.connector is not None
                self.connector.update_state_after_alloc(request, new_blocks, num_external)
                continue
            num_computed = (request.num_computed_tokens if resumed_remote
                            else num_hit + num_external)
            num_new = request.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > plan.tokens_left:
                break
            is_prefill = num_new > 1
            num_new = plan.fit(num_new)
            if num_new <= 0:
                break
            if not resumed_remote:
                request.num_computed_tokens = 0
            # Slots for the synchronously loaded tokens too; their blocks are final (and
            # cached) once this step ran, like the computed ones.
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_external + num_new, hits, num_hit
            )
            if new_blocks is None:
                break
            self.waiting.popleft()
            if not resumed_remote:
                self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit)
                request.num_local_hit_tokens = num_hit
                request.num_computed_tokens = num_hit
                if self.connector is not None:
                    self.connector.update_state_after_alloc(request, new_blocks, num_external)
                request.num_computed_tokens += num_external
            if request.num_cached_tokens < 0:  # local prefix hits + tokens loaded by a connector
                request.num_cached_tokens = request.num_computed_tokens
                request.num_external_tokens = (
                    request.num_computed_tokens - request.num_local_hit_tokens
                )
            if request.times.first_scheduled is None:
                request.times.first_scheduled = now
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.add(
                request,
                new_blocks.get_block_ids(),
                self.kv_cache_manager.get_block_ids,
                self._worker_known,
            )
            plan.spend(request.request_id, num_new, prefill=is_prefill)
        self.waiting.extendleft(reversed(skipped))

        output = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
        )
        self.finished_req_ids = set()
        for req_id, n in plan.num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    def _remote_load_reserve(self) -> int:
        """Blocks that must stay free after admitting an asynchronous load: the watermark plus
        one next-decode block per running or loading request, this one included. None when
        nothing runs or loads, so a load always starts once the pool can hold it."""
        if not self.running and not self.kv_state.waiting_for_remote:
            return 0
        watermark = math.ceil(self.config.remote_kv_watermark * self.num_blocks)
        return watermark + len(self.running) + len(self.kv_state.waiting_for_remote) + 1

    def _update_waiting_for_remote_kv(self) -> None:
        """Requests whose KV load ended go back to the front of the queue (or fail)."""
        to_resume, failed = self.kv_state.resolve_finished_loads()
        finished = self._take_handed_over_tokens()
        for request in to_resume:
            if request not in finished:
                self.waiting.appendleft(request)
        for request in failed:
            self._free_request(request)
            self.kv_state.finished_outside.append(request)

    def _take_handed_over_tokens(self) -> list[Request]:
        """Requests that resumed with the producer's first token (linear-state P/D): the token
        counts like a sampled one (output now, stop checks); those it finishes (EOS, a stop
        token, max_tokens=1) are freed here and returned."""
        finished = []
        now = time.monotonic()
        for request in self.kv_state.handed_over:
            request.times.first_token = request.times.last_token = now
            done = check_stop(request, self.max_model_len)
            if done:
                self._free_request(request)
                finished.append(request)
            self._handed_over.append(
                RequestUpdate(request, request.output_token_ids[-1:], None, done)
            )
        self.kv_state.handed_over = []
        return finished

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: free the blocks and requeue at the front."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._forget_in_worker(request.request_id)
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------- update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Append sampled tokens, apply stop conditions, free finished requests.

        Returns one RequestUpdate per request that got tokens this step.
        """
        state = self.kv_state
        updates = [
            RequestUpdate(r, [], None, True) for r in state.finished_outside
        ] + self._handed_over
        state.finished_outside, self._handed_over = [], []
        if runner_output.kv_connector_output is not None:
            state.apply_output(runner_output.kv_connector_output)
        now = time.monotonic()
        for req_id, token_ids in runner_output.sampled_token_ids.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            request.append_output_token_ids(token_ids)
            if request.times.first_token is None:
                request.times.first_token = now
            request.times.last_token = now
            finished = check_stop(request, self.max_model_len)
            if finished:
                self.running.remove(request)
                self._free_request(request)
            logprobs = runner_output.logprobs.get(req_id) if runner_output.logprobs else None
            prompt_lps = (
                runner_output.prompt_logprobs.get(req_id) if runner_output.prompt_logprobs else None
            )
            updates.append(RequestUpdate(request, token_ids, logprobs, finished, prompt_lps))
        return updates

    def _free_request(self, request: Request) -> None:
        self.kv_state.release(request)
        self._forget_in_worker(request.request_id)
        del self.requests[request.request_id]

    def _forget_in_worker(self, req_id: str) -> None:
        if req_id in self._worker_known:
            self._worker_known.discard(req_id)
            self.finished_req_ids.add(req_id)

    # --------------------------------------------------------------- prefix cache
    def reset_prefix_cache(self) -> bool:
        """Forget the engine's prefix cache (vLLM's Scheduler.reset_prefix_cache without
        reset_running_requests): refused, with nothing changed, while any KV cache block is in
        use (running requests, KV loads in flight, blocks held for a remote reader).

        Returns:
            True when every cached hash was dropped, else False.
        """
        return self.kv_cache_manager.reset_prefix_cache()

    def take_kv_events(self) -> list[Event]:
        """The KV cache events recorded since the last call (vLLM's take_events; empty unless
        made with `enable_kv_cache_events`). The engine loop calls it once per step."""
        return self.kv_cache_manager.take_events()
