"""`python -m pdkv.report.recipes.push_vs_pull`: push vs pull TTFT on loopback and on capped
links, with `pdkv plan`'s prediction of the exposed handoff (docs/PUSH.md).

Per link, in turn, each printed as `$ ...` before its output:
1. `pdkv bench handoff --transfer-modes pull,push --prompt-lens N --repeats R [--link-rate RATE]`
   (a capped rate puts P and D in two network namespaces: root and iproute2);
2. for a capped rate, `pdkv plan --model smollm2 --prompt-len N --prefill-tps T --link-bandwidth B
   --json`, T being N / the run's median P prefill of the pull requests (tokens/s) and B the
   rate in bytes/s: its "handoff time" is the pull's predicted exposed handoff, its "layer-wise
   push: handoff" the push's.
Then the table: per link the median TTFT of each mode (s), push / pull, the median exposed
handoff of each mode (ms) and the plan's. A link the handoff bench skips (not root) stops the
recipe: a table without its capped rows would not be the guide's.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdkv.report.recipes import steps

LOOPBACK = "loopback"
MODEL = "smollm2"  # what pdkv bench handoff's peers serve
COLUMNS = ["link", "median TTFT pull / push (s)", "TTFT push / pull",
           "median exposed pull / push (ms)", "plan: exposed pull / push (ms)"]
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)(bit|bps)$", re.IGNORECASE)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The recipe's flags (defaults: docs/PUSH.md's run)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link-rates", type=lambda s: [x for x in s.split(",") if x],
                   default=[LOOPBACK, "1gbit", "110mbit"],
                   help=f"comma-separated links, in order: {LOOPBACK!r} or a tc rate (1gbit)")
    p.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens")
    p.add_argument("--repeats", type=int, default=2, help="requests per mode and link")
    p.add_argument("--timeout", type=float, default=3600.0, help="deadline of each step, s")
    p.add_argument("--json", default=None, help="write {links: [{link, handoff, plan}]} here")
    return p.parse_args(argv)


def label(link: str) -> str:
    """A link as the table names it: "loopback", "1gbit" → "1 Gbit/s", "110mbit" → "110 Mbit/s".

    Raises:
        ValueError: neither "loopback" nor a tc rate.
    """
    if link == LOOPBACK:
        return link
    m = _RATE.match(link)
    if not m:
        raise ValueError(f"link must be {LOOPBACK!r} or a tc rate like 1gbit, got {link!r}")
    unit = "bit/s" if m.group(3).lower() == "bit" else "B/s"
    return f"{m.group(1)} {m.group(2).upper()}{unit}"


def handoff_step(args: argparse.Namespace, link: str, result_json: str) -> steps.Step:
    """The handoff bench of one link (`--link-rate` unless loopback)."""
    rate = () if link == LOOPBACK else ("--link-rate", link)
    return steps.Step(steps.pdkv_argv(
        "bench", "handoff", "--transfer-modes", "pull,push", "--prompt-lens",
        str(args.prompt_len), "--repeats", str(args.repeats), *rate,
        "--result-json", result_json), args.timeout)


def medians(result: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """{mode: {"ttft_s", "exposed_s", "prefill_s"}}: medians over a modes result's rows, seconds.

    Raises:
        ValueError: the run was skipped or a mode has no row.
    """
    if result.get("skipped"):
        raise ValueError(f"pdkv bench handoff skipped: {result['skipped']}")
    out = {}
    for mode in ("pull", "push"):
        rows = [r for r in result.get("rows", []) if r["mode"] == mode]
        if not rows:
            raise ValueError(f"pdkv bench handoff returned no {mode} row")
        out[mode] = {k: statistics.median(float(r[k]) for r in rows)
                     for k in ("ttft_s", "exposed_s", "prefill_s")}
    return out


def plan_argv(prompt_len: int, prefill_tps: float, bandwidth: float) -> tuple[str, ...]:
    """`pdkv plan --json` for the handoff of `prompt_len` tokens at `prefill_tps` tokens/s over
    a link of `bandwidth` bytes/s."""
    return steps.pdkv_argv("plan", "--model", MODEL, "--prompt-len", str(prompt_len),
                           "--prefill-tps", f"{prefill_tps:.1f}", "--link-bandwidth",
                           f"{bandwidth:g}", "--json")


def plan_exposed(plan: Mapping[str, Any]) -> dict[str, float]:
    """{"pull", "push"}: `pdkv plan --json`'s handoff time and layer-wise push handoff, seconds.

    Raises:
        KeyError: the plan has no such figure.
    """
    figures = plan["figures"]
    return {"pull": float(figures["handoff_s"]["value"]),
            "push": float(figures["handoff_layerwise_s"]["value"])}


def row(link: str, got: Mapping[str, Mapping[str, float]],
        plan: Mapping[str, float] | None) -> list[str]:
    """One table row from a link's medians (seconds) and its plan (seconds; None: loopback)."""
    pull, push = got["pull"], got["push"]
    return [label(link), f"{pull['ttft_s']:.2f} / {push['ttft_s']:.2f}",
            f"{push['ttft_s'] / pull['ttft_s']:.2f}",
            f"{pull['exposed_s'] * 1e3:,.0f} / {push['exposed_s'] * 1e3:,.0f}",
            f"{plan['pull'] * 1e3:,.0f} / {plan['push'] * 1e3:,.0f}" if plan else "–"]


def table(rows: list[list[str]]) -> str:
    """The pipe table the guide shows."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def main(argv: Sequence[str] | None = None) -> int:
    """Run every link in turn, then print the table.

    Raises:
        RuntimeError: a handoff step failed or ran past its deadline (`--timeout`, seconds).
        subprocess.CalledProcessError, subprocess.TimeoutExpired: `pdkv plan` failed or hung.
        ValueError: a link is malformed or was skipped (not root), or a mode has no row.
    """
    args = parse_args(argv)
    for link in args.link_rates:
        label(link)  # malformed links fail before anything runs
    steps.stop_on_sigterm()
    from pdkv.launch.netns import rate_bytes_per_s

    rows, links = [], []
    with tempfile.TemporaryDirectory(prefix="pdkv-push-vs-pull-") as tmp:
        for i, link in enumerate(args.link_rates):
            path = str(Path(tmp) / f"{i}-{link}.json")
            steps.run(handoff_step(args, link, path), {tmp + "/": ""})
            result = json.loads(Path(path).read_text(encoding="utf-8"))
            got = medians(result)
            plan = None
            if link != LOOPBACK:
                cmd = plan_argv(args.prompt_len, args.prompt_len / got["pull"]["prefill_s"],
                                rate_bytes_per_s(link))
                print(f"$ {steps.shown(cmd)}", flush=True)
                out = subprocess.run(list(cmd), stdout=subprocess.PIPE, text=True, check=True,
                                     timeout=args.timeout).stdout
                plan = plan_exposed(json.loads(out))
            rows.append(row(link, got, plan))
            links.append({"link": link, "handoff": result, "plan": plan})
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"links": links}, indent=1) + "\n",
                                   encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
