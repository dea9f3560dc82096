"""Render a plan as text (number beside its assumption) or as JSON (torch-free)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pdkv.plan.planner import Figure

SECTIONS = {
    "state": "State per token / per request",
    "context": "State of one request at --context lengths",
    "rank": "Per rank (TP shards heads, DCP shards tokens)",
    "handoff": "P→D handoff",
    "reload": "Recompute vs reload",
    "pcp": "Prefill context parallelism (one prompt's prefill split over N ranks)",
    "pd": "P:D ratio",
    "afd": "Attention-FFN disaggregation (paper estimate)",
}


def fmt_value(value: Any, unit: str) -> str:
    """Human form of a value: bytes in B/kB/MB/GB (1e3 steps), seconds in µs/ms/s."""
    if value is None:
        return "never" if unit == "tokens" else "n/a"
    if isinstance(value, str):
        return value
    if unit in ("B", "B/s"):
        suffix = "/s" if unit == "B/s" else ""
        for div, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(value) >= div:
                exact = f" ({value:,.0f} B)" if unit == "B" and isinstance(value, int) else ""
                return f"{value / div:.3g} {name}{suffix}{exact}"
        return f"{value:,.0f} B{suffix}"
    if unit == "s":
        if value == 0:
            return "0 s"
        if abs(value) < 1e-3:
            return f"{value * 1e6:.3g} µs"
        if abs(value) < 1:
            return f"{value * 1e3:.3g} ms"
        return f"{value:.3g} s"
    if unit == "tokens":
        return f"{value:,} tokens" if isinstance(value, int) else f"{value:,.0f} tokens"
    if unit == "ratio":
        return f"{value:.3g}"
    return f"{value:.4g} {unit}"


def render_text(header: Sequence[str], figures: Sequence[Figure]) -> str:
    """Sections of `label: value   [assumption]` lines under the header lines."""
    lines = list(header)
    section = None
    for f in figures:
        if f.section != section:
            section = f.section
            lines += ["", SECTIONS.get(section, section)]
        lines.append(f"  {f.label}: {fmt_value(f.value, f.unit)}")
        lines.append(f"      [{f.assumption}]")
    return "\n".join(lines) + "\n"


def render_json(inputs: dict[str, Any], figures: Sequence[Figure]) -> str:
    """{"inputs": ..., "figures": {key: {value, unit, label, section, assumption}}}."""
    out = {
        "inputs": inputs,
        "figures": {f.key: {"value": f.value, "unit": f.unit, "label": f.label,
                            "section": f.section, "assumption": f.assumption} for f in figures},
    }
    return json.dumps(out, indent=2, ensure_ascii=False) + "\n"
