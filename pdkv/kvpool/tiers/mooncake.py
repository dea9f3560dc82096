"""Mooncake Store tier: chunks as objects in a Mooncake Store, through `MooncakeDistributedStore`
as a pure client (global_segment_size=0: the memory lives in the store process started by
`pdkv.launch.services.start_mooncake`), metadata "P2PHANDSHAKE", transfer protocol tcp or rdma.

Store semantics handled here (measured: /work/shared/reference/MOONCAKE.md, error codes from
mooncake-store/include/types.h):
- `get` of a missing key returns b"" (not an error); `get_size`/`get_into` answer -704
  (OBJECT_NOT_FOUND); both are misses. After a store process crash the master still reports
  the key for a while but `get` returns b"": also a miss (the contract allows it).
- `put` of an existing key keeps the old value (or answers -705): fine, keys are content
  addresses, so both count as stored.
- `put(bytes)`/`get` stage through the client's local buffer (`local_buffer_bytes`); larger
  objects fail there (-600 / b""), so they go zero-copy through a registered buffer
  (`register_buffer` + `put_from` / `get_into`).
- `remove` of a key still under its read lease answers -706 unless forced: removal is forced.
- With the master gone, calls take ~4 s and answer -900; `setup` against a dead master, or one
  that accepts connections but never answers (hung, stopped, or not a master), does not return
  for 20 retries of 30 s and holds the GIL all along, so no thread can bound it. So the master
  is probed before setup and, after any failure, before the next call: a TCP connect, then 16
  zero bytes (not a coro_rpc header) and a read, both within `timeout_s`; a live master closes
  the connection at once (measured on mooncake 0.3.x), a hung one answers nothing and the probe
  fails as "timeout". A master unusable at construction is not an error: the client is set up
  by the first call that finds the master answering (until then calls fail fast as misses).
  Every call runs on a daemon worker thread and the caller waits at most `timeout_s` (calls
  release the GIL, so the deadline fires).

Bytes in use: the pure client has no call that reports the store's usage (the master exports it
only as Prometheus metrics on its own port, which this tier is not told). So the tier reports the
bytes of the entries this instance put that the store still holds: it remembers each key it put
with its size (dropped on `remove` and on a `get` miss) and, in the background at most every
`BYTES_IN_USE_MAX_AGE_S` seconds, asks the store which of them still exist (one `batch_is_exist`
round trip) and forgets the rest (evicted by the store or removed by another client).
`bytes_in_use` never waits for that. Instances sharing the store each report their own writes,
so the pool's total is about their sum (a chunk two instances both put counts twice).

KV events (`Tier.set_event_listener`, issue 34): only what this instance does or sees is
reported. A put of this instance reports its key stored; its `remove`, a `get` miss on a key it
put, and the background check above finding such a key gone report it removed. A drop by the
store itself (its eviction) or by another client's remove is not seen when it happens: it is
reported at the next miss or background check (at most `BYTES_IN_USE_MAX_AGE_S` seconds later
while the store's stats are read every step), and never for keys this instance did not put.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from pdkv.kvpool.tiers.base import BackgroundValue, OwnEntries, Tier, TierError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

INSTALL_HINT = (
    "the mooncake tier needs the Mooncake Store client: "
    "`pip install mooncake-transfer-engine-non-cuda` and `apt-get install -y libibverbs1`"
)

# mooncake-store/include/types.h ErrorCode values the tier treats specially.
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
_CODE_NAMES = {
    -1: "INTERNAL_ERROR",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    INVALID_PARAMS: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    LEASE_EXPIRED: "LEASE_EXPIRED",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}
_NUM_WORKERS = 4
_PROBE_BYTES = 16
"""Zero bytes the master probe sends: not a valid coro_rpc request header, so a live master
drops the connection at once."""
BYTES_IN_USE_MAX_AGE_S = 5.0
"""Seconds between background checks of which of this instance's entries the store holds."""


