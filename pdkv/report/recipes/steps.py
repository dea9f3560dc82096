"""Running a recipe's steps: each a user-facing CLI in a subprocess whose output goes straight
to the recipe's stdout, preceded by the command as a user types it (`$ pdkv ...`)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdkv.procgroup import stop_process_group

# How long a step that was asked to stop (SIGTERM: the benches stop their processes and delete
# their namespaces) may take before it is killed, seconds.
STOP_GRACE_S = 60.0


@dataclass(frozen=True)
class Step:
    """One command of a recipe.

    argv: the full argv (`pdkv_argv` for a pdkv subcommand).
    timeout_s: deadline of the whole step, seconds.
    ok_codes: exit statuses that are outcomes, not failures (`pdkv bench handoff` exits 1 when a
        row misses its tolerance: a finding the figure shows).
    """

    argv: tuple[str, ...]
    timeout_s: float = 3600.0
    ok_codes: tuple[int, ...] = (0,)


def pdkv_argv(*args: str) -> tuple[str, ...]:
    """`pdkv ARGS...` run with this interpreter (`python -m pdkv.cli ARGS...`)."""
    return (sys.executable, "-m", "pdkv.cli", *args)


def shown(argv: Sequence[str], hide: Mapping[str, str] | None = None) -> str:
    """The argv as a user types it: `pdkv ...` for `python -m pdkv.cli ...`, `python -m M ...`
    for another module, each `hide` key (a temporary folder) replaced by its value."""
    words = list(argv)
    if words[1:3] == ["-m", "pdkv.cli"]:
        words = ["pdkv", *words[3:]]
    elif words[1:2] == ["-m"]:
        words = ["python", *words[1:]]
    text = " ".join(words)
    for old, new in (hide or {}).items():
        text = text.replace(old, new)
    return text


def run(step: Step, hide: Mapping[str, str] | None = None) -> int:
    """Print `$ <command>`, run the step with its output on this process's stdout, return its exit
    status. A step still running when this returns (its deadline passed, or this process is
    stopping) and whatever it started get SIGTERM, then SIGKILL after STOP_GRACE_S seconds
    (the step runs in its own process group: pdkv.procgroup.stop_process_group).

    Raises:
        RuntimeError: the step exited with a status not in `ok_codes`, or ran past `timeout_s`.
        OSError: it could not be started.
    """
    print(f"$ {shown(step.argv, hide)}", flush=True)
    proc = subprocess.Popen(list(step.argv), start_new_session=True)
    try:
        rc = proc.wait(timeout=step.timeout_s)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{shown(step.argv, hide)}: still running after {step.timeout_s:g} s"
                           ) from e
    finally:
        stop_process_group(proc, STOP_GRACE_S, STOP_GRACE_S)
    sys.stdout.flush()
    if rc not in step.ok_codes:
        raise RuntimeError(f"{shown(step.argv, hide)}: exited {rc}")
    return rc


def stop_on_sigterm() -> None:
    """Make SIGTERM unwind this process like Ctrl-C (SystemExit 143), so a running step is
    stopped by `run`'s cleanup rather than left behind."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
