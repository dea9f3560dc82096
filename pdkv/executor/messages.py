"""Typed msgpack messages between the engine process and its worker processes (msgspec).

Start-up: the engine sends `WorkerInit` to every rank; each loads its weights and answers
`WorkerLoaded` (with its KV budget when memory decides it); the engine sizes the KV cache once
and sends the result to every rank (`InitKVCache`); each allocates it and answers `WorkerReady`.
Then the engine sends an `ExecuteModel` per step (the scheduler's output, the same to every
rank), answered by a `StepResult` per rank, and `Shutdown` at the end. A rank that fails answers
`WorkerFailed` and exits. Between steps, a rank whose KV connector worker half has news sends
`ConnectorWakeup` on its own one-way wakeup pipe (pdkv.executor.wakeup). A rank on another
host sends the same messages over TCP (pdkv.executor.channel), each channel opened by a
`NodeHello`.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from pdkv.cache.specs import (
    CompressedKVSpec,
    CompressorStateSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    LinearStateSpec,
    MLASpec,
    SlidingWindowSpec,
)
from pdkv.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig
from pdkv.sched.output import ModelRunnerOutput, SchedulerOutput

_SPEC_TYPES: dict[str, type[KVCacheSpec]] = {
    cls.__name__: cls for cls in (FullAttentionSpec, SlidingWindowSpec, MLASpec, LinearStateSpec,
                                  CompressedKVSpec, CompressorStateSpec)}


class WorkerInit(msgspec.Struct, tag=True, kw_only=True):
    """Start-up of one rank.

    Attributes:
        rank: global rank (0 .. world_size - 1).
        init_method: torch.distributed rendezvous, "tcp://HOST:PORT" (127.0.0.1 on one node,
            the leader's master address across nodes).
        num_threads: torch CPU threads of this worker.
        node_host: across nodes, the address of this rank's node as the other nodes reach it
            (gloo's interface; the KV connectors' servers bind and advertise it); "" on one
            node (loopback, the configuration's hosts).
    """

    rank: int
    model_config: ModelConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    kv_transfer_config: KVTransferConfig | None
    init_method: str
    num_threads: int
    node_host: str = ""


class WorkerLoaded(msgspec.Struct, tag=True, kw_only=True):
    """A rank loaded its weight shard and waits for `InitKVCache`.

    Attributes:
        kv_budget_bytes: the KV cache budget measured now, in bytes (gpu_memory_utilization of
            the free memory, when that sizes the cache), else None.
    """

    rank: int
    kv_budget_bytes: int | None


class KVCacheGroupWire(msgspec.Struct, kw_only=True):
    """One KV cache group: its layers, its spec's class name and the spec's fields."""

    layer_indices: tuple[int, ...]
    kind: str
    spec: dict[str, object]


class InitKVCache(msgspec.Struct, tag=True, kw_only=True):
    """The KV cache every rank allocates (blocks of block_size tokens, the rank's KV heads),
    sized once by the engine (pdkv.worker.kv_cache.make_kv_cache_config)."""

    num_blocks: int
    groups: list[KVCacheGroupWire]

    @classmethod
    def from_config(cls, kv: KVCacheConfig) -> InitKVCache:
        """The message carrying `kv`."""
        return cls(num_blocks=kv.num_blocks, groups=[
            KVCacheGroupWire(layer_indices=g.layer_indices, kind=type(g.spec).__name__,
                             spec=msgspec.to_builtins(g.spec))
            for g in kv.groups])

    def to_config(self) -> KVCacheConfig:
        """The KVCacheConfig sent (equal to the one given to from_config).

        Raises:
            ValueError: an unknown spec kind.
        """
        groups = []
        for g in self.groups:
            if g.kind not in _SPEC_TYPES:
                raise ValueError(f"unknown KV cache spec {g.kind!r}")
            spec = msgspec.convert(g.spec, _SPEC_TYPES[g.kind])
            groups.append(KVCacheGroupSpec(layer_indices=tuple(g.layer_indices), spec=spec))
        return KVCacheConfig(num_blocks=self.num_blocks, groups=tuple(groups))


class WorkerReady(msgspec.Struct, tag=True, kw_only=True):
    """A rank allocated the KV cache of `InitKVCache`.

    Attributes:
        layout: its KV layout fingerprint (connector / `GET /kv_layout`).
        vocab_size, eos_token_id: the model's.
        control_address: [host, port] of its P2P producer control server; [] when it has none.
        pool_lookup_address: [host, port] of its KV pool lookup server; [] when it has none.
    """

    rank: int
    layout: Mapping[str, object]
    vocab_size: int
    eos_token_id: int | None
    control_address: list[str | int] = msgspec.field(default_factory=list)
    pool_lookup_address: list[str | int] = msgspec.field(default_factory=list)


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
        pcp_comm_s: of which PCP all-gathers (K/V and sampled rows; 0 in a step not split).
        connector_deadline_in_s: seconds from the sending of this result to the rank's KV
            connector worker half's `next_deadline()` after the step (relative, since a rank on
            another host has its own monotonic clock; <= 0: already passed), None without a
            deadline or a connector.
    """

    rank: int
    output: ModelRunnerOutput
    forward_s: float = 0.0
    dcp_comm_s: float = 0.0
    pcp_comm_s: float = 0.0
    connector_deadline_in_s: float | None = None


class ConnectorWakeup(msgspec.Struct, tag=True, kw_only=True):
    """A rank's KV connector worker half has something for the next step (a load or send
    finished, a load failed): sent on the rank's wakeup pipe, not the step pipe; wakes that
    arrive while one is being sent are coalesced into one message."""

    rank: int


class NodeHello(msgspec.Struct, tag=True, kw_only=True):
    """The first frame a rank of a headless node sends on each of its two TCP channels to the
    leader (pdkv.executor.nodes).

    Attributes:
        rank: its global rank.
        channel: "step" or "wakeup".
        host: its node's address as the leader sees it (the connection's local address).
        world_size, nnodes: the layout the headless node was started with (the leader refuses
            another).
    """

    rank: int
    channel: str
    host: str
    world_size: int
    nnodes: int


class WorkerFailed(msgspec.Struct, tag=True, kw_only=True):
    """A rank raised: the message and traceback; the rank exits after sending it."""

    rank: int
    error: str


ToWorker = WorkerInit | InitKVCache | ExecuteModel | ReadKVBlocks | Shutdown
FromWorker = WorkerLoaded | WorkerReady | StepResult | KVBlocks | WorkerFailed
