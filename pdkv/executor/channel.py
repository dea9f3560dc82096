"""Rank channels: the per-rank connection of the multiproc executor, and its TCP transport.

The executor talks to each rank over two channels: the step channel (request / response:
`ToWorker` / `FromWorker` messages) and the one-way wakeup channel (`ConnectorWakeup`). A rank
on this host uses multiprocessing pipes (`multiprocessing.connection.Connection`); a rank on
another host (a headless node, pdkv.executor.nodes) uses `TcpChannel`: the same msgpack frames,
each prefixed by its length (4 bytes, big-endian), over a TCP connection. Both satisfy
`RankChannel`, so the executor, the worker loop and the wakeup listener share their code.

A TCP peer that dies shows as EOF (`EOFError` from `recv_bytes`; the socket turns readable).
A silent peer (a cut link: no FIN, no RST) is found by TCP keepalive while idle and by
TCP_USER_TIMEOUT while data waits for an ACK, after about `dead_peer_s` seconds (DEAD_PEER_S on
the leader's side; a headless node's ranks wait longer, so that the leader, which owns the
engine and its error, notices first); the socket then reports an error, read as EOF too.
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import struct
import time
from typing import Protocol

HEADER = struct.Struct("!I")
"""A frame's length prefix: 4 bytes, big-endian, unsigned."""

MAX_FRAME_BYTES = (1 << 32) - 1
"""The largest frame (bytes): what the length prefix can say."""

DEAD_PEER_S = 5
"""About how long (seconds) a silent peer takes to show as dead, by default: TCP keepalive
probes after 2/5 of it idle, then every 1/5, KEEPALIVE_COUNT unanswered ones end the connection;
TCP_USER_TIMEOUT ends it when sent data waits that long for an ACK."""

KEEPALIVE_COUNT = 3
"""Unanswered keepalive probes after which the peer is dead."""

CONNECT_RETRY_S = 0.2
"""Seconds between two connection attempts of `connect_channel`."""


class RankChannel(Protocol):
    """One end of a per-rank connection (a multiprocessing `Connection` is one).

    `recv_bytes` raises EOFError when the peer is gone; `send_bytes` raises OSError (or
    ValueError on a closed channel); `poll(timeout)` says whether `recv_bytes` has data (or EOF)
    to read, waiting up to `timeout` seconds; `fileno` is for `multiprocessing.connection.wait`.
    """

    def send_bytes(self, buf: bytes) -> None: ...

    def recv_bytes(self) -> bytes: ...

    def poll(self, timeout: float | None = 0.0) -> bool: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...


