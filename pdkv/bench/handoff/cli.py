"""`pdkv bench handoff`: the P→D KV handoff time of one request, measured, beside `pdkv plan`'s
prediction for the same bytes.

For each transfer engine a prefill (P) and a decode (D) engine run as two processes
(pdkv.bench.handoff.peer), like a separately launched prefill and decode server; this process
sends each prompt to P (prefill leg, max_tokens=1), hands P's kv_transfer_params to D, and D
pulls the prompt's KV over the P2P connector. Measured: the consumer's transfer time of that pull
(claim, read, done acknowledgement; KVConnectorOutput.transfer_seconds) and the bytes D received.
Predicted: `pdkv plan --kv-bytes <bytes>` on the engine's link preset (tcp-loopback / shm) or a
measured --link-bandwidth, with the fixed cost measured by a one-block probe pull first
(pdkv.bench.handoff.compare). PASS when within --tolerance (30 %).

`--link-rate 1gbit` runs P and D in two network namespaces joined by a veth pair whose ends carry
a tbf qdisc at that rate (pdkv.bench.netns; root and iproute2 needed, otherwise skipped with a
message): P binds and advertises 10.77.0.1, D (and this driver's requests) come from 10.77.0.2,
and the prediction uses `--link-bandwidth <rate in bytes/s>`. Only tcp crosses a network.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TypedDict, TypeVar

from pdkv.bench.handoff.compare import (
    DEFAULT_TOLERANCE,
    Comparison,
    compare,
    engine_link,
    fixed_from_probe,
    format_table,
)
from pdkv.bench.handoff.peer import DecodeReply, PrefillReply
from pdkv.bench.handoff.procs import (
    BLOCK_TOKENS,
    Peer,
    capped_lengths,
    link_unavailable,
    peers,
    prompt_tokens,
)
from pdkv.bench.netns import NetnsPair
from pdkv.bench.results import write_result_json
from pdkv.launch.netns import rate_bytes_per_s

T = TypeVar("T")


class HandoffResult(TypedDict, total=False):
    """What `run_handoff_bench` returns: the run's config, probes, rows and verdict, or only
    `skipped` (why the namespaces could not be made)."""

    config: dict[str, object]
    probes: dict[str, dict[str, float]]
    rows: list[dict[str, object]]
    preset_rows: list[dict[str, object]]
    all_pass: bool
    skipped: str

ENGINES = ("tcp", "shm")
DEFAULT_PROMPT_LENS = (1024, 4096, 8192)
PROBE_TOKENS = BLOCK_TOKENS  # one block: the fixed-cost probe
def _handoff(p: Peer, d: Peer, ids: list[int]) -> tuple[PrefillReply, DecodeReply]:
    pre: PrefillReply = json.loads(p.call({"prompt_token_ids": ids}))
    got: DecodeReply = json.loads(
        d.call({"prompt_token_ids": ids, "kv_transfer_params": pre["kv_transfer_params"]}))
    return pre, got


def run_handoff_bench(
    transfers: Sequence[str] = ENGINES,
    prompt_lens: Sequence[int] = DEFAULT_PROMPT_LENS,
    link_rate: str | None = None,
    bandwidths: dict[str, float] | None = None,
    fixed_s: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    seed: int = 0,
    print_table: bool = True,
    cold_kv_cache: bool = False,
    repeats: int = 1,
) -> HandoffResult:
    """Measure one request's handoff per transfer engine and prompt length and compare each with
    `pdkv plan`.

    Args:
        transfers: transfer engines (tcp, shm); with link_rate only tcp.
        prompt_lens: prompt tokens (clipped to 8191: SmolLM2 holds 8192 positions).
        link_rate: tc rate (e.g. "1gbit") of a namespace-pair link P and D talk over; None =
            loopback in the root namespace.
        bandwidths: measured effective bytes/s per engine (`pdkv bench transfer`) replacing the
            preset's; ignored with link_rate.
        fixed_s: per-handoff fixed cost (s) for the prediction; None = measured by a one-block
            probe pull before the prompts.
        tolerance: PASS when |measured − predicted| ≤ tolerance · predicted.
        seed: prompt token seed.
        print_table: print progress and the table.
        cold_kv_cache: start P and D without `--kv-cache-prefault`, so D receives each prompt's
            KV into pages it touches for the first time and the page faults are in the measured
            pull (default: both engines write their whole KV cache at start, and the pull is
            measured as the plan models it: bytes into resident memory).
        repeats: pulls per prompt length, of the same prompt: P's prefix cache serves the
            repeats (only the first pays the prefill) and D pulls the whole prompt each time;
            the row's measured time is their median, and each pull's time is in "pulls_s".

    Returns:
        {"config": {...}, "rows": [Comparison fields + ratio, pass, plan_command],
        "preset_rows": the same against the presets when `bandwidths` replaced them,
        "probes": {transfer: {"seconds", "first_seconds", "bytes", "fixed_s"}}, "all_pass": bool
        (judged on "rows")} or, when the
        namespaces cannot be made, {"skipped": reason}.

    Raises:
        ValueError: bad engines, lengths, rate or repeats.
        RuntimeError: a peer failed, timed out, or an ip/tc command failed; repeated pulls of
            one prompt moved different bytes.
    """
    transfers = list(dict.fromkeys(transfers))
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    bad = [t for t in transfers if t not in ENGINES]
    if not transfers or bad:
        raise ValueError(f"transfers must be from {ENGINES}, got {transfers}")
    lens = capped_lengths(prompt_lens)
    rate_bps = rate_bytes_per_s(link_rate) if link_rate else None
    if link_rate and transfers != ["tcp"]:
        raise ValueError("--link-rate caps a network link: only --transfer tcp crosses one")
    say = print if print_table else (lambda *a, **k: None)
    reason = link_unavailable(link_rate, say)
    if reason:
        return {"skipped": reason}
    rows: list[Comparison] = []
    preset_rows: list[Comparison] = []  # the same measurements against the presets (reference)
    probes: dict[str, dict[str, float]] = {}
    pulls_s: dict[tuple[str, int], list[float]] = {}
    config: dict[str, object] = {
        "transfers": transfers,
        "prompt_lens": lens,
        "link_rate": link_rate,
        "bandwidths": bandwidths or {},
        "fixed_s": fixed_s,
        "tolerance": tolerance,
        "seed": seed,
        "cold_kv_cache": cold_kv_cache,
        "repeats": repeats,
    }
    with tempfile.TemporaryDirectory(prefix="pdkv-handoff-") as log_dir, \
            (NetnsPair(rate=link_rate) if link_rate else contextlib.nullcontext()) as pair:
        if pair is not None:
            say(
                f"namespaces {pair.ns('p')} ({pair.host('p')}) and {pair.ns('d')} "
                f"({pair.host('d')}); {pair.qdisc('p')}"
            )
        for transfer in transfers:
            link = engine_link(
                transfer, (bandwidths or {}).get(transfer), rate_bps, link_rate or ""
            )
            say(f"[{transfer}] starting P and D ...", flush=True)
            with peers(transfer, lens, pair, log_dir, prefault=not cold_kv_cache) as (p, d):
                # Two one-block probes: the first also pays the handshake and the data
                # connection (cached per peer afterwards); the second is the steady-state cost.
                _, cold = _handoff(p, d, prompt_tokens(PROBE_TOKENS, seed + 998))
                _, probe = _handoff(p, d, prompt_tokens(PROBE_TOKENS, seed + 999))
                probe_s = sum(probe["transfer_seconds"])
                fixed = (
                    fixed_s
                    if fixed_s is not None
                    else fixed_from_probe(probe_s, probe["bytes"], link)
                )
                probes[transfer] = {"seconds": probe_s, "bytes": probe["bytes"], "fixed_s": fixed,
                                    "first_seconds": sum(cold["transfer_seconds"])}
                say(
                    f"[{transfer}] probe: {PROBE_TOKENS} tokens, {probe['bytes']:.0f} B in "
                    f"{probe_s * 1e3:.2f} ms (first pull "
                    f"{probes[transfer]['first_seconds'] * 1e3:.2f} ms) → "
                    f"fixed cost {fixed * 1e3:.2f} ms",
                    flush=True,
                )
                for i, n in enumerate(lens):
                    ids = prompt_tokens(n, seed + i)
                    pulls = [_handoff(p, d, ids) for _ in range(repeats)]
                    pre, got = pulls[0]
                    moved = {g["bytes"] for _, g in pulls}
                    if len(moved) > 1:
                        raise RuntimeError(f"[{transfer}] {n} tokens: the repeated pulls moved "
                                           f"different bytes {sorted(moved)}")
                    times = [sum(g["transfer_seconds"]) for _, g in pulls]
                    row = compare(transfer, link, n, got["bytes"], statistics.median(times),
                                  fixed, pre["prefill_s"])
                    rows.append(row)
                    pulls_s[(transfer, n)] = times
                    if link.name == "custom" and not link_rate:  # the preset too, for reference
                        preset_rows.append(compare(transfer, engine_link(transfer), n, row.nbytes,
                                                   row.measured_s, fixed, row.prefill_s))
                    each = (f" (median of {repeats}: "
                            + ", ".join(f"{t * 1e3:.1f}" for t in times) + ")"
                            if repeats > 1 else "")
                    say(f"[{transfer}] {n} tokens: prefill {pre['prefill_s']:.1f} s, handoff "
                        f"{row.measured_s * 1e3:.1f} ms measured{each} / "
                        f"{row.predicted_s * 1e3:.1f} ms predicted ({row.plan_command()})",
                        flush=True)
    if print_table:
        print()
        print(format_table(rows, tolerance))
        if preset_rows:
            print("\nthe same measurements against the link presets (not judged):")
            print(format_table(preset_rows, tolerance))
    return {
        "config": config,
        "probes": probes,
        "rows": [
            dict(
                asdict(r),
                ratio=r.ratio,
                measured_gbps=r.measured_gbps,
                pulls_s=pulls_s[(r.transfer, r.prompt_len)],
                plan_command=r.plan_command(),
                **{"pass": r.within(tolerance)},
            )
            for r in rows
        ],
        "preset_rows": [
            dict(
                asdict(r),
                ratio=r.ratio,
                plan_command=r.plan_command(),
                **{"pass": r.within(tolerance)},
            )
            for r in preset_rows
        ],
        "all_pass": all(r.within(tolerance) for r in rows),
    }


def _parse_list(text: str, kind: Callable[[str], T]) -> list[T]:
    try:
        vals = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return vals


def _parse_bandwidths(values: list[str] | None) -> dict[str, float]:
    out = {}
    for v in values or []:
        engine, _, bw = v.partition("=")
        if engine not in ENGINES or not bw:
            raise ValueError(
                f"--link-bandwidth takes ENGINE=BYTES_PER_S with ENGINE in {ENGINES}, got {v!r}"
            )
        out[engine] = float(bw)
    return out


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `pdkv bench handoff` flags."""
    parser.add_argument("--transfer", type=lambda s: _parse_list(s, str), default=None,
                        help="comma-separated transfer engines from tcp,shm (default tcp,shm; tcp "
                             "with --link-rate)")
    parser.add_argument(
        "--prompt-lens",
        type=lambda s: _parse_list(s, int),
        default=",".join(map(str, DEFAULT_PROMPT_LENS)),
        help="comma-separated prompt lengths in tokens (8192 runs as 8191)",
    )
    parser.add_argument("--link-rate", default=None,
                        help="cap the P→D link with tbf at this rate (e.g. 1gbit): P and D in two "
                             "network namespaces (root, iproute2); tcp only")
    parser.add_argument(
        "--link-bandwidth",
        action="append",
        default=None,
        metavar="ENGINE=B/s",
        help="measured effective bandwidth replacing the preset's (from `pdkv bench "
        "transfer`), e.g. tcp=2.1e9; repeatable",
    )
    parser.add_argument(
        "--fixed-cost",
        type=float,
        default=None,
        help="per-handoff fixed cost, seconds (default: measured by a one-block probe)",
    )
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help="PASS when |measured − predicted| <= tolerance × predicted")
    parser.add_argument("--seed", type=int, default=0, help="prompt token seed")
    parser.add_argument("--cold-kv-cache", action="store_true",
                        help="start P and D without --kv-cache-prefault: D then receives the KV "
                        "into pages it touches for the first time, and their page faults are "
                        "part of the measured pull (as for a CPU engine's first requests); "
                        "default: both write their whole KV cache at start")
    parser.add_argument(
        "--transfer-modes",
        type=lambda s: _parse_list(s, str),
        default=None,
        help="comma-separated P2P transfer modes from pull,push: measure one request's TTFT "
        "with each instead of the pull's handoff time (tcp; pdkv/bench/handoff/modes.py)",
    )
    parser.add_argument("--repeats", type=int, default=1,
                        help="requests per prompt length (and mode, with --transfer-modes); a "
                        "handoff row compares the median of its pulls (P's prefix cache serves "
                        "the repeats, D pulls the whole prompt each time)")
    parser.add_argument("--timeline-plot", default=None, metavar="PNG",
                        help="--transfer-modes: draw the last push request's per-layer compute "
                        "vs wire timeline here")
    parser.add_argument("--result-json", default=None, help="write the result dict to this file")
    return parser


