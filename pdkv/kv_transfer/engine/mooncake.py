"""`mooncake` transfer engine: Mooncake Transfer Engine (optional extra
`mooncake-transfer-engine-non-cuda`, needs libibverbs1), P2PHANDSHAKE metadata, TCP transport
(RDMA on real clusters). The producer registers its KV cache; the consumer registers its own and
issues one batch of synchronous reads. API as documented by Mooncake's Python bindings:
initialize(host, "P2PHANDSHAKE", protocol, device), register_memory(addr, n),
batch_transfer_sync_read(session, local_addrs, remote_addrs, lengths) -> 0 | negative.
Reads are one-sided (registered memory): anyone who reaches the endpoint can read all of the
producer's KV cache, so this engine is for trusted cluster networks (grants are checked on the
control plane only).

Push mode (the P2P connector's `transfer_mode: push`): the consumer registers its KV cache and
the producer writes each layer's bytes into it with batch_transfer_sync_write(session,
local_addrs, remote_addrs, lengths) -> 0 | negative, every write reserved first with the
consumer's write handler and committed after it (push_control.py: no byte is written before the
consumer accepted exactly those (block, layer) ranges).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pdkv.kv_transfer.engine.base import (
    Authorizer,
    Grant,
    ReadOp,
    TransferEngine,
    TransferError,
    WriteDone,
    WriteOp,
    buffer_address,
)
from pdkv.kv_transfer.engine.push_control import PushControlClient, PushControlServer

_address = buffer_address


class MooncakeTransferEngine(TransferEngine):
    """Args:
        host: address the engine's RPC endpoint binds.
        protocol: Mooncake transport ("tcp"; "rdma" where devices exist).
        port: push mode, consumer side: port of the push control server (0: any free port).
        max_connections: connections that server serves at once.
        idle_timeout: seconds a control connection may idle, and a reserved write may take
            before it is committed.

    Raises:
        ValueError: the mooncake package (or libibverbs) is missing, or initialization failed.
    """

    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", port: int = 0,
                 max_connections: int = 64, idle_timeout: float = 60.0) -> None:
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
        self._port = port
        self._max_connections = max_connections
        self._idle_timeout = idle_timeout
        self._write_handler: tuple[Authorizer, WriteDone] | None = None
        self._sizes: dict[str, int] = {}  # registered region -> bytes (push control server)
        self._control: PushControlServer | None = None  # consumer: serves reservations
        self._client = PushControlClient()  # producer: reserves its writes

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
        self._sizes[name] = self._regions[name][1]

    def register_local(self, name: str, buffer: memoryview) -> None:
        view = buffer.cast("B")
        if self._regions.get(name) == (_address(view), len(view)):
            return  # registered already as a region (push mode: writes land in it)
        self._register("local:" + name, buffer)

    def set_write_handler(self, authorize: Authorizer, on_written: WriteDone) -> None:
        self._write_handler = (authorize, on_written)

    def start(self, host: str, advertise_host: str | None = None) -> None:
        """Name `advertise_host` in peer_info; push mode, consumer side (a write handler set):
        serve reservations on `host`."""
        if advertise_host:
            self._host = advertise_host
        if self._write_handler is None or self._control is not None:
            return
        self._control = PushControlServer(self._sizes, *self._write_handler,
                                          target=self.peer_info,
                                          max_connections=self._max_connections,
                                          idle_timeout=self._idle_timeout)
        self._control.start(host, self._port)

    def peer_info(self) -> dict[str, Any]:
        return {
            "session": f"{self._host}:{self._te.get_rpc_port()}",
            "regions": {k: list(v) for k, v in self._regions.items() if not k.startswith("local:")},
        }

    def write_address(self) -> tuple[str, int] | None:
        """Push mode, consumer side: the push control server (where reservations go)."""
        return None if self._control is None else (self._host, self._control.port)

    def write(
        self, peer: dict[str, Any], ops: list[WriteOp], deadline: float, grant: Grant | None = None
    ) -> int:
        """Push mode, producer side: write `ops` into the consumer's registered KV cache with
        Mooncake's batch write, each region's ops only after the consumer accepted them (`peer`:
        its push control server, {"host", "port"}). Every source must lie in memory this engine
        registered (the producer's KV cache).

        Raises:
            TransferError: refused (nothing written), unreachable, a range outside the
                consumer's region, Mooncake's write failed, or the deadline passed.
        """
        return self._client.write(peer, ops, deadline, grant, self._write_into)

    def _write_into(self, target: dict[str, Any], region: str, ops: list[WriteOp]) -> None:
        base = dict(target.get("regions", {})).get(region)
        session = target.get("session")
        if base is None or not isinstance(session, str):
            raise TransferError(f"peer has no region {region!r}")
        locals_, remotes, lengths = [], [], []
        for op in ops:
            if op.offset < 0 or op.length < 0 or op.offset + op.length > int(base[1]):
                raise TransferError(f"range {op.offset}+{op.length} outside region {region!r}")
            locals_.append(_address(op.src))
            remotes.append(int(base[0]) + op.offset)
            lengths.append(op.length)
        with self._lock:
            rc = self._te.batch_transfer_sync_write(session, locals_, remotes, lengths)
        if rc != 0:
            raise TransferError(f"Mooncake batch write to {session} failed with {rc}")

    def forget_peer(self, peer: dict[str, Any]) -> None:
        self._client.forget(peer)

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
        if self._control is not None:
            self._control.stop()
            self._control = None
        self._client.close()
        for addr, _ in self._regions.values():
            self._te.unregister_memory(addr)
        self._regions.clear()
        self._keep.clear()
