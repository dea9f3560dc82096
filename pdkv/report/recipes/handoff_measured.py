"""`python -m pdkv.report.recipes.handoff_measured`: measure the link, then the handoff against
that measurement (docs/PLAN.md "Predicted vs measured", docs/LEARNING.md step 4).

Two commands in turn, each printed as `$ pdkv ...` before its output:
1. `pdkv bench transfer --sizes 64,256 --repeats 3 --engines ENGINES --result-json ...`;
2. `pdkv bench handoff --transfer ENGINES --prompt-lens ... --repeats PULLS --link-bandwidth
   ENGINE=B/s ...`, B/s being each engine's median at the largest size of step 1 (GB/s × 1e9).
`pdkv bench handoff` exits 1 when a row misses its tolerance: that is a finding the table shows,
so it counts as a run; any other failure stops the recipe (exit 1, nothing written).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdkv.report.recipes import steps

GB = 1e9  # pdkv bench transfer's GB/s


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The recipe's flags (defaults: docs/PLAN.md's run)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transfer", type=_names, default=["tcp", "shm"],
                   help="comma-separated transfer engines, measured and handed off (tcp,shm)")
    p.add_argument("--sizes", type=_ints, default=[64, 256],
                   help="pdkv bench transfer's payload sizes, MiB; the largest gives the "
                   "bandwidth")
    p.add_argument("--repeats", type=int, default=3, help="pdkv bench transfer's repeats")
    p.add_argument("--prompt-lens", type=_ints, default=[1024, 4096, 8192],
                   help="pdkv bench handoff's prompt lengths, tokens")
    p.add_argument("--pulls", type=int, default=3,
                   help="pdkv bench handoff's --repeats: pulls per prompt length (the row "
                   "compares their median)")
    p.add_argument("--timeout", type=float, default=3600.0, help="deadline of each step, s")
    p.add_argument("--json", default=None,
                   help="write {transfer, link_bandwidth, handoff} (both results) here")
    return p.parse_args(argv)


def transfer_step(args: argparse.Namespace, result_json: str) -> steps.Step:
    """Step 1: `pdkv bench transfer` writing its result to `result_json`."""
    return steps.Step(steps.pdkv_argv(
        "bench", "transfer", "--sizes", ",".join(map(str, args.sizes)),
        "--repeats", str(args.repeats), "--engines", ",".join(args.transfer),
        "--result-json", result_json), args.timeout)


def link_bandwidths(transfer: Mapping[str, Any], engines: Sequence[str]) -> dict[str, float]:
    """Each engine's median bandwidth (bytes/s) at the largest size of a `pdkv bench transfer`
    result.

    Raises:
        ValueError: the result has no sizes, or no row for an engine at its largest size.
    """
    sizes = transfer.get("sizes") or []
    if not sizes:
        raise ValueError("pdkv bench transfer measured no size")
    largest = max(sizes, key=lambda s: s["size_mib"])
    missing = [e for e in engines if e not in largest["methods"]]
    if missing:
        raise ValueError(f"pdkv bench transfer has no {', '.join(missing)} row at "
                         f"{largest['size_mib']} MiB")
    return {e: float(largest["methods"][e]["median_gbps"]) * GB for e in engines}


def handoff_step(args: argparse.Namespace, bandwidths: Mapping[str, float],
                 result_json: str) -> steps.Step:
    """Step 2: `pdkv bench handoff` predicting with the measured `bandwidths` (bytes/s); exit 1
    (a row outside the tolerance) is an outcome."""
    link = [a for e, b in bandwidths.items() for a in ("--link-bandwidth", f"{e}={b!r}")]
    return steps.Step(steps.pdkv_argv(
        "bench", "handoff", "--transfer", ",".join(args.transfer),
        "--prompt-lens", ",".join(map(str, args.prompt_lens)), "--repeats", str(args.pulls),
        *link,
        "--result-json", result_json), args.timeout, ok_codes=(0, 1))


def main(argv: Sequence[str] | None = None) -> int:
    """Run both steps; exit 0 when both ran (whatever the rows' verdicts).

    Raises:
        RuntimeError: a step failed, ran past its deadline, or the handoff was skipped.
        ValueError: the transfer result lacks an engine.
    """
    args = parse_args(argv)
    steps.stop_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="pdkv-handoff-measured-") as tmp:
        hide = {tmp + "/": ""}
        t_json, h_json = str(Path(tmp) / "transfer.json"), str(Path(tmp) / "handoff.json")
        steps.run(transfer_step(args, t_json), hide)
        transfer = json.loads(Path(t_json).read_text(encoding="utf-8"))
        bandwidths = link_bandwidths(transfer, args.transfer)
        steps.run(handoff_step(args, bandwidths, h_json), hide)
        if not Path(h_json).exists():
            raise RuntimeError("pdkv bench handoff wrote no result")
        handoff = json.loads(Path(h_json).read_text(encoding="utf-8"))
    if handoff.get("skipped"):
        raise RuntimeError(f"pdkv bench handoff skipped: {handoff['skipped']}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"transfer": transfer, "link_bandwidth": bandwidths, "handoff": handoff},
            indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