def main(args: argparse.Namespace) -> int:
    """Run from `add_cli_args` flags; exit code 0 when every row passes (or the run was skipped), 1
    otherwise."""
    # A plain `kill` unwinds like Ctrl-C: peers stop and the namespaces are deleted.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.transfer_modes:
        from pdkv.bench.handoff.modes import run_modes_bench

        if args.transfer not in (None, ["tcp"]):
            raise SystemExit("--transfer-modes runs over the tcp transfer engine only")
        from pdkv.bench.handoff.modes import plot_timeline

        modes = run_modes_bench(args.transfer_modes, args.prompt_lens, args.link_rate,
                                args.seed, args.repeats)
        if args.result_json:
            write_result_json(modes, args.result_json)
        if args.timeline_plot and "timeline" in modes:
            line = modes["timeline"]
            why = plot_timeline(line, args.timeline_plot,
                                f"push, {line['prompt_tokens']} tokens, link "
                                f"{args.link_rate or 'loopback'}: per layer, P's compute vs the "
                                "write of its KV")
            print(f"timeline: {why or args.timeline_plot}")
        return 0
    transfers = args.transfer or (["tcp"] if args.link_rate else list(ENGINES))
    result = run_handoff_bench(transfers, args.prompt_lens, args.link_rate,
                               _parse_bandwidths(args.link_bandwidth), args.fixed_cost,
                               args.tolerance, args.seed, cold_kv_cache=args.cold_kv_cache,
                               repeats=args.repeats)
    if args.result_json:
        write_result_json(result, args.result_json)
    return 0 if result.get("skipped") or result["all_pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main(add_cli_args(argparse.ArgumentParser(description=__doc__)).parse_args()))
