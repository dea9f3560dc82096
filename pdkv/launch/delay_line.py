"""A link delay for kernels without the netem qdisc: a two-port delay line in user space
(Linux only; root; torch-free).

`NetnsBridge` (pdkv/launch/netns.py) gives a host a one-way `delay` with netem where the kernel
has sch_netem. Where it does not, the host's link is split in two veth pairs inside the switch
namespace and this process joins them:

    host eth0 ──veth── d<i>  [delay line: d<i> ⇄ e<i>]  e<i> ──veth── h<i> on bridge br0

Each port is an AF_PACKET socket (packet(7)) bound to one veth end, reading every frame that
arrives on it (ETH_P_ALL, PACKET_OUTGOING frames skipped) and writing it to the other port once
it has waited `delay` seconds, in arrival order (a FIFO per direction, so with a constant delay
no frame is sent before an earlier one). The sockets use PACKET_VNET_HDR: each frame comes with
a virtio-net header (struct virtio_net_hdr, include/uapi/linux/virtio_net.h) giving its GSO
type and size and its checksum offsets, and is written back with the same header, so a TCP
segmentation-offload frame of up to 64 KiB crosses whole and keeps its partial checksum, as a
hypervisor's virtio switch passes it. That keeps the frame rate low enough for Python at
1 Gbit/s (about 2,000 frames/s of 64 KiB, where 1,500-byte frames would be 83,000/s).

What it guarantees: a frame leaves no earlier than `delay` after it arrived (the time.monotonic
clock), in order per direction. What it adds: its own forwarding time, measured at about
0.1 ms one way on a 2-core box (the figures that use it say so). A queue of `limit` frames per
direction (1,000, netem's default limit) drops what arrives beyond it, as netem does.

The process prints "ready" once every port is bound and exits when its parent exits (checked
every second), on SIGTERM, or when a port's device is removed (the namespace is deleted).

    python -m pdkv.launch.delay_line --pair d0:e0:1ms [--pair d1:e1:250us ...]
"""

from __future__ import annotations

import argparse
import collections
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from pdkv.procgroup import stop_process_group

ETH_P_ALL = 0x0003
"""packet(7): every protocol."""

SOL_PACKET = 263
"""Socket level of the packet options (linux/socket.h)."""

PACKET_VNET_HDR = 15
"""packet(7) option: frames carry a struct virtio_net_hdr in front (linux/if_packet.h)."""

PACKET_OUTGOING = 4
"""sll_pkttype of a frame this host sent (linux/if_packet.h): not forwarded back."""

MAX_FRAME = 65536 + 64
"""recv buffer in bytes: a 64 KiB GSO frame, its Ethernet header and the virtio-net header."""

SO_RCVBUFFORCE = 33
"""socket(7): SO_RCVBUF beyond rmem_max (CAP_NET_ADMIN; asm-generic/socket.h)."""

RCVBUF_BYTES = 8 << 20
"""Receive buffer of a port, in bytes: 128 frames of 64 KiB."""

_DELAY = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)\s*$")
_DELAY_SCALE = {"us": 1e-6, "ms": 1e-3, "s": 1.0}

READY_S = 20.0
"""Deadline, in seconds, for a started delay line to bind its ports and print "ready"."""

DEFAULT_LIMIT = 1000
"""Frames queued per direction before new ones are dropped (netem's default `limit`)."""


def delay_seconds(delay: str) -> float:
    """Seconds of a tc time: "1ms" → 0.001, "250us" → 0.00025, "0.5s" → 0.5.

    Raises:
        ValueError: not a number followed by us, ms or s, or not > 0.
    """
    m = _DELAY.match(delay)
    if not m:
        raise ValueError(f"delay must look like 1ms, 250us or 0.5s, got {delay!r}")
    value = float(m.group(1)) * _DELAY_SCALE[m.group(2)]
    if value <= 0:
        raise ValueError(f"delay must be > 0, got {delay!r}")
    return value


def open_port(dev: str) -> socket.socket:
    """An AF_PACKET socket bound to `dev` with virtio-net headers (module doc).

    Raises:
        OSError: no such device, or not permitted (needs CAP_NET_RAW).
    """
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    try:
        sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        try:  # room for a burst of 64 KiB frames (the default holds three)
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF_BYTES)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
        sock.bind((dev, 0))
    except OSError:
        sock.close()
        raise
    return sock


