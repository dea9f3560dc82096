"""What one scheduling step hands to the worker, and what the worker hands back (torch-free),
with the typed messages between a KV connector's halves that ride on them (KVConnectorMetadata,
KVConnectorOutput; pdkv.kv_transfer.connector.base re-exports them for the connectors).

Typed msgspec Structs so that the same objects can later cross a process boundary as msgpack
(vLLM's `SchedulerOutput` / `ModelRunnerOutput`, simplified).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from pdkv.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdkv.request import Request


class KVConnectorMetadata(msgspec.Struct, kw_only=True):
    """Base of per-step scheduler → worker metadata (connectors subclass it)."""


class KVConnectorOutput(msgspec.Struct, kw_only=True):
    """Worker → scheduler report of one step.

    Attributes:
        finished_sending: request ids whose blocks the connector no longer needs (read by the
            peer, released, or lease expired): the scheduler may free them now.
        finished_recving: request ids whose KV load ended (successfully or not).
        invalid_block_ids: (KV cache group index, local block id) of every block whose load
            failed. Block ids are per group (each group has its own pool), so the group is part
            of the id: a failure in group 0 never touches block 3 of group 1.
        load_errors: request id -> why its load failed.
        stats: counter deltas since the last report (bytes, events).
        transfer_seconds: duration of each transfer that completed.
        request_bytes: request id -> {path: bytes} its loads moved since the last report
            ("p2p": pulled from a prefill engine, "pool": read from the KV pool).
        load_failure_policies: request id -> the kv_load_failure_policy for its failed load,
            when the connector decides it per request (a MultiConnector child's own policy);
            absent: the engine's policy.
        observations: histogram samples by metric key since the last report (e.g.
            "pool:dram:load_seconds" -> [seconds, ...]).
    """

    finished_sending: set[str] = msgspec.field(default_factory=set)
    finished_recving: set[str] = msgspec.field(default_factory=set)
    invalid_block_ids: set[tuple[int, int]] = msgspec.field(default_factory=set)
    load_errors: dict[str, str] = msgspec.field(default_factory=dict)
    stats: dict[str, float] = msgspec.field(default_factory=dict)
    transfer_seconds: list[float] = msgspec.field(default_factory=list)
    observations: dict[str, list[float]] = msgspec.field(default_factory=dict)
    load_failure_policies: dict[str, str] = msgspec.field(default_factory=dict)
    request_bytes: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)


class NewRequestData(msgspec.Struct, kw_only=True):
    """A request the worker has not seen (or must rebuild after preemption).

    Attributes:
        req_id: request id.
        token_ids: all tokens known now (prompt + outputs so far).
        num_prompt_tokens: how many of token_ids are prompt.
        sampling_params: how to sample.
        block_ids: block table per KV cache group.
        num_computed_tokens: tokens whose KV is already in those blocks (prefix hit).
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, kw_only=True):
    """Changes to a request the worker already tracks.

    Attributes:
        req_id: request id.
        new_block_ids: blocks appended to its block table, per group.
        num_computed_tokens: tokens with KV before this step.
    """

    req_id: str
    new_block_ids: tuple[list[int], ...]
    num_computed_tokens: int


class SchedulerOutput(msgspec.Struct, kw_only=True):
    """One step's plan.

    Attributes:
        scheduled_new_reqs: requests sent in full.
        scheduled_cached_reqs: deltas for requests the worker knows.
        num_scheduled_tokens: tokens to compute per request id.
        total_num_scheduled_tokens: their sum (<= max_num_batched_tokens).
        finished_req_ids: requests finished/preempted since the last step (worker drops state).
        kv_connector_metadata: opaque per-step connector metadata (None without a connector).
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    """Tokens sampled in one step.

    Attributes:
        sampled_token_ids: req id -> new token ids (requests that reached the end of their
            known tokens this step; prefill chunks that did not are absent).
        logprobs: req id -> per new token, list of (token_id, logprob, rank) with the sampled
            token first and then the top-N; None when no request asked.
        kv_connector_output: the KV connector worker's report of this step.
        prompt_logprobs: req id -> per prompt position, (token_id, logprob, rank) of the prompt
            token then the top-N (None for position 0); sent with a request's first sampled
            token, only for requests that asked.
    """

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[list[tuple[int, float, int]]]] | None = None
    kv_connector_output: KVConnectorOutput | None = None
    prompt_logprobs: dict[str, list[list[tuple[int, float, int]] | None]] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(sampled_token_ids={})


@dataclass
class RequestUpdate:
    """What one step changed for one request (consumed by the engine's output processor).

    Attributes:
        request: the request (its state after the step).
        new_token_ids: tokens appended this step.
        new_logprobs: per new token, [(token_id, logprob, rank), ...] or None.
        finished: True when the request finished this step.
        prompt_logprobs: per prompt position, [(token_id, logprob, rank), ...] (None for
            position 0), on the request's first token when it asked for prompt_logprobs.
    """

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[list[tuple[int, float, int]]] | None
    finished: bool
    prompt_logprobs: list[list[tuple[int, float, int]] | None] | None = None


@dataclass
class SchedulerStats:
    """Gauges read after every step (for metrics)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_preemptions: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_waiting_for_remote_kv: int = 0
    num_blocks_held_for_remote: int = 0
    kv_transfer: dict[str, float] | None = None
    transfer_seconds: list[float] | None = None
    kv_observations: dict[str, list[float]] | None = None
