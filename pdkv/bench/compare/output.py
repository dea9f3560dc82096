"""`pdkv compare`'s report assembly: the plan's predictions joined to the measured rows, the
generated sections, the Markdown file, its plots and compare.json."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

from pdkv.bench.compare.args import machine_text, report_notes, report_paths
from pdkv.bench.compare.explain import explain
from pdkv.bench.compare.phases import phase_table
from pdkv.bench.compare.plan import (
    PlanContext,
    breakeven_lines,
    calibrate_fixed,
    measured_prefill_tps,
    plan_assumptions,
    plan_table,
    predict_row,
)
from pdkv.bench.compare.plots import write_plots
from pdkv.bench.compare.report import render_report
from pdkv.modelspec.hf_config import ModelSpec, spec_from_hf_config
from pdkv.plan.resolve import load_config


def rerender(args: argparse.Namespace, path: str, rendered_by: str) -> str:
    """Rewrite the report under `args.out` from a compare.json (no runs: after a change to the
    report code); the rows, command, date, machine and workload are the measured run's.

    Raises:
        OSError / ValueError: unreadable file or not a compare.json.
    """
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path} is not a pdkv compare.json")
    return write_report(
        data["rows"],
        args,
        command=data.get("command", "?"),
        date=data.get("date", "?"),
        skipped=data.get("skipped", {}),
        total_s=0.0,
        machine=data.get("machine"),
        workload=data.get("workload"),
        rendered_by=rendered_by,
    )


def plan_model(name: str) -> ModelSpec | None:
    """The planner's model spec for `name` (None when no config.json is found)."""
    try:
        cfg, _ = load_config(name)
        return spec_from_hf_config(cfg, name)
    except ValueError:
        return None


def workload_text(args: argparse.Namespace, total_s: float) -> str:
    """One line describing the sweep."""
    conc = ", ".join(str(c) if c else "unbounded" for c in args.max_concurrency)
    return (
        f"random prompts of {', '.join(map(str, args.input_lens))} tokens, {args.output_len} "
        f"output tokens, {args.num_prompts} prompts per run, max concurrency {conc}, request "
        f"rate {args.request_rate}, seed {args.seed}; model {args.model}; "
        + (
            f"pool tier {args.pool_tier}, chunk {args.pool_chunk_size} tokens; "
            if "pool" in str(args.topologies)
            else ""
        )
        + f"transfer {args.kv_transfer}"
        + (f"; capped link {args.link_rate}" if args.link_rate else "")
        + f"; total {total_s:.0f} s"
    )


def write_report(rows: list[dict[str, Any]], args: argparse.Namespace, *, command: str, date: str,
                 skipped: Mapping[str, str], total_s: float, machine: str | None = None,
                 workload: str | None = None, rendered_by: str | None = None) -> str:
    """Add the predictions to `rows` (in place), write the Markdown report, its plots and
    compare.json under `args.out`; returns the report text. `machine` / `workload`: the measured
    run's (when re-rendering from its compare.json; default this machine now and `args`);
    `rendered_by`: the command that re-rendered it."""
    machine = machine or machine_text()
    workload = workload or workload_text(args, total_s)
    ctx = PlanContext(args.kv_transfer, args.pool_tier, args.link_rate, args.link_rate_bps)
    for r in rows:  # measured handoffs first: the fixed cost is calibrated on them
        r["raw_phases"] = r.get("raw_phases") or {}
    fixed = calibrate_fixed(rows, ctx)
    for r in rows:
        r.update(predict_row(r, ctx, fixed[0] if fixed else None))
    model = plan_model(args.model)
    prefill = measured_prefill_tps(rows)
    f_s = fixed[0] if fixed else None
    pool_ran = any("pool" in r["topology"] for r in rows)
    breakeven = breakeven_lines(
        model, args.input_lens, prefill, ctx, fixed_s=f_s, pool_ran=pool_ran
    )
    if any(r.get("link_rate") for r in rows):
        breakeven += [
            x
            for x in breakeven_lines(model, args.input_lens, prefill, ctx, True, f_s, pool_ran)
            if x.startswith("P/D link")
        ]
    md_path, plot_dir, json_path = report_paths(args.out)
    plots: list[str] = []
    plot_note = None
    if args.no_plots:
        plot_note = "Plots: off (--no-plots)."
    elif rows:
        prefix = os.path.relpath(plot_dir, os.path.dirname(md_path) or ".")
        try:
            names = write_plots(rows, plot_dir, "compare_")
            plots = [os.path.normpath(os.path.join(prefix, n)) for n in names]
        except ImportError:
            plot_note = "Plots: skipped (matplotlib is not installed; `pip install matplotlib`)."
    sections = [
        ("TTFT phases (mean ms per request)", [phase_table(rows)]),
        ("Plan vs measured (per request)", [plan_table(rows)]),
        ("Break-even (`pdkv plan`, as a library)", breakeven),
        ("When it does not pay (generated from the rows above)", explain(rows)),
    ]
    sections = [(t, lines) for t, lines in sections if lines and lines[0]]
    if rendered_by:
        workload += f"; report re-rendered from its compare.json by `{rendered_by}`"
    text = render_report(
        rows,
        command=command,
        date=date,
        machine=machine,
        workload=workload,
        notes=report_notes(args) + plan_assumptions(ctx, fixed, pool_ran),
        skipped=skipped,
        plots=plots,
        plot_note=plot_note,
        sections=sections,
    )
    os.makedirs(os.path.dirname(md_path) or ".", exist_ok=True)
    os.makedirs(plot_dir, exist_ok=True)
    with open(md_path, "w") as f:
        f.write(text)
    with open(json_path, "w") as f:
        json.dump({"command": command, "date": date, "machine": machine,
                   "workload": workload.split("; report re-rendered")[0], "rows": rows,
                   "skipped": dict(skipped)}, f, indent=1, default=str)
    return text