def import_store_class() -> Any:
    """`mooncake.store.MooncakeDistributedStore`. Raises ImportError naming what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return MooncakeDistributedStore


def _kind(code: int) -> str:
    if code == NO_AVAILABLE_HANDLE:
        return "full"
    if code == RPC_TIMEOUT:
        return "timeout"
    if code in (RPC_FAIL, TRANSFER_FAIL):
        return "unavailable"
    return "other"


def _error(what: str, key: str, code: int) -> TierError:
    name = _CODE_NAMES.get(code, "unknown")
    return TierError(f"mooncake {what} {key!r} failed with code {code} ({name})", _kind(code))


class _Workers:
    """Daemon threads running blocking client calls, so a caller can give up at a deadline
    (a call stuck on a dead peer keeps its thread, never the process's exit)."""

    def __init__(self, n: int) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._threads = [
            threading.Thread(target=self._loop, name=f"pdkv-mooncake-{i}", daemon=True)
            for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the waiting caller
                fut.set_exception(e)

    def submit(self, fn: Callable[[], _T]) -> Future[_T]:
        fut: Future[_T] = Future()
        self._q.put((fn, fut))
        return fut

    def stop(self, timeout_s: float) -> bool:
        """Let queued calls finish, stop the threads; whether all ended within timeout_s."""
        for _ in self._threads:
            self._q.put(None)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


class _Registered:
    """A bytearray registered with the client for zero-copy put_from/get_into."""

    def __init__(self, store: Any, nbytes: int) -> None:
        self.buf = bytearray(max(1, nbytes))
        self.addr = ctypes.addressof((ctypes.c_char * len(self.buf)).from_buffer(self.buf))
        self._store = store
        rc = store.register_buffer(self.addr, len(self.buf))
        if rc != 0:
            raise _error("register_buffer of", f"{len(self.buf)} bytes", rc)

    def release(self) -> None:
        self._store.unregister_buffer(self.addr)


class MooncakeTier(Tier):
    """A pool tier in a Mooncake Store whose master is at `master` ("host:port").

    Args:
        master: the mooncake_master RPC address, e.g. "127.0.0.1:50051".
        local_hostname: the address this client's transfer engine is reached on.
        protocol: "tcp" (no RDMA hardware needed) or "rdma".
        local_buffer_bytes: the client's staging buffer in bytes; values up to a quarter of it go
            through plain put/get, larger ones zero-copy through a registered buffer.
        timeout_s: seconds a caller waits for any one operation (and for the master's port).

    Raises:
        ImportError: the mooncake package (or libibverbs) is missing; the message says what to
            install.
        ValueError: bad master address or sizes.

    No error for an unusable master: construction tries to set the client up (bounded, see the
    module docstring) and, when the master is unreachable, hung or refuses, logs a warning and
    returns; every call then tries again first and raises `TierError` ("unavailable" or
    "timeout") within about timeout_s until the master answers, so an engine starts and serves
    without the tier and uses it once its server is up (as the redis tier does).

    Thread-safe: calls from any thread run on a small pool of worker threads.
    """

    name = "mooncake"
    local_index = False

    def __init__(
        self,
        master: str,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        local_buffer_bytes: int = 64 << 20,
        timeout_s: float = 5.0,
    ) -> None:
        host, sep, port = master.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"mooncake master must be 'host:port', got {master!r}")
        if local_buffer_bytes <= 0 or not timeout_s > 0:
            raise ValueError(
                f"local_buffer_bytes and timeout_s must be > 0, got {local_buffer_bytes}, "
                f"{timeout_s}"
            )
        self._store_cls = import_store_class()
        self._setup_args = (local_hostname, "P2PHANDSHAKE", 0, local_buffer_bytes, protocol, "",
                            master)
        self._master = master
        self._master_addr = (host, int(port))
        self._timeout_s = float(timeout_s)
        self._inline_max = local_buffer_bytes // 4
        self._suspect = False  # set after a failure: probe the master before the next call
        self._closed = False
        self._close_lock = threading.Lock()
        self._store: Any = None  # the set-up client, once the master answered
        self._setup_lock = threading.Lock()
        self._workers = _Workers(_NUM_WORKERS)
        self._own = OwnEntries(self)
        self._in_use = BackgroundValue(
            self.fetch_bytes_in_use, BYTES_IN_USE_MAX_AGE_S, "pdkv-mooncake-in-use"
        )
        try:
            self._connect()
        except TierError as e:
            logger.warning("mooncake tier: %s; the pool runs without it and sets it up on a later "
                           "call once the master answers", e)

    def _connect(self) -> None:
        """Set up the client unless it is: probe the master (bounded), then `setup` on the
        calling thread (it holds the GIL until it returns, so the probe must pass first).

        Raises:
            TierError: the master is unreachable ("unavailable"), does not answer the probe
                ("timeout"), setup fails (code named, "unavailable"), or another thread's setup
                did not end within timeout_s ("timeout").
        """
        if self._store is not None:
            return
        if not self._setup_lock.acquire(timeout=self._timeout_s):
            raise TierError(f"mooncake setup against {self._master} still running", "timeout")
        try:
            if self._store is not None:
                return
            self._probe_master()
            store = self._store_cls()
            rc = store.setup(*self._setup_args)
            if rc != 0:
                self._suspect = True
                raise TierError(
                    f"mooncake setup against master {self._master} failed with code {rc}",
                    "unavailable",
                )
            self._store = store
            self._suspect = False
        finally:
            self._setup_lock.release()

    # -- plumbing ---------------------------------------------------------------------------

    def _probe_master(self) -> None:
        """Check within timeout_s that the master accepts a connection and answers (see the
        module docstring).

        Raises:
            TierError: "unavailable" when the connect fails, "timeout" when the master does not
                react to the probe within timeout_s; the tier is marked suspect either way.
        """
        deadline = time.monotonic() + self._timeout_s
        try:
            conn = socket.create_connection(self._master_addr, timeout=self._timeout_s)
        except OSError as e:
            self._suspect = True
            raise TierError(
                f"mooncake master {self._master} unreachable: {e}", "unavailable"
            ) from e
        with conn:
            try:
                conn.settimeout(max(0.001, deadline - time.monotonic()))
                conn.sendall(bytes(_PROBE_BYTES))
                conn.recv(64)  # b"" (closed) or an error reply: either way it answered
            except TimeoutError as e:
                self._suspect = True
                raise TierError(
                    f"mooncake master {self._master} accepts connections but did not answer "
                    f"within {self._timeout_s} s (hung, stopped, or not a mooncake_master)",
                    "timeout",
                ) from e
            except OSError:
                pass  # reset or refused mid-way: it answered by dropping the connection

    def _run(self, what: str, fn: Callable[[], _T]) -> _T:
        """fn() on a worker thread, waited for at most timeout_s; failures mark the tier
        suspect, so the next call first checks that the master still accepts connections."""
        if self._closed:
            raise TierError(f"mooncake tier for {self._master} is closed", "unavailable")
        if self._store is None:
            self._connect()
        elif self._suspect:
            self._probe_master()
        fut = self._workers.submit(fn)
        try:
            result = fut.result(timeout=self._timeout_s)
        except FutureTimeout as e:
            fut.cancel()
            self._suspect = True
            raise TierError(
                f"mooncake {what} did not answer within {self._timeout_s} s", "timeout"
            ) from e
        except TierError as e:
            if e.kind in ("unavailable", "timeout"):
                self._suspect = True
            raise
        self._suspect = False
        return result

    # -- Tier -------------------------------------------------------------------------------

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """One batch_is_exist round trip. Raises TierError (code named) on a negative answer."""
        if not keys:
            return []
        key_list = list(keys)

        def run() -> list[bool]:
            codes = self._store.batch_is_exist(key_list)
            for k, c in zip(key_list, codes):
                if c < 0:
                    raise _error("batch_is_exist", k, c)
            return [c == 1 for c in codes]

        return self._run("batch_is_exist", run)

    def get(self, key: str) -> bytes | None:
        """get_size, then get (small) or get_into a registered buffer (large); None on a miss
        (-704, -707, or an empty answer). Raises TierError on other negative codes."""

        def run() -> bytes | None:
            size = self._store.get_size(key)
            if size in (OBJECT_NOT_FOUND, LEASE_EXPIRED):
                return None
            if size < 0:
                raise _error("get_size", key, size)
            if size <= self._inline_max:
                data = self._store.get(key)
                if len(data) == size:
                    return bytes(data)
                # b"": gone since get_size, or the local buffer was busy: try zero-copy once.
            reg = _Registered(self._store, size)
            try:
                n = self._store.get_into(key, reg.addr, size)
            finally:
                reg.release()
            if n in (OBJECT_NOT_FOUND, LEASE_EXPIRED) or n == 0:
                return None
            if n < 0:
                raise _error("get_into", key, n)
            return bytes(memoryview(reg.buf)[:n])

        value = self._run("get", run)
        if value is None:
            self._own.drop(key)
        return value

    def put(self, key: str, value: bytes) -> None:
        """put (small) or put_from a registered buffer (large or when the local buffer is busy).
        An existing key keeps its old value and counts as stored. Raises TierError ("full" on
        -200: no space and nothing evictable)."""

        def run() -> None:
            rc = INVALID_PARAMS
            if len(value) <= self._inline_max:
                rc = self._store.put(key, value)
            if rc == INVALID_PARAMS:  # too large for the local buffer (or it is busy)
                reg = _Registered(self._store, len(value))
                try:
                    reg.buf[: len(value)] = value
                    rc = self._store.put_from(key, reg.addr, len(value))
                finally:
                    reg.release()
            if rc not in (0, OBJECT_ALREADY_EXISTS):
                raise _error("put", key, rc)

        self._run("put", run)
        self._own.add(key, len(value))

    def remove(self, key: str) -> None:
        """Forced remove (a read lease does not block it); absent is fine. Raises TierError."""

        def run() -> None:
            rc = self._store.remove(key, True)
            if rc not in (0, OBJECT_NOT_FOUND):
                raise _error("remove", key, rc)

        self._run("remove", run)
        self._own.drop(key)

    def bytes_in_use(self) -> int:
        """Bytes of this instance's entries the store held at the last background check (see
        the module docstring; 0 until the first check answers). Never blocks."""
        return self._in_use.get()

    def fetch_bytes_in_use(self) -> int:
        """Check now which entries this instance put the store still holds (one batch_is_exist
        round trip), forget the others, and return the bytes of those it holds.

        Raises:
            TierError: the store cannot answer (nothing is forgotten then).
        """
        keys = self._own.keys()
        return self._own.prune(keys, self.contains_many(keys))

    def close(self) -> None:
        """Close the client (its segment is empty, so no object is lost). Waits at most
        timeout_s for in-flight calls; a client stuck on a dead master is left to its thread."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._workers.stop(self._timeout_s) and self._store is not None:
            closer = threading.Thread(
                target=self._store.close, name="pdkv-mooncake-close", daemon=True
            )
            closer.start()
            closer.join(self._timeout_s)
