"""Producer side of the P2P worker half: the ledger of blocks held for consumers (one grant per
held request, keyed by (request id, nonce), under a renewable lease) and the control server
consumers talk to (handshake, claim, notices). The tcp data server asks `authorize` before
serving a read, so only a claimed grant's own blocks ever leave this engine.

A grant may have several readers (the DCP ranks of a decode engine, each pulling its shard of the
blocks; Claim.readers): it stays open to reads, and its blocks stay held, until "done" came from
every distinct reader, or "release" from any one of them."""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from pdkv.kv_transfer.connector.p2p_messages import (
    Ack,
    Claim,
    ClaimReply,
    ControlRequest,
    Handshake,
    HandshakeReply,
    Notify,
    SendSpec,
    layout_mismatch,
)
from pdkv.kv_transfer.connector.p2p_results import WorkerResults
from pdkv.kv_transfer.engine.base import Grant, TransferEngine
from pdkv.kv_transfer.wire import WireError, recv_msg, send_msg, start_server, stop_server

if TYPE_CHECKING:
    from pdkv.cache.kv_layout import KVLayout
    from pdkv.kv_transfer.connector.spec import P2PSpec

logger = logging.getLogger(__name__)

REGISTRATION_WAIT_S = 2.0  # how long a notice waits for its grant to be registered
# How long a claim waits for its grant to be registered (at most one lease). P registers a grant
# at the start of its next step, after its HTTP answer has left: on a starved CPU that can take
# seconds, and a claim refused too early fails a request whose KV P is about to hold. A claim for
# a grant that already ended, or from a consumer that saw another incarnation, is refused at once.
CLAIM_REGISTRATION_WAIT_S = 30.0
MAX_ENDED = 16384  # ended grants remembered (so a replayed claim is refused without waiting)
MAX_EARLY_NOTICES = 1024


class _Held:
    """A grant: a producer request whose blocks wait for the consumer."""

    def __init__(self, block_ids: tuple[list[int], ...], deadline: float, digest: str) -> None:
        self.block_ids = block_ids
        self.deadline = deadline
        self.digest = digest
        self.claimed = False
        self.readers = 1  # consumer ranks that read this grant (the largest count announced)
        self.done: set[int] = set()  # readers that said "done"
        self.nbytes = 0  # bytes those readers read, in all

    def reader_done(self, reader: int, readers: int, nbytes: int) -> bool:
        """Record "done" from `reader` of `readers`; True when every reader is done."""
        self.readers = max(self.readers, readers)
        if reader not in self.done:
            self.done.add(reader)
            self.nbytes += nbytes
        return len(self.done) >= self.readers


