"""Running one figure's command and turning its result into the figure's data."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdkv.procgroup import stop_process_group
from pdkv.report import machine
from pdkv.report.figures import Figure, converter

# Seconds a timed-out command's process group has between SIGTERM and SIGKILL (a recipe stops
# its `pdkv up` in that time).
TERM_GRACE_S = 30.0


class Refused(RuntimeError):
    """The box is too busy for a figure to be measured (and --force was not given)."""


def argv(figure: Figure, json_path: str, folder: str) -> list[str]:
    """The figure's command with its placeholders filled in (also inside an argument:
    "{dir}/COMPARE.md")."""
    fill = {"{python}": sys.executable, "{json}": json_path, "{dir}": folder}
    out = []
    for a in figure.command:
        for key, value in fill.items():
            a = a.replace(key, value)
        out.append(a)
    return out


@dataclass(frozen=True)
class Measured:
    """One run of a command: its output ({"stdout", "files", "json"}, see
    `figures.default_convert`), the machine object of the run (load after included) and the
    kept files (path relative to `{dir}` -> bytes; `Figure.keep`)."""

    output: dict[str, Any]
    machine: dict[str, Any]
    kept: dict[str, bytes] = field(default_factory=dict)


def measure(root: Path, figure: Figure, probe: machine.Probe, force: bool,
            timeout_s: float | None = None, wait_s: float = 0.0,
            keep: tuple[str, ...] | None = None, output_dir: Path | None = None) -> Measured:
    """Run `figure`'s command now in `root`: refuse when the load is above the core count after
    waiting up to `wait_s` seconds for it to fall (unless `force`: then it runs at once). The
    files of `{dir}` matching `keep` (default `figure.keep`; the figures sharing the command
    pass all of theirs) come back in `Measured.kept`. With `output_dir`, `{dir}` is
    `output_dir`/out and `{json}` `output_dir`/result.json, and both stay there after the run,
    failed or not (an earlier run's `output_dir` is removed first); else they are in a temporary
    folder, removed at the end.

    Raises:
        Refused: the 1-minute load average exceeds the core count and `force` is False.
        ValueError: the figure has no command, or is a record of a past run.
        RuntimeError: the command failed (an exit status not in `figure.exit_codes`) or ran
            past `timeout_s` (then its process group gets SIGTERM, and SIGKILL after
            TERM_GRACE_S).
        OSError, ValueError: its `{json}` file is missing or not JSON.
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
    facts = machine.facts(root, probe, figure.requests_per_point, figure.measures)
    if output_dir is not None:
        shutil.rmtree(output_dir, ignore_errors=True)
        output_dir.mkdir(parents=True)
        print(f"[{figure.id}] its output stays in {output_dir}/", file=sys.stderr, flush=True)
    with (tempfile.TemporaryDirectory(prefix=f"pdkv-report-{figure.id}-") if output_dir is None
          else contextlib.nullcontext(str(output_dir))) as tmp:
        json_path = str(Path(tmp) / "result.json")
        folder = Path(tmp) / "out"
        folder.mkdir()
        cmd = argv(figure, json_path, str(folder))
        print(f"[{figure.id}] {' '.join(cmd)}", file=sys.stderr, flush=True)
        # Its own session: at the deadline SIGTERM reaches the command and whatever it started
        # (a recipe's `pdkv up` and engines), so its clean-up runs; SIGKILL only after a grace.
        proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            stop_process_group(proc, TERM_GRACE_S)
            raise RuntimeError(f"figure {figure.id}: timed out after {timeout_s} s (its process "
                               "group was sent SIGTERM)") from e
        except BaseException:  # Ctrl-C or SIGTERM of `pdkv report`: the command goes too
            stop_process_group(proc, TERM_GRACE_S)
            raise
        sys.stdout.write(stdout)
        if proc.returncode not in figure.exit_codes:
            raise RuntimeError(f"figure {figure.id}: command exited {proc.returncode}: "
                               f"{stdout[-2000:]}")
        result = (json.loads(Path(json_path).read_text(encoding="utf-8"))
                  if "{json}" in figure.command else None)
        files = {p.name: p.read_text(encoding="utf-8")
                 for pattern in ("*.md", "*.json") for p in sorted(folder.glob(pattern))}
        kept = {str(p.relative_to(folder)): p.read_bytes()
                for pattern in (figure.keep if keep is None else keep)
                for p in sorted(folder.glob(pattern)) if p.is_file()}
    return Measured({"stdout": stdout, "files": files, "json": result},
                    machine.finish(facts, probe), kept)


def keep_raw(figure: Figure, measured: Measured) -> str:
    """Write a run whose output did not convert to `<tmp>/pdkv-report-<id>-raw-<random>.json`
    (its output and machine object), so a converter fix need not re-run it; returns the path."""
    fd, path = tempfile.mkstemp(prefix=f"pdkv-report-{figure.id}-raw-", suffix=".json")
    with open(fd, "w", encoding="utf-8") as f:
        json.dump({"figure": figure.id, "output": measured.output, "machine": measured.machine},
                  f, indent=1, default=str)
    return path


def to_data(figure: Figure, measured: Measured) -> dict[str, Any]:
    """The data file of `figure` from a run of its command (the run may be shared with other
    figures of the same command).

    Raises:
        ValueError: the output does not convert into the figure's kind.
    """
    converted = converter(figure)(measured.output)
    key = "table" if figure.kind == "table" else "text"
    if key not in converted:
        raise ValueError(f"figure {figure.id}: its result converts to "
                         f"{sorted(converted)}, not a {key}: the figure needs a "
                         "`convert` function")
    data: dict[str, Any] = {"figure": figure.id, "guide": figure.guide,
                            "command": figure.command_text(), "machine": measured.machine,
                            **converted}
    if measured.output.get("json") is not None:
        data["result"] = measured.output["json"]
    return data
