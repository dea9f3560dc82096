"""`pdkv bench memory`'s parts without a model: RSS read from /proc (this process has torch
mapped; a child shell does not), descendants found through two generations, the table's
goal column."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch  # noqa: F401  (mapped into this process: process_rss must see it)

from pdkv.bench.memory import (
    LIGHT_GOAL_BYTES,
    SERVE_GOAL_BYTES,
    Rss,
    descendants,
    process_rss,
    report,
    tree_rss,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_rss_and_descendants_of_a_process_tree():
    me = process_rss(os.getpid())
    assert me.torch_loaded and me.total > 50_000_000 and me.anon + me.file + me.shmem == me.total
    # A shell (child) that starts a sleep (grandchild) and waits for it.
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & echo started; wait"], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
        tree, kids = descendants(os.getpid()), descendants(proc.pid)
        assert len(kids) == 1  # the sleep
        assert proc.pid in tree and kids[0] in tree and tree.index(proc.pid) < tree.index(kids[0])
        assert not process_rss(proc.pid).torch_loaded
        assert tree_rss(proc.pid).total > process_rss(proc.pid).total
    finally:
        for pid in reversed(descendants(proc.pid) + [proc.pid]):
            os.kill(pid, signal.SIGKILL)
        proc.wait(10)


def test_report_marks_each_goal():
    small, big = (
        Rss(50_000_000, 40_000_000, 10_000_000, 0, False),
        Rss(SERVE_GOAL_BYTES + 1, 0, 0, 0, True),
    )
    text = report(
        {
            "serve": (big, big),
            "launcher": (small, small),
            "proxy": (small, Rss(LIGHT_GOAL_BYTES + 1, 0, 0, 0, False)),
        },
        [],
    )
    lines = text.splitlines()
    assert lines[0].startswith("engine flags: (defaults)")
    assert (
        lines[2].split()[-1] == "NO"
        and lines[3].split()[-1] == "yes"
        and lines[4].split()[-1] == "NO"
    )
    assert lines[2].split()[-3] == "yes" and lines[3].split()[-3] == "no"  # torch column
