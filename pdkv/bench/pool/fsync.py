"""`pdkv bench pool --disk-fsync`: what the disk tier's fsync costs per chunk written (no
engine, no torch).

Two disk tiers in sibling directories of one work directory, one with fsync (file before the
rename, directory after it) and one without, each write the same random chunk-sized value under
fresh keys, alternately, so both see the same machine load and page-cache state. Reported per
setting: median and p90 put time and MB/s (MB = 1e6 bytes); plus the file system of the work
directory, the CPU model with its vector flags and the load average before and after (the cost
is the storage's, and a loaded box inflates both).
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import tempfile
import time
from typing import TypedDict

from pdkv.bench.offline.report import cpu_description
from pdkv.kvpool.tiers.disk import DiskTier

SMOLLM2_BYTES_PER_TOKEN = 46_080
"""SmolLM2-135M fp32 KV bytes per token (30 layers x K and V x 3 KV heads x 64 x 4 B): the
default chunk value is chunk_size tokens of it."""


class FsyncSide(TypedDict):
    """Put times (ms) of one setting."""

    median_ms: float
    p90_ms: float
    mb_per_s: float


class FsyncResult(TypedDict):
    """What `measure_disk_fsync` returns."""

    value_bytes: int
    writes: int
    path: str
    fs_type: str
    cpu: str
    cpus: int
    load_avg_1m: list[float]
    on: FsyncSide
    off: FsyncSide
    cost_ms: float


def fs_type(path: str) -> str:
    """File system type of the mount holding `path` (/proc/mounts; "unknown" elsewhere)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1]
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def _side(times_s: list[float], value_bytes: int) -> FsyncSide:
    ordered = sorted(times_s)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    med = statistics.median(ordered)
    return {"median_ms": 1000 * med, "p90_ms": 1000 * p90, "mb_per_s": value_bytes / med / 1e6}


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def measure_disk_fsync(work_dir: str | None, value_bytes: int, writes: int) -> FsyncResult:
    """Time `writes` puts of a `value_bytes` value with fsync on and as many with it off,
    alternately, in a fresh directory under `work_dir` (None: the system's temporary directory),
    removed afterwards.

    Raises:
        ValueError: value_bytes or writes not positive, or work_dir not an existing directory.
        TierError: a put failed (e.g. the file system is full).
    """
    if value_bytes <= 0 or writes <= 0:
        raise ValueError(f"value_bytes and writes must be positive, got {value_bytes}, {writes}")
    if work_dir is not None and not os.path.isdir(work_dir):
        raise ValueError(f"--work-dir {work_dir!r} is not an existing directory (the benchmark "
                         "writes in a fresh directory under it, on the disk to measure)")
    root = tempfile.mkdtemp(prefix="pdkv-bench-fsync-", dir=work_dir)
    load_before = _load()
    try:
        capacity = value_bytes * (writes + 1)
        tiers = {on: DiskTier(os.path.join(root, "on" if on else "off"), capacity, fsync=on)
                 for on in (True, False)}
        value = os.urandom(value_bytes)
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(writes):
            for on in ((True, False) if i % 2 else (False, True)):
                t0 = time.perf_counter()
                tiers[on].put(f"pdkv:bench-fsync:{i:06d}", value)
                times[on].append(time.perf_counter() - t0)
        on_side, off_side = _side(times[True], value_bytes), _side(times[False], value_bytes)
        return {
            "value_bytes": value_bytes, "writes": writes, "path": root, "fs_type": fs_type(root),
            "cpu": f"{cpu_description()}, {platform.machine()}", "cpus": os.cpu_count() or 0,
            "load_avg_1m": [load_before, _load()], "on": on_side, "off": off_side,
            "cost_ms": on_side["median_ms"] - off_side["median_ms"],
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def format_fsync(result: FsyncResult) -> str:
    """The plain-text report of `measure_disk_fsync`."""
    load = result["load_avg_1m"]
    lines = [
        f"pdkv bench pool --disk-fsync: {result['writes']} puts of "
        f"{result['value_bytes'] / 1e6:.1f} MB per setting, alternating, in "
        f"{os.path.dirname(result['path'])} ({result['fs_type']})",
        f"cpu: {result['cpu']}, {result['cpus']} CPUs; load average {load[0]:.1f} at start, "
        f"{load[1]:.1f} at end",
        f"{'fsync':<6} {'median ms':>10} {'p90 ms':>8} {'MB/s':>8}",
    ]
    for name in ("on", "off"):
        side: FsyncSide = result["on"] if name == "on" else result["off"]
        lines.append(f"{name:<6} {side['median_ms']:>10.1f} {side['p90_ms']:>8.1f} "
                     f"{side['mb_per_s']:>8.0f}")
    lines.append(f"fsync costs {result['cost_ms']:+.1f} ms per chunk written (median on - off)")
    return "\n".join(lines)
