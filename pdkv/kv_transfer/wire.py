"""Framed msgpack messages over TCP sockets (length-prefixed; no pickle)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

_LEN = struct.Struct("!I")
MAX_MESSAGE = 64 << 20

T = TypeVar("T")


class WireError(ConnectionError):
    """The peer closed the connection or sent a malformed frame."""


def send_msg(sock: socket.socket, obj: Any) -> None:
    """Send one msgpack-encoded object with a 4-byte length prefix."""
    payload = msgspec.msgpack.encode(obj)
    sock.sendall(_LEN.pack(len(payload)) + payload)


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket.

    Raises:
        WireError: the peer closed early.
    """
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError(f"connection closed after {got} of {n} bytes")
        got += k


def recv_msg(sock: socket.socket, typ: type[T]) -> T:
    """Receive one framed message decoded as `typ`.

    Raises:
        WireError: closed connection or a frame that does not decode as `typ`.
    """
    head = bytearray(_LEN.size)
    recv_exact_into(sock, memoryview(head))
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE:
        raise WireError(f"frame of {n} bytes exceeds the {MAX_MESSAGE} byte limit")
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    try:
        return msgspec.msgpack.decode(bytes(buf), type=typ)
    except msgspec.DecodeError as e:
        raise WireError(f"malformed message: {e}") from None


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection with `timeout` seconds for connect and every later operation."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def start_server(host: str, port: int, handler: Callable[[socket.socket], None], name: str) -> socket.socket:
    """Listen on host:port (0 = any free port) and run handler(conn) on a thread per connection
    (TCP_NODELAY set). Returns the listening socket; stop it with stop_server."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(64)

    def accept_loop() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:  # closed by stop_server
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=handler, args=(conn,), name=name + "-conn", daemon=True).start()

    threading.Thread(target=accept_loop, name=name, daemon=True).start()
    return srv


def stop_server(srv: socket.socket) -> None:
    """Stop accepting (shutdown wakes a blocked accept() on Linux) and close."""
    with contextlib.suppress(OSError):
        srv.shutdown(socket.SHUT_RDWR)
    srv.close()
