"""`pdkv report` (also `make figures`): re-make the figures of README.md and docs/, or list the
stale ones (`--check`), or re-render the blocks from the data (`--render-only`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from pdkv.report import markdown, render, runner, stale
from pdkv.report.figures import MIN_REQUESTS_FOR_P99, Figure, by_id, validate
from pdkv.report.machine import Probe

ROOT = Path(__file__).resolve().parents[2]
EXIT_REFUSED = 3


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The flags of `pdkv report`."""
    p.add_argument("--only", default="", help="comma-separated figure ids (default: all)")
    p.add_argument("--list", action="store_true",
                   help="list the figures: id, guide, command, and whether its data is stale")
    p.add_argument("--check", action="store_true",
                   help="list figures whose data predate a change to the code they measure, ran "
                   "on uncommitted changes to it, name no commit this repository knows, ended "
                   f"above {stale.LOAD_AFTER_MARGIN} x the cores (not judged for the soak, whose "
                   f"own load is above), show a p99 from fewer than {MIN_REQUESTS_FOR_P99} "
                   "requests per point, or have no data file "
                   "(and which only another kind of CPU can re-make); runs nothing, exits 0 "
                   "(see --strict)")
    p.add_argument("--strict", action="store_true", help="with --check: exit 1 when any is stale")
    p.add_argument("--render-only", action="store_true",
                   help="re-render the guides' blocks from the data files; runs nothing")
    p.add_argument("--force", action="store_true",
                   help="measure even when the 1-minute load average exceeds the core count "
                   "(the figure's machine line then says FORCED)")
    p.add_argument("--wait-quiet", type=float, default=300.0,
                   help="seconds to wait for the load average to fall to the core count before "
                   "refusing a figure (the previous figure's own load takes a minute or two to "
                   "decay)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds one figure's command may run (default: no limit); then its "
                   "process group gets SIGTERM, so a recipe stops what it started, and SIGKILL "
                   "30 s later")
    p.add_argument("--output-dir", default="pdkv-logs/report",
                   help="each figure's command writes its files (logs, summaries, plots) into "
                   "OUTPUT_DIR/ID/out/ (its {dir}; a --json result: OUTPUT_DIR/ID/result.json), "
                   "kept after the run, failed or not, until the figure's next run; relative to "
                   "--root (empty: a temporary folder, removed)")
    p.add_argument("--root", default=str(ROOT), help="repository root (default: this pdkv's)")


def main(args: argparse.Namespace) -> int:
    """`pdkv report` over the registered figures. A reader that closes the pipe early
    (`pdkv report --list | head`) ends the listing quietly."""
    from pdkv.report.registry import FIGURES

    stop_on_sigterm()
    try:
        return report(args, FIGURES, Probe())
    except BrokenPipeError:
        # Python's documented way: point stdout at devnull so the exit flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def stop_on_sigterm() -> None:
    """Make SIGTERM unwind this process (SystemExit 143) instead of ending it at once, so the
    figure's command and whatever it started are stopped too (`runner.measure`'s clean-up), as
    on Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _guide_path(root: Path, figure: Figure) -> Path:
    return root / figure.guide


def render_guides(root: Path, figures: tuple[Figure, ...],
                  datas: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Re-render, in their guides, the blocks of `figures` from `datas` (default: their data
    files); returns the guides changed.

    Raises:
        OSError, ValueError: a data file is missing or malformed, or a guide has no block (or
            more than one) for a figure.
    """
    if datas is None:
        datas = {f.id: render.read_data(root, f) for f in figures}
    changed = []
    by_guide: dict[str, list[Figure]] = {}
    for f in figures:
        if f.id in datas:
            by_guide.setdefault(f.guide, []).append(f)
    for guide, figs in by_guide.items():
        path = root / guide
        text = path.read_text(encoding="utf-8")
        lines = text.split("\n")
        for f in figs:
            lines = markdown.replace_block(lines, f.id, render.body(f, datas[f.id]))
        new = "\n".join(lines)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(guide)
    return changed


def report(args: argparse.Namespace, figures: tuple[Figure, ...], probe: Probe) -> int:
    """Run `pdkv report` with parsed `args` over `figures`, reading the load through `probe`.
    Returns the exit status: 0, 1 (a figure failed; --check --strict: one is stale) or 3 (refused:
    the load average exceeds the core count)."""
    validate(figures)
    root = Path(args.root)
    chosen = by_id(figures, [x for x in args.only.split(",") if x.strip()])
    if args.list or args.check:
        stale_ids = {f.id: why for f, why in stale.check(root, chosen)}
        flags = probe.flags()  # /proc/cpuinfo, read once
        mismatch = {f.id: f.isa_mismatch(flags) for f in chosen if f.id in stale_ids}
        elsewhere = {k: v for k, v in mismatch.items() if v}
        for f in chosen:
            why = stale_ids.get(f.id)
            if why and f.id in elsewhere:
                why += f" (not here: {elsewhere[f.id]})"
            if args.list:
                print(f"{f.id}  {f.guide}  {f.command_text()}"
                      + (f"  [needs {f.needs}]" if f.needs else "")
                      + (f"  [{f.isa} CPU]" if f.isa else "")
                      + (f"  STALE: {why}" if why else ""))
            elif why:
                print(f"{f.id} ({f.guide}): {why}")
        if args.check:
            other = f", {len(elsewhere)} of them only on another kind of CPU" if elsewhere else ""
            print(f"{len(stale_ids)} of {len(chosen)} figures stale{other}", file=sys.stderr)
        return 1 if args.check and args.strict and stale_ids else 0
    if args.render_only:
        for guide in render_guides(root, chosen):
            print(f"re-rendered {guide}")
        return 0
    failed = made = skipped = 0
    runs: dict[tuple[str, ...], runner.Measured] = {}
    for f in chosen:
        if not f.command or not f.rerun:
            why = "a record of a past run" if not f.rerun else "no command yet"
            print(f"{f.id}: skipped ({why})", file=sys.stderr)
            skipped += 1
            continue
        wrong_cpu = f.isa_mismatch(probe.flags())
        if wrong_cpu:
            print(f"{f.id}: skipped ({wrong_cpu})", file=sys.stderr)
            skipped += 1
            continue
        markdown.replace_block(_guide_path(root, f).read_text(encoding="utf-8").split("\n"),
                               f.id, [])  # the guide holds its block: checked before the run
        try:
            if f.command not in runs:  # figures of one command share its run (and keeps)
                keep = tuple(g for x in chosen if x.command == f.command for g in x.keep)
                runs[f.command] = runner.measure(
                    root, f, probe, args.force, args.timeout, args.wait_quiet, keep,
                    root / args.output_dir / f.id if args.output_dir else None)
        except runner.Refused as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_REFUSED
        except (RuntimeError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        try:
            data = runner.to_data(f, runs[f.command])
        except (TypeError, KeyError, ValueError) as e:  # the run is kept: nothing measured is lost
            raw = runner.keep_raw(f, runs[f.command])
            print(f"error: figure {f.id}: its output does not convert ({e}); the run's output "
                  f"and machine are kept in {raw}", file=sys.stderr)
            failed += 1
            continue
        render.write_data(root, f, data)
        kept = render.write_kept(root, f, runs[f.command].kept)
        render_guides(root, (f,), {f.id: data})
        print(f"{f.id}: wrote {f.data}" + "".join(f", {k}" for k in kept)
              + f" and its block in {f.guide}")
        made += 1
    print(f"{made} figures made, {skipped} skipped, {failed} failed", file=sys.stderr)
    return 1 if failed else 0
