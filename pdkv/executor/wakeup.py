"""Connector wakeups from worker processes: how a KV connector worker half in a TP/DCP worker
wakes the engine loop in the engine process.

Each rank has a one-way wakeup pipe (a TCP channel for a rank on another host,
pdkv.executor.channel) beside its step pipe (the step pipe is request / response and
read only inside a step). In the worker, `WakeupSender.wake` is the connector's wakeup callback:
it never blocks, and a burst of wakes becomes one `ConnectorWakeup` message. In the engine
process, one `WakeupListener` thread reads every rank's pipe and calls the engine loop's wakeup
once per batch of messages it read.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

import msgspec

from pdkv.executor.messages import ConnectorWakeup

if TYPE_CHECKING:
    from pdkv.executor.channel import RankChannel

logger = logging.getLogger(__name__)

CLOSE_WAIT_S = 5.0
"""How long `close` waits for a sender's or the listener's thread to end."""


class WakeupSender:
    """Worker process: the wakeup callback of the rank's connector worker half.

    `wake()` only sets a flag (any thread, never blocks: a load thread calls it); a daemon thread
    sends one message per flag it finds set, so wakes that arrive while a message is being sent
    are coalesced into the next one. Should the engine stop reading (the pipe full), only that
    thread waits.

    Args:
        conn: the write end of the rank's wakeup pipe, or its TCP wakeup channel (this object
            closes it).
        rank: the rank, carried in every message.
    """

    def __init__(self, conn: RankChannel, rank: int) -> None:
        self._conn = conn
        self._message = msgspec.msgpack.encode(ConnectorWakeup(rank=rank))
        self._pending = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"pdkv-wakeup-{rank}",
                                        daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Ask for a wakeup of the engine loop (any thread; never blocks)."""
        self._pending.set()

    def _run(self) -> None:
        while True:
            self._pending.wait()
            if self._closed:
                return
            self._pending.clear()
            try:
                self._conn.send_bytes(self._message)
            except (OSError, ValueError):  # the engine closed its end: nobody left to wake
                return

    def close(self) -> None:
        """Stop the thread and close the pipe (the worker's exit path; later wakes do nothing)."""
        self._closed = True
        self._pending.set()
        self._thread.join(CLOSE_WAIT_S)
        if not self._thread.is_alive():  # else it is stuck in a send: the process exit ends it
            self._conn.close()


class WakeupListener:
    """Engine process: a daemon thread reading every rank's wakeup pipe.

    Each time messages arrive it reads all that are there, then calls the wakeup set by
    `set_wakeup` once (before one is set, they are dropped: nothing sleeps on them). A pipe at
    EOF (its worker exited) is dropped and also wakes the loop, whose next step then reports the
    dead worker; with every pipe gone the thread ends, it never spins on a closed pipe.

    Args:
        conns: the read end of each rank's wakeup pipe, or its TCP wakeup channel (this object
            closes them).
    """

    def __init__(self, conns: list[RankChannel]) -> None:
        self._conns = list(conns)
        self._wakeup: Callable[[], None] | None = None
        self._decoder = msgspec.msgpack.Decoder(ConnectorWakeup)
        self._stop_r, self._stop_w = mp.Pipe(duplex=False)
        self._thread = threading.Thread(target=self._run, name="pdkv-wakeup-listener",
                                        daemon=True)
        self._thread.start()

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """The engine loop's wakeup callback (it must not block); called from the listener's
        thread."""
        self._wakeup = wakeup

    def _run(self) -> None:
        live = list(self._conns)
        while live:
            ready = wait([self._stop_r, *live])  # type: ignore[list-item]
            if self._stop_r in ready:
                return
            woken = False
            for conn in [c for c in live if c in ready]:
                try:
                    while conn.poll():
                        self._decode(conn.recv_bytes())
                        woken = True
                except (EOFError, OSError):
                    live.remove(conn)
                    woken = True
            wakeup = self._wakeup
            if woken and wakeup is not None:
                wakeup()

    def _decode(self, data: bytes) -> None:
        try:
            self._decoder.decode(data)
        except msgspec.DecodeError as e:  # still a wakeup: a spare step costs nothing
            logger.warning("unexpected message on a wakeup pipe: %s", e)

    def close(self) -> None:
        """End the thread (waits for it) and close every pipe; no wakeup is called after this."""
        with contextlib.suppress(OSError):
            self._stop_w.close()
        self._thread.join(CLOSE_WAIT_S)
        self._stop_r.close()
        for conn in self._conns:
            conn.close()
