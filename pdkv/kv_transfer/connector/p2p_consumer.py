"""Consumer side of the P2P worker half: pulls of remote blocks into local ones and the
notices (renew, release, done) sent to producers' control servers."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pdkv.kv_transfer.connector.p2p_messages import (
    Ack,
    Handshake,
    HandshakeReply,
    Notify,
    NotifySpec,
    RecvSpec,
    RemoteEngine,
)
from pdkv.kv_transfer.connector.p2p_results import WorkerResults
from pdkv.kv_transfer.engine.base import ReadOp, TransferEngine, TransferError
from pdkv.kv_transfer.wire import WireError, connect, recv_msg, send_msg

if TYPE_CHECKING:
    from pdkv.config import KVTransferConfig

logger = logging.getLogger(__name__)


class ConsumerSide:
    """Args:
        config: kv_transfer_config (extra: transfer_timeout).
        layout: this engine's layout fingerprint (sent in handshakes).
        engine: the transfer engine reads go through.
        results: where finished loads are reported.
        regions: this engine's KV cache bytes per group (filled at register_kv_caches).
        block_bytes: bytes per block of each group (filled at register_kv_caches).
    """

    def __init__(self, config: KVTransferConfig, layout: dict[str, Any], engine: TransferEngine,
                 results: WorkerResults, regions: list[memoryview], block_bytes: list[int]) -> None:
        self.config = config
        self.layout = layout
        self.engine = engine
        self.results = results
        self.regions = regions
        self.block_bytes = block_bytes
        self.timeout = float(config.kv_connector_extra_config.get("transfer_timeout", 30.0))  # type: ignore[arg-type]
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdkv-kv-pull")
        self._handshakes: dict[RemoteEngine, HandshakeReply] = {}

    def submit(self, pulls: list[RecvSpec], notices: list[NotifySpec]) -> None:
        """Engine loop: start these pulls and send these notices (never blocks)."""
        for spec in pulls:
            self._pool.submit(self._pull, spec)
        for note in notices:
            self._pool.submit(self._notify_quietly, note)

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

    def _read_ops(self, spec: RecvSpec, peer: HandshakeReply) -> list[ReadOp]:
        ops = []
        for g, (local, remote) in enumerate(zip(spec.local_block_ids, spec.remote_block_ids)):
            bb = self.block_bytes[g]
            if peer.block_bytes[g] != bb:
                raise TransferError(f"block bytes differ: producer {peer.block_bytes[g]}, consumer {bb}")
            # One op per run of blocks consecutive on both sides (fewer, larger copies).
            i = 0
            while i < len(local):
                j = i + 1
                while j < len(local) and local[j] == local[j - 1] + 1 and remote[j] == remote[j - 1] + 1:
                    j += 1
                n = (j - i) * bb
                dest = self.regions[g][local[i] * bb : local[i] * bb + n]
                ops.append(ReadOp(f"g{g}", remote[i] * bb, n, dest))
                i = j
        return ops

    def _pull(self, spec: RecvSpec) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        local_blocks = [b for g in spec.local_block_ids for b in g]
        try:
            peer = self._handshake(spec.remote, deadline)
            nbytes = self.engine.read(peer.peer_info, self._read_ops(spec, peer), deadline)
            ack = self._control(spec.remote, Notify(spec.remote_request_id, "done", nbytes), Ack, deadline)
            if not ack.ok:  # the producer may have reused the blocks: the data is not trustworthy
                raise TransferError(f"producer did not confirm the read: {ack.error}")
            self.results.load_succeeded(spec.request_id, nbytes, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - every failure ends the load by policy
            logger.warning("KV pull for %s failed: %s", spec.request_id, e)
            self.results.load_failed(spec.request_id, str(e), local_blocks)
            self._notify_quietly(NotifySpec(spec.remote, spec.remote_request_id, "release"))

    def _notify_quietly(self, note: NotifySpec) -> None:
        try:
            self._control(note.remote, Notify(note.remote_request_id, note.kind), Ack, time.monotonic() + 5.0)
        except TransferError as e:
            logger.info("notification %s for %s not delivered: %s", note.kind, note.remote_request_id, e)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
