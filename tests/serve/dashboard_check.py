"""Check docs/grafana.json against what engines serve on /metrics.

How the PromQL is read: every metric in the dashboard has the `pdkv:` prefix, so the metric
names in an expression are the matches of `pdkv:[A-Za-z0-9_:]+` (a PromQL metric name may
contain `:`; functions, `by (...)` labels, `$variables` and quoted label values never start with
`pdkv:`). A `{...}` right after a name is its selector: its `label="value"` matchers whose value
holds no `$` (fixed ones, e.g. source="local_compute") narrow the samples the liveness check
sums; template-variable matchers (`=~"$instance"`) and the other operators select everything
here and are ignored. No PromQL parser is needed for that.

A panel's description lists what it queries ("Queries: a, b.") and, for the panels expected to
show data after any short run, a marker "Always live (any deployment)." or "Always live (P/D)."
(only in a P/D deployment).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana.json"
METRIC_RE = re.compile(r"(pdkv:[A-Za-z0-9_:]+)(\{[^}]*\})?")
MATCHER_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
LIVE_RE = re.compile(r"Always live \((any deployment|P/D)\)\.")
QUERIES_RE = re.compile(r"Queries: ([^\n]*)\.")
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel with queries (rows flattened, row headers left out)."""
    out: list[dict[str, Any]] = []
    for p in dashboard["panels"]:
        if p.get("type") == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric name, fixed equality matchers) for every `pdkv:` metric in a PromQL expression."""
    out = []
    for name, braces in METRIC_RE.findall(expr):
        fixed = {
            k: v for k, op, v in MATCHER_RE.findall(braces or "") if op == "=" and "$" not in v
        }
        out.append((name, fixed))
    return out


def panel_selectors(panel: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
    return [s for t in panel.get("targets", []) for s in selectors(t["expr"])]


def live_scope(panel: dict[str, Any]) -> str | None:
    """"any deployment", "P/D" or None (not expected to be live)."""
    m = LIVE_RE.search(panel.get("description", ""))
    return m.group(1) if m else None


def listed_metrics(panel: dict[str, Any]) -> list[str]:
    m = QUERIES_RE.search(panel.get("description", ""))
    return [s.strip() for s in m.group(1).split(",")] if m else []


def scrape(texts: list[str]) -> tuple[set[str], list[tuple[str, dict[str, str], float]]]:
    """From /metrics texts (one per engine): the sample names their families declare (with or
    without samples yet) and every sample as (name, labels, value)."""
    declared: set[str] = set()
    samples: list[tuple[str, dict[str, str], float]] = []
    for text in texts:
        for family in text_string_to_metric_families(text):
            declared.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
            samples.extend((s.name, dict(s.labels), s.value) for s in family.samples)
    return declared, samples


def problems(dashboard: dict[str, Any], texts: list[str], scopes: set[str]) -> list[str]:
    """What is wrong: a queried metric no engine declares, or a panel live in one of `scopes`
    whose metric (with its fixed matchers) sums to zero over all engines."""
    declared, samples = scrape(texts)
    out = []
    for panel in panels(dashboard):
        live = live_scope(panel) in scopes
        for name, fixed in panel_selectors(panel):
            if name not in declared:
                out.append(f"{panel['title']}: {name} is not on /metrics")
                continue
            if live:
                total = sum(v for n, labels, v in samples
                            if n == name and all(labels.get(k) == val for k, val in fixed.items()))
                if total == 0:
                    out.append(f"{panel['title']} (always live): {name}{fixed or ''} is 0")
    return out
