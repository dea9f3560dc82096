"""`python -m pdkv.report.recipes.cpu_linear`: the `--cpu-linear auto` timings of one layer's
projections per row count, float32 and bfloat16 in one table (docs/SPEED.md).

Runs `python -m pdkv.model.cpu_linear --dtype D` once per dtype (each printed as `$ ...` before
its output), reads the timings from its `cpu-linear auto table [...] (...)` line and prints one
table: a row per row count, a column per (dtype, backend), microseconds; a backend the timing
pruned at that row count shows "(pruned)".
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Sequence

from pdkv.report.recipes import steps

SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_LINE = re.compile(r"cpu-linear auto table \[.*?\] from .*? \((?P<cells>.*)\)\s*$")
_BUCKET = re.compile(r"^(\d+): (.*)$")
_TIMING = re.compile(r"(\S+) (\d+)us")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The recipe's flags (defaults: docs/SPEED.md's table)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", type=lambda s: [x for x in s.split(",") if x],
                   default=["float32", "bfloat16"], help="comma-separated, one run each")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--timeout", type=float, default=1800.0, help="deadline of each run, s")
    return p.parse_args(argv)


def run_argv(model: str, dtype: str) -> tuple[str, ...]:
    """`python -m pdkv.model.cpu_linear` for one dtype."""
    return (sys.executable, "-m", "pdkv.model.cpu_linear", "--model", model, "--dtype", dtype)


def timings(output: str) -> dict[int, dict[str, int]]:
    """{rows: {backend: microseconds}} from `pdkv.model.cpu_linear`'s output.

    Raises:
        ValueError: the output has no `cpu-linear auto table` line.
    """
    for line in output.splitlines():
        m = _LINE.search(line)
        if m:
            out: dict[int, dict[str, int]] = {}
            for cell in m.group("cells").split("; "):
                b = _BUCKET.match(cell.strip())
                if b:
                    out[int(b.group(1))] = {n: int(us) for n, us in _TIMING.findall(b.group(2))}
            return out
    raise ValueError("pdkv.model.cpu_linear printed no `cpu-linear auto table` line")


def table(by_dtype: dict[str, dict[int, dict[str, int]]]) -> str:
    """One pipe table of every dtype's timings (microseconds)."""
    columns = [(d, n) for d, t in by_dtype.items()
               for n in dict.fromkeys(n for cells in t.values() for n in cells)]
    buckets = sorted({b for t in by_dtype.values() for b in t})
    head = ["rows", *(f"{SHORT.get(d, d)} {n} (µs)" for d, n in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in buckets:
        cells = [str(by_dtype[d].get(b, {}).get(n, "(pruned)")) for d, n in columns]
        lines.append("| " + " | ".join([str(b), *cells]) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one timing per dtype, then print the table.

    Raises:
        subprocess.CalledProcessError, subprocess.TimeoutExpired: a run failed or ran past
            `--timeout` seconds.
        ValueError: a run printed no timings.
    """
    args = parse_args(argv)
    by_dtype = {}
    for dtype in args.dtypes:
        cmd = run_argv(args.model, dtype)
        print(f"$ {steps.shown(cmd)}", flush=True)
        out = subprocess.run(list(cmd), stdout=subprocess.PIPE, text=True, check=True,
                             timeout=args.timeout).stdout
        print(out, end="", flush=True)
        by_dtype[dtype] = timings(out)
    print()
    print(table(by_dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
