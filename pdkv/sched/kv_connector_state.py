"""The scheduler's KV connector bookkeeping (torch-free).

What the scheduler tracks for a KV connector, apart from plain batching: requests waiting for a
remote KV load (WAITING_FOR_REMOTE_KVS), the results the worker half reported (finished loads,
invalid blocks, load errors), blocks whose free is delayed until the connector lets go, requests
finished outside a step whose output is still owed, transfer counters, and the load-failure
policy. The `Scheduler` owns one instance and calls it from the engine loop thread only; no
method blocks.
"""

from __future__ import annotations

import time

from pdkv.cache.kv_cache_manager import KVCacheManager
from pdkv.request import Request, RequestStatus
from pdkv.sched.kv_connector_api import SchedulerConnector
from pdkv.sched.output import KVConnectorOutput


class KVConnectorState:
    """Remote-KV state of one scheduler.

    Args:
        kv_cache_manager: the scheduler's block manager (blocks are freed through it).
        connector: scheduler half of the KV connector, or None (then only stats stay empty).
        kv_load_failure_policy: "recompute" (free the blocks, prefill locally) or "fail"
            (finish the request with FINISHED_ERROR) when a load fails.

    Attributes:
        waiting_for_remote: request id -> request whose asynchronous load is in flight.
        delayed_free: request id -> finished request whose blocks the connector still uses.
        finished_outside: requests finished outside a step (failed loads) whose final output
            is emitted by the next `update_from_output`.
        stats: cumulative counters (bytes, events, `kv_load_failures_<policy>`: every failed
            load once, including a load whose request was aborted before the failure came
            back; it is counted under the policy in force although no policy applies to it).
        transfer_seconds: durations of completed transfers, drained by the metrics reader.
        observations: histogram samples by metric key (e.g. "pool:disk:load_seconds"), drained
            by the metrics reader.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        connector: SchedulerConnector | None,
        kv_load_failure_policy: str,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.connector = connector
        self.policy = kv_load_failure_policy
        self.waiting_for_remote: dict[str, Request] = {}
        # request id -> token count the request has once its load is done (local hits + load)
        self.load_end: dict[str, int] = {}
        self.finished_recving: set[str] = set()
        self.invalid_blocks: set[tuple[int, int]] = set()  # (group index, block id)
        self.load_errors: dict[str, str] = {}
        # request id -> policy for its failed load when the connector chose one (else self.policy)
        self.failure_policy: dict[str, str] = {}
        self.delayed_free: dict[str, Request] = {}
        self.finished_outside: list[Request] = []
        # Requests that resumed with the producer's first output token appended (a linear-state
        # model's P/D load), drained by the scheduler (stop checks, the token's output).
        self.handed_over: list[Request] = []
        self.stats: dict[str, float] = {}
        self.transfer_seconds: list[float] = []
        self.observations: dict[str, list[float]] = {}

    # ------------------------------------------------------------------ queries
    def has_pending_work(self) -> bool:
        """Blocks held for the connector, owed outputs, or connector work in flight."""
        connector_busy = self.connector is not None and self.connector.has_pending_work()
        return bool(self.delayed_free or self.finished_outside or connector_busy)

    def needs_step(self) -> bool:
        """Owed outputs, load results to apply, or connector metadata for the worker."""
        connector_meta = self.connector is not None and self.connector.has_pending_metadata()
        return bool(self.finished_outside or self.finished_recving or connector_meta)

    def num_blocks_held(self) -> int:
        """Blocks (all groups) of finished requests whose free is delayed."""
        return sum(
            self.kv_cache_manager.num_blocks_of(r.request_id) for r in self.delayed_free.values()
        )

    def drain_transfer_seconds(self) -> list[float]:
        """Transfer durations (s) reported since the last call."""
        times, self.transfer_seconds = self.transfer_seconds, []
        return times

    def drain_observations(self) -> dict[str, list[float]]:
        """Histogram samples reported since the last call."""
        obs, self.observations = self.observations, {}
        return obs

    def count(self, key: str, value: float = 1.0) -> None:
        """Add `value` to the cumulative counter `key`."""
        self.stats[key] = self.stats.get(key, 0.0) + value

    # ------------------------------------------------------------- transitions
    def start_load(self, request: Request, num_external_tokens: int) -> None:
        """The request's blocks are allocated and its asynchronous load of
        `num_external_tokens` tokens, right after its `num_computed_tokens` local hits, is
        queued. A load may cover a prefix of the prompt (a KV pool: whole chunks) or all of it
        (P/D); the scheduler resumes the request after the loaded tokens."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.times.kv_wait_started = time.monotonic()
        self.waiting_for_remote[request.request_id] = request
        self.load_end[request.request_id] = request.num_computed_tokens + num_external_tokens

    def abandon_load(self, request: Request) -> None:
        """The request finishes (abort) while waiting for its load: forget the load."""
        if self.waiting_for_remote.pop(request.request_id, None) is not None:
            _end_kv_wait(request, time.monotonic())
            self.load_end.pop(request.request_id, None)
            self.forget_load_result(request)

    def resolve_finished_loads(self) -> tuple[list[Request], list[Request]]:
        """Apply the policy to every request whose load ended.

        A good load leaves the request with `load_end` tokens computed (its local hits plus the
        loaded tokens), but never all of them: when the load reached the last token, that token
        is recomputed to get its logits; except on a model with a linear-state group, whose load
        of the whole prompt carries the producer's first token: it is appended (drained from
        `handed_over` by the scheduler) and the request resumes after all n prompt tokens. A failed
        load under "recompute" keeps the loaded blocks before the first invalid one (as vLLM does)
        and recomputes from there; with nothing valid the request starts over (its blocks freed, the
        connector asked again, which must not offer the same load twice). Under "fail" the request
        ends with FINISHED_ERROR.

        Returns:
            (to_resume, failed): `to_resume` go back to the front of the waiting queue, in
            this order of `appendleft` calls (their num_computed_tokens are set);
            `failed` are FINISHED_ERROR (policy "fail") and must be freed by the caller.
        """
        to_resume: list[Request] = []
        failed: list[Request] = []
        now = time.monotonic()
        for rid in [r for r in self.waiting_for_remote if r in self.finished_recving]:
            self.finished_recving.discard(rid)
            request = self.waiting_for_remote.pop(rid)
            _end_kv_wait(request, now)
            load_end = self.load_end.pop(rid, request.num_tokens)
            bad = self._bad_blocks_of(request)
            error = self.load_errors.pop(rid, None)
            valid_end = load_end
            policy = self.failure_policy.pop(rid, self.policy)
            if bad or error is not None:
                self.invalid_blocks.difference_update(bad)
                self.count("kv_load_failures_" + policy)
                if policy == "fail":
                    request.status = RequestStatus.FINISHED_ERROR
                    request.error = f"KV load failed: {error or 'invalid blocks'}"
                    failed.append(request)
                    continue
                valid_end = self._valid_prefix(request, bad, request.num_computed_tokens)
            request.status = RequestStatus.WAITING
            to_resume.append(request)
            if valid_end <= 0:
                # Nothing usable: drop every block (their content is undefined), prefill locally.
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                continue
            token = self._producer_first_token(request, valid_end)
            if token is not None:  # resume after all n prompt tokens, with P's token as output 0
                request.append_output_token_ids([token])
                self.handed_over.append(request)
            request.num_computed_tokens = min(valid_end, request.num_tokens - 1)
            self.kv_cache_manager.cache_loaded_blocks(request, valid_end)
        return to_resume, failed

    def _has_linear_state(self) -> bool:
        return any(g.spec.state_slot for g in self.kv_cache_manager.config.groups)

    def _producer_first_token(self, request: Request, valid_end: int) -> int | None:
        """On a model with a linear-state group, a load that reached the prompt's end carries the
        state after all n prompt tokens (it cannot be rewound to n - 1), so the request resumes at
        n with the producer's sampled token (kv_transfer_params "first_token", checked by the
        connector's validate_request) as its first output token. None otherwise (D recomputes
        the last prompt token, vLLM's rule)."""
        p = request.kv_transfer_params or {}
        token = p.get("first_token")
        if (not self._has_linear_state() or token is None or request.num_output_tokens
                or valid_end != request.num_prompt_tokens):
            return None
        return int(token)

    def _valid_prefix(self, request: Request, bad: list[tuple[int, int]], load_start: int) -> int:
        """Tokens with valid KV after a failed load: those before the first invalid block, and
        at least the `load_start` local hits (a load never touches them); `load_start` when no
        block is named (the whole load failed). With a sliding-window group, `load_start` too:
        such a load writes only the window of the last prompt token, so an earlier end would
        resume over window blocks that were never loaded. With a linear-state group too: such a
        load writes only the state slot of the prompt's end."""
        if (not bad or any(w is not None for w in self.kv_cache_manager.config.sliding_windows)
                or self._has_linear_state()):
            return load_start
        tables = self.kv_cache_manager.get_block_ids(request.request_id)
        first_bad = min(tables[g].index(b) for g, b in bad)
        return max(load_start, first_bad * self.kv_cache_manager.block_size)

    def apply_output(self, out: KVConnectorOutput) -> None:
        """Take in the worker half's report of one step (before the connector sees it)."""
        for key, value in out.stats.items():
            self.count(key, value)
        self.transfer_seconds.extend(out.transfer_seconds)
        for key, samples in out.observations.items():
            self.observations.setdefault(key, []).extend(samples)
        self.invalid_blocks.update(out.invalid_block_ids)
        for rid, paths in out.request_bytes.items():
            loading = self.waiting_for_remote.get(rid)
            if loading is not None:
                for path, n in paths.items():
                    loading.kv_load_bytes[path] = loading.kv_load_bytes.get(path, 0) + int(n)
        for rid, error in out.load_errors.items():
            policy = out.load_failure_policies.get(rid, self.policy)
            if rid in self.waiting_for_remote or rid in self.delayed_free:
                self.load_errors[rid] = error
                self.failure_policy[rid] = policy
            else:  # its request is gone (aborted without delaying the free): count it here
                self.count("kv_load_failures_" + policy)
        for rid in out.finished_recving:
            delayed = self.delayed_free.pop(rid, None)
            if delayed is not None:  # finished (aborted) while its load was in flight
                if rid in self.load_errors or self._bad_blocks_of(delayed):
                    # The pull failed although nobody waits for it any more: still a failure.
                    self.count("kv_load_failures_" + self.failure_policy.get(rid, self.policy))
                self.forget_load_result(delayed)
                self.kv_cache_manager.free(delayed)
            elif rid in self.waiting_for_remote:
                self.finished_recving.add(rid)
        for rid in out.finished_sending:
            delayed = self.delayed_free.pop(rid, None)
            if delayed is not None:
                self.kv_cache_manager.free(delayed)
        if self.connector is not None:
            self.connector.update_connector_output(out)
            for key, value in self.connector.take_scheduler_stats().items():
                self.count(key, value)

    def forget_load_result(self, request: Request) -> None:
        """Drop what a finished request's load reported (its block ids will be reused)."""
        self.finished_recving.discard(request.request_id)
        self.load_errors.pop(request.request_id, None)
        self.failure_policy.pop(request.request_id, None)
        self.invalid_blocks.difference_update(self._group_blocks(request))

    def _bad_blocks_of(self, request: Request) -> list[tuple[int, int]]:
        """The request's blocks reported invalid, as (group index, block id)."""
        return [b for b in self._group_blocks(request) if b in self.invalid_blocks]

    def _group_blocks(self, request: Request) -> list[tuple[int, int]]:
        """(group index, block id) of every block the request holds."""
        return [
            (g, b)
            for g, ids in enumerate(self.kv_cache_manager.get_block_ids(request.request_id))
            for b in ids
        ]

    def release(self, request: Request) -> None:
        """A request finished: ask the connector (which may return kv_transfer_params for the
        client and delay the free), then free its blocks now or when the connector lets go."""
        request.times.finished = time.monotonic()
        delay = False
        if self.connector is not None:
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            delay, params = self.connector.request_finished(request, block_ids)
            request.output_kv_transfer_params = params
        if delay:
            self.delayed_free[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)


def _end_kv_wait(request: Request, now: float) -> None:
    """Add the wait since `start_load` to `request.times.kv_wait` (seconds)."""
    started = request.times.kv_wait_started
    if started is not None:
        request.times.kv_wait += max(0.0, now - started)
        request.times.kv_wait_started = None
