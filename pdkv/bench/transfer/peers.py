"""The producer side of `pdkv bench transfer`: producer processes (tcp / shm engine or a raw
loopback socket serving the pattern) and the consumer of the raw socket peer."""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from pdkv.bench.transfer.payload import REGION, fill_pattern
from pdkv.jsontypes import JSONObject, as_object
from pdkv.kv_transfer.engine.base import TransferEngine

_REQ = struct.Struct("!Q")
_START_TIMEOUT_S = 60.0
READ_TIMEOUT_S = 120.0


def _producer_main(kind: str, nbytes: int, send: Callable[[JSONObject], None],
                   wait_stop: Callable[[], None]) -> None:
    """Producer body: build the region of `nbytes` bytes, fill the pattern, serve it, `send`
    {"ok": True, "peer": peer_info} (or {"ok": False, "error": ...}), serve until `wait_stop`
    returns, then close the engine (unlinking shared memory) and send {"closed": True}."""
    engine: TransferEngine | None = None
    raw_srv: socket.socket | None = None
    try:
        if kind == "tcp":
            from pdkv.kv_transfer.engine.tcp import TcpTransferEngine

            buf = bytearray(nbytes)
            fill_pattern(memoryview(buf))
            engine = TcpTransferEngine()
            engine.register_region(REGION, memoryview(buf))
            engine.start("127.0.0.1")
            peer = engine.peer_info()
        elif kind == "shm":
            from pdkv.kv_transfer.engine.shm import ShmTransferEngine

            engine = ShmTransferEngine()
            view = engine.allocate(REGION, nbytes)
            fill_pattern(view)
            engine.register_region(REGION, view)
            del view
            peer = engine.peer_info()
        elif kind == "raw":
            buf = bytearray(nbytes)
            fill_pattern(memoryview(buf))
            raw_srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            raw_srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            raw_srv.bind(("127.0.0.1", 0))
            raw_srv.listen(8)
            threading.Thread(
                target=_raw_serve, args=(raw_srv, memoryview(buf)), daemon=True
            ).start()
            peer = {"host": "127.0.0.1", "port": raw_srv.getsockname()[1]}
        else:
            raise ValueError(f"unknown producer kind {kind!r}")
    except Exception as e:  # report to the parent instead of dying silently
        _close_quietly(engine, raw_srv)
        send({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return
    try:
        send({"ok": True, "peer": peer})
        wait_stop()
    finally:
        _close_quietly(engine, raw_srv)
    send({"closed": True})


def producer_stdio() -> None:
    """Entry point of a producer subprocess: `python -c ... KIND NBYTES`; JSON lines on stdout,
    "stop" (or EOF) on stdin ends it."""
    kind, nbytes = sys.argv[1], int(sys.argv[2])

    def send(msg: JSONObject) -> None:
        with contextlib.suppress(OSError):
            sys.stdout.write(json.dumps(msg) + "\n")
            sys.stdout.flush()

    def wait_stop() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                return

    _producer_main(kind, nbytes, send, wait_stop)


def _close_quietly(engine: TransferEngine | None, srv: socket.socket | None) -> None:
    if engine is not None:
        with contextlib.suppress(Exception):
            engine.close()
    if srv is not None:
        with contextlib.suppress(OSError):
            srv.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            srv.close()


def _raw_serve(srv: socket.socket, region: memoryview) -> None:
    """Raw loopback peer: for every 8-byte request N, sendall(region[:N])."""
    while True:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            head = bytearray(_REQ.size)
            try:
                while True:
                    if not _recv_exact(conn, memoryview(head)):
                        break
                    (n,) = _REQ.unpack(head)
                    conn.sendall(region[: min(n, len(region))])
            except OSError:
                pass


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from `sock` with recv_into; False if the peer closed first."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return False
        got += k
    return True


class Producer:
    """A producer subprocess of kind "tcp", "shm" or "raw" serving `nbytes` bytes of the pattern.

    A separate interpreter (not a multiprocessing child), like a separately launched prefill
    server: it has its own multiprocessing resource tracker. Use as a context manager or call
    `stop()`; `peer` is the producer's peer_info (a plain dict) after `wait_ready()`.
    """

    def __init__(self, kind: str, nbytes: int) -> None:
        self.kind = kind
        root = str(Path(os.path.abspath(__file__)).parents[3])  # the checkout holding pdkv/
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-c",
             "from pdkv.bench.transfer.peers import producer_stdio; producer_stdio()",
             kind, str(nbytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
        )
        self.peer: JSONObject = {}

    def _recv(self, timeout: float) -> JSONObject | None:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self._proc.stdout.readline()
        return json.loads(line) if line else None

    def wait_ready(self, timeout: float = _START_TIMEOUT_S) -> JSONObject:
        """Block until the producer serves (timeout in seconds); returns its peer_info.

        Raises:
            RuntimeError: the producer failed or did not start in time (it is stopped).
        """
        msg = self._recv(timeout)
        if msg is None or not msg.get("ok"):
            self.stop()
            why = msg.get("error") if msg else f"no answer within {timeout:.0f} s or it exited"
            raise RuntimeError(f"{self.kind} producer failed: {why}")
        self.peer = as_object(msg["peer"], "the producer's peer")
        return self.peer

    @property
    def pid(self) -> int:
        """The producer's process id."""
        return self._proc.pid

    def kill(self) -> None:
        """Kill the producer abruptly (SIGKILL) and reap it (for failure tests)."""
        self._proc.kill()
        self._proc.wait(5)
        self._close_pipes()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the producer to close its engine (unlinking shared memory) and exit; kill it if it
        has not exited within `timeout` seconds."""
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            with contextlib.suppress(OSError, ValueError):
                self._proc.stdin.write("stop\n")
                self._proc.stdin.flush()
            with contextlib.suppress(OSError, ValueError):
                self._recv(timeout)  # {"closed": true}
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for f in (self._proc.stdin, self._proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError, ValueError):
                    f.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RawClient:
    """Consumer side of the raw loopback peer: one persistent connection."""

    def __init__(self, peer: JSONObject) -> None:
        host, port = peer["host"], peer["port"]
        if not isinstance(host, str) or not isinstance(port, (int, str)):
            raise ValueError(f"raw producer peer_info needs a host and a port: {peer}")
        self.sock = socket.create_connection((host, int(port)), timeout=READ_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def read(self, dest: memoryview) -> None:
        self.sock.sendall(_REQ.pack(len(dest)))
        if not _recv_exact(self.sock, dest):
            raise ConnectionError("raw producer closed the connection")

    def close(self) -> None:
        self.sock.close()
