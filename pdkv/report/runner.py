"""Running one figure's command and turning its result into the figure's data."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pdkv.report import machine
from pdkv.report.figures import Figure, converter


class Refused(RuntimeError):
    """The box is too busy for a figure to be measured (and --force was not given)."""


def argv(figure: Figure, json_path: str, folder: str) -> list[str]:
    """The figure's command with its placeholders filled in."""
    fill = {"{python}": sys.executable, "{json}": json_path, "{dir}": folder}
    return [fill.get(a, a) for a in figure.command]


def run(root: Path, figure: Figure, probe: machine.Probe, force: bool,
        timeout_s: float | None = None, wait_s: float = 0.0) -> dict[str, Any]:
    """Measure `figure` now: refuse when the load is above the core count after waiting up to
    `wait_s` seconds for it to fall (unless `force`: then it runs at once), run
    its command in `root`, convert its result, and return the data to write (nothing is written
    here).

    Raises:
        Refused: the 1-minute load average exceeds the core count and `force` is False.
        ValueError: the figure has no command, is a record of a past run, or its result does not
            convert into its kind.
        RuntimeError: the command failed (its exit status) or timed out.
    """
    if not figure.command:
        raise ValueError(f"figure {figure.id} has no command yet ({figure.how})")
    if not figure.rerun:
        raise ValueError(f"figure {figure.id} is a record of a past run; it is not re-run")
    reason = machine.refusal(probe) if force else machine.wait_quiet(probe, wait_s)
    if reason is not None and not force:
        raise Refused(f"figure {figure.id}: refused, {reason}: the figure would measure the "
                      "other jobs too; wait for a quiet box or pass --force (the figure then "
                      "says FORCED)")
    facts = machine.facts(root, probe, figure.requests_per_point)
    with tempfile.TemporaryDirectory(prefix=f"pdkv-report-{figure.id}-") as tmp:
        json_path = str(Path(tmp) / "result.json")
        folder = Path(tmp) / "out"
        folder.mkdir()
        cmd = argv(figure, json_path, str(folder))
        print(f"[{figure.id}] {' '.join(cmd)}", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(cmd, cwd=root, stdout=subprocess.PIPE, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"figure {figure.id}: timed out after {timeout_s} s") from e
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0:
            raise RuntimeError(f"figure {figure.id}: command exited {proc.returncode}: "
                               f"{proc.stdout[-2000:]}")
        result = (json.loads(Path(json_path).read_text(encoding="utf-8"))
                  if "{json}" in figure.command else None)
        files = {p.name: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.md"))}
    converted = converter(figure)({"stdout": proc.stdout, "files": files, "json": result})
    if figure.kind not in converted:
        raise ValueError(f"figure {figure.id}: its result converts to "
                         f"{sorted(converted)}, not a {figure.kind}: the figure needs a "
                         "`convert` function")
    data: dict[str, Any] = {"figure": figure.id, "guide": figure.guide,
                            "command": figure.command_text(),
                            "machine": machine.finish(facts, probe), **converted}
    if result is not None:
        data["result"] = result
    return data
