"""Push control plane of the one-sided transfer engines (shm, mooncake): the consumer authorizes
every write *before* the producer's bytes can land in its memory.

A one-sided engine writes straight into the consumer's KV cache (a memcpy into its shared
segment, a Mooncake write into its registered memory), so the consumer cannot refuse bytes as
they arrive the way the tcp engine's data server does. Each write is therefore bracketed by a
small exchange (framed msgpack over TCP, pdkv/kv_transfer/wire.py) on one connection:

    P -> D  Reserve(region, ranges, request_id, nonce)
    D -> P  ControlReply(ok, error, target)   D ran its write handler's `authorize`: accepted
                                               (the window counts the write in flight), or
                                               refused with the reason (P writes nothing)
    P       the one-sided write of exactly the reserved ranges into D's memory, named by
            `target` (D's engine peer info: shared segments, Mooncake session and addresses)
    P -> D  Commit(landed)                     D runs `on_written(grant, region, ranges, landed)`
    D -> P  ControlReply(ok)

The reservation lives only on its connection: when the connection breaks (P died) or no Commit
arrives within `commit_timeout` seconds after the acceptance, D ends the write as not landed
(its units stay unwritten; the window completes only through other writes, or ends at its
lease). P starts no copy once `commit_timeout` has passed since it read the acceptance.

Trust: D decides which (block, layer) units may be written and when they count; it cannot stop
a P that writes elsewhere in the memory it exposes. One-sided engines are for one trusted host
(shm) or a trusted cluster network (mooncake), as for their reads.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from pdkv.kv_transfer.engine.base import Authorizer, Grant, TransferError, WriteDone, WriteOp
from pdkv.kv_transfer.engine.connections import PeerConnections, attempt_failed, set_timeout
from pdkv.kv_transfer.wire import WireError, recv_msg, send_msg, start_server, stop_server

logger = logging.getLogger(__name__)


class Reserve(msgspec.Struct, tag="reserve", frozen=True):
    """P -> D: may P write `ranges` ((offset, length) bytes) of D's region `region` ("g<group>")
    for D's grant (request_id, nonce)?"""

    region: str
    ranges: list[tuple[int, int]]
    request_id: str = ""
    nonce: str = ""


class Commit(msgspec.Struct, tag="commit", frozen=True):
    """P -> D: the reserved write ended; `landed`: all its bytes were written (else its ranges
    hold undefined bytes)."""

    landed: bool


ControlRequest = Reserve | Commit


class ControlReply(msgspec.Struct, frozen=True):
    """D -> P. To a Reserve: `ok` (accepted; `target` is D's engine peer info, where to write,
    and P must commit within `commit_timeout_s` seconds) or the refusal in `error`. To a Commit:
    `ok` once D counted it."""

    ok: bool
    error: str = ""
    target: dict[str, Any] = msgspec.field(default_factory=dict)
    commit_timeout_s: float = 0.0


Copy = Callable[[dict[str, Any], str, list[WriteOp]], None]
"""Producer side: write `ops` (all of region `region`) into the consumer's memory named by its
`target` peer info; raises TransferError when they did not all land."""


class PushControlServer:
    """D's side: serves Reserve / Commit for its one-sided engine.

    Args:
        sizes: bytes of each registered region by name (a range outside is refused before
            `authorize` is asked).
        authorize, on_written: the write handler (`TransferEngine.set_write_handler`).
        target: D's engine peer info, sent with every acceptance.
        max_connections: connections served at once (more are closed at accept).
        idle_timeout: seconds a connection may wait for its next Reserve; also the commit
            timeout of an accepted reservation.
    """

    def __init__(self, sizes: Mapping[str, int], authorize: Authorizer, on_written: WriteDone,
                 target: Callable[[], dict[str, Any]], max_connections: int = 64,
                 idle_timeout: float = 60.0) -> None:
        self._sizes = sizes
        self._authorize = authorize
        self._on_written = on_written
        self._target = target
        self._max_connections = max_connections
        self.commit_timeout = idle_timeout
        self._server: socket.socket | None = None
        self.port = 0

    def start(self, host: str, port: int = 0) -> int:
        """Listen on host:port (0: any free port); returns the port."""
        self._server = start_server(host, port, self._serve, "pdkv-push-control",
                                    self._max_connections, self.commit_timeout)
        self.port = int(self._server.getsockname()[1])
        return self.port

    def _refusal(self, req: Reserve) -> str | None:
        size = self._sizes.get(req.region)
        if size is None or any(o < 0 or n < 0 or o + n > size for o, n in req.ranges):
            return f"bad region or range in {req.region!r}"
        grant = (req.request_id, req.nonce) if req.request_id else None
        return self._authorize(grant, req.region, req.ranges)

    def _serve(self, conn: socket.socket) -> None:
        while True:
            try:
                req: Reserve | Commit = recv_msg(conn, ControlRequest)  # type: ignore[arg-type]
                if isinstance(req, Commit):
                    send_msg(conn, ControlReply(False, error="commit without a reservation"))
                    continue
                error = self._refusal(req)
                if error is not None:
                    send_msg(conn, ControlReply(False, error=error))
                    continue
                self._reserved(conn, req)
            except (OSError, WireError, TimeoutError):
                return

    def _reserved(self, conn: socket.socket, req: Reserve) -> None:
        """An accepted reservation: acknowledge it, wait for its Commit, end it (landed only by
        a Commit saying so; a broken connection or a late Commit ends it as not landed)."""
        grant: Grant = (req.request_id, req.nonce)
        landed = False
        try:
            send_msg(conn, ControlReply(True, target=self._target(),
                                        commit_timeout_s=self.commit_timeout))
            commit: Reserve | Commit = recv_msg(
                conn, ControlRequest, time.monotonic() + self.commit_timeout)  # type: ignore[arg-type]
            if not isinstance(commit, Commit):
                raise WireError("a reservation must be committed before the next one")
            landed = commit.landed
        finally:  # an accepted write always ends (the window waits for it)
            self._on_written(grant, req.region, req.ranges, landed)
        send_msg(conn, ControlReply(True))

    def stop(self) -> None:
        if self._server is not None:
            stop_server(self._server)
            self._server = None


