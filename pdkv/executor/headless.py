"""`pdkv serve MODEL ... --nnodes N --node-rank n --master-addr A --master-port P --headless`:
a non-leader node of a TP/DCP engine (vLLM's flag names). It runs no engine and no HTTP server:
one process per rank of this node (pdkv.executor.nodes.NodeLayout), each connecting its step
and wakeup channels to the leader at A:P+1 and then serving steps exactly as a rank the leader
spawned itself (pdkv.executor.worker_proc.run_worker: the leader sends its configuration in
`WorkerInit`; a `LeaderWatch` ends a rank whose leader is gone even mid-collective). The
command ends when its ranks end: 0 when every rank ended cleanly (the
leader's Shutdown or its channels closed), 1 when one failed (the others are stopped then).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from pdkv.config import ParallelConfig
from pdkv.executor.channel import TcpChannel
from pdkv.executor.nodes import NodeLayout, connect_rank

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""How long (seconds) the other ranks get to end after one failed, before they are killed."""

LEADER_GONE_GRACE_S = 5.0
"""How long (seconds) a rank whose wakeup channel ended gets to end by itself (the leader's
Shutdown, or EOF on its step channel) before the watch ends its process."""


class LeaderWatch:
    """Ends a headless rank whose leader is gone even while the rank is caught in a collective
    (which only gloo's timeout, worker_timeout_s, would end): a daemon thread waits on the rank's
    wakeup channel, which the leader never writes to, so its turning readable means EOF or a
    broken connection (a cut link: after HEADLESS_DEAD_PEER_S). It then gives the rank
    LEADER_GONE_GRACE_S to finish (`done` set: a Shutdown or an EOF the worker loop read), else
    calls `on_lost` (default: log and end the process with code 1).

    Args:
        wake: the rank's wakeup channel (not closed by this object).
        rank: for the log line.
        done: set when the rank's worker loop has returned.
        on_lost: what ends the rank (tests pass their own).
    """

    def __init__(self, wake: TcpChannel, rank: int, done: threading.Event,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self._wake, self._rank, self._done = wake, rank, done
        self._on_lost = on_lost or self._exit
        self._thread = threading.Thread(target=self._run, name=f"pdkv-leader-watch-{rank}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                if not self._wake.poll(1.0):
                    continue
                why = self._wake.gone()
            except (ValueError, OSError):  # closed by the rank's own exit path
                return
            if why is None:  # a stray byte (the leader sends nothing here): look again later
                self._done.wait(1.0)
                continue
            if self._done.wait(LEADER_GONE_GRACE_S):
                return
            self._on_lost(why)
            return

    def _exit(self, why: str) -> None:
        logger.error("rank %d: the leader is gone (%s) and the rank did not end within %g s: "
                     "ending it", self._rank, why, LEADER_GONE_GRACE_S)
        logging.shutdown()
        os._exit(1)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def run_remote_rank(layout: NodeLayout, rank: int, connect_timeout_s: float,
                    io_timeout_s: float) -> None:
    """One rank of a headless node (a spawned process): connect to the leader within
    `connect_timeout_s` seconds, then serve steps until the leader says stop or is gone.

    Raises:
        TimeoutError: the leader did not accept in time.
        SystemExit(1): the rank failed (reported to the leader first, by run_worker).
    """
    from pdkv.executor.worker_proc import run_worker

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    step, wake, host = connect_rank(layout, rank, time.monotonic() + connect_timeout_s,
                                    io_timeout_s)
    logger.info("rank %d connected to the leader from %s", rank, host)
    done = threading.Event()
    LeaderWatch(wake, rank, done)
    try:
        run_worker(step, wake)
    finally:
        done.set()


def run_headless(par: ParallelConfig) -> int:
    """Run this node's ranks until they end; returns the exit code (0: all ended cleanly).

    Raises:
        ValueError: node rank 0 (the leader runs the engine: leave out --headless) or a single
            node.
    """
    layout = NodeLayout.of(par)
    if layout.nnodes < 2 or layout.node_rank == 0:
        raise ValueError("--headless runs the ranks of a node other than the leader: give "
                         "--nnodes > 1 and --node-rank >= 1 (node 0 runs the engine without "
                         "--headless)")
    ctx = mp.get_context("spawn")
    procs: dict[object, tuple[int, BaseProcess]] = {}
    ranks = layout.ranks(layout.node_rank)
    logger.info("headless node %d of %d: ranks %d-%d, leader at %s:%d", layout.node_rank,
                layout.nnodes, ranks[0], ranks[-1], *layout.control_address)
    for rank in ranks:
        proc: BaseProcess = ctx.Process(target=run_remote_rank,
                           args=(layout, rank, par.worker_timeout_s, par.worker_timeout_s),
                           name=f"pdkv-worker-{rank}", daemon=True)
        proc.start()
        procs[proc.sentinel] = (rank, proc)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    code = 0
    try:
        while procs:
            for s in wait(list(procs)):  # type: ignore[arg-type]
                rank, ended = procs.pop(s)
                ended.join(1.0)
                if ended.exitcode != 0:
                    logger.error("rank %d exited with %s: stopping this node", rank,
                                 ended.exitcode)
                    code = 1
            if code:
                break
    except KeyboardInterrupt:
        code = 0
    finally:
        deadline = time.monotonic() + STOP_GRACE_S
        for _, left in procs.values():
            left.terminate()
        for _, left in procs.values():
            left.join(max(0.0, deadline - time.monotonic()))
            if left.is_alive() and left.pid is not None:
                os.kill(left.pid, signal.SIGKILL)
                left.join(1.0)
    return code
