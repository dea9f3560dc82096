"""The machine a figure ran on: CPU, ISA flags, cores, load average, versions, commit (torch is
never imported: its version comes from the installed metadata)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdkv.bench.header import host_facts
from pdkv.report import gitinfo

UNKNOWN = "unknown"
# The keys every data file's "machine" holds ("unknown" where a transcribed run did not say).
REQUIRED = ("cpu", "flags", "cores", "load_before", "load_after", "versions", "commit", "date",
            "requests_per_point", "forced")


def _cores() -> int:
    return os.cpu_count() or 1


def _flags() -> str:
    return host_facts()["flags"] or ""


@dataclass(frozen=True)
class Probe:
    """Where the load average (1, 5, 15 min), the core count and the CPU's vector flags (space-
    separated /proc/cpuinfo names) come from, and how to wait (seconds); tests pass fakes."""

    load: Callable[[], tuple[float, float, float]] = field(default=os.getloadavg)
    cores: Callable[[], int] = field(default=_cores)
    sleep: Callable[[float], None] = field(default=time.sleep)
    flags: Callable[[], str] = field(default=_flags)


def refusal(probe: Probe) -> str | None:
    """Why a figure may not be measured now: the 1-minute load average above the core count
    (another job would share the CPUs), or None when it may."""
    load, cores = probe.load()[0], probe.cores()
    if load > cores:
        return f"load average {load:.2f} > {cores} cores"
    return None


def wait_quiet(probe: Probe, wait_s: float, poll_s: float = 15.0) -> str | None:
    """Wait up to `wait_s` seconds (polling every `poll_s`) for the load average to fall to the
    core count (the previous figure's own load decays within a minute or two); returns the
    refusal still standing after that, or None."""
    waited = 0.0
    reason = refusal(probe)
    while reason is not None and waited < wait_s:
        step = min(poll_s, wait_s - waited)
        probe.sleep(step)
        waited += step
        reason = refusal(probe)
    return reason


def versions() -> dict[str, str]:
    """Python's and the installed torch's version ("unknown" when torch is not installed)."""
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = UNKNOWN
    return {"python": platform.python_version(), "torch": torch}


def facts(root: Path, probe: Probe, requests_per_point: int | None,
          measures: tuple[str, ...] = ()) -> dict[str, Any]:
    """The machine object of a run about to start: everything but load_after (set by `finish`).
    The commit is HEAD of `root` (full hash) with `dirty` when tracked files under `measures`
    (the code the figure measures; any, when empty) differ from it: an uncommitted edit elsewhere
    changes the run no more than a commit elsewhere makes it stale."""
    host = host_facts()
    load = probe.load()
    forced = refusal(probe)
    return {
        "cpu": host["cpu"] or UNKNOWN, "flags": host["flags"] or "-", "cores": probe.cores(),
        "load_before": [round(x, 2) for x in load], "load_after": UNKNOWN,
        "versions": versions(), "commit": gitinfo.head(root) or UNKNOWN,
        "dirty": gitinfo.dirty(root, measures),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "requests_per_point": requests_per_point,
        "forced": forced is not None,
    }


def finish(machine: dict[str, Any], probe: Probe) -> dict[str, Any]:
    """`machine` with the load average read now as load_after."""
    return {**machine, "load_after": [round(x, 2) for x in probe.load()]}


def missing(machine: dict[str, Any]) -> list[str]:
    """The REQUIRED keys `machine` lacks (an empty value counts as missing)."""
    return [k for k in REQUIRED if k not in machine or machine[k] in ("", [], {})]


def _load(value: object) -> str:
    if isinstance(value, list) and value:
        return f"{float(value[0]):.2f}"
    return str(value)


def line(machine: dict[str, Any]) -> str:
    """The machine line printed above a figure's table, e.g. "Machine: AMD EPYC, flags avx2,
    2 cores; load average (1 min) 0.59 before, 1.91 after; Python 3.11.7, torch 2.13.0; commit
    e0f3c58; 2026-12-04; 24 requests per point." (prefixed "FORCED: ..." when it ran above the
    core count)."""
    v = machine.get("versions") or {}
    vtext = (f"Python {v.get('python', UNKNOWN)}, torch {v.get('torch', UNKNOWN)}"
             if isinstance(v, dict) else f"versions {v}")
    date = machine.get("date", UNKNOWN)
    commit = str(machine.get("commit", UNKNOWN))
    commit = commit[:7] if commit != UNKNOWN else commit
    if machine.get("dirty"):
        commit += " + uncommitted changes"
    rpp = machine.get("requests_per_point")
    text = (f"Machine: {machine.get('cpu', UNKNOWN)}, flags {machine.get('flags', UNKNOWN)}, "
            f"{machine.get('cores', UNKNOWN)} cores; load average (1 min) "
            f"{_load(machine.get('load_before'))} before, {_load(machine.get('load_after'))} "
            f"after; {vtext}; commit {commit}; {'date ' if date == UNKNOWN else ''}{date}")
    if rpp is not None:
        text += f"; {rpp} requests per point"
    text += "."
    if machine.get("forced"):
        text = (f"**FORCED: load average {_load(machine.get('load_before'))} > "
                f"{machine.get('cores', UNKNOWN)} cores.** " + text)
    return text
