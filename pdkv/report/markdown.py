"""Figure blocks and tables in a markdown guide (torch-free, no I/O).

A figure block is

    <!-- figure: ID -->
    Machine: ... (one line, rendered from the figure's data)

    | table rendered from the data |
    <!-- /figure -->

A table is a GitHub pipe table: a row of cells followed by a separator row (`|---|---:|`), then
its body rows, outside fenced code. A table outside any block whose cells look measured must be
annotated `<!-- not-a-figure: reason -->` on the line right above it (`measured_cells`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OPEN = re.compile(r"^<!-- figure: ([a-z0-9][a-z0-9-]*) -->$")
CLOSE = "<!-- /figure -->"
NOT_A_FIGURE = re.compile(r"^<!-- not-a-figure: (.+) -->$")
SEPARATOR = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+$")
FENCE = re.compile(r"^\s*(```|~~~)")

# A number followed by a unit of time, rate, size or a ratio / share sign: what a measurement
# looks like in a cell ("2,068 ms", "3.88 GB/s", "79 %", "1.08x", "1109 MB").
UNIT = (r"(?:ms|µs|us|ns|s|min|h|tok/s|req/s|tokens/s|GB/s|MB/s|GiB/s|MiB/s|GFLOP/s|"
        r"B|kB|KB|MB|GB|KiB|MiB|GiB|%|x|×)")
MEASURED_CELL = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?" + UNIT + r"(?![\w/])")
# A header that names a measured quantity; a numeric cell under it is a measurement.
MEASURED_HEADER = re.compile(
    r"\b(ms|µs|tok/s|req/s|GB/s|MB/s|GiB/s|GFLOP/s|MiB|TTFT|TPOT|ITL|E2EL|p50|p90|p99|"
    r"median|mean|ratio|hit rate|RSS|load avg|duration|throughput)\b|/ ?(?:HF|torch|oneDNN|"
    r"onednn|llama\.cpp|N=1)\b",
    re.IGNORECASE)
_NUM = r"-?\d[\d,]*(?:\.\d+)?"
# A bare number, or a pair of them ("5997 / 7604", "1.51 → 1.23"), with at most a short suffix.
NUMBER = re.compile(r"^[~≈<>≤≥]?\s?" + _NUM + r"(?:\s?(?:/|→)\s?" + _NUM + r")*\s?\S{0,6}$")
# A row label naming its unit ("duration (s)", "throughput (req/s)"): a transposed table.
UNIT_LABEL = re.compile(r"\((?:s|ms|µs|tok/s|req/s|GB/s|MB|GB|MiB|%)\)")


@dataclass(frozen=True)
class Table:
    """A pipe table: its first line's index in the text (0-based), header cells, alignment
    ("", "left", "right", "center" per column) and body rows (cells as written, stripped)."""

    line: int
    end: int  # index after its last row
    columns: list[str]
    align: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class Block:
    """A figure block: its id and the indexes of its opening and closing marker lines."""

    figure: str
    start: int
    end: int


def split_row(line: str) -> list[str]:
    """The cells of a pipe-table row (outer pipes dropped, `\\|` kept inside a cell)."""
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return [c.strip() for c in re.split(r"(?<!\\)\|", body)]


def _align(cell: str) -> str:
    cell = cell.strip()
    if cell.startswith(":") and cell.endswith(":"):
        return "center"
    return "right" if cell.endswith(":") else "left" if cell.startswith(":") else ""


def tables(lines: list[str]) -> list[Table]:
    """Every pipe table outside fenced code, in order. A row followed by a separator row starts a
    new table (a command that prints two tables with no blank line between them)."""
    out: list[Table] = []
    fenced = False
    i = 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            fenced = not fenced
            i += 1
            continue
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if not fenced and lines[i].lstrip().startswith("|") and SEPARATOR.match(nxt):
            j = i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|") and not (
                    j + 1 < len(lines) and SEPARATOR.match(lines[j + 1].strip())):
                j += 1
            out.append(Table(i, j, split_row(lines[i]), [_align(c) for c in split_row(nxt)],
                             [split_row(r) for r in lines[i + 2:j]]))
            i = j
            continue
        i += 1
    return out


GRID_RULE = re.compile(r"^-+(?:-\+-+)+$")


def printed_tables(lines: list[str]) -> list[Table]:
    """The tables a command printed, in order: pipe tables, and plain-text grids (a header of
    cells joined by " | ", a rule of dashes joined by "-+-", rows until a line without " | ")."""
    found = {t.line: t for t in tables(lines)}
    for i in range(len(lines) - 1):
        if " | " in lines[i] and GRID_RULE.match(lines[i + 1].strip()):
            j = i + 2
            while j < len(lines) and " | " in lines[j]:
                j += 1
            cols = [c.strip() for c in lines[i].split(" | ")]
            found[i] = Table(i, j, cols, [""] * len(cols),
                             [[c.strip() for c in r.split(" | ")] for r in lines[i + 2:j]])
    return [found[k] for k in sorted(found)]


def blocks(lines: list[str]) -> list[Block]:
    """Every figure block, in order.

    Raises:
        ValueError: a block is not closed, is nested, or a closing marker has no opening one
            (the message names the line, 1-based).
    """
    out: list[Block] = []
    current: tuple[str, int] | None = None
    for i, line in enumerate(lines):
        m = OPEN.match(line.strip())
        if m:
            if current is not None:
                raise ValueError(f"line {i + 1}: figure {m.group(1)} opens inside figure "
                                 f"{current[0]} (line {current[1] + 1})")
            current = (m.group(1), i)
        elif line.strip() == CLOSE:
            if current is None:
                raise ValueError(f"line {i + 1}: {CLOSE} without an opening marker")
            out.append(Block(current[0], current[1], i))
            current = None
    if current is not None:
        raise ValueError(f"line {current[1] + 1}: figure {current[0]} is never closed")
    return out


def measured_cells(table: Table) -> list[str]:
    """The cells of `table` that look like measurements: a number with a unit of time, rate,
    size, share or ratio anywhere in the table, or a bare number under a header naming a measured
    quantity (ms, tok/s, TTFT, p99, ratio, ...) or in a row whose label does. Empty: the table
    reads as reference text."""
    found: list[str] = []
    measured_cols = {k for k, c in enumerate(table.columns) if MEASURED_HEADER.search(c)}
    for row in table.rows:
        label = bool(row) and bool(MEASURED_HEADER.search(row[0]) or UNIT_LABEL.search(row[0]))
        for k, cell in enumerate(row):
            named = k in measured_cols or (label and k > 0)
            if MEASURED_CELL.search(cell) or (named and NUMBER.match(cell)):
                found.append(cell)
    return found


def not_a_figure(lines: list[str], line: int) -> str | None:
    """The reason given by a `<!-- not-a-figure: reason -->` line right above line `line` (a
    table's or a fence's first, 0-based), if any."""
    if line == 0:
        return None
    m = NOT_A_FIGURE.match(lines[line - 1].strip())
    return m.group(1) if m else None


@dataclass(frozen=True)
class Fence:
    """A fenced code block: its opening line's index, the index after its closing line, its
    language tag ("" when none) and its lines."""

    line: int
    end: int
    lang: str
    body: list[str]


def fences(lines: list[str]) -> list[Fence]:
    """Every fenced code block, in order (an unclosed one runs to the end)."""
    out: list[Fence] = []
    i = 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            j = i + 1
            while j < len(lines) and not FENCE.match(lines[j]):
                j += 1
            lang = lines[i].strip().lstrip("`~").strip()
            out.append(Fence(i, min(j + 1, len(lines)), lang, lines[i + 1:j]))
            i = j + 1
            continue
        i += 1
    return out


def printed_measurements(fence: Fence) -> list[str]:
    """The lines of a command's printed output (a fence with no language tag, or "text" /
    "console") that hold a measurement-looking number (MEASURED_CELL); empty for code."""
    if fence.lang not in ("", "text", "console"):
        return []
    return [x for x in fence.body if MEASURED_CELL.search(x)]


def render_table(columns: list[str], rows: list[list[str]], align: list[str] | None = None
                 ) -> list[str]:
    """A pipe table's lines from its header, rows (cells as text) and alignment.

    Raises:
        ValueError: a row has not as many cells as there are columns.
    """
    marks = {"": "---", "left": ":---", "right": "---:", "center": ":---:"}
    align = align or [""] * len(columns)
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"row {row!r} has {len(row)} cells for {len(columns)} columns")
    def line(cells: list[str]) -> str:
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    return ([line(columns), "|" + "|".join(marks[a] for a in align) + "|"]
            + [line(row) for row in rows])


def replace_block(lines: list[str], figure: str, body: list[str]) -> list[str]:
    """`lines` with the inside of figure `figure`'s block replaced by `body`, each non-empty line
    indented as the opening marker is (a block inside a list item).

    Raises:
        ValueError: the guide has no block, or more than one, for `figure`.
    """
    found = [b for b in blocks(lines) if b.figure == figure]
    if len(found) != 1:
        raise ValueError(f"{len(found)} blocks for figure {figure} (need exactly one "
                         f"'<!-- figure: {figure} -->' ... '{CLOSE}')")
    b = found[0]
    opening = lines[b.start]
    indent = opening[:len(opening) - len(opening.lstrip())]
    return lines[:b.start + 1] + [indent + x if x else x for x in body] + lines[b.end:]
