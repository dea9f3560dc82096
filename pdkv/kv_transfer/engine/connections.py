"""Pooled client connections to peers' TCP servers, shared by the transfer engines that speak a
framed request / reply protocol to a peer (tcp's data server, the push control server of the
one-sided engines: push_control.py). One kept connection per peer; a kept connection the peer
closed while idle is replaced once by a fresh one."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from pdkv.kv_transfer.engine.base import TransferError
from pdkv.kv_transfer.wire import connect

T = TypeVar("T")

PeerKey = tuple[str, int]
"""(host, port) of a peer's server."""


class StaleConnection(Exception):
    """A kept connection failed before any reply: the peer had closed it (idle)."""


def attempt_failed(sock: socket.socket, e: Exception, may_be_stale: bool, what: str) -> Exception:
    """Close `sock` after a socket / wire error of one attempt (its stream position is unknown:
    never reuse it) and return what to raise: `StaleConnection` when a kept connection failed
    before any reply (`may_be_stale`; the caller retries on a fresh one), else a TransferError
    naming `what` and the deadline or the error."""
    sock.close()
    if may_be_stale and not isinstance(e, TimeoutError):
        return StaleConnection()
    why = "transfer deadline passed" if isinstance(e, TimeoutError) else str(e)
    return TransferError(f"{what} failed: {why}")


def set_timeout(sock: socket.socket, deadline: float) -> None:
    """Give `sock` the time left until `deadline` (time.monotonic()).

    Raises:
        TransferError: the deadline passed.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError("transfer deadline passed")
    sock.settimeout(left)


class PeerConnections:
    """Kept connections by peer, any thread. `run` lends one to an attempt and keeps it after a
    success; a failed attempt closes its socket itself (see `attempt_failed`)."""

    def __init__(self) -> None:
        self._conns: dict[PeerKey, socket.socket] = {}
        self._lock = threading.Lock()

    def run(self, key: PeerKey, deadline: float,
            attempt: Callable[[socket.socket, bool], T]) -> T:
        """Run `attempt(sock, stale_ok)` on a kept connection to `key` (or a new one); a kept
        connection the peer closed while idle (`StaleConnection`) is replaced by a fresh one,
        once. Returns what the attempt returns.

        Raises:
            TransferError: cannot connect by `deadline`, or what the attempt raises.
        """
        sock, reused = self._connection(key, deadline)
        try:
            out = attempt(sock, reused)
        except StaleConnection:
            sock, _ = self._connection(key, deadline, fresh=True)
            out = attempt(sock, False)
        self._release(key, sock)
        return out

    def _connection(self, key: PeerKey, deadline: float,
                    fresh: bool = False) -> tuple[socket.socket, bool]:
        """(a connection to `key`, whether it was kept from an earlier attempt)."""
        if not fresh:
            with self._lock:
                sock = self._conns.pop(key, None)
            if sock is not None:
                return sock, True
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError("transfer deadline passed")
        try:
            return connect(key[0], key[1], left), False
        except OSError as e:
            raise TransferError(f"cannot connect to {key[0]}:{key[1]}: {e}") from None

    def _release(self, key: PeerKey, sock: socket.socket) -> None:
        with self._lock:
            if key not in self._conns:
                self._conns[key] = sock
                return
        sock.close()

    def forget(self, key: PeerKey) -> None:
        """Close the kept connection to `key`, if any."""
        with self._lock:
            sock = self._conns.pop(key, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Close every kept connection."""
        with self._lock:
            socks = list(self._conns.values())
            self._conns.clear()
        for sock in socks:
            sock.close()
