"""A transfer engine for P2P worker-half tests: reads ask the producer's authorizer, then copy
from the producer engine's registered regions (no sockets); every op is recorded."""

from __future__ import annotations

import time
from typing import Any

from pdkv.config import KVTransferConfig
from pdkv.kv_transfer.connector.spec import P2PSpec, connector_spec
from pdkv.kv_transfer.engine.base import Grant, ReadOp, TransferEngine, TransferError


class FakeEngine(TransferEngine):
    """Reads ask the producer's authorizer, then copy from its region.

    Args:
        source: the producer's engine (a consumer's reads copy from it); settable later.
    """

    name = "fake"

    def __init__(self, source: FakeEngine | None = None) -> None:
        self.regions: dict[str, memoryview] = {}
        self.authorizer: Any = None
        self.source = source
        self.ops: list[tuple[Grant | None, ReadOp]] = []  # every read op, with its grant

    def register_region(self, name: str, buffer: memoryview) -> None:
        self.regions[name] = buffer

    def set_authorizer(self, authorizer: Any) -> None:
        self.authorizer = authorizer

    def peer_info(self) -> dict[str, Any]:
        return {}

    def read(
        self, peer: dict[str, Any], ops: list[ReadOp], deadline: float, grant: Grant | None = None
    ) -> int:
        src = self.source
        assert src is not None
        for op in ops:
            why = src.authorizer(grant, op.region, [(op.offset, op.length)])
            if why:
                raise TransferError(why)
            op.dest[:] = src.regions[op.region][op.offset : op.offset + op.length]
            self.ops.append((grant, op))
        return sum(op.length for op in ops)


def cfg(role: str, engine_id: str) -> P2PSpec:
    """A P2P connector's spec for one side (transfer_timeout 10 s)."""
    spec = connector_spec(KVTransferConfig("P2PConnector", role, engine_id=engine_id,
                                           kv_connector_extra_config={"transfer_timeout": 10.0}),
                          16)
    assert isinstance(spec, P2PSpec)
    return spec


def wait_loaded(results: Any, rid: str, timeout: float = 10.0) -> None:
    """Wait until a consumer side's WorkerResults report `rid`'s load ended, and check it ended
    without an error (AssertionError after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while rid not in results.recved:
        assert time.monotonic() < deadline, "load did not end"
        time.sleep(0.005)
    assert results.errors.get(rid) is None

