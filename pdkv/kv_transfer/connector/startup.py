"""What the two connector halves of one engine share at start-up: `ConnectorStartup`.

The worker half is built first (by the model runner, or in each worker process); the scheduler
half of the same engine is built afterwards with the same start-up values and learns what the
worker half filled in: the P2P producer's bound control address, the KV pool's store and (in a
TP/DCP worker process) the address of its pool lookup server.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdkv.kvpool.store import KVPoolStore

Address = list[str | int]
"""A [host, port] pair (a list: the P2P worker half fills it in place)."""


@dataclass
class ConnectorStartup:
    """Start-up values of one engine's connector halves (mutable: the worker half fills some).

    Attributes:
        dcp_rank, dcp_size: this worker's DCP rank and the DCP size (0 / 1 without DCP).
        rank, world_size: this worker's global rank and the engine's worker count (None: the
            DCP ones).
        tp_rank, tp_size: this worker's TP rank and the TP size (0 / 1 without TP).
        control_address: P2P: the producer's control server [host, port], filled in place by
            the worker half when its server is bound (port 0 until then); None until a P2P
            connector is built.
        push_address: P2P push mode, consumer: [host, port] where producers write (tcp: its
            data server; shm, mooncake: its push control server; `TransferEngine.write_address`),
            filled in place by the worker half; the scheduler half puts it into grants.
        control_endpoints: P2P, multi-process engine: every rank's [host, port] (rank order),
            set by the executor; None otherwise.
        pool_store: KVPoolConnector: the pool's store, created by the half built first.
        pool_lookup_address: KVPoolConnector in a TP/DCP worker process: [host, port] of this
            rank's lookup server, filled by the worker half.
        pool_lookup_endpoints: KVPoolConnector, engine process of a TP/DCP engine: every rank's
            lookup server (rank order), set by the executor; the scheduler half then asks the
            ranks instead of opening a store of its own.
        node_host: the address of this worker's host as the engine's process reaches it: where
            its KV pool lookup server listens (127.0.0.1, or the node's address for a rank on
            another host, pdkv.executor.nodes).
    """

    dcp_rank: int = 0
    dcp_size: int = 1
    rank: int | None = None
    world_size: int | None = None
    control_address: Address | None = None
    push_address: Address | None = None
    control_endpoints: list[Address] | None = None
    tp_rank: int = 0
    tp_size: int = 1
    pool_store: KVPoolStore | None = None
    pool_lookup_address: Address | None = None
    pool_lookup_endpoints: list[Address] | None = None
    node_host: str = "127.0.0.1"
