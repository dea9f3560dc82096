"""Worker half of the P2P connector: the producer's control server and block leases, the
consumer's pull threads. Bytes move through a TransferEngine (tcp | shm)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pdkv.kv_transfer.connector.p2p_messages import (
    Ack,
    ControlRequest,
    Handshake,
    HandshakeReply,
    Notify,
    NotifySpec,
    P2PConnectorMetadata,
    RecvSpec,
    RemoteEngine,
    layout_mismatch,
)
from pdkv.kv_transfer.engine.base import ReadOp, TransferError
from pdkv.kv_transfer.engine.factory import create_transfer_engine
from pdkv.kv_transfer.wire import WireError, connect, recv_msg, send_msg, start_server, stop_server

if TYPE_CHECKING:
    from pdkv.config import KVTransferConfig

logger = logging.getLogger(__name__)


class _Held:
    """A producer request whose blocks wait for the consumer."""

    def __init__(self, block_ids: tuple[list[int], ...], deadline: float) -> None:
        self.block_ids = block_ids
        self.deadline = deadline


class P2PConnectorWorker:
    """Args:
        config: kv_transfer_config (extra: transfer, kv_host, kv_port, transfer_timeout).
        layout: this engine's layout fingerprint.
        control_address: shared [host, port] list the scheduler half reads (filled here).
    """

    def __init__(self, config: KVTransferConfig, layout: dict[str, Any], control_address: list[Any]) -> None:
        extra = config.kv_connector_extra_config
        self.config = config
        self.layout = layout
        self.transfer_name = str(extra.get("transfer", "tcp"))
        self.engine = create_transfer_engine(self.transfer_name, dict(extra))
        self.host = str(extra.get("kv_host", "127.0.0.1"))
        self.timeout = float(extra.get("transfer_timeout", 30.0))  # type: ignore[arg-type]
        self.control_address = control_address
        self._lock = threading.Lock()
        self._regions: list[memoryview] = []
        self._block_bytes: list[int] = []
        # producer state
        self._held: dict[str, _Held] = {}
        # Notifications that arrived before the request was registered: id -> (kind, nbytes).
        self._early: dict[str, tuple[str, int]] = {}
        self._registered = threading.Condition(self._lock)
        # results for get_finished
        self._sent: set[str] = set()
        self._recved: set[str] = set()
        self._bad_blocks: set[tuple[int, int]] = set()  # (group, block id)
        self._errors: dict[str, str] = {}
        self._stats: dict[str, float] = {}
        self._transfer_times: list[float] = []
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdkv-kv-pull")
        self._handshakes: dict[RemoteEngine, HandshakeReply] = {}
        self._server: socket.socket | None = None
        self._wakeup: Callable[[], None] | None = None
        if config.is_kv_producer:
            self._start_control_server(int(extra.get("kv_port", 0)))  # type: ignore[arg-type]

    # ---------------------------------------------------------------- memory
    def kv_cache_buffer(self, group: int, nbytes: int) -> memoryview | None:
        """Memory for group `group`'s KV cache when the transfer engine needs its own (shm)."""
        if self.transfer_name == "shm" and self.config.is_kv_producer:
            from pdkv.kv_transfer.engine.shm import ShmTransferEngine

            assert isinstance(self.engine, ShmTransferEngine)
            return self.engine.allocate(f"g{group}", nbytes)
        return None

    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        import torch

        for g, t in enumerate(kv_caches):
            flat = t.view(-1).view(torch.uint8)
            view = memoryview(flat.numpy())
            self._regions.append(view)
            self._block_bytes.append(len(view) // t.shape[0])
            if self.config.is_kv_producer:
                self.engine.register_region(f"g{g}", view)
            if self.config.is_kv_consumer:
                self.engine.register_local(f"g{g}", view)
        if self.config.is_kv_producer:
            self.engine.start(self.host)

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """The engine loop's wake-up callback (called when sends or loads finish)."""
        self._wakeup = wakeup

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup()

    def next_deadline(self) -> float | None:
        """Earliest lease expiry of the blocks held for consumers (time.monotonic()), or None."""
        with self._lock:
            return min((h.deadline for h in self._held.values()), default=None)

    # ------------------------------------------------------------ per step
    def start_load_kv(self, meta: P2PConnectorMetadata) -> None:
        now = time.monotonic()
        with self._lock:
            for spec in meta.reqs_to_send:
                held = _Held(spec.block_ids, now + spec.lease_s)
                self._held[spec.request_id] = held
                early = self._early.pop(spec.request_id, None)
                if early is not None:
                    self._finish_send(spec.request_id, early[0], early[1])
            self._registered.notify_all()
        for spec in meta.reqs_to_recv:
            self._pool.submit(self._pull, spec)
        for note in meta.notifications:
            self._pool.submit(self._notify_quietly, note)

    def get_finished(self) -> tuple[set[str], set[str]]:
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, h in self._held.items() if now > h.deadline]
            for rid in expired:
                logger.warning("KV lease of request %s expired before the consumer read it", rid)
                self._finish_send(rid, "expired")
            sent, recved = self._sent, self._recved
            self._sent, self._recved = set(), set()
        return sent, recved

    def get_block_ids_with_load_errors(self) -> set[tuple[int, int]]:
        with self._lock:
            bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def get_load_errors(self) -> dict[str, str]:
        with self._lock:
            errors, self._errors = self._errors, {}
        return errors

    def get_stats(self) -> tuple[dict[str, float], list[float]]:
        with self._lock:
            stats, self._stats = self._stats, {}
            times, self._transfer_times = self._transfer_times, []
        return stats, times

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._held)

    def _count(self, key: str, value: float = 1.0) -> None:
        self._stats[key] = self._stats.get(key, 0.0) + value

    def _finish_send(self, rid: str, how: str, nbytes: int = 0) -> None:
        """Lock held. The request's blocks may be freed now; `nbytes` = what the consumer read."""
        held = self._held.pop(rid, None)
        if held is None:
            return
        self._sent.add(rid)
        self._wake()
        if how == "done":
            self._count("kv_bytes_sent", nbytes)
        elif how == "expired":
            self._count("lease_expirations")
        elif how == "release":
            self._count("released_unread")

    # ---------------------------------------------------------- producer side
    def _start_control_server(self, port: int) -> None:
        self._server = start_server(self.host, port, self._serve, "pdkv-kv-control")
        self.control_address[:] = [self.host, self._server.getsockname()[1]]

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
                                  transfer=self.transfer_name, peer_info=self.engine.peer_info(),
                                  block_bytes=list(self._block_bytes))
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
                held.deadline = max(held.deadline, time.monotonic() + self._lease_of(held))
                return Ack(True)
            if msg.kind in ("done", "release"):
                self._finish_send(msg.request_id, msg.kind, msg.nbytes)
                return Ack(True)
        return Ack(False, error=f"unknown notification {msg.kind!r}")

    def _lease_of(self, held: _Held) -> float:
        return float(self.config.kv_connector_extra_config.get("kv_lease_duration", 30.0))  # type: ignore[arg-type]

    # ---------------------------------------------------------- consumer side
    def _control(self, remote: RemoteEngine, msg: Handshake | Notify, reply_type: type, deadline: float) -> Any:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError("deadline passed before contacting the producer")
        try:
            with connect(remote.host, remote.port, left) as sock:
                send_msg(sock, msg)
                return recv_msg(sock, reply_type)
        except (OSError, WireError) as e:
            raise TransferError(f"producer {remote.host}:{remote.port} unreachable: {e}") from None

    def _handshake(self, remote: RemoteEngine, deadline: float) -> HandshakeReply:
        reply = self._handshakes.get(remote)
        if reply is None:
            reply = self._control(remote, Handshake(self.config.engine_id, self.layout), HandshakeReply, deadline)
            if not reply.ok:
                raise TransferError(reply.error)
            self._handshakes[remote] = reply
        return reply

    def _pull(self, spec: RecvSpec) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        local_blocks = [(g, b) for g, ids in enumerate(spec.local_block_ids) for b in ids]
        try:
            peer = self._handshake(spec.remote, deadline)
            ops = []
            for g, (local, remote) in enumerate(zip(spec.local_block_ids, spec.remote_block_ids)):
                bb = self._block_bytes[g]
                if peer.block_bytes[g] != bb:
                    raise TransferError(f"block bytes differ: producer {peer.block_bytes[g]}, consumer {bb}")
                # One op per run of blocks consecutive on both sides (fewer, larger copies).
                i = 0
                while i < len(local):
                    j = i + 1
                    while j < len(local) and local[j] == local[j - 1] + 1 and remote[j] == remote[j - 1] + 1:
                        j += 1
                    n = (j - i) * bb
                    dest = self._regions[g][local[i] * bb : local[i] * bb + n]
                    ops.append(ReadOp(f"g{g}", remote[i] * bb, n, dest))
                    i = j
            nbytes = self.engine.read(peer.peer_info, ops, deadline)
            ack = self._control(spec.remote, Notify(spec.remote_request_id, "done", nbytes), Ack, deadline)
            if not ack.ok:  # the producer may have reused the blocks: the data is not trustworthy
                raise TransferError(f"producer did not confirm the read: {ack.error}")
            elapsed = time.monotonic() - t0
            with self._lock:
                self._count("kv_bytes_received", nbytes)
                self._count("kv_transfers")
                self._transfer_times.append(elapsed)
                self._recved.add(spec.request_id)
            self._wake()
        except Exception as e:  # noqa: BLE001 - every failure ends the load by policy
            logger.warning("KV pull for %s failed: %s", spec.request_id, e)
            with self._lock:
                self._errors[spec.request_id] = str(e)
                self._count("kv_load_failures")
                self._bad_blocks.update(local_blocks)
                self._recved.add(spec.request_id)
            self._wake()
            self._notify_quietly(NotifySpec(spec.remote, spec.remote_request_id, "release"))

    def _notify_quietly(self, note: NotifySpec) -> None:
        try:
            self._control(note.remote, Notify(note.remote_request_id, note.kind), Ack, time.monotonic() + 5.0)
        except TransferError as e:
            logger.info("notification %s for %s not delivered: %s", note.kind, note.remote_request_id, e)

    def shutdown(self) -> None:
        if self._server is not None:
            stop_server(self._server)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()
