"""Producer side of the P2P worker half: the control server consumers talk to (handshake,
notices) and the ledger of blocks held for them under a lease."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from pdkv.kv_transfer.connector.p2p_messages import (
    Ack,
    ControlRequest,
    Handshake,
    HandshakeReply,
    Notify,
    SendSpec,
    layout_mismatch,
)
from pdkv.kv_transfer.connector.p2p_results import WorkerResults
from pdkv.kv_transfer.engine.base import TransferEngine
from pdkv.kv_transfer.wire import WireError, recv_msg, send_msg, start_server, stop_server

if TYPE_CHECKING:
    from pdkv.config import KVTransferConfig

logger = logging.getLogger(__name__)


class _Held:
    """A producer request whose blocks wait for the consumer."""

    def __init__(self, block_ids: tuple[list[int], ...], deadline: float) -> None:
        self.block_ids = block_ids
        self.deadline = deadline


class ProducerSide:
    """Args:
        config: kv_transfer_config (extra: kv_lease_duration).
        layout: this engine's layout fingerprint (checked in handshakes).
        engine: the transfer engine serving the KV regions.
        results: where finished sends are reported.
        block_bytes: bytes per block of each KV cache group (filled at register_kv_caches).
    """

    def __init__(self, config: KVTransferConfig, layout: dict[str, Any], engine: TransferEngine,
                 results: WorkerResults, block_bytes: list[int]) -> None:
        self.config = config
        self.layout = layout
        self.engine = engine
        self.results = results
        self.block_bytes = block_bytes
        self.lease_s = float(config.kv_connector_extra_config.get("kv_lease_duration", 30.0))  # type: ignore[arg-type]
        self._lock = results.lock
        self._held: dict[str, _Held] = {}
        # Notifications that arrived before the request was registered: id -> (kind, nbytes).
        self._early: dict[str, tuple[str, int]] = {}
        self._registered = threading.Condition(self._lock)
        self._server: socket.socket | None = None

    def start(self, host: str, port: int) -> tuple[str, int]:
        """Start the control server on host:port (0 = any free port); returns its address."""
        self._server = start_server(host, port, self._serve, "pdkv-kv-control")
        return host, self._server.getsockname()[1]

    def hold(self, specs: list[SendSpec]) -> None:
        """Engine loop: hold these requests' blocks for consumers."""
        now = time.monotonic()
        with self._lock:
            for spec in specs:
                self._held[spec.request_id] = _Held(spec.block_ids, now + spec.lease_s)
                early = self._early.pop(spec.request_id, None)
                if early is not None:
                    self._finish_send(spec.request_id, early[0], early[1])
            self._registered.notify_all()

    def expire(self) -> None:
        """Engine loop: end the leases that ran out."""
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, h in self._held.items() if now > h.deadline]
            for rid in expired:
                logger.warning("KV lease of request %s expired before the consumer read it", rid)
                self._finish_send(rid, "expired")

    def next_deadline(self) -> float | None:
        """Earliest lease expiry (time.monotonic()), or None."""
        with self._lock:
            return min((h.deadline for h in self._held.values()), default=None)

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._held)

    def _finish_send(self, rid: str, how: str, nbytes: int = 0) -> None:
        """Lock held. The request's blocks may be freed now; `nbytes` = what the consumer read."""
        if self._held.pop(rid, None) is not None:
            self.results.send_finished(rid, how, nbytes)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    msg = recv_msg(conn, ControlRequest)  # type: ignore[arg-type]
                except (WireError, OSError):
                    return
                try:
                    send_msg(conn, self._handle(msg))
                except OSError:
                    return

    def _handle(self, msg: Handshake | Notify) -> HandshakeReply | Ack:
        if isinstance(msg, Handshake):
            mismatch = layout_mismatch(msg.layout, self.layout)
            if mismatch:
                return HandshakeReply(False, error=mismatch)
            return HandshakeReply(True, engine_id=self.config.engine_id, layout=self.layout,
                                  transfer=self.engine.name, peer_info=self.engine.peer_info(),
                                  block_bytes=list(self.block_bytes))
        with self._lock:
            if msg.request_id not in self._held:
                # The HTTP response with the params can overtake the engine step that
                # registers the request: wait briefly for it.
                self._registered.wait_for(lambda: msg.request_id in self._held, timeout=2.0)
            held = self._held.get(msg.request_id)
            if held is None:
                if msg.kind in ("done", "release"):
                    self._early[msg.request_id] = (msg.kind, msg.nbytes)
                return Ack(False, error=f"unknown or expired request {msg.request_id!r}")
            if msg.kind == "renew":
                held.deadline = max(held.deadline, time.monotonic() + self.lease_s)
                return Ack(True)
            if msg.kind in ("done", "release"):
                self._finish_send(msg.request_id, msg.kind, msg.nbytes)
                return Ack(True)
        return Ack(False, error=f"unknown notification {msg.kind!r}")

    def shutdown(self) -> None:
        if self._server is not None:
            stop_server(self._server)
