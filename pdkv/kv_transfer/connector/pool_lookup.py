"""Where the KVPoolConnector's scheduler half asks which chunks the pool holds.

- `StoreLookup` (one worker, in this process): the engine's own store, under its namespace.
- `RankLookup` (an engine with TP/DCP worker processes): each rank stores its own shard of a
  chunk under a key carrying its rank and the world layout (`pdkv.kvpool.keys.PoolNamespace`), in
  its own store. Each rank's worker half serves `PoolLookupServer` (a ZeroMQ ROUTER on loopback);
  the scheduler half sends one `LookupRequest` to every rank at once and a chunk is present only
  if every rank holds its shard (one round; a chunk some ranks hold and others do not is counted
  in "pool:all:rank_misses"). The same design as LMCache's lookup server and vLLM-Ascend's
  pool-key lookup in its AscendStoreConnector, where the scheduler asks the workers.

Messages are typed msgpack (msgspec), never pickle.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Protocol

import msgspec
import zmq

from pdkv.kvpool.events import PoolTierEvents
from pdkv.kvpool.keys import chunk_key
from pdkv.kvpool.store import KVPoolStore

logger = logging.getLogger(__name__)


class PoolLookup(Protocol):
    """What the scheduler half needs from the pool.

    Attributes:
        all_local: a lookup answers at once (in-process tiers only): it may run inline on the
            engine thread; else it runs on a lookup thread.
        tier_events: the store's KV event reporter when it lives in this process, else None.
    """

    @property
    def all_local(self) -> bool: ...

    @property
    def tier_events(self) -> PoolTierEvents | None: ...

    def contains(self, chunk_hashes: Sequence[bytes]) -> list[bool]:
        """Per chunk hash, whether the pool holds that chunk (every shard of it)."""
        ...

    def key(self, chunk_hash: bytes) -> str:
        """The pool key of a chunk as this engine's KV events name it."""
        ...

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call ("pool:all:<name>")."""
        ...

    def close(self) -> None: ...


class StoreLookup:
    """The lookups of an engine whose worker half runs in this process (one rank).

    Args:
        store: the engine's pool store (shared with the worker half).
        fingerprint: the engine's pool namespace fingerprint.
    """

    def __init__(self, store: KVPoolStore, fingerprint: str) -> None:
        self.store = store
        self.fingerprint = fingerprint

    @property
    def all_local(self) -> bool:
        return self.store.all_local

    @property
    def tier_events(self) -> PoolTierEvents | None:
        return self.store.tier_events

    def key(self, chunk_hash: bytes) -> str:
        return chunk_key(self.fingerprint, chunk_hash)

    def contains(self, chunk_hashes: Sequence[bytes]) -> list[bool]:
        return self.store.contains([self.key(h) for h in chunk_hashes])

    def take_stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """The worker half closes the store."""


class LookupRequest(msgspec.Struct, frozen=True):
    """Which of these chunks does this rank hold (its shard, under its own namespace)?"""

    id: int
    chunk_hashes: list[bytes]


class LookupReply(msgspec.Struct, frozen=True):
    """Per asked chunk, whether the rank holds its shard; `error` names a failed lookup."""

    id: int
    present: list[bool]
    error: str = ""


class PoolLookupServer:
    """One rank's answer to the scheduler half's lookups: a ROUTER socket on `host` (port chosen
    by the OS) served by a daemon thread, which checks `store` under `fingerprint`.

    Args:
        store: this rank's pool store.
        fingerprint: this rank's pool namespace fingerprint (its tp/dcp rank and size in it).
        host: the interface to bind (loopback: the ranks are this engine's own processes).

    Attributes:
        address: [host, port] the server is bound to.
    """

    POLL_MS = 200  # how often the serving thread checks for close()

    def __init__(self, store: KVPoolStore, fingerprint: str, host: str = "127.0.0.1") -> None:
        self.store = store
        self.fingerprint = fingerprint
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address: list[str | int] = [host, port]
        self._stop = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(LookupRequest)
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._serve, name="pdkv-pool-lookup-server",
                                        daemon=True)
        self._thread.start()

    def _answer(self, payload: bytes) -> LookupReply:
        try:
            req = self._decoder.decode(payload)
        except msgspec.DecodeError as e:
            return LookupReply(-1, [], f"bad lookup request: {e}")
        try:
            keys = [chunk_key(self.fingerprint, h) for h in req.chunk_hashes]
            return LookupReply(req.id, self.store.contains(keys))
        except Exception as e:  # the store counts tier failures; the scheduler sees a miss
            return LookupReply(req.id, [], f"{type(e).__name__}: {e}")

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(self.POLL_MS):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 2:
                continue
            self._sock.send_multipart([frames[0], self._encoder.encode(self._answer(frames[1]))])

    def close(self) -> None:
        """Stop serving (within POLL_MS) and release the socket."""
        self._stop.set()
        self._thread.join(2 * self.POLL_MS / 1000 + 1.0)
        self._sock.close(0)
        self._ctx.term()


class RankLookup:
    """The scheduler half's lookups in an engine with worker processes: every rank at once.

    Args:
        endpoints: every rank's `PoolLookupServer` address [host, port], in rank order.
        timeout_s: how long one lookup waits for every rank (s); a rank that has not answered by
            then makes every asked chunk a miss (counted in "pool:all:rank_lookup_timeouts").

    Thread-safety: `contains` may be called from several threads (one lookup at a time).
    """

    def __init__(self, endpoints: Sequence[Sequence[str | int]], timeout_s: float) -> None:
        if not endpoints:
            raise ValueError("RankLookup needs every rank's lookup address")
        self.endpoints = [(str(h), int(p)) for h, p in endpoints]
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._socks = []
        for host, port in self.endpoints:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{host}:{port}")
            self._socks.append(sock)
        self._poller = zmq.Poller()
        for sock in self._socks:
            self._poller.register(sock, zmq.POLLIN)
        self._rank_of = {sock: rank for rank, sock in enumerate(self._socks)}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # one lookup at a time on the sockets
        self._stats_lock = threading.Lock()
        # Reported at 0 from the first report on, so the series exist before any event.
        self._stats: dict[str, float] = {"pool:all:rank_misses": 0.0,
                                         "pool:all:rank_lookup_timeouts": 0.0}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(LookupReply)
        self._closed = False

    @property
    def all_local(self) -> bool:
        return False

    @property
    def tier_events(self) -> PoolTierEvents | None:
        return None

    def key(self, chunk_hash: bytes) -> str:
        """The hash's hex (each rank keys its shard under its own namespace; no KV events)."""
        return chunk_hash.hex()

    def _count(self, name: str, value: float) -> None:
        with self._stats_lock:
            key = f"pool:all:{name}"
            self._stats[key] = self._stats.get(key, 0.0) + value

    def contains(self, chunk_hashes: Sequence[bytes]) -> list[bool]:
        """Per chunk, whether every rank holds its shard (one request to each rank, answered in
        parallel). A rank that fails or does not answer within timeout_s: all misses."""
        n = len(chunk_hashes)
        if not n:
            return []
        with self._lock:
            if self._closed:
                return [False] * n
            rid = next(self._ids)
            payload = self._encoder.encode(LookupRequest(rid, list(chunk_hashes)))
            for sock in self._socks:
                sock.send(payload)
            deadline = time.monotonic() + self.timeout_s
            answers: dict[int, list[bool]] = {}
            while len(answers) < len(self._socks):
                left = deadline - time.monotonic()
                if left <= 0:
                    self._count("rank_lookup_timeouts", 1)
                    logger.warning("KV pool lookup: ranks %s did not answer within %g s (a miss)",
                                   sorted(set(range(len(self._socks))) - set(answers)),
                                   self.timeout_s)
                    return [False] * n
                for sock, _ in self._poller.poll(max(1, int(left * 1000))):
                    reply = self._decoder.decode(sock.recv())
                    if reply.id != rid:  # a late answer to an earlier, timed-out lookup
                        continue
                    rank = self._rank_of[sock]
                    if reply.error or len(reply.present) != n:
                        logger.warning("KV pool lookup on rank %d failed: %s", rank,
                                       reply.error or "wrong answer length")
                        answers[rank] = [False] * n
                    else:
                        answers[rank] = reply.present
            present = [all(a[j] for a in answers.values()) for j in range(n)]
            partial = sum(1 for j in range(n)
                          if not present[j] and any(a[j] for a in answers.values()))
            if partial:
                self._count("rank_misses", partial)
            return present

    def take_stats(self) -> dict[str, float]:
        with self._stats_lock:
            stats, self._stats = self._stats, {}
        return stats

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sock in self._socks:
                sock.close(0)
            self._ctx.term()
