"""A figure's block, rendered from its data file: the machine line, then the table (or the
command's printed text), so the guide and the data cannot disagree."""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path
from typing import Any

from pdkv.report import machine as machine_mod
from pdkv.report import markdown
from pdkv.report.figures import Figure

TRANSCRIBED = "transcribed from the guide; re-run with pdkv report"


def read_data(root: Path, figure: Figure) -> dict[str, Any]:
    """The figure's data file, parsed.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON, or not an object with a "machine" and a "table" / "text".
    """
    path = root / figure.data
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{figure.data}: not JSON: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("machine"), dict):
        raise ValueError(f"{figure.data}: no 'machine' object")
    if ("table" if figure.kind == "table" else "text") not in data:
        raise ValueError(f"{figure.data}: no '{'table' if figure.kind == 'table' else 'text'}'")
    return data


def write_data(root: Path, figure: Figure, data: dict[str, Any]) -> None:
    """Write the figure's data file (indented JSON, created with its folder)."""
    path = root / figure.data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_kept(root: Path, figure: Figure, kept: dict[str, bytes]) -> list[str]:
    """Write the files of a run that `figure.keep` names beside the guide (same path relative
    to the guide's folder as to `{dir}`), after removing the files an earlier run left under
    the same globs; returns the paths written, relative to `root`."""
    folder = root / (os.path.dirname(figure.guide) or ".")
    for pattern in figure.keep:
        for old in folder.glob(pattern):
            if old.is_file():
                old.unlink()
    written = []
    for name, blob in sorted(kept.items()):
        if any(fnmatch.fnmatch(name, g) for g in figure.keep):
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(blob)
            written.append(str(path.relative_to(root)))
    return written


def body(figure: Figure, data: dict[str, Any]) -> list[str]:
    """The lines inside the figure's block: the machine line with the command and the data
    file's link, a blank line, the table (or fenced text, or the markdown as it is), a blank
    line.

    Raises:
        ValueError: a table row has not as many cells as there are columns.
    """
    link = os.path.relpath(figure.data, os.path.dirname(figure.guide) or ".")
    how = "Made by" if figure.command else "Made by hand, no one command yet:"
    text = (f"{machine_mod.line(data['machine'])} {how} `{figure.command_text()}`; "
            f"data [{link}]({link}).")
    if data.get("provenance"):
        text += f" Data {data['provenance']}."
    if not figure.rerun:
        text += " A record of one past run (not re-run)."
    out = [text, ""]
    if figure.kind == "table":
        t = data["table"]
        out += markdown.render_table(t["columns"], t["rows"], t.get("align"))
    elif figure.kind == "markdown":
        out += data["text"]
    else:
        out += ["```", *data["text"], "```"]
    return [*out, ""]


def render_guide(text: str, figures: dict[str, Figure], datas: dict[str, dict[str, Any]]
                 ) -> str:
    """`text` (a guide) with every block of a figure in `datas` re-rendered from its data."""
    lines = text.split("\n")
    for block in markdown.blocks(lines):
        if block.figure in datas:
            lines = markdown.replace_block(lines, block.figure,
                                           body(figures[block.figure], datas[block.figure]))
    return "\n".join(lines)
