"""The committed docs/SUPPORT_MATRIX.md still holds: it is the rendering of the JSON beside it
(never edited by hand); `pdkv matrix --quick` run now gives the committed quick cells' statuses;
and every committed cell's tests are still collected with that cell's tag (the quick run lists
every tagged test it collected; the slow ones run in the suite itself, so a broken feature fails
CI there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pdkv.matrix.catalog import FAILED
from pdkv.matrix.report import json_path, read_json, render_markdown

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "SUPPORT_MATRIX.md"


def committed() -> dict:
    return read_json(json_path(os.fspath(DOC)))


def test_markdown_is_the_rendering_of_the_json_and_made_by_the_full_run():
    data = committed()
    assert DOC.read_text(encoding="utf-8") == render_markdown(data)
    assert data["command"] == "pdkv matrix"  # the full run, not a subset
    assert not [c for c in data["cells"] if c["status"] == FAILED]


def test_quick_run_gives_the_committed_quick_cells(tmp_path):
    out = tmp_path / "matrix.md"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            x for x in (os.fspath(ROOT), os.environ.get("PYTHONPATH", "")) if x
        ),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdkv.cli",
            "matrix",
            "--quick",
            "--out",
            os.fspath(out),
            "--timeout",
            "540",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    now = read_json(json_path(os.fspath(out)))
    got = {(c["model"], c["feature"]): c["status"] for c in now["cells"]}
    every = {(c["model"], c["feature"]): c["status"] for c in committed()["cells"]}
    quick = {(c["model"], c["feature"]) for c in committed()["cells"] if c["quick"]}
    # Every quick cell, plus the cells with both quick and slow checks (their quick part ran),
    # each with its committed status.
    assert quick <= set(got)
    assert got == {k: every.get(k, "not in the committed page") for k in got}
    assert "[1/" in proc.stdout  # progress, one line per cell
    for cell in committed()["cells"]:
        key = f"{cell['model']}/{cell['feature']}"
        missing = set(cell["tests"]) - set(now["tagged"].get(key, []))
        assert not missing, (
            f"{key} is {cell['status']} in {DOC.name} but {sorted(missing)} no longer check it"
        )
