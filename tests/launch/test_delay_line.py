"""The delay line (pdkv/launch/delay_line.py) with fake ports: every frame waits at least the
delay, frames leave in arrival order, the host's own outgoing frames are not sent back, a full
queue drops arrivals as netem does, a port that goes down and up keeps forwarding, and a removed
device ends it. No root needed (the real ports are covered by tests/launch/test_netns_bridge.py)."""

from __future__ import annotations

import errno
import queue
import threading
import time

import pytest

from pdkv.launch import delay_line
from pdkv.launch.delay_line import PACKET_OUTGOING, Direction, parse_pair

HOST = 0  # sll_pkttype of a frame for this host


class FakeSource:
    """recvfrom() hands out queued frames (stamped when handed out) or raises queued errors."""

    def __init__(self) -> None:
        self.items: queue.Queue[tuple[bytes, int] | OSError] = queue.Queue()
        self.handed: dict[bytes, float] = {}

    def recvfrom(self, size: int) -> tuple[bytes, tuple[str, int, int]]:
        item = self.items.get(timeout=30)
        if isinstance(item, OSError):
            raise item
        frame, kind = item
        self.handed[frame] = time.monotonic()
        return frame, ("d0", 3, kind, 1, b"")


class FakeDest:
    """send() records each frame with the time it was sent; `gate` can hold a send back."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, float]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def send(self, frame: bytes) -> int:
        self.entered.set()
        self.gate.wait(30)
        self.sent.append((frame, time.monotonic()))
        return len(frame)


def _start(direction: Direction) -> list[threading.Thread]:
    threads = [threading.Thread(target=direction.receive_loop, daemon=True),
               threading.Thread(target=direction.send_loop, daemon=True)]
    for t in threads:
        t.start()
    return threads


def _wait_for(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _end(src: FakeSource, threads: list[threading.Thread], monkeypatch) -> None:
    monkeypatch.setattr(delay_line, "_device_exists", lambda dev: False)
    src.items.put(OSError(errno.ENETDOWN, "device removed"))
    for t in threads:
        t.join(10)
        assert not t.is_alive()


def test_every_frame_waits_the_delay_and_leaves_in_order(monkeypatch):
    src, dst = FakeSource(), FakeDest()
    d = Direction(src, dst, "d0", delay=0.05)  # type: ignore[arg-type]
    threads = _start(d)
    frames = [f"frame-{i}".encode() for i in range(20)]
    for i, f in enumerate(frames):
        src.items.put((f, HOST))
        if i % 5 == 0:
            time.sleep(0.01)
    src.items.put((b"mine", PACKET_OUTGOING))  # this host's own frame on the port: not sent
    _wait_for(lambda: len(dst.sent) == len(frames))
    time.sleep(0.1)
    assert [f for f, _ in dst.sent] == frames
    for f, at in dst.sent:
        assert at - src.handed[f] >= 0.05, f  # never early
    assert d.forwarded == 20 and d.dropped == 0
    _end(src, threads, monkeypatch)


def test_a_full_queue_drops_arrivals_and_a_down_port_keeps_forwarding(monkeypatch):
    src, dst = FakeSource(), FakeDest()
    d = Direction(src, dst, "d0", delay=0.01, limit=2)  # type: ignore[arg-type]
    dst.gate.clear()  # the far end stalls: the queue fills
    threads = _start(d)
    src.items.put((b"0", HOST))
    assert dst.entered.wait(20)  # frame 0 is out of the queue, its send stalled
    for i in range(1, 5):
        src.items.put((b"%d" % i, HOST))
    _wait_for(lambda: src.items.empty() and d.dropped >= 2)
    dst.gate.set()
    _wait_for(lambda: d.forwarded + d.dropped == 5)
    # frame 0 was in the stalled send, 1 and 2 queued, 3 and 4 dropped
    assert d.forwarded == 3 and d.dropped == 2, (d.forwarded, d.dropped)
    # the port goes down (a cut link) and comes back: ENETDOWN while the device exists
    monkeypatch.setattr(delay_line, "_device_exists", lambda dev: True)
    src.items.put(OSError(errno.ENETDOWN, "down"))
    src.items.put((b"after", HOST))
    _wait_for(lambda: d.forwarded == 4)
    assert dst.sent[-1][0] == b"after" and not d.done.is_set()
    _end(src, threads, monkeypatch)
    assert d.done.is_set()


def test_pairs_and_delays_are_checked():
    assert parse_pair("d0:e0:250us") == ("d0", "e0", pytest.approx(2.5e-4))
    for bad in ("d0", "d0:e0", "d0:d0:1ms", ":e0:1ms", "a:b:c:1ms"):
        with pytest.raises(ValueError, match="two device names and a delay"):
            parse_pair(bad)
    with pytest.raises(ValueError, match="delay must look like 1ms"):
        parse_pair("d0:e0:1")
    with pytest.raises(ValueError, match="delay must be > 0"):
        Direction(FakeSource(), FakeDest(), "d0", delay=0)  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        delay_line.main(["--pair", "d0:e0:1 fortnight"])
