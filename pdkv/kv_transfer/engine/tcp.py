"""`tcp` transfer engine: the producer serves byte ranges of its regions over a TCP socket;
the consumer receives them straight into its KV cache blocks (recv_into, no extra copy).
Push mode (the P2P connector's `transfer_mode: push`) runs the other way on the same protocol: the
producer writes byte ranges into the consumer's registered regions, each write asked first of the
consumer's write handler (`set_write_handler`) and acknowledged twice (accepted, then landed).

Every read names the producer grant it belongs to; with an authorizer set (the P2P connector
always sets one) the server serves only ranges inside the blocks held for that grant. Server
connections are bounded in number and dropped when idle; a consumer read has one deadline for
the whole transfer, however slowly the peer sends."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import msgspec

from pdkv.kv_transfer.engine.base import (
    Authorizer,
    Grant,
    ReadOp,
    TransferEngine,
    TransferError,
    WriteDone,
    WriteOp,
    coalesce,
)
from pdkv.kv_transfer.engine.connections import (
    PeerConnections,
    attempt_failed,
    set_timeout,
)
from pdkv.kv_transfer.wire import (
    WireError,
    recv_exact_into,
    recv_msg,
    send_msg,
    start_server,
    stop_server,
)

logger = logging.getLogger(__name__)


class _ReadRequest(msgspec.Struct, tag="read"):
    region: str
    ranges: list[tuple[int, int]]  # (offset, length)
    request_id: str = ""
    nonce: str = ""


class _WriteRequest(msgspec.Struct, tag="write"):
    """Push: the ranges' bytes follow once the server accepted (a first _ReadReply)."""

    region: str
    ranges: list[tuple[int, int]]  # (offset, length)
    request_id: str = ""
    nonce: str = ""


_Request = _ReadRequest | _WriteRequest


class _ReadReply(msgspec.Struct):
    ok: bool
    nbytes: int = 0
    error: str = ""


