"""The registry of figures: every measured table of README.md and docs/*.md, the command that
makes it, the code it measures and where its data lives (torch-free).

A command is an argv whose placeholders `pdkv report` fills in: `{python}` (the running
interpreter), `{json}` (a file the command writes its result to) and `{dir}` (an empty folder
for its other files). Without `{json}` the command's stdout is its result."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pdkv.report import markdown

# p99 of fewer requests is the maximum, not a percentile: a figure whose table shows p99 runs at
# least this many requests per point.
MIN_REQUESTS_FOR_P99 = 20

PDKV = ("{python}", "-m", "pdkv.cli")

# Code every engine-level measurement depends on.
ENGINE = ("pdkv/engine", "pdkv/model", "pdkv/worker", "pdkv/sched", "pdkv/cache",
          "pdkv/executor")
SERVING = (*ENGINE, "pdkv/serve", "pdkv/router", "pdkv/launch", "pdkv/bench/serve")
PD = (*SERVING, "pdkv/kv_transfer")


@dataclass(frozen=True)
class Figure:
    """One measured table.

    id: the marker's name (`<!-- figure: ID -->`) and the data file's (docs/figures/ID.json).
    guide: the markdown file holding the block, relative to the repository root.
    command: the argv that makes it (placeholders above); empty when no one command does yet,
        and then `how` says what was run.
    measures: repository paths (files or folders) of the code it measures: a commit touching any
        of them after the data's commit makes the figure stale.
    requests_per_point: requests behind each row's statistics (None: not a request benchmark).
    percentiles: the table shows p99 (or p90): then requests_per_point must be at least
        MIN_REQUESTS_FOR_P99.
    convert: "module:function" turning the command's output into the data's "table" or "text"
        (default `default_convert`: the table the command printed, or wrote to the markdown
        file `table_source` in `{dir}`, whose first header cell starts with `table_header`, else
        the `table_index`-th).
    rerun: False for a record of one past run that the guide discusses as such (a "before"
        table): `pdkv report` does not run it and --check does not call it stale.
    needs: what the command needs beyond this repository ("root", "llama.cpp"), said by --list.
    kind: "table" (a pipe table), "text" (a command's printed output, in a code fence) or
        "markdown" (markdown the command wrote, such as a report's generated notes and plot
        links, rendered as it is; its converter returns it as "text" lines).
    keep: globs, relative to `{dir}`, of files the command writes that the guide links (plots,
        the raw result): they are written beside the guide at the same relative path, after
        the files of an earlier run under the same globs are removed.
    exit_codes: the command's exit statuses that are a run (`pdkv bench handoff` exits 1 when
        a row misses its tolerance: a finding its table shows); any other fails the figure.
    isa: the CPU its table describes: "avx2" (AVX2 without AVX-512F) or "avx512" (AVX-512F);
        on another CPU `pdkv report` skips it, so a guide's per-ISA tables are never re-made on
        the wrong one (empty: any CPU).
    overloads: its command keeps more work running than the box has cores, by design (the
        soak: 64 clients, three engines and two proxies on 2 cores), so the load average at
        its end is its own: `pdkv report --check` does not judge its load after (the load
        before, which decides whether it may start, is judged as for any figure).
    """

    id: str
    guide: str
    command: tuple[str, ...]
    measures: tuple[str, ...]
    requests_per_point: int | None = None
    percentiles: bool = False
    convert: str = ""
    rerun: bool = True
    how: str = ""
    needs: str = ""
    kind: str = "table"
    table_index: int = 0
    table_source: str = ""
    table_header: str = ""
    keep: tuple[str, ...] = ()
    exit_codes: tuple[int, ...] = (0,)
    isa: str = ""
    overloads: bool = False

    def isa_mismatch(self, flags: str) -> str | None:
        """Why this figure may not be made on a CPU with these flags (/proc/cpuinfo's names,
        space-separated), or None when it may."""
        have = set(flags.split())
        avx512 = "avx512f" in have
        if self.isa == "avx512" and not avx512:
            return "its table is of an AVX-512 CPU; this one has no avx512f"
        if self.isa == "avx2" and (avx512 or "avx2" not in have):
            return "its table is of an AVX2-only CPU; this one " + (
                "has AVX-512" if avx512 else "has no avx2")
        return None

    @property
    def data(self) -> str:
        """The data file, relative to the repository root."""
        return f"docs/figures/{self.id}.json"

    def command_text(self) -> str:
        """The command as a user types it (`pdkv ...`; `{json}` shown as PATH), or `how`."""
        if not self.command:
            return self.how
        argv = list(self.command)
        if tuple(argv[:3]) == PDKV:
            argv = ["pdkv", *argv[3:]]
        elif argv[:2] == ["{python}", "-m"]:
            argv = ["python", "-m", *argv[2:]]
        argv = [a.replace("{json}", "PATH").replace("{dir}", "DIR") for a in argv]
        return " ".join(a if a and " " not in a else repr(a) for a in argv)


def validate(figures: tuple[Figure, ...]) -> None:
    """Check a registry.

    Raises:
        ValueError: an id is repeated or malformed, a kind is unknown, a figure with percentiles
            runs fewer than MIN_REQUESTS_FOR_P99 requests per point, one without a command
            says nothing in `how`, or one keeps files without a `{dir}` in its command (or by
            a glob that leaves `{dir}`).
    """
    seen: set[str] = set()
    for f in figures:
        if f.id in seen:
            raise ValueError(f"figure {f.id} is registered twice")
        seen.add(f.id)
        if not f.id.replace("-", "").isalnum() or f.id != f.id.lower():
            raise ValueError(f"figure id {f.id!r}: lowercase letters, digits and '-' only")
        if f.kind not in ("table", "text", "markdown"):
            raise ValueError(f"figure {f.id}: kind {f.kind!r} is not 'table', 'text' or "
                             "'markdown'")
        if f.percentiles and (f.requests_per_point or 0) < MIN_REQUESTS_FOR_P99:
            raise ValueError(f"figure {f.id} shows percentiles from {f.requests_per_point} "
                             f"requests per point: p99 needs at least {MIN_REQUESTS_FOR_P99}")
        if not f.command and not f.how:
            raise ValueError(f"figure {f.id} has no command and no `how`")
        if f.keep and not any("{dir}" in a for a in f.command):
            raise ValueError(f"figure {f.id} keeps {list(f.keep)} but its command writes no "
                             "{dir}")
        for g in f.keep:
            if g.startswith("/") or ".." in g.split("/"):
                raise ValueError(f"figure {f.id}: kept glob {g!r} must stay inside {{dir}}")


def by_id(figures: tuple[Figure, ...], ids: list[str]) -> tuple[Figure, ...]:
    """The figures named in `ids` (all when empty), in registry order.

    Raises:
        ValueError: an id is not registered (the message lists the known ones).
    """
    known = {f.id for f in figures}
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise ValueError(f"unknown figure(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    return tuple(f for f in figures if not ids or f.id in ids)


def default_convert(output: Mapping[str, Any], kind: str = "table", index: int = 0,
                    source: str = "", header: str = "") -> dict[str, Any]:
    """A command's output as figure data. `output` holds "stdout" (text), "files" (the markdown
    and JSON files it wrote in `{dir}`, by name, as text) and "json" (what it wrote to `{json}`,
    or None). The data is the JSON's own "table" ({"columns", "rows"[, "align"]}; a "table" that
    is the printed markdown string, as `pdkv bench hosts` writes, is read from the stdout like
    any printed one)
    or "text" (lines) when it has one;
    else, for a table, the first table printed in the stdout (or in file `source`: pipe tables
    and plain-text grids, `markdown.printed_tables`) whose first header cell starts with `header`,
    or the `index`-th when `header` is empty; for text or markdown, the stdout (or that file)
    itself.

    Raises:
        ValueError: there is no such table or file.
    """
    result = output.get("json")
    if isinstance(result, Mapping) and isinstance(result.get("table"), Mapping):
        table = result["table"]
        return {"table": {"columns": [str(c) for c in table["columns"]],
                          "rows": [[str(c) for c in r] for r in table["rows"]],
                          "align": list(table.get("align") or [""] * len(table["columns"]))}}
    if isinstance(result, Mapping) and "text" in result:
        return {"text": [str(x) for x in result["text"]]}
    files = output.get("files") or {}
    if source and source not in files:
        raise ValueError(f"the command wrote no {source} (it wrote {sorted(files) or 'nothing'})")
    text = str(files[source] if source else output.get("stdout", ""))
    lines = text.rstrip("\n").split("\n")
    if kind in ("text", "markdown"):
        return {"text": lines}
    found = markdown.printed_tables(lines)
    if header:
        found = [t for t in found if t.columns and t.columns[0].startswith(header)]
        index = 0
    if len(found) <= index:
        what = f"no table headed {header!r}" if header else f"{len(found)} tables, no table {index}"
        raise ValueError(f"{source or 'the stdout'} holds {what}: the figure needs a `convert` "
                         "function")
    t = found[index]
    return {"table": {"columns": t.columns, "rows": t.rows, "align": t.align}}


def converter(figure: Figure) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """The function turning `figure`'s command output (see `default_convert`) into its data:
    `figure.convert`, or `default_convert` with the figure's kind, table index and source.

    Raises:
        ValueError: `convert` is not "module:function" or cannot be imported.
    """
    if not figure.convert:
        return functools.partial(default_convert, kind=figure.kind, index=figure.table_index,
                                 source=figure.table_source, header=figure.table_header)
    module, _, name = figure.convert.partition(":")
    try:
        fn: Callable[[Mapping[str, Any]], dict[str, Any]] = getattr(
            importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"figure {figure.id}: convert {figure.convert!r}: {e}") from e
    return fn
