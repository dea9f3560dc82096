"""Typed msgpack messages between the engine process and its worker processes (msgspec).

The engine sends `WorkerInit` once per rank, then an `ExecuteModel` per step (the scheduler's
output, the same to every rank) and `Shutdown` at the end. Every rank answers `WorkerReady` once
and a `StepResult` per step; a rank that fails answers `WorkerFailed` and exits.
"""

from __future__ import annotations

import msgspec

from pdkv.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig
from pdkv.sched.output import ModelRunnerOutput, SchedulerOutput


class WorkerInit(msgspec.Struct, tag=True, kw_only=True):
    """Start-up of one rank.

    Attributes:
        rank: global rank (0 .. world_size - 1).
        init_method: torch.distributed rendezvous, "tcp://127.0.0.1:PORT".
        num_threads: torch CPU threads of this worker.
    """

    rank: int
    model_config: ModelConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    kv_transfer_config: KVTransferConfig | None
    init_method: str
    num_threads: int


class WorkerReady(msgspec.Struct, tag=True, kw_only=True):
    """A rank loaded its weight shard and allocated its KV cache.

    Attributes:
        num_blocks: KV blocks it allocated (every rank must agree).
        kv_cache_bytes: bytes of its KV cache.
        layout: its KV layout fingerprint (connector / `GET /kv_layout`).
        vocab_size, eos_token_id: the model's.
        control_address: [host, port] of its P2P producer control server; [] when it has none.
    """

    rank: int
    num_blocks: int
    kv_cache_bytes: int
    layout: dict[str, object]
    vocab_size: int
    eos_token_id: int | None
    control_address: list[object] = msgspec.field(default_factory=list)


class ExecuteModel(msgspec.Struct, tag=True, kw_only=True):
    """Run one step."""

    scheduler_output: SchedulerOutput


class ReadKVBlocks(msgspec.Struct, tag=True, kw_only=True):
    """Inspection (tests, debugging): send back these blocks of KV cache group 0."""

    block_ids: list[int]


class KVBlocks(msgspec.Struct, tag=True, kw_only=True):
    """A rank's copy of the blocks asked for: raw bytes of a tensor [len(block_ids), layers, 2,
    block_size, local KV heads, head_size] of `dtype` (a torch dtype name)."""

    rank: int
    data: bytes
    shape: list[int]
    dtype: str


class Shutdown(msgspec.Struct, tag=True):
    """Stop the worker loop and tear down torch.distributed."""


class StepResult(msgspec.Struct, tag=True, kw_only=True):
    """One rank's answer to ExecuteModel (rank 0's output carries the sampled tokens).

    Attributes:
        forward_s: seconds of this rank's forward pass.
        dcp_comm_s: of which DCP all-gathers and merge.
    """

    rank: int
    output: ModelRunnerOutput
    forward_s: float = 0.0
    dcp_comm_s: float = 0.0


class WorkerFailed(msgspec.Struct, tag=True, kw_only=True):
    """A rank raised: the message and traceback; the rank exits after sending it."""

    rank: int
    error: str


ToWorker = WorkerInit | ExecuteModel | ReadKVBlocks | Shutdown
FromWorker = WorkerReady | StepResult | KVBlocks | WorkerFailed