def set_dead_peer_detection(sock: socket.socket, dead_peer_s: float = DEAD_PEER_S) -> None:
    """TCP keepalive and TCP_USER_TIMEOUT so that a silent peer ends the connection after about
    `dead_peer_s` seconds (see DEAD_PEER_S), and no Nagle delay, on `sock` (Linux options;
    others are left as they are where the OS lacks them)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, round(dead_peer_s * 0.4))
    interval = max(1, round(dead_peer_s * 0.2))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
                        ("TCP_USER_TIMEOUT", round(dead_peer_s * 1000))):
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)


class TcpChannel:
    """A `RankChannel` over a connected TCP socket: length-prefixed frames.

    Reads take exactly one frame from the socket (nothing is buffered here), so the socket's
    readiness is the channel's. Once a frame's first byte has arrived, the rest must arrive
    within `io_timeout_s`; every send must finish within it too.

    Args:
        sock: a connected TCP socket (this object owns and closes it).
        io_timeout_s: deadline of one send and of the rest of a frame, seconds.
        peer: how errors name the other end ("rank 1 at 10.0.0.12:41234").
        dead_peer_s: about how long a silent peer takes to end the connection (seconds).
    """

    def __init__(self, sock: socket.socket, io_timeout_s: float, peer: str = "",
                 dead_peer_s: float = DEAD_PEER_S) -> None:
        self._sock = sock
        self._timeout = io_timeout_s
        self.peer = peer or _describe(sock)
        set_dead_peer_detection(sock, dead_peer_s)
        sock.settimeout(io_timeout_s)

    @property
    def closed(self) -> bool:
        return self._sock.fileno() < 0

    def fileno(self) -> int:
        return self._sock.fileno()

    def local_address(self) -> str:
        """This end's IP address (the interface the connection leaves by)."""
        return str(self._sock.getsockname()[0])

    def send_bytes(self, buf: bytes) -> None:
        """Send one frame.

        Raises:
            ValueError: more than MAX_FRAME_BYTES, or the channel is closed.
            TimeoutError: not sent within io_timeout_s.
            OSError: the connection is broken (reset, dead peer).
        """
        if self.closed:
            raise ValueError("the channel is closed")
        if len(buf) > MAX_FRAME_BYTES:
            raise ValueError(f"a frame of {len(buf)} bytes is over {MAX_FRAME_BYTES}")
        self._sock.sendall(HEADER.pack(len(buf)) + bytes(buf))

    def recv_bytes(self) -> bytes:
        """The next frame, waiting for its start as long as the peer is alive.

        Raises:
            EOFError: the peer closed the connection, or it broke (reset, dead peer), naming it.
            TimeoutError: a frame began but did not end within io_timeout_s.
            ValueError: the channel is closed.
        """
        if self.closed:
            raise ValueError("the channel is closed")
        while not self.poll(self._timeout):  # each round bounded; a dead peer ends it (EOF)
            pass
        (size,) = HEADER.unpack(self._read_exact(HEADER.size))
        return self._read_exact(size)

    def _read_exact(self, n: int) -> bytes:
        out = bytearray(n)
        view = memoryview(out)
        got = 0
        deadline = time.monotonic() + self._timeout
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.peer}: {got} of {n} bytes of a frame within "
                                   f"{self._timeout:g} s")
            self._sock.settimeout(left)
            try:
                k = self._sock.recv_into(view[got:])
            except TimeoutError as e:
                if e.errno == errno.ETIMEDOUT:  # the kernel: a dead peer (keepalive, user timeout)
                    raise EOFError(f"{self.peer}: connection broken ({e})") from None
                raise TimeoutError(f"{self.peer}: {got} of {n} bytes of a frame within "
                                   f"{self._timeout:g} s") from None
            except OSError as e:
                raise EOFError(f"{self.peer}: connection broken ({e})") from None
            finally:
                self._sock.settimeout(self._timeout)
            if k == 0:
                raise EOFError(f"{self.peer}: closed the connection")
            got += k
        return bytes(out)

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a frame (or EOF, or an error) is there to read, waiting up to `timeout`
        seconds (None: as long as it takes).

        Raises:
            ValueError: the channel is closed.
        """
        if self.closed:
            raise ValueError("the channel is closed")
        ready, _, _ = select.select([self._sock], [], [], timeout)
        return bool(ready)

    def gone(self) -> str | None:
        """Why the peer is gone (EOF, reset, dead-peer timeout), or None while the connection
        stands; never blocks and consumes nothing."""
        if self.closed:
            return "the channel is closed"
        if not self.poll(0):
            return None
        try:  # readable: this recv does not wait
            data = self._sock.recv(1, socket.MSG_PEEK)
        except OSError as e:
            return f"connection broken ({e})"
        return None if data else "closed the connection"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def _describe(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "peer"
    return f"{host}:{port}"


def connect_channel(host: str, port: int, deadline: float, io_timeout_s: float,
                    peer: str = "", dead_peer_s: float = DEAD_PEER_S) -> TcpChannel:
    """A channel connected to `host`:`port`, retrying every CONNECT_RETRY_S until `deadline`
    (time.monotonic()) while nobody listens there yet.

    Raises:
        TimeoutError: not connected by the deadline (the last error named).
    """
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"could not connect to {host}:{port} in time (last error: {last})")
        try:
            sock = socket.create_connection((host, port), timeout=min(left, io_timeout_s))
        except OSError as e:
            last = e
            time.sleep(min(CONNECT_RETRY_S, max(0.0, deadline - time.monotonic())))
            continue
        return TcpChannel(sock, io_timeout_s, peer or f"{host}:{port}", dead_peer_s)


class ChannelListener:
    """A listening TCP socket that hands out `TcpChannel`s.

    Args:
        host, port: where to listen (port 0: any free one; `address` says which).

    Raises:
        OSError: the address cannot be bound (named).
    """

    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self._sock.listen(64)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]

    def accept(self, timeout: float, io_timeout_s: float) -> TcpChannel | None:
        """The next connection as a channel, or None when none arrived within `timeout` s."""
        ready, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        if not ready:
            return None
        sock, _ = self._sock.accept()
        return TcpChannel(sock, io_timeout_s)

    def close(self) -> None:
        self._sock.close()
