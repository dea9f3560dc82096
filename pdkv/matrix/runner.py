"""Run the tagged tests in one pytest subprocess and turn their outcomes into cells.

The subprocess loads `pdkv.matrix.plugin`, which writes the selected items and each test's
outcome as JSON lines; this side reads them as they come and prints a line per finished cell.
Only test files that mention `mark.matrix` are collected (a text scan), which keeps `--quick`
from importing the whole suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdkv.matrix.cells import Cell, CheckOutcome, CollectedItem, build_cells
from pdkv.procgroup import stop_process_group

MARKER_TEXT = "mark.matrix("


@dataclass(frozen=True)
class MatrixOptions:
    """What to run.

    Attributes:
        root: repository root (pytest's rootdir; node ids are relative to it).
        tests: test directories or files to scan for tagged tests, relative to root.
        models, features: catalog ids to keep (empty: all).
        quick: leave out tests marked `slow` (those that load SmolLM2 or HF's model).
        timeout_s: deadline of the whole pytest run in seconds; tests still unreported then
            make their cells "failed".
        test_timeout_s: pytest-timeout's limit per test (setup included) in seconds; None keeps
            the project's (pyproject `timeout`). A slow or busy machine may need more.
        python: interpreter that runs pytest.
    """

    root: str
    tests: tuple[str, ...] = ("tests",)
    models: tuple[str, ...] = ()
    features: tuple[str, ...] = ()
    quick: bool = False
    timeout_s: float = 3600.0
    test_timeout_s: float | None = None
    python: str = field(default_factory=lambda: sys.executable)


def test_files(root: str, tests: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(tagged, untagged) test files (test_*.py, relative to root, sorted): tagged ones contain
    the text `mark.matrix(`."""
    tagged: set[str] = set()
    untagged: set[str] = set()
    for entry in tests:
        base = Path(root, entry)
        paths = [base] if base.is_file() else sorted(base.rglob("test_*.py"))
        for p in paths:
            text = p.read_text(encoding="utf-8", errors="replace")
            (tagged if MARKER_TEXT in text else untagged).add(str(p.relative_to(root)))
    return sorted(tagged), sorted(untagged)


def pytest_command(opts: MatrixOptions, report: str, untagged: list[str]) -> list[str]:
    """The pytest subprocess's argv. The test paths are given whole and the untagged files are
    `--ignore`d (rather than naming the tagged files): conftest.py files then load in the suite's
    own order, which the tests' `from conftest import ...` relies on."""
    cmd = [opts.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pdkv.matrix.plugin",
           "--matrix-report", report]
    if opts.models:
        cmd += ["--matrix-models", ",".join(opts.models)]
    if opts.features:
        cmd += ["--matrix-features", ",".join(opts.features)]
    if opts.quick:
        cmd.append("--matrix-quick")
    if opts.test_timeout_s is not None:
        cmd += ["-o", f"timeout={opts.test_timeout_s:g}"]
    return cmd + [f"--ignore={f}" for f in untagged] + list(opts.tests)


@dataclass
class _Progress:
    items: list[CollectedItem] = field(default_factory=list)
    results: dict[str, CheckOutcome] = field(default_factory=dict)
    collected: bool = False
    tagged: dict[str, list[str]] = field(default_factory=dict)
    announced: set[tuple[str, str]] = field(default_factory=set)


def run_matrix(
    opts: MatrixOptions, say: Callable[[str], None] = print
) -> tuple[list[Cell], dict[str, list[str]]]:
    """Run the checks; return the cells (catalog order) and every tagged test collected, selected
    or not, by "model/feature" (what a full run would check).

    Raises:
        RuntimeError: no tagged test file, or pytest ended without collecting (the error and
            the tail of its output are in the message).
    """
    files, untagged = test_files(opts.root, opts.tests)
    if not files:
        raise RuntimeError(f"no test file under {opts.tests} mentions {MARKER_TEXT!r}")
    with tempfile.TemporaryDirectory(prefix="pdkv-matrix-") as tmp:
        report, log_path = os.path.join(tmp, "report.jsonl"), os.path.join(tmp, "pytest.log")
        env = _env(opts)
        state = _Progress()
        say(f"pdkv matrix: running the tagged tests of {len(files)} files (log: pytest -q)")
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(pytest_command(opts, report, untagged), cwd=opts.root, env=env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        offset = 0
        try:
            while True:
                done = proc.poll() is not None
                offset = _read_events(report, offset, state, say, t0)
                if done:
                    break
                if time.monotonic() - t0 > opts.timeout_s:
                    say(f"deadline of {opts.timeout_s:.0f} s reached: stopping pytest")
                    break
                time.sleep(0.5)
        finally:
            stop_process_group(proc, 30, 30)
        with open(log_path, errors="replace") as f:
            tail = f.read()[-3000:]
        if not state.collected:
            raise RuntimeError(f"pytest exited {proc.returncode} before collecting:\n{tail}")
        if any(it["nodeid"] not in state.results for it in state.items):
            say(
                f"some tests never reported (pytest exit {proc.returncode}); its output "
                f"ends:\n{tail}"
            )
    return build_cells(state.items, state.results), state.tagged


def _env(opts: MatrixOptions) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (opts.root, env.get("PYTHONPATH", "")) if x)
    return env


def _read_events(
    path: str, offset: int, state: _Progress, say: Callable[[str], None], t0: float
) -> int:
    if not os.path.exists(path):
        return offset
    with open(path, "rb") as f:
        f.seek(offset)
        while True:
            line = f.readline()
            if not line.endswith(b"\n"):
                break  # partial line: read it next time
            offset += len(line)
            event = json.loads(line)
            if event["event"] == "collected":
                state.items, state.collected, state.tagged = event["items"], True, event["tagged"]
                cells = {(m, f_) for it in state.items for m, f_, _ in it["tags"]}
                say(f"{len(cells)} cells, {len(state.items)} tests")
            else:
                state.results[event["nodeid"]] = CheckOutcome(
                    event["nodeid"],
                    event["outcome"],
                    event["message"],
                    event["detail"],
                    event["seconds"],
                )
                _announce(state, say, t0)
    return offset


def _announce(state: _Progress, say: Callable[[str], None], t0: float) -> None:
    total = len({(m, f) for it in state.items for m, f, _ in it["tags"]})
    complete = [c for c in build_cells(state.items, state.results)
                if (c.model, c.feature) not in state.announced
                and all(t in state.results for t in c.tests)]
    for c in complete:
        state.announced.add((c.model, c.feature))
        say(f"[{len(state.announced)}/{total}] {c.feature} × {c.model}: {c.status} "
            f"({len(c.tests)} tests, {c.seconds:.1f} s; {time.monotonic() - t0:.0f} s elapsed)")
