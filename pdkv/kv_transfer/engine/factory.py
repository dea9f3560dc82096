"""Transfer engines by name."""

from __future__ import annotations

from typing import Any

from pdkv.kv_transfer.engine.base import TransferEngine

TRANSFER_ENGINES = ("tcp", "shm", "mooncake")


def create_transfer_engine(name: str, options: dict[str, Any]) -> TransferEngine:
    """Build the engine called `name`.

    Raises:
        ValueError: unknown name, or an optional engine whose package is missing.
    """
    if name == "tcp":
        from pdkv.kv_transfer.engine.tcp import TcpTransferEngine

        return TcpTransferEngine(port=int(options.get("transfer_port", 0)),
                                 max_connections=int(options.get("kv_server_max_connections", 64)),
                                 idle_timeout=float(options.get("kv_server_idle_timeout", 60.0)))
    if name == "shm":
        from pdkv.kv_transfer.engine.shm import ShmTransferEngine

        return ShmTransferEngine()
    if name == "mooncake":
        from pdkv.kv_transfer.engine.mooncake import MooncakeTransferEngine

        return MooncakeTransferEngine(str(options.get("kv_host", "127.0.0.1")),
                                      str(options.get("mooncake_protocol", "tcp")))
    raise ValueError(f"unknown transfer engine {name!r}; known: {TRANSFER_ENGINES}")
