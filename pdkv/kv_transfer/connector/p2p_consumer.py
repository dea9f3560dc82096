"""Consumer side of the P2P worker half: pulls of remote blocks into local ones and the notices
(renew, release, done) sent to producers' control servers.

Pulls and notices run on separate thread pools, each with bounded concurrency per producer, so
an unreachable producer stalls only its own work. A pull's deadline is stamped when it is
submitted; until its read begins (the producer accepts its claim) its lease keeps being renewed.
A pull first claims its grant: the producer checks the nonce and the prompt digest, and returns
the grant's block ids, which must match the ones in kv_transfer_params. A failure, or a producer
whose incarnation changed (restart), drops the cached handshake and connections to it. A
producer the transfer engine cannot read at all (`TransferEngine.peer_refusal`: shm across hosts)
fails the pull at the handshake, before the claim; the grant is released.

DCP (P/D into DCP): this side belongs to DCP rank r of N. With the interleave equal to the block
size, producer block k of a request holds tokens [k·bs, (k+1)·bs), all stored on rank k % N in
logical block k // N, so rank r reads only the pairs whose producer block index (counted from the
grant's first block) is ≡ r mod N.

Re-sharding (P tp 1 → D tp > 1, dcp 1): a rank whose KV heads are a subset of P's reads only its
heads, per (block, layer, K/V, token) (pdkv/kv_transfer/reshard.py); a rank holding all of P's
heads (replicated over D's TP ranks) reads whole blocks, as every rank does when heads are equal.

Producer at tp > 1 (RecvSpec.remote_ranks; this engine dcp 1, P's block size): this rank reads
each of its heads from a P rank holding it (plan_head_reads) and contacts exactly the P ranks of
plan_producer_readers: it claims each one's grant (readers = the consumer ranks contacting that P
rank), reads, then says "done" to each, so every P rank frees its blocks after its own readers.
A linear-state slot (Gated DeltaNet) is rebuilt from the P ranks holding its conv channels and
value heads (pdkv/kv_transfer/reshard_state.py); those P ranks count among the ones it contacts.

With a producer at tp 1, every rank of the engine claims the grant (Claim.readers = world size,
reader = global rank) and says "done", even one with nothing to read, so the producer frees the
blocks after the last rank."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from pdkv.jsontypes import as_int
from pdkv.kv_transfer.connector.p2p_messages import (
    Ack,
    Claim,
    ClaimReply,
    Handshake,
    HandshakeReply,
    Notify,
    NotifySpec,
    RecvSpec,
    RemoteEngine,
)
from pdkv.kv_transfer.connector.p2p_peer_queue import PeerQueues
from pdkv.kv_transfer.connector.p2p_read_plan import ReadPlanner
from pdkv.kv_transfer.connector.p2p_results import WorkerResults
from pdkv.kv_transfer.engine.base import TransferEngine, TransferError
from pdkv.kv_transfer.reshard import (
    plan_head_reads,
    plan_producer_readers,
)
from pdkv.kv_transfer.reshard_state import state_producer_ranks
from pdkv.kv_transfer.wire import WireError, connect, recv_msg, send_msg
from pdkv.parallel.layout import ParallelLayout

if TYPE_CHECKING:
    from pdkv.cache.kv_layout import KVLayout
    from pdkv.kv_transfer.connector.spec import P2PSpec

R = TypeVar("R")  # the reply type of a control request

logger = logging.getLogger(__name__)

NOTICE_TIMEOUT_S = 5.0


class _Pull:
    """A submitted pull: its deadline (stamped at submit) and renewal state."""

    def __init__(self, spec: RecvSpec, deadline: float, next_renew: float) -> None:
        self.spec = spec
        self.deadline = deadline
        self.next_renew = next_renew
        self.started = False  # a pull thread took it
        self.cancelled = False  # failed while still queued
        self.claimed = False  # the producer accepted the claim: the read begins


class _Refused(TransferError):
    """The producer refused the claim: the grant is not this request's, so never release it."""


