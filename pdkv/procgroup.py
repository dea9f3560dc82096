"""Processes by PID: stopping a child started with `start_new_session=True` (its own process
group), so that whatever it started goes with it, and asking whether a process still exists."""

from __future__ import annotations

import os
import signal
import subprocess


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (signal 0; a permission error means it does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(proc: subprocess.Popen[bytes] | subprocess.Popen[str], term_timeout: float,
                       kill_timeout: float = 10.0) -> None:
    """SIGTERM the group led by `proc`, wait up to `term_timeout` s, then SIGKILL it and wait up
    to `kill_timeout` s. Nothing happens when `proc` has already exited.

    Raises:
        subprocess.TimeoutExpired: the group leader outlived SIGKILL's wait (a stuck kernel call).
    """
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(term_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(kill_timeout)
