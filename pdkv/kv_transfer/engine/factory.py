"""Transfer engines by name."""

from __future__ import annotations

from pdkv.kv_transfer.engine.base import TransferEngine

TRANSFER_ENGINES = ("tcp", "shm", "mooncake")


def create_transfer_engine(name: str, *, port: int = 0, max_connections: int = 64,
                           idle_timeout: float = 60.0, host: str = "127.0.0.1",
                           mooncake_protocol: str = "tcp") -> TransferEngine:
    """Build the engine called `name`: tcp (data server on `port`, 0 = any free port, at most
    `max_connections` connections, each closed after `idle_timeout` s idle), shm, or mooncake
    (on `host` with `mooncake_protocol`); shm and mooncake serve push reservations (consumer
    side, push mode) on `port` with the same bounds.

    Raises:
        ValueError: unknown name, or an optional engine whose package is missing.
    """
    if name == "tcp":
        from pdkv.kv_transfer.engine.tcp import TcpTransferEngine

        return TcpTransferEngine(port=port, max_connections=max_connections,
                                 idle_timeout=idle_timeout)
    if name == "shm":
        from pdkv.kv_transfer.engine.shm import ShmTransferEngine

        return ShmTransferEngine(port=port, max_connections=max_connections,
                                 idle_timeout=idle_timeout)
    if name == "mooncake":
        from pdkv.kv_transfer.engine.mooncake import MooncakeTransferEngine

        return MooncakeTransferEngine(host, mooncake_protocol, port=port,
                                      max_connections=max_connections, idle_timeout=idle_timeout)
    raise ValueError(f"unknown transfer engine {name!r}; known: {TRANSFER_ENGINES}")