class ConsumerSide:
    """Args:
        spec: the connector (engine id; `spec.p2p`: transfer_timeout, kv_lease_duration,
            kv_pulls_per_peer, kv_pull_threads).
        layout: this engine's KV layout (its wire form is sent in handshakes).
        engine: the transfer engine reads go through.
        results: where finished loads are reported.
        regions: this engine's KV cache bytes per group (filled at register_kv_caches).
        block_bytes: bytes per block of each group (filled at register_kv_caches).
        dcp_rank, dcp_size: this worker's DCP rank and the DCP size (which blocks it reads).
        rank, world_size: this worker's global rank and the engine's worker count (reader and
            readers of every grant; TP rank for re-sharding); default dcp_rank / dcp_size.

    Raises:
        ValueError: dcp_rank outside [0, dcp_size) or rank outside [0, world_size).
    """

    def __init__(self, spec: P2PSpec, layout: KVLayout, engine: TransferEngine,
                 results: WorkerResults, regions: list[memoryview], block_bytes: list[int],
                 dcp_rank: int = 0, dcp_size: int = 1, rank: int | None = None,
                 world_size: int | None = None) -> None:
        if not 0 <= dcp_rank < dcp_size:
            raise ValueError(f"dcp_rank={dcp_rank} must lie in [0, dcp_size={dcp_size})")
        self.rank = dcp_rank if rank is None else rank
        self.world_size = dcp_size if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must lie in [0, world_size={self.world_size})")
        s = spec.p2p
        self.dcp_rank = dcp_rank
        self.dcp_size = dcp_size
        self.spec = spec
        self.layout = layout
        self.engine = engine
        self.results = results
        self.regions = regions
        self.block_bytes = block_bytes
        self.timeout = s.transfer_timeout
        self.renew_every = s.kv_lease_duration / 3
        per_peer = s.kv_pulls_per_peer
        threads = s.kv_pull_threads
        self._pull_pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pdkv-kv-pull")
        self._notice_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdkv-kv-notice")
        self._pulls = PeerQueues(self._pull_pool, per_peer)
        self._notices = PeerQueues(self._notice_pool, 1, max_queued=256)
        self._lock = threading.Lock()
        self._unclaimed: dict[str, _Pull] = {}  # request id -> pull whose read has not begun
        self._handshakes: dict[RemoteEngine, HandshakeReply] = {}
        self.plan = ReadPlanner(layout, regions, block_bytes, self.rank, dcp_rank, dcp_size)

    # ----------------------------------------------------------- engine loop
    def submit(self, pulls: list[RecvSpec], notices: list[NotifySpec]) -> None:
        """Engine loop: start these pulls and send these notices (never blocks; DCP rank 0 alone
        sends the scheduler's notices)."""
        now = time.monotonic()
        for spec in pulls:
            if spec.error:  # refused before contacting anyone: nothing to read, nothing to tell
                self.results.load_failed(spec.request_id, spec.error, spec.local_block_ids)
                continue
            pull = _Pull(spec, now + self.timeout, now + self.renew_every)
            with self._lock:
                self._unclaimed[spec.request_id] = pull
            self._pulls.submit(spec.remote, lambda pull=pull: self._run(pull))  # type: ignore[misc]
        if self.rank == 0:  # the scheduler's notices reach every rank: one sends them
            for note in notices:
                self._send_notice(note)

    def tick(self) -> None:
        """Engine loop (each step): renew the leases of pulls whose read has not begun; fail
        queued pulls whose deadline passed."""
        now = time.monotonic()
        renew, late = [], []
        with self._lock:
            for pull in self._unclaimed.values():
                if not pull.started and now > pull.deadline:
                    pull.cancelled = True
                    late.append(pull)
                elif now >= pull.next_renew:
                    pull.next_renew = now + self.renew_every
                    renew.append(pull.spec)
            for pull in late:
                del self._unclaimed[pull.spec.request_id]
        for spec in renew:
            for remote in spec.remote_ranks or (spec.remote,):
                self._send_notice(
                    NotifySpec(remote, spec.remote_request_id, "renew", spec.remote_nonce)
                )
        for pull in late:
            self._failed(
                pull.spec, TransferError("transfer deadline passed while waiting for the producer")
            )

    def next_deadline(self) -> float | None:
        """When `tick` must next run (a renewal or a queued pull's deadline), or None."""
        with self._lock:
            times = [min(p.next_renew, p.deadline) for p in self._unclaimed.values()]
        return min(times, default=None)

    # ---------------------------------------------------------------- notices
    def _send_notice(self, note: NotifySpec) -> None:
        if not self._notices.submit(note.remote, lambda: self._notify_quietly(note)):
            logger.info(
                "notice queue to %s full: %s for %s dropped",
                note.remote,
                note.kind,
                note.remote_request_id,
            )

    def _notify_quietly(self, note: NotifySpec) -> None:
        msg = Notify(
            note.remote_request_id,
            note.kind,
            nonce=note.remote_nonce,
            engine_id=note.remote.engine_id,
        )
        try:
            self._control(note.remote, msg, Ack, time.monotonic() + NOTICE_TIMEOUT_S)
        except TransferError as e:
            logger.info("notification %s for %s not delivered within %g s: %s", note.kind,
                        note.remote_request_id, NOTICE_TIMEOUT_S, e)

    # ------------------------------------------------------------------ pulls
    def _control(self, remote: RemoteEngine, msg: Handshake | Notify | Claim, reply_type: type[R],
                 deadline: float) -> R:
        """One control exchange with the producer, within `deadline` (time.monotonic()); a
        timeout reads "transfer deadline passed" (for a pull its own deadline, stamped at its
        submit, whichever phase it was in; a notification's caller names its own).

        Raises:
            TransferError: the producer is unreachable or the deadline passed.
        """
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError("transfer deadline passed before contacting the producer")
        try:
            with connect(remote.host, remote.port, left) as sock:
                send_msg(sock, msg)
                return recv_msg(sock, reply_type, deadline)
        except (OSError, WireError) as e:
            why = "transfer deadline passed" if isinstance(e, TimeoutError) else str(e)
            raise TransferError(f"producer {remote.host}:{remote.port} unreachable: {why}"
                                ) from None

    def _handshake(self, remote: RemoteEngine, deadline: float) -> HandshakeReply:
        with self._lock:
            reply = self._handshakes.get(remote)
        if reply is None:
            hello = Handshake(self.spec.engine_id, {**self.layout.to_wire()})
            reply = self._control(remote, hello, HandshakeReply, deadline)
            if not reply.ok:
                raise TransferError(reply.error)
            refusal = self.engine.peer_refusal(reply.peer_info)
            if refusal:  # e.g. shm across hosts: refused before any claim, never cached
                raise TransferError(f"producer {remote.host}:{remote.port}: {refusal}")
            with self._lock:
                self._handshakes[remote] = reply
        return reply

    def _forget(self, remote: RemoteEngine) -> None:
        """Drop the cached handshake of `remote` and the transfer engine's connections to it."""
        with self._lock:
            reply = self._handshakes.pop(remote, None)
        if reply is not None:
            self.engine.forget_peer(reply.peer_info)

    def _claim(self, spec: RecvSpec, pull: _Pull, remote: RemoteEngine | None = None,
               readers: int | None = None) -> HandshakeReply:
        """Handshake (cached) and claim the grant at `remote` (default spec.remote) for `readers`
        consumer ranks (default this engine's world size); returns the producer's handshake."""
        remote = spec.remote if remote is None else remote
        peer = self._handshake(remote, pull.deadline)
        claim = Claim(
            spec.remote_request_id,
            spec.remote_nonce,
            spec.prompt_digest,
            remote.engine_id,
            readers=self.world_size if readers is None else readers,
            reader=self.rank,
            incarnation=peer.incarnation,
        )
        reply: ClaimReply = self._control(remote, claim, ClaimReply, pull.deadline)
        if reply.incarnation and reply.incarnation != peer.incarnation:  # the producer restarted
            self._forget(remote)
            peer = self._handshake(remote, pull.deadline)
        if not reply.ok:
            raise _Refused(f"producer refused the read: {reply.error}")
        with self._lock:
            pull.claimed = True
            self._unclaimed.pop(spec.request_id, None)
        for g, remote_ids in enumerate(spec.remote_block_ids):
            first = (
                spec.group_first_blocks[g] if spec.group_first_blocks else spec.remote_first_block
            )
            held = (
                reply.block_ids[g][first : first + len(remote_ids)]
                if g < len(reply.block_ids)
                else []
            )
            if held != list(remote_ids):
                raise TransferError(
                    f"kv_transfer_params.remote_block_ids (group {g}) are not the blocks "
                    "the producer holds for this request"
                )
        return peer

    def _run(self, pull: _Pull) -> None:
        with self._lock:
            if pull.cancelled:
                return
            pull.started = True
        spec = pull.spec
        t0 = time.monotonic()
        try:
            nbytes, n_ops = self._pull_ranks(pull) if spec.remote_ranks else self._pull_one(pull)
            self.results.load_succeeded(spec.request_id, nbytes, time.monotonic() - t0, n_ops)
        except Exception as e:  # noqa: BLE001 - every failure ends the load by policy
            self._failed(spec, e)
        finally:
            with self._lock:
                self._unclaimed.pop(spec.request_id, None)

    def _pull_one(self, pull: _Pull) -> tuple[int, int]:
        """A producer at tp 1: claim, read, "done". Returns (bytes read, read ops).

        Raises:
            TransferError: any step failed (_Refused: the claim was refused).
        """
        spec = pull.spec
        peer = self._claim(spec, pull)
        grant = (spec.remote_request_id, spec.remote_nonce)
        finish = None
        if self.plan.dequantizes(spec):  # a quantized producer: staged, then dequantized here
            ops, finish = self.plan.dequant_ops(spec, peer)
        else:
            ops = self.plan.block_ops(spec, peer)
        nbytes = self.engine.read(peer.peer_info, ops, pull.deadline, grant) if ops else 0
        if finish is not None:
            finish()
        done = Notify(
            spec.remote_request_id,
            "done",
            nbytes,
            spec.remote_nonce,
            spec.remote.engine_id,
            reader=self.rank,
            readers=self.world_size,
        )
        ack = self._control(spec.remote, done, Ack, pull.deadline)
        if not ack.ok:  # the producer may have reused the blocks: the data is not trustworthy
            raise TransferError(f"producer did not confirm the read: {ack.error}")
        return nbytes, len(ops)

    def _pull_ranks(self, pull: _Pull) -> tuple[int, int]:
        """A producer at tp > 1 (this engine dcp 1, equal block sizes): claim the grant on each P
        rank this rank contacts (plan_producer_readers), read each of this rank's heads from the
        P rank the plan names, then say "done" to each contacted P rank. Returns (bytes read,
        read ops).

        Raises:
            TransferError: a plan the layouts do not allow, or any step failed.
        """
        spec = pull.spec
        p_tp, d_tp = len(spec.remote_ranks), self.layout.tp
        heads = as_int(spec.remote_layout.get("num_kv_heads", 0))
        me = ParallelLayout(tp_size=d_tp).tp_rank(self.rank)
        state = self.plan.state
        try:  # a linear-state slot may need P ranks the KV heads do not
            extra = state_producer_ranks(state, p_tp, d_tp) if state is not None else None
            readers = plan_producer_readers(p_tp, d_tp, heads, extra)
            reads = plan_head_reads(p_tp, d_tp, heads)[me]
        except ValueError as e:
            raise TransferError(f"re-sharding plan: {e}") from None
        p_heads = ParallelLayout(tp_size=p_tp).kv_heads_per_rank(heads)
        d_heads = ParallelLayout(tp_size=d_tp).kv_heads_per_rank(heads)
        peers = {
            p: self._claim(spec, pull, spec.remote_ranks[p], len(ds))
            for p, ds in readers.items()
            if me in ds
        }
        grant = (spec.remote_request_id, spec.remote_nonce)
        read: dict[int, int] = {}
        n_ops = 0
        for p, peer in peers.items():
            ops = self.plan.copy_ops(
                spec, peer, p_heads, d_heads, [r for r in reads if r.p_rank == p], p_tp, p
            )
            read[p] = self.engine.read(peer.peer_info, ops, pull.deadline, grant) if ops else 0
            n_ops += len(ops)
        for p in peers:
            remote = spec.remote_ranks[p]
            done = Notify(
                spec.remote_request_id,
                "done",
                read[p],
                spec.remote_nonce,
                remote.engine_id,
                reader=self.rank,
                readers=len(readers[p]),
            )
            ack = self._control(remote, done, Ack, pull.deadline)
            if not ack.ok:  # that rank may have reused the blocks: the data is not trustworthy
                raise TransferError(f"producer rank {p} did not confirm the read: {ack.error}")
        return sum(read.values()), n_ops

    def _failed(self, spec: RecvSpec, error: Exception) -> None:
        logger.warning("KV pull for %s failed: %s", spec.request_id, error)
        self.results.load_failed(spec.request_id, str(error), spec.local_block_ids)
        if isinstance(error, _Refused):
            return
        for remote in spec.remote_ranks or (spec.remote,):
            self._forget(remote)
            self._send_notice(
                NotifySpec(remote, spec.remote_request_id, "release", spec.remote_nonce)
            )

    def shutdown(self) -> None:
        self._pull_pool.shutdown(wait=False, cancel_futures=True)
        self._notice_pool.shutdown(wait=False, cancel_futures=True)
