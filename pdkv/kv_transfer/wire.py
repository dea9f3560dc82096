"""Framed msgpack messages over TCP sockets (length-prefixed; no pickle)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec

_LEN = struct.Struct("!I")
MAX_MESSAGE = 64 << 20

T = TypeVar("T")


class WireError(ConnectionError):
    """The peer closed the connection or sent a malformed frame."""


def send_msg(sock: socket.socket, obj: object) -> None:
    """Send one msgpack-encoded object (any msgspec-encodable value) with a 4-byte length
    prefix.

    Raises:
        OSError: the socket failed.
        TypeError: msgspec cannot encode `obj`.
    """
    payload = msgspec.msgpack.encode(obj)
    sock.sendall(_LEN.pack(len(payload)) + payload)


def recv_exact_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from the socket, all of it by `deadline` (time.monotonic(); None = only the
    socket's own per-call timeout applies), however slowly the peer trickles bytes.

    Raises:
        WireError: the peer closed early.
        TimeoutError: the deadline passed (or the socket's timeout expired).
    """
    got, n = 0, len(view)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"deadline passed after {got} of {n} bytes")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError(f"connection closed after {got} of {n} bytes")
        got += k


def recv_msg(sock: socket.socket, typ: type[T], deadline: float | None = None) -> T:
    """Receive one framed message decoded as `typ`, whole by `deadline` (see recv_exact_into).

    Raises:
        WireError: closed connection or a frame that does not decode as `typ`.
        TimeoutError: the deadline passed.
    """
    head = bytearray(_LEN.size)
    recv_exact_into(sock, memoryview(head), deadline)
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE:
        raise WireError(f"frame of {n} bytes exceeds the {MAX_MESSAGE} byte limit")
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf), deadline)
    try:
        return msgspec.msgpack.decode(bytes(buf), type=typ)
    except msgspec.DecodeError as e:
        raise WireError(f"malformed message: {e}") from None


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection with `timeout` seconds for connect and every later operation."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def start_server(host: str, port: int, handler: Callable[[socket.socket], None], name: str,
                 max_connections: int = 64, idle_timeout: float = 60.0) -> socket.socket:
    """Listen on host:port (0 = any free port) and run handler(conn) on a thread per connection
    (TCP_NODELAY set, socket timeout `idle_timeout` seconds so idle or stalled peers are dropped).
    At most `max_connections` connections are served at once; one more is closed at accept.
    The handler owns `conn` and closes it. Returns the listening socket; stop it with
    stop_server."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(64)
    slots = threading.BoundedSemaphore(max_connections)

    def serve(conn: socket.socket) -> None:
        try:
            handler(conn)
        finally:
            # The slot first: a peer that sees the close and connects again at once is served.
            slots.release()
            conn.close()

    def accept_loop() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:  # closed by stop_server
                return
            if not slots.acquire(blocking=False):  # over the bound: refuse by closing
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(idle_timeout)
            threading.Thread(target=serve, args=(conn,), name=name + "-conn", daemon=True).start()

    threading.Thread(target=accept_loop, name=name, daemon=True).start()
    return srv


def stop_server(srv: socket.socket) -> None:
    """Stop accepting (shutdown wakes a blocked accept() on Linux) and close."""
    with contextlib.suppress(OSError):
        srv.shutdown(socket.SHUT_RDWR)
    srv.close()