class TcpTransferEngine(TransferEngine):
    """Args:
        port: data port to listen on (0 = any free port), producer side.
        max_connections: connections the data server serves at once (more are closed).
        idle_timeout: seconds a server connection may wait for a request or stall a send.
    """

    name = "tcp"

    def __init__(
        self, port: int = 0, max_connections: int = 64, idle_timeout: float = 60.0
    ) -> None:
        self._regions: dict[str, memoryview] = {}
        self._port = port
        self._max_connections = max_connections
        self._idle_timeout = idle_timeout
        self._server: socket.socket | None = None
        self._host = "127.0.0.1"
        self._authorizer: Authorizer | None = None
        self._write_authorizer: Authorizer | None = None
        self._on_written: WriteDone | None = None
        self._conns = PeerConnections()

    def register_region(self, name: str, buffer: memoryview) -> None:
        self._regions[name] = buffer.cast("B")

    def set_authorizer(self, authorizer: Authorizer) -> None:
        self._authorizer = authorizer

    def set_write_handler(self, authorize: Authorizer, on_written: WriteDone) -> None:
        self._write_authorizer = authorize
        self._on_written = on_written

    def start(self, host: str, advertise_host: str | None = None) -> None:
        self._host = advertise_host or host
        self._server = start_server(host, self._port, self._serve, "pdkv-tcp-transfer",
                                    self._max_connections, self._idle_timeout)
        self._port = self._server.getsockname()[1]

    def peer_info(self) -> dict[str, Any]:
        return {"host": self._host, "port": self._port}

    def write_address(self) -> tuple[str, int] | None:
        if self._server is None or self._write_authorizer is None:
            return None
        return self._host, self._port

    # ---------------------------------------------------------------- server
    def _refusal(self, req: _ReadRequest) -> str | None:
        region = self._regions.get(req.region)
        if region is None or any(o < 0 or n < 0 or o + n > len(region) for o, n in req.ranges):
            return f"bad region or range in {req.region!r}"
        if self._authorizer is not None:
            grant = (req.request_id, req.nonce) if req.request_id else None
            return self._authorizer(grant, req.region, req.ranges)
        return None

    def _write_refusal(self, req: _WriteRequest) -> str | None:
        region = self._regions.get(req.region)
        if region is None or any(o < 0 or n < 0 or o + n > len(region) for o, n in req.ranges):
            return f"bad region or range in {req.region!r}"
        if self._write_authorizer is None:
            return "this engine accepts no writes"
        grant = (req.request_id, req.nonce) if req.request_id else None
        return self._write_authorizer(grant, req.region, req.ranges)

    def _serve_write(self, conn: socket.socket, req: _WriteRequest) -> None:
        """Accept (or refuse) one write, receive its bytes into the region, acknowledge."""
        error = self._write_refusal(req)
        if error is not None:
            send_msg(conn, _ReadReply(False, error=error))
            return
        region = self._regions[req.region]
        total = sum(n for _, n in req.ranges)
        send_msg(conn, _ReadReply(True, total))
        deadline = time.monotonic() + self._idle_timeout
        landed = False
        try:
            for off, n in req.ranges:
                recv_exact_into(conn, region[off : off + n], deadline)
            landed = True
        finally:  # accepted writes always end, landed or not (the window waits for them)
            if self._on_written is not None:
                self._on_written((req.request_id, req.nonce), req.region, req.ranges, landed)
        send_msg(conn, _ReadReply(True, total))

    def _serve(self, conn: socket.socket) -> None:
        while True:
            try:
                req: _ReadRequest | _WriteRequest = recv_msg(conn, _Request)  # type: ignore[arg-type]
            except (WireError, OSError):
                return
            if isinstance(req, _WriteRequest):
                try:
                    self._serve_write(conn, req)
                except (OSError, WireError, TimeoutError):
                    return
                continue
            try:
                error = self._refusal(req)
                if error is not None:
                    send_msg(conn, _ReadReply(False, error=error))
                    continue
                region = self._regions[req.region]
                send_msg(conn, _ReadReply(True, sum(n for _, n in req.ranges)))
                for off, n in req.ranges:
                    conn.sendall(region[off : off + n])
            except OSError:
                return

    # ---------------------------------------------------------------- client
    def read(
        self, peer: dict[str, Any], ops: list[ReadOp], deadline: float, grant: Grant | None = None
    ) -> int:
        """Read `ops` from the peer's registered regions into their destinations.

        A connection kept from an earlier read may have been closed by the peer meanwhile (its
        server drops idle connections after `idle_timeout`): when such a reused connection fails
        before any reply arrived, the read is sent once more on a fresh connection (a read has
        no side effect on the producer; its grant ends only with "done").

        Raises:
            TransferError: refused, unreachable, a broken stream, or the deadline passed.
        """
        key = (str(peer["host"]), int(peer["port"]))
        rid, nonce = grant if grant is not None else ("", "")
        by_region: dict[str, list[ReadOp]] = {}
        for op in coalesce(ops):
            by_region.setdefault(op.region, []).append(op)
        return self._conns.run(
            key, deadline,
            lambda sock, stale_ok: self._read_on(sock, key, by_region, rid, nonce, deadline,
                                                 stale_ok=stale_ok),
        )

    def _read_on(
        self,
        sock: socket.socket,
        key: tuple[str, int],
        by_region: dict[str, list[ReadOp]],
        rid: str,
        nonce: str,
        deadline: float,
        stale_ok: bool,
    ) -> int:
        """One attempt on `sock` (closed on any failure). Raises StaleConnection instead of
        TransferError when `stale_ok` and nothing was received yet."""
        total = 0
        replied = False
        try:
            for region, region_ops in by_region.items():
                set_timeout(sock, deadline)
                send_msg(
                    sock,
                    _ReadRequest(region, [(op.offset, op.length) for op in region_ops], rid, nonce),
                )
                reply = recv_msg(sock, _ReadReply, deadline)
                replied = True
                if not reply.ok:
                    raise TransferError(f"peer {key[0]}:{key[1]} refused read: {reply.error}")
                for op in region_ops:
                    recv_exact_into(sock, op.dest.cast("B")[: op.length], deadline)
                    total += op.length
        except (OSError, WireError) as e:
            raise attempt_failed(sock, e, stale_ok and not replied,
                                  f"read from {key[0]}:{key[1]}") from None
        except TransferError:
            sock.close()
            raise
        return total

    def write(
        self, peer: dict[str, Any], ops: list[WriteOp], deadline: float, grant: Grant | None = None
    ) -> int:
        """Write `ops` into the peer's regions (push mode). Like `read`, a kept connection that
        fails before any reply is retried once on a fresh one (nothing was written then).

        Raises:
            TransferError: refused (the reason is the consumer's), unreachable, a broken
                stream, or the deadline passed.
        """
        key = (str(peer["host"]), int(peer["port"]))
        rid, nonce = grant if grant is not None else ("", "")
        by_region: dict[str, list[WriteOp]] = {}
        for op in ops:
            by_region.setdefault(op.region, []).append(op)
        return self._conns.run(
            key, deadline,
            lambda sock, stale_ok: self._write_on(sock, key, by_region, rid, nonce, deadline,
                                                  stale_ok=stale_ok),
        )

    def _write_on(self, sock: socket.socket, key: tuple[str, int],
                  by_region: dict[str, list[WriteOp]], rid: str, nonce: str, deadline: float,
                  stale_ok: bool) -> int:
        """One write attempt on `sock` (closed on any failure); see `_read_on`."""
        total = 0
        replied = False
        try:
            for region, region_ops in by_region.items():
                set_timeout(sock, deadline)
                ranges = [(op.offset, op.length) for op in region_ops]
                send_msg(sock, _WriteRequest(region, ranges, rid, nonce))
                reply = recv_msg(sock, _ReadReply, deadline)
                replied = True
                if not reply.ok:
                    raise TransferError(f"peer {key[0]}:{key[1]} refused write: {reply.error}")
                for op in region_ops:
                    set_timeout(sock, deadline)
                    sock.sendall(op.src.cast("B")[: op.length])
                landed = recv_msg(sock, _ReadReply, deadline)
                if not landed.ok:
                    raise TransferError(f"peer {key[0]}:{key[1]} failed write: {landed.error}")
                total += sum(op.length for op in region_ops)
        except (OSError, WireError) as e:
            raise attempt_failed(sock, e, stale_ok and not replied,
                                  f"write to {key[0]}:{key[1]}") from None
        except TransferError:
            sock.close()
            raise
        return total

    def forget_peer(self, peer: dict[str, Any]) -> None:
        self._conns.forget((str(peer.get("host")), int(peer.get("port", 0))))

    def close(self) -> None:
        if self._server is not None:
            stop_server(self._server)
        self._conns.close()
