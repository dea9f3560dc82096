"""docs/SUPPORT_MATRIX.md and the JSON beside it (pure: data in, text out).

The JSON holds everything the Markdown shows; `render_markdown(read_json(p))` reproduces the
committed Markdown byte for byte, which a test checks so that the page is never edited by hand.
A partial run (`--quick`, `--models`, `--features`) is merged into the page it finds (`merge`):
the cells it re-checked are replaced and stamped with its date and commit, every other cell stays.
"""

from __future__ import annotations

import json
import os
from typing import TypedDict

from pdkv.matrix.catalog import (
    FAILED,
    FEATURES,
    MODELS,
    NOT_SUPPORTED,
    SKIPPED,
    VERIFIED,
    cell_order,
)
from pdkv.matrix.cells import Cell


class _CellFields(TypedDict):
    model: str
    feature: str
    status: str
    tests: list[str]
    detail: str
    seconds: float
    quick: bool
    command: str


class CellRecord(_CellFields, total=False):
    """A cell in the JSON document: `Cell`'s fields, its re-run command and, on a merged page,
    `checked` (the date and commit of the run that checked it)."""

    checked: str


class MergedRun(TypedDict):
    """A partial run merged into the page: its header and how many cells it re-checked."""

    generated: str
    command: str
    commit: str
    cells: int


class _DocFields(TypedDict):
    generated: str
    command: str
    commit: str
    cells: list[CellRecord]
    tagged: dict[str, list[str]]


class MatrixDoc(_DocFields, total=False):
    """The support matrix's JSON document (`merged`: only on a page partial runs updated)."""

    merged: list[MergedRun]


SYMBOLS = {VERIFIED: "✅ verified", FAILED: "❌ failed", NOT_SUPPORTED: "⛔ not supported",
           SKIPPED: "⏭ skipped"}


def to_data(cells: list[Cell], generated: str, command: str, commit: str,
            tagged: dict[str, list[str]] | None = None) -> MatrixDoc:
    """The JSON document: when and how it was made, every cell with its command, and every
    tagged test the run collected ("model/feature" → node ids, also those a subset left out)."""
    return {
        "generated": generated,
        "command": command,
        "commit": commit,
        "cells": [_cell_record(c) for c in cells],
        "tagged": dict(sorted((tagged or {}).items())),
    }


def _cell_record(c: Cell) -> CellRecord:
    return {"model": c.model, "feature": c.feature, "status": c.status, "tests": list(c.tests),
            "detail": c.detail, "seconds": c.seconds, "quick": c.quick, "command": c.command}


def _stamp(data: MatrixDoc) -> str:
    return f"{data['generated']} ({data['commit']})"


def merge(old: MatrixDoc, new: MatrixDoc) -> MatrixDoc:
    """A partial run's document (`new`) merged into the page it updates (`old`).

    The cells `new` holds replace old ones (same feature and model) and get `checked`: new's date
    and commit; every other cell is kept, with `checked` its own earlier stamp (the base run's when
    it has none). The header stays the base run's (`generated`, `command`, `commit`), and `merged`
    lists each partial run since: {generated, command, commit, cells}. `tagged` takes new's
    lists. Cells come in catalog order (features, then models)."""
    cells: dict[tuple[str, str], CellRecord] = {
        (c["feature"], c["model"]): {**c, "checked": c.get("checked", _stamp(old))}
        for c in old["cells"]
    }
    for c in new["cells"]:
        cells[(c["feature"], c["model"])] = {**c, "checked": _stamp(new)}

    run: MergedRun = {"generated": new["generated"], "command": new["command"],
                      "commit": new["commit"], "cells": len(new["cells"])}
    return {"generated": old["generated"], "command": old["command"], "commit": old["commit"],
            "cells": [cells[k] for k in sorted(cells, key=lambda k: cell_order(*k))],
            "tagged": dict(sorted({**old.get("tagged", {}), **new.get("tagged", {})}.items())),
            "merged": [*old.get("merged", []), run]}


def json_path(md_path: str) -> str:
    """The JSON file beside a Markdown path (same name, .json)."""
    return os.path.splitext(md_path)[0] + ".json"


def read_json(path: str) -> MatrixDoc:
    """Load a matrix JSON document (raises OSError / ValueError as `json.load` does)."""
    with open(path, encoding="utf-8") as f:
        data: MatrixDoc = json.load(f)
    return data


def write(md_path: str, data: MatrixDoc) -> None:
    """Write the Markdown at `md_path` and the JSON beside it."""
    os.makedirs(os.path.dirname(os.path.abspath(md_path)), exist_ok=True)
    with open(json_path(md_path), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
        f.write("\n")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(render_markdown(data))


def _esc(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(data: MatrixDoc) -> str:
    """The support matrix page: a grid (features × models) and one line per checked cell."""
    cells = {(c["feature"], c["model"]): c for c in data["cells"]}
    models = [m for m in MODELS if any(k[1] == m.id for k in cells)]
    features = [f for f in FEATURES if any(k[0] == f.id for k in cells)]
    counts = {s: sum(c["status"] == s for c in data["cells"]) for s in SYMBOLS}
    merged = data.get("merged") or []
    since = "".join(
        f" Cells re-checked since by `{r['command']}` on {r['generated']} (commit {r['commit']}, "
        f"{r['cells']} cells);" for r in merged)
    out = [
        "# Support matrix",
        "",
        f"Generated by `{data['command']}` on {data['generated']} (commit "
        f"{data['commit']});{since} do not edit, regenerate. Every cell is the outcome of the "
        "tests tagged `@pytest.mark.matrix(feature, model=...)` in the suite:",
        "- **verified**: greedy output token-identical to the reference (HF transformers or the "
        "colocated engine) and every KV block back to baseline;",
        "- **not supported**: pdkv refuses the feature with an error naming what is missing (the "
        "error text is below);",
        "- **failed**: a check failed; **skipped**: its dependency is missing here; "
        "`·`: no check tagged for the cell, or not selected by this run (`--quick`, `--models`, "
        "`--features`).",
        "",
        "Totals: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ". "
        "`pdkv matrix --quick` re-runs the cells marked *quick* (checks not marked `slow`: no "
        "SmolLM2 weights) and CI runs it.",
        "",
        "| feature | " + " | ".join(f"`{m.id}`" for m in models) + " |",
        "|---|" + "---|" * len(models),
    ]
    for f in features:
        row = [
            SYMBOLS[cells[(f.id, m.id)]["status"]] if (f.id, m.id) in cells else "·" for m in models
        ]
        out.append(f"| {f.title} (`{f.id}`) | " + " | ".join(row) + " |")
    out += ["", "Models:"]
    out += [f"- `{m.id}`: {m.title}" for m in models]
    # A merged page says when each cell was last checked (a full run checked them all at once).
    checked_col = " checked |" if merged else ""
    out += [
        "",
        "## Cells",
        "",
        "| feature | model | status | quick | detail | check |" + checked_col,
        "|---|---|---|---|---|---|" + ("---|" if merged else ""),
    ]
    for c in data["cells"]:
        out.append(
            f"| `{c['feature']}` | `{c['model']}` | {c['status']} | {'yes' if c['quick'] else ''} "
            f"| {_esc(c['detail'])} | `{_esc(c['command'])}` |"
            + (f" {c.get('checked', '')} |" if merged else "")
        )
    return "\n".join(out) + "\n"
