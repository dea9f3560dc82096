"""Request and its states, named as in vLLM v1 (vllm/v1/request.py). Torch-free."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdkv.block_hashing import BlockHash, hash_request_tokens
from pdkv.jsontypes import JSONObject
from pdkv.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request inside the engine. Values above PREEMPTED are finished."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        """OpenAI finish_reason for a finished status ("stop" | "length" | "abort" | "error")."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestTimes:
    """Monotonic timestamps (seconds, time.monotonic) of one request's milestones.

    `first_scheduled` is the first admission: a request whose KV a connector loads
    asynchronously is admitted when its load starts. `kv_wait` is the total time (s) it spent
    in WAITING_FOR_REMOTE_KVS (load admitted → load result applied by the scheduler);
    `kv_wait_started` is set while it waits.
    """

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    kv_wait_started: float | None = None
    kv_wait: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


class Request:
    """One generation request as the scheduler sees it.

    Token bookkeeping: `all_token_ids` = prompt + outputs; `num_computed_tokens` of them have
    their KV in the cache. `block_hashes` holds the hash of every full block of all_token_ids,
    extended as outputs are appended.

    Args:
        request_id: unique id.
        prompt_token_ids: non-empty list of token ids.
        sampling_params: validated SamplingParams.
        block_size: tokens per block (for hashing).
        eos_token_id: the model's EOS id (None: no EOS).
        cache_salt: optional salt isolating this request's prefix-cache entries.
        kv_transfer_params: the client's JSON object for the KV connector (P/D); None when
            unused. Typed dict[str, Any] while the connectors read its fields unchecked.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        block_size: int,
        eos_token_id: int | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        self.kv_transfer_params = kv_transfer_params
        self.block_size = block_size

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache (or loaded) when first scheduled; -1 = not yet.
        self.num_cached_tokens = -1
        # Of those, the tokens a KV connector loaded (P/D pull, KV pool, host offload); the rest
        # were local prefix-cache hits (`num_local_hit_tokens`, from the latest lookup).
        self.num_external_tokens = 0
        self.num_local_hit_tokens = 0
        # Bytes of this request's KV loaded by connectors, by path ("p2p", "pool").
        self.kv_load_bytes: dict[str, int] = {}
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # kv_transfer_params the connector returns to the client (JSON) when the request finishes.
        self.output_kv_transfer_params: JSONObject | None = None
        self.times = RequestTimes()
        self.block_hashes: list[BlockHash] = hash_request_tokens(
            self.all_token_ids, block_size, cache_salt
        )

    # ------------------------------------------------------------------ tokens
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        """Append sampled tokens and hash any block they complete."""
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        num_full = self.num_tokens // self.block_size
        if num_full > len(self.block_hashes):
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.extend(
                hash_request_tokens(
                    self.all_token_ids,
                    self.block_size,
                    self.cache_salt,
                    parent_block_hash=parent,
                    start_block=len(self.block_hashes),
                )
            )

    # ------------------------------------------------------------------ status
    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