class ProducerSide:
    """Args:
        spec: the connector (engine id; `spec.p2p`: kv_lease_duration,
            kv_server_max_connections, kv_server_idle_timeout).
        layout: this engine's KV layout (its wire form is checked in handshakes).
        engine: the transfer engine serving the KV regions (its authorizer is set here).
        results: where finished sends are reported.
        block_bytes: bytes per block of each KV cache group (filled at register_kv_caches).
    """

    def __init__(self, spec: P2PSpec, layout: KVLayout, engine: TransferEngine,
                 results: WorkerResults, block_bytes: list[int]) -> None:
        s = spec.p2p
        self.spec = spec
        self.layout = layout
        self.wire_layout: dict[str, object] = {**layout.to_wire()}  # handshakes compare, answer
        self.engine = engine
        self.results = results
        self.block_bytes = block_bytes
        self.lease_s = s.kv_lease_duration
        self.max_connections = s.kv_server_max_connections
        self.idle_timeout = s.kv_server_idle_timeout
        self.incarnation = secrets.token_hex(8)
        self._lock = results.lock
        self._held: dict[Grant, _Held] = {}
        # "done"/"release" that arrived before their grant was registered: grant -> notices (in
        # arrival order) and forget-at. They apply to that grant only, and expire after one lease.
        self._early: dict[Grant, tuple[list[Notify], float]] = {}
        self._registered = threading.Condition(self._lock)
        self._ended: OrderedDict[Grant, None] = OrderedDict()  # most recent last
        self._server: socket.socket | None = None
        engine.set_authorizer(self.authorize)

    def start(self, host: str, port: int, advertise_host: str) -> tuple[str, int]:
        """Start the control server on host:port (0 = any free port); returns the address
        consumers reach it at (advertise_host, port)."""
        self._server = start_server(host, port, self._serve, "pdkv-kv-control",
                                    self.max_connections, self.idle_timeout)
        return advertise_host, self._server.getsockname()[1]

    # ----------------------------------------------------------- engine loop
    def hold(self, specs: list[SendSpec]) -> None:
        """Engine loop: hold these requests' blocks for consumers."""
        now = time.monotonic()
        with self._lock:
            for spec in specs:
                grant = (spec.request_id, spec.nonce)
                self._held[grant] = _Held(spec.block_ids, now + spec.lease_s, spec.prompt_digest)
                early = self._early.pop(grant, None)
                for note in early[0] if early is not None else []:
                    held = self._held.get(grant)
                    if held is not None:  # (an earlier notice may have ended it)
                        self._apply(grant, held, note)
            self._registered.notify_all()

    def expire(self) -> None:
        """Engine loop: end the leases that ran out; forget stale early notices."""
        now = time.monotonic()
        with self._lock:
            for grant in [g for g, h in self._held.items() if now > h.deadline]:
                logger.warning(
                    "KV lease of request %s expired before the consumer read it", grant[0]
                )
                self._finish_send(grant, "expired")
            for grant in [g for g, e in self._early.items() if now > e[1]]:
                del self._early[grant]

    def next_deadline(self) -> float | None:
        """Earliest lease expiry (time.monotonic()), or None."""
        with self._lock:
            return min((h.deadline for h in self._held.values()), default=None)

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._held)

    def _finish_send(self, grant: Grant, how: str, nbytes: int = 0) -> None:
        """Lock held. The grant's blocks may be freed now; `nbytes` = what the consumer read."""
        if self._held.pop(grant, None) is not None:
            self.results.send_finished(grant[0], how, nbytes)
            self._ended[grant] = None
            while len(self._ended) > MAX_ENDED:
                self._ended.popitem(last=False)

    # --------------------------------------------------------- data plane
    def authorize(
        self, grant: Grant | None, region: str, ranges: list[tuple[int, int]]
    ) -> str | None:
        """Transfer-engine threads: None when every (offset, length) of `region` ("g<group>")
        lies inside blocks held for `grant` and the grant was claimed; else why not."""
        if grant is None:
            return "read names no grant"
        try:
            group = int(region[1:])
            bb = self.block_bytes[group]
        except (ValueError, IndexError):
            return f"unknown region {region!r}"
        with self._lock:
            held = self._held.get(grant)
            if held is None or not held.claimed:
                return f"no claimed grant for request {grant[0]!r}"
            allowed = set(held.block_ids[group]) if group < len(held.block_ids) else set()
        for off, n in ranges:
            if n <= 0:
                continue
            first, last = off // bb, (off + n - 1) // bb
            if last - first + 1 > len(allowed) or any(
                b not in allowed for b in range(first, last + 1)
            ):
                return f"range {off}+{n} of {region!r} is outside the blocks held for {grant[0]!r}"
        return None

    # ------------------------------------------------------- control plane
    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    msg: Handshake | Notify | Claim = recv_msg(
                        conn, ControlRequest, time.monotonic() + self.idle_timeout)  # type: ignore[arg-type]
                except (WireError, OSError):
                    return
                try:
                    send_msg(conn, self._handle(msg))
                except OSError:
                    return

    def _handle(self, msg: Handshake | Notify | Claim) -> HandshakeReply | ClaimReply | Ack:
        if isinstance(msg, Handshake):
            mismatch = layout_mismatch(msg.layout, self.wire_layout)
            if mismatch:
                return HandshakeReply(False, error=mismatch)
            return HandshakeReply(True, engine_id=self.spec.engine_id, layout=self.wire_layout,
                                  transfer=self.engine.name, peer_info=self.engine.peer_info(),
                                  block_bytes=list(self.block_bytes), incarnation=self.incarnation)
        if msg.engine_id and msg.engine_id != self.spec.engine_id:
            error = f"this is engine {self.spec.engine_id!r}, not {msg.engine_id!r}"
            return (
                ClaimReply(False, error=error)
                if isinstance(msg, Claim)
                else Ack(False, error=error)
            )
        grant = (msg.request_id, msg.nonce)
        with self._lock:
            # The HTTP response with the params can overtake the engine step that registers the
            # grant: wait for it (a claim up to a lease; a notice briefly, then it is kept as an
            # early notice).
            wait = REGISTRATION_WAIT_S
            if isinstance(msg, Claim):
                restarted = bool(msg.incarnation) and msg.incarnation != self.incarnation
                ended = restarted or grant in self._ended
                wait = 0.0 if ended else min(self.lease_s, CLAIM_REGISTRATION_WAIT_S)
            self._registered.wait_for(lambda: grant in self._held, timeout=wait)
            held = self._held.get(grant)
            if isinstance(msg, Claim):
                return self._claim(grant, held, msg)
            if held is None:
                if msg.kind in ("done", "release"):
                    early = self._early.get(grant)
                    if early is not None and len(early[0]) < MAX_EARLY_NOTICES:
                        early[0].append(msg)
                    elif early is None and len(self._early) < MAX_EARLY_NOTICES:
                        self._early[grant] = ([msg], time.monotonic() + self.lease_s)
                return Ack(False, error=f"unknown or expired request {msg.request_id!r}")
            return self._apply(grant, held, msg)

    def _apply(self, grant: Grant, held: _Held, msg: Notify) -> Ack:
        """Lock held. Apply a notice to its registered grant: "renew" extends the lease,
        "release" ends the grant, "done" ends it once every reader said so."""
        if msg.kind == "renew":
            held.deadline = max(held.deadline, time.monotonic() + self.lease_s)
            return Ack(True)
        if msg.kind == "release":
            self._finish_send(grant, "release", held.nbytes)
            return Ack(True)
        if msg.kind == "done":
            if held.reader_done(msg.reader, msg.readers, msg.nbytes):
                self._finish_send(grant, "done", held.nbytes)
            return Ack(True)
        return Ack(False, error=f"unknown notification {msg.kind!r}")

    def _claim(self, grant: Grant, held: _Held | None, msg: Claim) -> ClaimReply:
        """Lock held."""
        if held is None:
            return ClaimReply(False, error=f"unknown or expired request {msg.request_id!r}",
                              incarnation=self.incarnation)
        if msg.prompt_digest != held.digest:
            return ClaimReply(
                False,
                error="prompt digest mismatch: the held KV belongs to another prompt",
                incarnation=self.incarnation,
            )
        held.claimed = True
        held.readers = max(held.readers, msg.readers)
        held.deadline = max(held.deadline, time.monotonic() + self.lease_s)
        return ClaimReply(
            True, block_ids=[list(g) for g in held.block_ids], incarnation=self.incarnation
        )

    def shutdown(self) -> None:
        if self._server is not None:
            stop_server(self._server)
