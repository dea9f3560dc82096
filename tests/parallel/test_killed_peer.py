"""When a TP/DCP rank is killed, its peers fail in their next collective (gloo's "Connection
reset by peer") as soon as its sockets close, sometimes before its exit can be seen: the executor
names the killed rank as the cause, not the first rank to report (MultiprocExecutor._killed_peer;
a full run once reported "worker rank 0 failed" for a SIGKILLed rank 1)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

from pdkv.executor.multiproc import MultiprocExecutor


def _sleep() -> None:
    signal.pause()


def _fail() -> None:
    raise SystemExit(1)


def _executor(procs: list) -> MultiprocExecutor:
    ex = object.__new__(MultiprocExecutor)  # only its processes: no model, no pipes
    ex._procs = procs
    return ex


def test_the_killed_rank_is_found_not_the_reporting_one():
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_sleep, daemon=True) for _ in range(3)]
    for p in procs:
        p.start()
    try:
        os.kill(procs[2].pid, signal.SIGKILL)  # rank 2 killed; rank 0 reports a failure
        assert _executor(procs)._killed_peer(0, grace_s=30.0) == 2
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


def test_no_peer_is_blamed_when_none_was_killed():
    ctx = mp.get_context("spawn")
    alive = ctx.Process(target=_sleep, daemon=True)
    failed = ctx.Process(target=_fail, daemon=True)  # exits with a code, not a signal
    alive.start()
    failed.start()
    failed.join(30)
    try:
        assert failed.exitcode == 1
        assert _executor([alive, alive, failed])._killed_peer(0, grace_s=0.2) is None
    finally:
        alive.kill()
        alive.join(10)
