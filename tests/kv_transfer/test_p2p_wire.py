"""Wire helpers, the tcp transfer engine's grant checks and server bounds, per-peer queues and
the prompt digest (torch-free, in-process sockets)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from pdkv.kv_transfer.connector.p2p_messages import prompt_digest
from pdkv.kv_transfer.connector.p2p_peer_queue import PeerQueues
from pdkv.kv_transfer.engine.base import ReadOp, TransferError
from pdkv.kv_transfer.engine.tcp import TcpTransferEngine, _ReadReply, _ReadRequest
from pdkv.kv_transfer.wire import recv_msg, send_msg, start_server, stop_server


class Trickler:
    """A fake producer data server: answers a read "ok" and then sends 1 byte every `period` s."""

    def __init__(self, period: float = 0.2) -> None:
        self.period = period
        self.stop = threading.Event()
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            conn, _ = self.srv.accept()
        except OSError:
            return
        with conn:
            req = recv_msg(conn, _ReadRequest)
            send_msg(conn, _ReadReply(True, sum(n for _, n in req.ranges)))
            while not self.stop.wait(self.period):
                try:
                    conn.sendall(b"x")
                except OSError:
                    return

    def close(self) -> None:
        self.stop.set()
        self.srv.close()


def test_a_trickling_peer_cannot_stretch_a_read_past_its_deadline():
    peer = Trickler(0.2)
    eng = TcpTransferEngine()
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="deadline"):
            eng.read({"host": "127.0.0.1", "port": peer.port},
                     [ReadOp("g0", 0, 4096, memoryview(bytearray(4096)))], t0 + 1.0)
        # Each 0.2 s gap is far below the deadline: only a whole-read deadline ends it.
        assert time.monotonic() - t0 < 3.0
    finally:
        eng.close()
        peer.close()


def _closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_server_closes_connections_over_its_bound():
    release = threading.Event()
    served: list[int] = []

    def handler(conn: socket.socket) -> None:
        served.append(1)
        release.wait(10)

    srv = start_server("127.0.0.1", 0, handler, "test-bound", max_connections=2, idle_timeout=30)
    port = srv.getsockname()[1]
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
    try:
        deadline = time.monotonic() + 5
        while len(served) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(served) == 2
        third = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(third)
        assert _closed_by_peer(third)  # refused at once, never handed to a thread
        assert len(served) == 2
        release.set()  # the two served ones end; a new connection is served again
        for s in socks[:2]:
            assert _closed_by_peer(s)
        again = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(again)
        deadline = time.monotonic() + 5
        while len(served) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(served) == 3
    finally:
        release.set()
        for s in socks:
            s.close()
        stop_server(srv)


def test_server_drops_idle_connections():
    eng = TcpTransferEngine(idle_timeout=0.3)
    eng.register_region("g0", memoryview(bytearray(64)))
    eng.start("127.0.0.1")
    try:
        idle = socket.create_connection(("127.0.0.1", eng.peer_info()["port"]), timeout=5)
        with idle:
            assert _closed_by_peer(idle)  # says nothing: dropped after the idle timeout
    finally:
        eng.close()


def test_a_kept_connection_the_producer_dropped_is_replaced_not_a_failed_read():
    """A D idle longer than P's idle timeout finds its kept data connection closed: the read is
    sent again on a fresh connection instead of failing (it has no side effect on P)."""
    data = bytes(range(256)) * 4
    p = TcpTransferEngine(idle_timeout=0.3)
    p.register_region("g0", memoryview(bytearray(data)))
    p.start("127.0.0.1")
    d = TcpTransferEngine()
    try:
        for _ in range(2):
            dest = bytearray(64)
            n = d.read(
                p.peer_info(), [ReadOp("g0", 10, 64, memoryview(dest))], time.monotonic() + 10
            )
            assert n == 64 and bytes(dest) == data[10:74]
            (kept,) = d._conns._conns.values()
            assert _closed_by_peer(kept)  # P dropped it after its idle timeout
    finally:
        d.close()
        p.close()


class Ledger:
    """An authorizer that allows bytes [0, 100) of g0 to grant ("r", "n") only."""

    def __call__(self, grant, region, ranges):
        if grant != ("r", "n"):
            return f"no grant {grant}"
        if region != "g0" or any(o < 0 or o + n > 100 for o, n in ranges):
            return "outside the grant"
        return None


def test_tcp_server_serves_only_what_the_authorizer_allows():
    data = bytes(range(256))
    prod = TcpTransferEngine()
    prod.register_region("g0", memoryview(bytearray(data)))
    prod.set_authorizer(Ledger())
    prod.start("127.0.0.1")
    cons = TcpTransferEngine()
    peer = prod.peer_info()
    try:
        out = bytearray(50)
        assert (
            cons.read(
                peer, [ReadOp("g0", 50, 50, memoryview(out))], time.monotonic() + 5, ("r", "n")
            )
            == 50
        )
        assert bytes(out) == data[50:100]
        for grant, op in [
            (("r", "n"), ReadOp("g0", 90, 20, memoryview(bytearray(20)))),  # past the grant
            (("r", "other-nonce"), ReadOp("g0", 0, 10, memoryview(bytearray(10)))),
            (None, ReadOp("g0", 0, 10, memoryview(bytearray(10)))),
        ]:
            with pytest.raises(TransferError, match="refused"):
                cons.read(peer, [op], time.monotonic() + 5, grant)
    finally:
        cons.close()
        prod.close()


def test_advertised_address_is_not_the_bind_address():
    eng = TcpTransferEngine()
    eng.register_region("g0", memoryview(bytearray(16)))
    eng.start("0.0.0.0", "127.0.0.1")
    try:
        assert eng.peer_info()["host"] == "127.0.0.1"
        out = bytearray(16)
        assert TcpTransferEngine().read(eng.peer_info(), [ReadOp("g0", 0, 16, memoryview(out))],
                                        time.monotonic() + 5) == 16
    finally:
        eng.close()


def test_peer_queues_bound_concurrency_per_peer():
    gate = threading.Event()
    started: list[str] = []
    lock = threading.Lock()

    def job(name: str):
        def run() -> None:
            with lock:
                started.append(name)
            if name.startswith("dead"):
                gate.wait(10)
        return run

    with ThreadPoolExecutor(max_workers=8) as pool:
        queues = PeerQueues(pool, per_peer=2)
        for i in range(5):
            assert queues.submit("dead", job(f"dead{i}"))
        for i in range(3):
            assert queues.submit("alive", job(f"alive{i}"))
        deadline = time.monotonic() + 5
        while sum(n.startswith("alive") for n in started) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(n for n in started if n.startswith("alive")) == ["alive0", "alive1", "alive2"]
        assert sorted(n for n in started if n.startswith("dead")) == ["dead0", "dead1"]
        assert queues.running("dead") == 2
        gate.set()
        deadline = time.monotonic() + 5
        while len(started) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(started) == 8
    full = PeerQueues(ThreadPoolExecutor(max_workers=1), per_peer=1, max_queued=1)
    hold = threading.Event()
    assert full.submit("p", lambda: hold.wait(5))  # runs
    assert full.submit("p", lambda: None)  # waits
    assert not full.submit("p", lambda: None)  # over max_queued
    hold.set()
    full.executor.shutdown(wait=True)


def test_prompt_digest_depends_on_tokens_and_salt_only():
    d = prompt_digest([1, 2, 3], None)
    assert d == prompt_digest((1, 2, 3), "") and len(d) == 64
    assert d != prompt_digest([1, 2, 4], None)
    assert d != prompt_digest([1, 2, 3], "tenant-a") != prompt_digest([1, 2, 3], "tenant-b")
    assert d != prompt_digest([1, 2], None) and d != prompt_digest([1, 2, 3, 0], None)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(d)) == d