class PushControlClient:
    """P's side: brackets each one-sided write with Reserve and Commit (any thread; a kept
    connection per consumer)."""

    def __init__(self) -> None:
        self._conns = PeerConnections()

    def write(self, peer: dict[str, Any], ops: list[WriteOp], deadline: float,
              grant: Grant | None, copy: Copy) -> int:
        """Reserve, copy and commit `ops` region by region; returns bytes written.

        Args:
            peer: the consumer's push control server, {"host", "port"} (a grant's host / port).
            ops: writes into the consumer's regions.
            deadline: time.monotonic() by which every write must have been committed.
            grant: the consumer's (request id, nonce).
            copy: the engine's one-sided write of one region's ops into `target`.

        Raises:
            TransferError: refused (the reason is the consumer's; nothing was written), the
                copy failed (committed as not landed), unreachable, or the deadline passed.
        """
        key = (str(peer["host"]), int(peer["port"]))
        rid, nonce = grant if grant is not None else ("", "")
        by_region: dict[str, list[WriteOp]] = {}
        for op in ops:
            by_region.setdefault(op.region, []).append(op)
        return self._conns.run(
            key, deadline,
            lambda sock, stale_ok: self._write_on(sock, key, by_region, rid, nonce, deadline,
                                                  copy, stale_ok))

    def _write_on(self, sock: socket.socket, key: tuple[str, int],
                  by_region: dict[str, list[WriteOp]], rid: str, nonce: str, deadline: float,
                  copy: Copy, stale_ok: bool) -> int:
        """One attempt on `sock` (closed on any failure); a kept connection that fails before
        any reply raises StaleConnection (nothing was reserved: the caller retries)."""
        total = 0
        replied = False
        try:
            for region, region_ops in by_region.items():
                set_timeout(sock, deadline)
                send_msg(sock, Reserve(region, [(op.offset, op.length) for op in region_ops],
                                       rid, nonce))
                reply = recv_msg(sock, ControlReply, deadline)
                replied = True
                if not reply.ok:
                    raise TransferError(f"peer {key[0]}:{key[1]} refused write: {reply.error}")
                accepted = time.monotonic()
                failure: TransferError | None = None
                if time.monotonic() > min(deadline, accepted + reply.commit_timeout_s):
                    failure = TransferError("transfer deadline passed before the write")
                else:
                    try:
                        copy(reply.target, region, region_ops)
                    except TransferError as e:
                        failure = e
                    except Exception as e:  # (a bad target, a mapping error: not landed)
                        failure = TransferError(f"one-sided write failed: {e!r}")
                commit_by = max(deadline, time.monotonic() + 1.0)  # commit even when late
                set_timeout(sock, commit_by)
                send_msg(sock, Commit(failure is None))
                done = recv_msg(sock, ControlReply, commit_by)
                if failure is not None:
                    raise failure
                if not done.ok:
                    raise TransferError(f"peer {key[0]}:{key[1]} failed write: {done.error}")
                total += sum(op.length for op in region_ops)
        except (OSError, WireError) as e:
            raise attempt_failed(sock, e, stale_ok and not replied,
                                 f"write to {key[0]}:{key[1]}") from None
        except TransferError:
            sock.close()
            raise
        return total

    def forget(self, peer: dict[str, Any]) -> None:
        """Drop the kept connection to `peer` ({"host", "port"})."""
        if "host" in peer and "port" in peer:
            self._conns.forget((str(peer["host"]), int(peer["port"])))

    def close(self) -> None:
        self._conns.close()
