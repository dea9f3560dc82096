"""The push control plane of the one-sided transfer engines (engine/push_control.py): a write is
reserved with D's write handler before any byte is copied and committed after; a refusal copies
nothing; a P that dies (or stalls) between reserve and commit ends the write as not landed.
Then the shm and mooncake engines' `write` over it: the bytes land where the ranges say, and a
refused write leaves D's memory untouched."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import msgspec
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pdkv.kv_transfer.engine.base import TransferError, WriteOp  # noqa: E402
from pdkv.kv_transfer.engine.push_control import (  # noqa: E402
    Commit,
    ControlReply,
    ControlRequest,
    PushControlClient,
    PushControlServer,
    Reserve,
)
from pdkv.kv_transfer.wire import connect, recv_msg, send_msg  # noqa: E402

GRANT = ("req-1", "nonce-1")


class Handler:
    """D's write handler: accepts bytes [0, 64) of g0 under GRANT; records every call."""

    def __init__(self) -> None:
        self.asked: list[tuple[Any, str, list[tuple[int, int]]]] = []
        self.written: list[tuple[Any, str, list[tuple[int, int]], bool]] = []
        self.ended = threading.Event()

    def authorize(self, grant, region, ranges):
        self.asked.append((grant, region, ranges))
        if grant != GRANT:
            return f"no window for {grant}"
        if region != "g0" or any(o + n > 64 for o, n in ranges):
            return "outside the window"
        return None

    def on_written(self, grant, region, ranges, landed):
        self.written.append((grant, region, ranges, landed))
        self.ended.set()


@pytest.fixture
def server():
    handler = Handler()
    srv = PushControlServer({"g0": 128}, handler.authorize, handler.on_written,
                            target=lambda: {"where": "d"}, idle_timeout=0.5)
    srv.start("127.0.0.1")
    yield srv, handler
    srv.stop()


def test_messages_round_trip_as_one_tagged_union():
    for msg in (Reserve("g0", [(0, 32), (32, 32)], *GRANT), Commit(True), Commit(False)):
        raw = msgspec.msgpack.encode(msg)
        assert msgspec.msgpack.decode(raw, type=ControlRequest) == msg
    reply = ControlReply(True, target={"segments": {"g0": "psm_1"}}, commit_timeout_s=2.0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=ControlReply) == reply
    with pytest.raises(msgspec.ValidationError):  # an untagged or unknown message
        msgspec.msgpack.decode(msgspec.msgpack.encode({"type": "steal"}), type=ControlRequest)


def test_accepted_write_is_copied_between_reserve_and_commit(server):
    srv, handler = server
    client = PushControlClient()
    seen = []

    def copy(target, region, ops):
        assert handler.asked and not handler.written  # reserved, not yet committed
        seen.append((target, region, [(o.offset, o.length) for o in ops]))

    src = memoryview(bytearray(64))
    ops = [WriteOp("g0", 0, 32, src[:32]), WriteOp("g0", 32, 32, src[32:])]
    try:
        n = client.write({"host": "127.0.0.1", "port": srv.port}, ops,
                         time.monotonic() + 10, GRANT, copy)
        assert n == 64
        assert seen == [({"where": "d"}, "g0", [(0, 32), (32, 32)])]
        assert handler.written == [(GRANT, "g0", [(0, 32), (32, 32)], True)]
    finally:
        client.close()


@pytest.mark.parametrize(("grant", "offset", "asked"), [
    (("req-1", "forged"), 0, True),  # D's handler refuses
    (GRANT, 96, True),  # outside the window, inside the region
    (GRANT, 120, False),  # past the region's end: refused before the handler is asked
])
def test_a_refused_reservation_copies_nothing(server, grant, offset, asked):
    srv, handler = server
    client = PushControlClient()
    copied = []
    try:
        with pytest.raises(TransferError, match="refused write"):
            client.write({"host": "127.0.0.1", "port": srv.port},
                         [WriteOp("g0", offset, 16, memoryview(bytearray(16)))],
                         time.monotonic() + 10, grant, lambda *a: copied.append(a))
        assert copied == [] and handler.written == []
        assert bool(handler.asked) == asked
    finally:
        client.close()


def test_a_failed_copy_is_committed_as_not_landed(server):
    srv, handler = server
    client = PushControlClient()

    def copy(target, region, ops):
        raise TransferError("cannot map the segment")

    try:
        with pytest.raises(TransferError, match="cannot map"):
            client.write({"host": "127.0.0.1", "port": srv.port},
                         [WriteOp("g0", 0, 16, memoryview(bytearray(16)))],
                         time.monotonic() + 10, GRANT, copy)
        assert handler.written == [(GRANT, "g0", [(0, 16)], False)]
    finally:
        client.close()


