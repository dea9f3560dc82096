"""Bandwidth statistics, engine/peer ratios with their targets, and the text table of a
`pdkv bench transfer` result (GB/s, GB = 1e9 bytes)."""

from __future__ import annotations

import statistics
from typing import TypedDict

GB = 1e9
TCP_TARGET = 0.80  # tcp >= 80% of raw socket at >= TCP_TARGET_MIN_MIB
TCP_TARGET_MIN_MIB = 16
SHM_TARGET = 0.50  # shm >= 50% of memcpy


class _Bandwidth(TypedDict):
    best_gbps: float
    median_gbps: float
    gbps: list[float]
    seconds: list[float]


class MethodStats(_Bandwidth, total=False):
    """One method's GB/s over the timed repeats; `verified`: the warm-up read matched."""

    verified: bool


# "pass" is a keyword: the functional form.
Target = TypedDict("Target",
                   {"target": float, "ratio": float, "applies": bool, "pass": bool | None})


class SizeResult(TypedDict):
    """Every method at one payload size, the engine/peer ratios and the targets."""

    size_mib: int
    nbytes: int
    num_ops: int
    repeats: int
    methods: dict[str, MethodStats]
    ratios: dict[str, dict[str, float]]
    targets: dict[str, Target]


class TransferConfig(TypedDict):
    """The run's settings as `run_transfer_bench` reports them."""

    sizes_mib: list[int]
    repeats: int
    engines: list[str]
    verify: bool
    block_bytes: int
    gb: float
    large_size_mib: int
    large_repeats: int


class TransferResult(TypedDict):
    """What `run_transfer_bench` returns and `--result-json` writes."""

    config: TransferConfig
    sizes: list[SizeResult]


def stats(seconds: list[float], nbytes: int) -> MethodStats:
    gbps = [nbytes / s / GB for s in seconds]
    return {
        "best_gbps": max(gbps),
        "median_gbps": statistics.median(gbps),
        "gbps": gbps,
        "seconds": seconds,
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def size_result(size: int, nbytes: int, num_ops: int, reps: int,
                methods: dict[str, MethodStats]) -> SizeResult:
    ratios: dict[str, dict[str, float]] = {}
    targets: dict[str, Target] = {}
    for eng, peer, target, min_mib in (("tcp", "raw_socket", TCP_TARGET, TCP_TARGET_MIN_MIB),
                                       ("shm", "memcpy", SHM_TARGET, 0)):
        if eng not in methods:
            continue
        key = f"{eng}/{peer}"
        ratios[key] = {
            "best": _ratio(methods[eng]["best_gbps"], methods[peer]["best_gbps"]),
            "median": _ratio(methods[eng]["median_gbps"], methods[peer]["median_gbps"]),
        }
        applies = size >= min_mib
        targets[key] = {
            "target": target,
            "ratio": ratios[key]["best"],
            "applies": applies,
            "pass": (ratios[key]["best"] >= target) if applies else None,
        }
    return {"size_mib": size, "nbytes": nbytes, "num_ops": num_ops, "repeats": reps,
            "methods": methods, "ratios": ratios, "targets": targets}


def format_table(result: TransferResult) -> str:
    """The bandwidth table (GB/s, GB = 1e9 bytes) and the target lines of a `run_transfer_bench`
    result, as text."""
    lines = [
        f"{'size':>8} {'method':>11} {'best GB/s':>10} {'median GB/s':>12} {'ratio(best)':>12} "
        f"{'ratio(med)':>11} {'verified':>9}",
    ]
    for s in result["sizes"]:
        for name, m in s["methods"].items():
            r = s["ratios"].get(f"{name}/raw_socket") or s["ratios"].get(f"{name}/memcpy")
            peer = "raw" if f"{name}/raw_socket" in s["ratios"] else "memcpy"
            rb = f"{r['best']:.2f} /{peer}" if r else ""
            rm = f"{r['median']:.2f}" if r else ""
            lines.append(
                f"{str(s['size_mib']) + ' MiB':>8} {name:>11} {m['best_gbps']:>10.2f} "
                f"{m['median_gbps']:>12.2f} {rb:>12} {rm:>11} {'yes' if m['verified'] else 'no':>9}"
            )
    reps = ", ".join(f"{s['size_mib']} MiB x{s['repeats']}" for s in result["sizes"])
    lines.append(f"(timed repeats: {reps}; ReadOps of {result['config']['block_bytes']} B; "
                 "ratios = engine GB/s / peer GB/s)")
    lines.append("targets:")
    for s in result["sizes"]:
        for key, t in s["targets"].items():
            if key.startswith("tcp"):
                label = f"tcp >= {TCP_TARGET:.0%} of raw socket at >= {TCP_TARGET_MIN_MIB} MiB"
            else:
                label = f"shm >= {SHM_TARGET:.0%} of memcpy"
            verdict = "n/a (size below target range)" if t["pass"] is None else (
                "PASS" if t["pass"] else "FAIL")
            lines.append(f"  {label:<42} {str(s['size_mib']) + ' MiB':>8}: "
                         f"{t['ratio']:.0%} -> {verdict}")
    return "\n".join(lines)
