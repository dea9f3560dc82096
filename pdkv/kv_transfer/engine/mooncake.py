"""`mooncake` transfer engine: Mooncake Transfer Engine (optional extra
`mooncake-transfer-engine-non-cuda`, needs libibverbs1), P2PHANDSHAKE metadata, TCP transport
(RDMA on real clusters). The producer registers its KV cache; the consumer registers its own and
issues one batch of synchronous reads. API as documented by Mooncake's Python bindings:
initialize(host, "P2PHANDSHAKE", protocol, device), register_memory(addr, n),
batch_transfer_sync_read(session, local_addrs, remote_addrs, lengths) -> 0 | negative.
Reads are one-sided (registered memory): anyone who reaches the endpoint can read all of the
producer's KV cache, so this engine is for trusted cluster networks (grants are checked on the
control plane only).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pdkv.kv_transfer.engine.base import (
    Grant,
    ReadOp,
    TransferEngine,
    TransferError,
    buffer_address,
)

_address = buffer_address


class MooncakeTransferEngine(TransferEngine):
    """Args:
        host: address the engine's RPC endpoint binds.
        protocol: Mooncake transport ("tcp"; "rdma" where devices exist).

    Raises:
        ValueError: the mooncake package (or libibverbs) is missing, or initialization failed.
    """

    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        try:
            from mooncake.engine import TransferEngine as _TE
        except ImportError as e:
            raise ValueError(
                "transfer 'mooncake' needs `pip install mooncake-transfer-engine-non-cuda` and "
                f"the libibverbs1 system package: {e}"
            ) from None
        self._te = _TE()
        rc = self._te.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise ValueError(f"Mooncake TransferEngine.initialize failed with {rc}")
        self._host = host
        self._regions: dict[str, tuple[int, int]] = {}
        self._keep: list[memoryview] = []
        self._lock = threading.Lock()  # one batch at a time per engine

    def _register(self, name: str, buffer: memoryview) -> None:
        view = buffer.cast("B")
        addr = _address(view)
        rc = self._te.register_memory(addr, len(view))
        if rc != 0:
            raise ValueError(f"Mooncake register_memory({name}) failed with {rc}")
        self._regions[name] = (addr, len(view))
        self._keep.append(view)

    def register_region(self, name: str, buffer: memoryview) -> None:
        self._register(name, buffer)

    def register_local(self, name: str, buffer: memoryview) -> None:
        self._register("local:" + name, buffer)

    def start(self, host: str, advertise_host: str | None = None) -> None:
        if advertise_host:
            self._host = advertise_host

    def peer_info(self) -> dict[str, Any]:
        return {
            "session": f"{self._host}:{self._te.get_rpc_port()}",
            "regions": {k: list(v) for k, v in self._regions.items() if not k.startswith("local:")},
        }

    def read(
        self, peer: dict[str, Any], ops: list[ReadOp], deadline: float, grant: Grant | None = None
    ) -> int:
        regions = peer.get("regions", {})
        locals_, remotes, lengths = [], [], []
        for op in ops:
            base = regions.get(op.region)
            if base is None:
                raise TransferError(f"peer has no region {op.region!r}")
            if op.offset < 0 or op.length < 0 or op.offset + op.length > base[1]:
                raise TransferError(f"range {op.offset}+{op.length} outside region {op.region!r}")
            locals_.append(_address(op.dest))
            remotes.append(base[0] + op.offset)
            lengths.append(op.length)
        if time.monotonic() > deadline:
            raise TransferError("transfer deadline passed")
        with self._lock:
            rc = self._te.batch_transfer_sync_read(str(peer["session"]), locals_, remotes, lengths)
        if rc != 0:
            raise TransferError(f"Mooncake batch read from {peer['session']} failed with {rc}")
        if time.monotonic() > deadline:
            raise TransferError("transfer deadline passed")
        return sum(lengths)

    def close(self) -> None:
        for addr, _ in self._regions.values():
            self._te.unregister_memory(addr)
        self._regions.clear()
        self._keep.clear()
