"""What the two connector halves of one engine share at start-up: `ConnectorStartup`.

The worker half is built first (by the model runner, or in each worker process); the scheduler
half of the same engine is built afterwards with the same start-up values and learns what the
worker half filled in: the P2P producer's bound control address and the KV pool's store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeGuard

from pdkv.kvpool.store import KVPoolStore

Address = list[str | int]
"""A [host, port] pair (a list: the P2P worker half fills it in place)."""


def _is_address(value: object) -> TypeGuard[Address]:
    return isinstance(value, list) and all(isinstance(v, str | int) for v in value)


@dataclass
class ConnectorStartup:
    """Start-up values of one engine's connector halves (mutable: the worker half fills some).

    Attributes:
        dcp_rank, dcp_size: this worker's DCP rank and the DCP size (0 / 1 without DCP).
        rank, world_size: this worker's global rank and the engine's worker count (None: the
            DCP ones).
        control_address: P2P: the producer's control server [host, port], filled in place by
            the worker half when its server is bound (port 0 until then); None until a P2P
            connector is built.
        control_endpoints: P2P, multi-process engine: every rank's [host, port] (rank order),
            set by the executor; None otherwise.
        pool_store: KVPoolConnector: the pool's store, created by the half built first.
    """

    dcp_rank: int = 0
    dcp_size: int = 1
    rank: int | None = None
    world_size: int | None = None
    control_address: Address | None = None
    control_endpoints: list[Address] | None = None
    pool_store: KVPoolStore | None = None

    def as_shared(self) -> dict[str, object]:
        """The legacy by-name form (for callers that still hand a dict on: the engine and the
        executor): every field that is set, the address list itself (not a copy)."""
        out: dict[str, object] = {"dcp_rank": self.dcp_rank, "dcp_size": self.dcp_size}
        for name in ("rank", "world_size", "control_address", "control_endpoints", "pool_store"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    @staticmethod
    def from_shared(shared: Mapping[str, object]) -> ConnectorStartup:
        """Parse the by-name form (`as_shared`'s keys; missing ones take the defaults). The
        control address list is kept, not copied, so a worker half filling it is seen.

        Raises:
            ValueError: an unknown key or a value of the wrong type (named).
        """
        known = ("dcp_rank", "dcp_size", "rank", "world_size", "control_address",
                 "control_endpoints", "pool_store")
        unknown = sorted(set(shared) - set(known))
        if unknown:
            raise ValueError(f"unknown connector start-up values {unknown}; known: {list(known)}")
        ints: dict[str, int | None] = {}
        for key in ("dcp_rank", "dcp_size", "rank", "world_size"):
            value = shared.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"connector start-up {key} must be an integer, got {value!r:.40}")
            ints[key] = value
        address = shared.get("control_address")
        if address is not None and not _is_address(address):
            raise ValueError("connector start-up control_address must be [host, port], "
                             f"got {address!r:.60}")
        endpoints = shared.get("control_endpoints")
        if endpoints is not None and not (isinstance(endpoints, list)
                                          and all(_is_address(e) for e in endpoints)):
            raise ValueError("connector start-up control_endpoints must list [host, port] pairs, "
                             f"got {endpoints!r:.80}")
        store = shared.get("pool_store")
        if store is not None and not isinstance(store, KVPoolStore):
            raise ValueError("connector start-up pool_store must be a KVPoolStore, "
                             f"got {store!r:.40}")
        dcp_rank, dcp_size = ints["dcp_rank"], ints["dcp_size"]
        return ConnectorStartup(
            dcp_rank=dcp_rank if dcp_rank is not None else 0,
            dcp_size=dcp_size if dcp_size is not None else 1,
            rank=ints["rank"], world_size=ints["world_size"], control_address=address,
            control_endpoints=([e for e in endpoints if _is_address(e)]
                               if endpoints is not None else None),
            pool_store=store)