class Direction:
    """Frames from one port to the other, each held `delay` seconds (module doc).

    Args:
        src, dst: bound AF_PACKET sockets (open_port).
        src_dev: `src`'s device name (to tell a removed device from one merely down).
        delay: seconds a frame waits, > 0.
        limit: frames queued before arrivals are dropped.
    """

    def __init__(self, src: socket.socket, dst: socket.socket, src_dev: str, delay: float,
                 limit: int = DEFAULT_LIMIT) -> None:
        if delay <= 0:
            raise ValueError(f"delay must be > 0 s, got {delay}")
        self.src, self.dst, self.src_dev = src, dst, src_dev
        self.delay, self.limit = delay, limit
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self._cv = threading.Condition()
        self.forwarded = 0
        self.dropped = 0
        self.done = threading.Event()

    def receive_loop(self) -> None:
        """Read frames from `src` and queue them until the device is removed (sets `done`)."""
        while not self.done.is_set():
            try:
                frame, addr = self.src.recvfrom(MAX_FRAME)
            except OSError as e:
                # ENETDOWN once when the device goes down (a cut link); it may come back up.
                if e.errno == errno.ENETDOWN and _device_exists(self.src_dev):
                    continue
                break
            if addr[2] == PACKET_OUTGOING:
                continue
            with self._cv:
                if len(self._queue) >= self.limit:
                    self.dropped += 1
                    continue
                self._queue.append((time.monotonic() + self.delay, frame))
                self._cv.notify()
        self.done.set()
        with self._cv:
            self._cv.notify()

    def send_loop(self) -> None:
        """Write each queued frame to `dst` once its time has come, in order, until `done`."""
        while True:
            with self._cv:
                while not self._queue and not self.done.is_set():
                    self._cv.wait(1.0)
                if self.done.is_set():
                    return
                due, frame = self._queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with self._cv:
                self._queue.popleft()
            try:
                self.dst.send(frame)
                self.forwarded += 1
            except OSError:
                self.dropped += 1  # the far end is down (a cut link): the frame is lost


def _device_exists(dev: str) -> bool:
    try:
        socket.if_nametoindex(dev)
    except OSError:
        return False
    return True


def parse_pair(text: str) -> tuple[str, str, float]:
    """"d0:e0:1ms" → ("d0", "e0", 0.001): two veth ends and the delay, one way per direction,
    in tc syntax.

    Raises:
        ValueError: not two distinct device names and a delay joined by ":".
    """
    parts = text.split(":")
    if len(parts) != 3 or not all(parts) or parts[0] == parts[1]:
        raise ValueError(f"a pair is two device names and a delay joined by ':' (d0:e0:1ms), "
                         f"got {text!r}")
    return parts[0], parts[1], delay_seconds(parts[2])


def run(pairs: Sequence[tuple[str, str, float]], limit: int = DEFAULT_LIMIT) -> int:
    """Bind every pair's ports, print "ready", forward both ways with the pair's delay (s)
    until the parent exits, SIGTERM, or a device is removed. Returns the exit status (0).

    Raises:
        OSError: a port cannot be opened (no such device, no CAP_NET_RAW).
    """
    parent = os.getppid()
    directions = []
    for a, b, delay in pairs:
        sa, sb = open_port(a), open_port(b)
        directions += [Direction(sa, sb, a, delay, limit), Direction(sb, sa, b, delay, limit)]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for d in directions:
        threading.Thread(target=d.receive_loop, daemon=True).start()
        threading.Thread(target=d.send_loop, daemon=True).start()
    print("ready", flush=True)
    while not stop.wait(1.0):
        if os.getppid() != parent or any(d.done.is_set() for d in directions):
            break
    return 0


def _drain(stream: IO[str]) -> None:
    """Read a child's output to its end (so it never blocks on a full pipe)."""
    for _ in stream:
        pass


class DelayLineProcess:
    """The delay line run as a child process in network namespace `netns` (NetnsBridge's switch
    namespace), started and waited for "ready" by the constructor; `stop` ends it (its process
    group).

    Args:
        netns: the namespace holding the veth ends of `pairs`.
        pairs: "DEV_A:DEV_B:DELAY" per delayed link (parse_pair's syntax).
        ready_s: deadline for "ready", in seconds.

    Raises:
        RuntimeError: it exited or stayed silent past the deadline (its last output lines; the
            process is stopped first).
    """

    def __init__(self, netns: str, pairs: Sequence[str], ready_s: float = READY_S) -> None:
        cmd = ["ip", "netns", "exec", netns, sys.executable, "-m", "pdkv.launch.delay_line"]
        for pair in pairs:
            cmd += ["--pair", pair]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True)
        out = self._proc.stdout
        assert out is not None
        got: list[str] = []
        timer = threading.Timer(ready_s, self._proc.kill)
        timer.start()
        try:
            for line in out:
                got.append(line.rstrip())
                if line.strip() == "ready":
                    break
        finally:
            timer.cancel()
        if not got or got[-1] != "ready":
            self.stop()
            raise RuntimeError(f"the delay line did not start within {ready_s:.0f} s: "
                               + " | ".join(got[-5:]))
        threading.Thread(target=_drain, args=(out,), daemon=True).start()

    @property
    def pid(self) -> int:
        """The delay line's process id."""
        return self._proc.pid

    def poll(self) -> int | None:
        """Its exit status, or None while it runs."""
        return self._proc.poll()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM its process group, SIGKILL after `timeout_s` seconds (nothing if it ended)."""
        stop_process_group(self._proc, term_timeout=timeout_s)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: `python -m pdkv.launch.delay_line --pair d0:e0:1ms ...` (module doc)."""
    parser = argparse.ArgumentParser(prog="python -m pdkv.launch.delay_line",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--pair", action="append", required=True, metavar="DEV_A:DEV_B:DELAY",
                        help="two veth ends joined by the delay line and the delay, one way per "
                        "direction, in tc syntax (d0:e0:1ms; repeatable)")
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                        help="frames queued per direction before arrivals are dropped")
    args = parser.parse_args(argv)
    try:
        pairs = [parse_pair(p) for p in args.pair]
        if args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
    except ValueError as e:
        parser.error(str(e))
    return run(pairs, args.limit)


if __name__ == "__main__":
    sys.exit(main())