@pytest.mark.parametrize("dies", [True, False])
def test_a_p_that_dies_or_stalls_between_reserve_and_commit_ends_the_write_unlanded(
        server, dies):
    srv, handler = server
    sock = connect("127.0.0.1", srv.port, 10)
    try:
        send_msg(sock, Reserve("g0", [(0, 16)], *GRANT))
        assert recv_msg(sock, ControlReply, time.monotonic() + 10).ok
        assert not handler.written
        if dies:
            sock.close()
        # dead: the connection broke; stalled: no commit within the 0.5 s commit timeout
        assert handler.ended.wait(10)
        assert handler.written == [(GRANT, "g0", [(0, 16)], False)]
    finally:
        sock.close()


def test_a_commit_without_a_reservation_is_refused(server):
    srv, handler = server
    sock = connect("127.0.0.1", srv.port, 10)
    try:
        send_msg(sock, Commit(True))
        reply = recv_msg(sock, ControlReply, time.monotonic() + 10)
        assert not reply.ok and "without a reservation" in reply.error
        assert handler.written == []
    finally:
        sock.close()


# ------------------------------------------------------------------- the one-sided engines
def _mooncake_available() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


def _engines(kind: str, dest: memoryview | None) -> Any:
    if kind == "shm":
        from pdkv.kv_transfer.engine.shm import ShmTransferEngine

        eng = ShmTransferEngine(idle_timeout=5.0)
        if dest is not None:
            return eng, eng.allocate("g0", len(dest))
        return eng, None
    from system_packages import require_reason

    require_reason(None if _mooncake_available() else
                   "mooncake-transfer-engine-non-cuda / libibverbs1 not installed")
    from pdkv.kv_transfer.engine.mooncake import MooncakeTransferEngine

    return MooncakeTransferEngine(idle_timeout=5.0), dest


@pytest.mark.parametrize("kind", ["shm", "mooncake"])
def test_one_sided_engine_writes_only_what_d_accepted(kind):
    handler = Handler()
    d, region = _engines(kind, memoryview(bytearray(128)))
    p, _ = _engines(kind, None)
    try:
        region[:] = b"\x5a" * 128  # sentinel
        d.register_region("g0", region)
        d.register_local("g0", region)  # (a consumer registers it as local too: no overlap)
        d.set_write_handler(handler.authorize, handler.on_written)
        d.start("127.0.0.1")
        host, port = d.write_address()
        peer = {"host": host, "port": port}
        src = memoryview(bytearray(bytes(range(64))))
        if kind == "mooncake":
            p.register_region("g0", src)  # mooncake writes from registered memory
        ops = [WriteOp("g0", 16, 16, src[:16]), WriteOp("g0", 48, 16, src[16:32])]
        assert p.write(peer, ops, time.monotonic() + 20, GRANT) == 32
        want = bytearray(b"\x5a" * 128)
        want[16:32], want[48:64] = bytes(range(16)), bytes(range(16, 32))
        assert bytes(region) == bytes(want)
        assert handler.written == [(GRANT, "g0", [(16, 16), (48, 16)], True)]
        for grant, off in ((("req-1", "forged"), 0), (GRANT, 64)):
            with pytest.raises(TransferError, match="refused write"):
                p.write(peer, [WriteOp("g0", off, 16, src[32:48])], time.monotonic() + 20, grant)
        assert bytes(region) == bytes(want)  # nothing written by a refused reservation
        assert len(handler.written) == 1
    finally:
        p.close()
        d.close()


def test_an_shm_producer_copies_nothing_into_a_consumer_on_another_host():
    """The acceptance names D's host identity: a P on another host (another network namespace)
    writes nothing into segments of the same name, and the write ends as not landed."""
    from pdkv.kv_transfer.engine.shm import ShmTransferEngine

    handler = Handler()
    d = ShmTransferEngine(idle_timeout=5.0, host_id="boot a netns 1")
    p = ShmTransferEngine(idle_timeout=5.0, host_id="boot a netns 2")
    try:
        region = d.allocate("g0", 64)
        region[:] = b"\x5a" * 64
        d.register_region("g0", region)
        d.set_write_handler(handler.authorize, handler.on_written)
        d.start("127.0.0.1")
        host, port = d.write_address()
        src = memoryview(bytearray(16))
        with pytest.raises(TransferError, match=r"consumer is on host \[boot a netns 1\]"):
            p.write({"host": host, "port": port}, [WriteOp("g0", 0, 16, src)],
                    time.monotonic() + 20, GRANT)
        assert bytes(region) == b"\x5a" * 64
        assert handler.written == [(GRANT, "g0", [(0, 16)], False)]
    finally:
        p.close()
        d.close()
