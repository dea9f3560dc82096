"""The figures of README.md and docs/ (`pdkv report`, pdkv/report/): every measured table is a
registered figure block whose text is rendered from a data file with its machine line; the load
refusal, staleness, the p99 rule and the CLI on a fake figure. No benchmark runs; no torch.

"Measured" (markdown.measured_cells): a pipe table outside fenced code is measured when a cell
holds a number with a unit of time, rate, size, share or ratio (ms, s, tok/s, GB/s, MiB, %, x,
...), or a bare number sits under a header (or beside a row label) naming a measured quantity
(ms, tok/s, TTFT, p99, mean, ratio, hit rate, RSS, load avg, ...). Such a table must be inside a
figure block, or carry `<!-- not-a-figure: reason -->` right above it (a reference table whose
defaults say "30 s", or a table computed by `pdkv plan`). The same holds for a command's printed
output: a fence with no language tag (or text / console) with such a number on a line
(markdown.printed_measurements); a ```bash fence is a command, never a figure."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdkv.report import cli, convert, gitinfo, machine, markdown, render, runner, stale
from pdkv.report.figures import PDKV, Figure, converter, default_convert, validate
from pdkv.report.registry import FIGURES

ROOT = Path(__file__).resolve().parents[2]
GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REGISTRY = {f.id: f for f in FIGURES}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("guide", GUIDES, ids=_rel)
def test_every_measured_table_is_a_figure_or_says_why_not(guide: Path) -> None:
    lines = guide.read_text(encoding="utf-8").split("\n")
    inside = [(b.start, b.end) for b in markdown.blocks(lines)]
    bad = []
    for t in markdown.tables(lines):
        if any(s < t.line < e for s, e in inside) or markdown.not_a_figure(lines, t.line):
            continue
        cells = markdown.measured_cells(t)
        if cells:
            bad.append(f"line {t.line + 1}: {cells[:3]}")
    for f in markdown.fences(lines):
        if any(s < f.line < e for s, e in inside) or markdown.not_a_figure(lines, f.line):
            continue
        printed = markdown.printed_measurements(f)
        if printed:
            bad.append(f"printed output at line {f.line + 1}: {printed[:2]}")
    assert not bad, (f"{_rel(guide)}: measured tables or printed outputs outside a figure block "
                     "(wrap them in <!-- figure: ID --> ... <!-- /figure --> and register them "
                     f"in pdkv/report/registry.py, or annotate <!-- not-a-figure: why -->): {bad}")


def test_registry_is_valid_and_every_figure_has_one_block_in_its_guide() -> None:
    validate(FIGURES)
    found: dict[str, str] = {}
    for guide in GUIDES:
        for b in markdown.blocks(guide.read_text(encoding="utf-8").split("\n")):
            assert b.figure not in found, (b.figure, found[b.figure], _rel(guide))
            found[b.figure] = _rel(guide)
    assert set(found) == set(REGISTRY), (set(found) ^ set(REGISTRY))
    for fid, guide in found.items():
        assert REGISTRY[fid].guide == guide


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f.id)
def test_figure_data_has_its_machine_line_and_the_block_is_rendered_from_it(
        figure: Figure) -> None:
    data = render.read_data(ROOT, figure)
    assert not machine.missing(data["machine"]), (figure.data, machine.missing(data["machine"]))
    assert data["figure"] == figure.id and data["guide"] == figure.guide
    lines = (ROOT / figure.guide).read_text(encoding="utf-8").split("\n")
    assert markdown.replace_block(lines, figure.id, render.body(figure, data)) == lines, (
        f"{figure.guide}: the block of {figure.id} differs from its data ({figure.data}); "
        "edit the data and run `pdkv report --render-only`")


# -- units: markdown, rule, render ------------------------------------------------------------

def test_measured_rule_tells_measurements_from_reference_text() -> None:
    def table(*rows: str) -> markdown.Table:
        (t,) = markdown.tables(list(rows))
        return t

    assert markdown.measured_cells(table("| a | b |", "|---|---|", "| x | 2,068 ms |"))
    assert markdown.measured_cells(table("| a | TTFT p99 |", "|---|---|", "| x | 12.5 |"))
    assert markdown.measured_cells(table("| | run |", "|---|---|", "| duration (s) | 109.24 |"))
    assert markdown.measured_cells(table("| a | load avg |", "|---|---|", "| x | 1.5 → 1.2 |"))
    assert not markdown.measured_cells(table("| flag | meaning |", "|---|---|",
                                             "| `--tp N` | ranks, 2 or 4 |"))
    # fenced code is not a table; a fence of printed output with measurements is a figure
    fenced = ["```", "| a | b |", "|---|---|", "| 1 ms | 2 |", "```"]
    assert not markdown.tables(fenced)
    (fence,) = markdown.fences(fenced)
    assert markdown.printed_measurements(fence) == ["| 1 ms | 2 |"]
    (code,) = markdown.fences(["```bash", "pdkv bench hosts --link-delay 0.5ms", "```"])
    assert not markdown.printed_measurements(code)


def test_blocks_refuse_unclosed_or_nested_markers() -> None:
    with pytest.raises(ValueError, match="never closed"):
        markdown.blocks(["<!-- figure: a -->", "x"])
    with pytest.raises(ValueError, match="opens inside"):
        markdown.blocks(["<!-- figure: a -->", "<!-- figure: b -->"])
    with pytest.raises(ValueError, match="without an opening"):
        markdown.blocks(["<!-- /figure -->"])


# -- the load refusal -------------------------------------------------------------------------

def _probe(load: float, cores: int = 2) -> machine.Probe:
    def no_sleep(s: float) -> None:
        raise AssertionError(f"slept {s} s")

    return machine.Probe(load=lambda: (load, load, load), cores=lambda: cores, sleep=no_sleep)


def test_refused_above_the_core_count_only() -> None:
    assert machine.refusal(_probe(2.0)) is None
    assert machine.refusal(_probe(2.01)) == "load average 2.01 > 2 cores"


def test_waits_for_the_load_to_fall_then_refuses() -> None:
    loads = iter([3.0, 2.5, 1.5])
    slept: list[float] = []
    probe = machine.Probe(load=lambda: (next(loads),) * 3, cores=lambda: 2, sleep=slept.append)
    assert machine.wait_quiet(probe, 60.0) is None and slept == [15.0, 15.0]
    slept.clear()
    busy = machine.Probe(load=lambda: (3.0,) * 3, cores=lambda: 2, sleep=slept.append)
    assert machine.wait_quiet(busy, 20.0) == "load average 3.00 > 2 cores"
    assert slept == [15.0, 5.0]


def test_forced_figure_says_so() -> None:
    m = {"cpu": "c", "flags": "avx2", "cores": 2, "load_before": [3.5, 1, 1],
         "load_after": [2, 1, 1],
         "versions": {"python": "3", "torch": "2"}, "commit": "a" * 40, "date": "d",
         "requests_per_point": 24, "forced": True}
    assert machine.line(m).startswith("**FORCED: load average 3.50 > 2 cores.**")
    assert "24 requests per point" in machine.line(m)
    assert "FORCED" not in machine.line({**m, "forced": False})


# -- the p99 rule -----------------------------------------------------------------------------

def test_p99_figure_needs_twenty_requests_per_point() -> None:
    fig = Figure("x", "docs/X.md", ("{python}",), (), requests_per_point=19, percentiles=True)
    with pytest.raises(ValueError, match="at least 20"):
        validate((fig,))
    validate((Figure("x", "docs/X.md", ("{python}",), (), requests_per_point=20,
                     percentiles=True),))
    assert all((f.requests_per_point or 0) >= 20 for f in FIGURES if f.percentiles)


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f.id)
def test_a_figure_showing_p99_is_registered_with_percentiles(figure: Figure) -> None:
    data = render.read_data(ROOT, figure)
    shown = json.dumps(data.get("table") or data.get("text"))
    if re.search(r"\bp9\d\b", shown, re.IGNORECASE):
        assert figure.percentiles, f"{figure.id} shows p90/p99: register it with percentiles=True"


# -- the CLI on a fake figure, in a temporary repository ---------------------------------------

SCRIPT = """import json, sys
table = {"columns": ["n", "ms p99"], "rows": [[1, 2.5], [2, 3.5]]}
json.dump({"table": table}, open(sys.argv[1], "w"))
open("runs.txt", "a").write("run\\n")
"""


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "fake.py").write_text(SCRIPT)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "G.md").write_text("# G\n\n<!-- figure: fake -->\n<!-- /figure -->\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "one")
    return tmp_path


FAKE = Figure("fake", "docs/G.md", ("{python}", "bench/fake.py", "{json}"), ("bench",),
              requests_per_point=20, percentiles=True)


def _args(root: Path, **kw: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_cli_args(p)
    args = p.parse_args(["--root", str(root), "--wait-quiet", "0"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_cli_runs_a_figure_writes_its_data_and_renders_its_block(repo: Path) -> None:
    assert cli.report(_args(repo), (FAKE,), _probe(0.5)) == 0
    data = json.loads((repo / FAKE.data).read_text())
    assert data["table"]["rows"] == [["1", "2.5"], ["2", "3.5"]]
    m = data["machine"]
    assert not machine.missing(m) and m["forced"] is False and m["requests_per_point"] == 20
    assert m["commit"] == _git(repo, "rev-parse", "HEAD") and m["load_before"] == [0.5] * 3
    text = (repo / "docs/G.md").read_text()
    assert "| 1 | 2.5 |" in text and "Machine: " in text and "20 requests per point" in text
    assert "FORCED" not in text
    # --render-only reproduces the same guide from the data
    assert cli.report(_args(repo, render_only=True), (FAKE,), _probe(9.0)) == 0
    assert (repo / "docs/G.md").read_text() == text


def test_a_figure_of_another_isa_is_skipped_and_the_others_run(
        repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Per-ISA tables (docs/SPEED.md): an AVX-512 one is never re-made on an AVX2-only CPU and an
    # AVX2 one never on an AVX-512 CPU; a figure with no isa runs on both.
    avx2_box = machine.Probe(load=lambda: (0.5,) * 3, cores=lambda: 2, flags=lambda: "avx2 fma")
    wide = dataclasses.replace(FAKE, isa="avx512")
    assert cli.report(_args(repo), (wide,), avx2_box) == 0
    assert "its table is of an AVX-512 CPU; this one has no avx512f" in capsys.readouterr().err
    assert not (repo / FAKE.data).exists() and not (repo / "runs.txt").exists()
    avx512_box = dataclasses.replace(avx2_box, flags=lambda: "avx2 avx512f avx512bw fma")
    narrow = dataclasses.replace(FAKE, isa="avx2")
    assert cli.report(_args(repo), (narrow,), avx512_box) == 0
    assert "this one has AVX-512" in capsys.readouterr().err and not (repo / FAKE.data).exists()
    assert cli.report(_args(repo), (wide,), avx512_box) == 0
    assert (repo / FAKE.data).exists() and (repo / "runs.txt").read_text() == "run\n"
    assert Figure("x", "docs/X.md", (), ()).isa_mismatch("sse2") is None
    # --check says which stale figures this CPU cannot re-make
    other = dataclasses.replace(FAKE, id="fakeavx2", isa="avx2")  # no data yet
    assert cli.report(_args(repo, check=True), (wide, other), avx512_box) == 0
    out, err = capsys.readouterr()
    assert ("no data file (not here: its table is of an AVX2-only CPU; this one has AVX-512)"
            in out)
    assert "1 of 2 figures stale, 1 of them only on another kind of CPU" in err


def test_figures_of_one_command_share_one_run(repo: Path) -> None:
    (repo / "docs" / "G.md").write_text("<!-- figure: fake -->\n<!-- /figure -->\n\n"
                                        "<!-- figure: fake2 -->\n<!-- /figure -->\n")
    second = Figure("fake2", "docs/G.md", FAKE.command, ("bench",), table_header="n")
    assert cli.report(_args(repo), (FAKE, second), _probe(0.5)) == 0
    assert (repo / "runs.txt").read_text() == "run\n"
    text = (repo / "docs" / "G.md").read_text()
    assert text.count("| 1 | 2.5 |") == 2


def test_a_run_is_dirty_only_for_changes_to_the_code_it_measures(repo: Path) -> None:
    # A run of two commands: the first rewrote its guide (docs/), which must not mark the second
    # as measured on uncommitted changes; nor does an edit to code it does not measure (as a
    # commit there does not make it stale); an edit to measured code does.
    (repo / "docs" / "G.md").write_text("# G edited\n\n<!-- figure: fake -->\n<!-- /figure -->\n")
    assert not gitinfo.dirty(repo)
    (repo / "tool.py").write_text("x = 1\n")  # tracked code the figure does not measure
    _git(repo, "add", "tool.py")
    _git(repo, "commit", "-qm", "tool")
    (repo / "tool.py").write_text("x = 2\n")
    assert gitinfo.dirty(repo) and not gitinfo.dirty(repo, FAKE.measures)
    assert cli.report(_args(repo), (FAKE,), _probe(0.5)) == 0
    assert json.loads((repo / FAKE.data).read_text())["machine"]["dirty"] is False
    (repo / "bench" / "fake.py").write_text(SCRIPT + "\n# edited\n")
    assert gitinfo.dirty(repo) and gitinfo.dirty(repo, FAKE.measures)
    assert cli.report(_args(repo), (FAKE,), _probe(0.5)) == 0
    assert json.loads((repo / FAKE.data).read_text())["machine"]["dirty"] is True


def test_cli_refuses_on_a_busy_box_and_writes_nothing(repo: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    before = (repo / "docs/G.md").read_text()
    assert cli.report(_args(repo), (FAKE,), _probe(2.5)) == cli.EXIT_REFUSED
    assert "load average 2.50 > 2 cores" in capsys.readouterr().err
    assert not (repo / FAKE.data).exists() and (repo / "docs/G.md").read_text() == before
    assert cli.report(_args(repo, force=True), (FAKE,), _probe(2.5)) == 0
    assert json.loads((repo / FAKE.data).read_text())["machine"]["forced"] is True
    assert "**FORCED: load average 2.50 > 2 cores.**" in (repo / "docs/G.md").read_text()


def test_an_exit_status_the_figure_names_is_a_run(repo: Path) -> None:
    # `pdkv bench handoff` exits 1 when a row misses its tolerance: the table is the finding.
    script = ("import json, sys; json.dump({'table': {'columns': ['a'], 'rows': [['1']]}}, "
              "open(sys.argv[1], 'w')); sys.exit(1)")
    missed = Figure("fake", "docs/G.md", ("{python}", "-c", script, "{json}"), ("bench",),
                    exit_codes=(0, 1))
    assert cli.report(_args(repo), (missed,), _probe(0.1)) == 0
    assert json.loads((repo / missed.data).read_text())["table"]["rows"] == [["1"]]


STUCK_SCRIPT = """import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open("child.pid", "w").write(str(child.pid))
def stop(*_):
    child.terminate()
    open("stopped.txt", "w").write("clean-up ran")
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
open("started.txt", "w").write("")
time.sleep(120)
"""


def test_a_command_past_its_timeout_gets_sigterm_so_it_can_stop_what_it_started(
        repo: Path) -> None:
    # A recipe stops its `pdkv up` in a finally / SIGTERM handler: SIGKILL would leave it running.
    (repo / "bench" / "stuck.py").write_text(STUCK_SCRIPT)
    stuck = Figure("fake", "docs/G.md", ("{python}", "bench/stuck.py", "{json}"), ("bench",))
    assert cli.report(_args(repo, timeout=5.0), (stuck,), _probe(0.1)) == 1
    assert (repo / "stopped.txt").read_text() == "clean-up ran"
    child = int((repo / "child.pid").read_text())
    for _ in range(100):  # the child was terminated (and reaped by init once its parent left)
        if not Path(f"/proc/{child}").exists() or "Z" in Path(
                f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"child {child} of the timed-out command still runs")
    assert not (repo / FAKE.data).exists()


NOTES_SCRIPT = """import json, os, sys
out = sys.argv[1]
os.makedirs(os.path.join(out, "plots"))
open(os.path.join(out, "REPORT.md"), "w").write(
    "| n | ms |\\n|---|---|\\n| 1 | 2.5 |\\n\\nHow to read it: fast.\\n\\n![a](plots/a.png)\\n")
open(os.path.join(out, "plots", "a.png"), "wb").write(bytes([137, 80, 0, 255]))
open(os.path.join(out, "plots", "x.txt"), "w").write("not kept")
"""


def test_kept_files_land_beside_the_guide_and_replace_an_earlier_runs(repo: Path) -> None:
    # A report with a table and generated notes linking a plot (as `pdkv compare` writes): the
    # notes are a markdown block, the plot lands at the path its link names, a plot an earlier
    # run left under the same glob goes, and the figure that keeps files need not run first.
    (repo / "bench" / "notes.py").write_text(NOTES_SCRIPT)
    (repo / "docs" / "G.md").write_text("<!-- figure: tbl -->\n<!-- /figure -->\n\n"
                                        "<!-- figure: notes -->\n<!-- /figure -->\n")
    (repo / "docs" / "plots").mkdir()
    (repo / "docs" / "plots" / "old.png").write_bytes(b"old")
    (repo / "docs" / "plots" / "mine.txt").write_text("a hand-made file")
    cmd = ("{python}", "bench/notes.py", "{dir}")
    table = Figure("tbl", "docs/G.md", cmd, ("bench",), table_source="REPORT.md")
    notes = Figure("notes", "docs/G.md", cmd, ("bench",), kind="markdown",
                   table_source="REPORT.md", keep=("plots/*.png",))
    assert cli.report(_args(repo), (table, notes), _probe(0.5)) == 0
    assert (repo / "docs/plots/a.png").read_bytes() == bytes([137, 80, 0, 255])
    assert not (repo / "docs/plots/old.png").exists()
    assert not (repo / "docs/plots/x.txt").exists()  # written by the run, not kept
    assert (repo / "docs/plots/mine.txt").read_text() == "a hand-made file"
    text = (repo / "docs/G.md").read_text()
    assert "How to read it: fast.\n\n![a](plots/a.png)\n" in text  # as it is, not fenced
    assert text.count("| 1 | 2.5 |") == 2 and "```" not in text
    assert cli.report(_args(repo, render_only=True), (table, notes), _probe(9.0)) == 0
    assert (repo / "docs/G.md").read_text() == text


def test_a_figure_keeps_files_only_from_its_dir() -> None:
    with pytest.raises(ValueError, match="writes no"):
        validate((Figure("k", "docs/K.md", ("{python}", "x.py", "{json}"), (),
                         keep=("a.png",)),))
    with pytest.raises(ValueError, match="inside"):
        validate((Figure("k", "docs/K.md", ("{python}", "x.py", "{dir}"), (),
                         keep=("../a.png",)),))
    with pytest.raises(ValueError, match="kind"):
        validate((Figure("k", "docs/K.md", ("{python}", "x.py"), (), kind="html"),))


def test_cli_failed_command_writes_nothing(repo: Path) -> None:
    script = ("import json, sys; json.dump({'table': {'columns': ['a'], 'rows': [['1']]}}, "
              "open(sys.argv[1], 'w')); sys.exit(4)")  # a result, then a failure
    broken = Figure("fake", "docs/G.md", ("{python}", "-c", script, "{json}"), ("bench",))
    assert cli.report(_args(repo), (broken,), _probe(0.1)) == 1
    assert not (repo / broken.data).exists()


def test_check_lists_figures_whose_code_changed_after_their_data(repo: Path) -> None:
    assert stale.why_stale(repo, FAKE) == "no data file"
    assert cli.report(_args(repo), (FAKE,), _probe(0.5)) == 0
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "data")
    assert stale.why_stale(repo, FAKE) is None           # data from HEAD~1... code unchanged
    (repo / "docs" / "G.md").write_text((repo / "docs" / "G.md").read_text() + "\nprose\n")
    _git(repo, "commit", "-qam", "docs only")
    assert stale.why_stale(repo, FAKE) is None           # a change outside `measures`
    # a comment and a docstring change the bytes, not what runs: still current
    (repo / "bench" / "fake.py").write_text('"""The fake bench."""\n' + SCRIPT + "\n# changed\n")
    _git(repo, "commit", "-qam", "docstring and comment")
    assert stale.why_stale(repo, FAKE) is None
    (repo / "bench" / "fake.py").write_text(SCRIPT.replace("2.5", "2.6"))
    _git(repo, "commit", "-qam", "code")
    code = _git(repo, "rev-parse", "HEAD")[:7]
    (repo / "bench" / "fake.py").write_text(SCRIPT.replace("2.5", "2.6") + "# a later comment\n")
    _git(repo, "commit", "-qam", "comment after the code")
    assert stale.why_stale(repo, FAKE) == f"code it measures changed in {code}, after " + (
        json.loads((repo / FAKE.data).read_text())["machine"]["commit"][:7])
    assert cli.report(_args(repo, check=True), (FAKE,), _probe(0.1)) == 0
    assert cli.report(_args(repo, check=True, strict=True), (FAKE,), _probe(0.1)) == 1
    data = json.loads((repo / FAKE.data).read_text())
    _git(repo, "reset", "-q", "--hard", "HEAD~3")  # back to the data's own commit
    busy = dict(data, machine=dict(data["machine"], load_after=[2.23, 1.7, 1.6]))
    (repo / FAKE.data).write_text(json.dumps(busy))
    assert "load average after the run was 2.23, above 1.1 x the 2 cores" in (
        stale.why_stale(repo, FAKE) or "")
    # A command that overloads the box by design (the soak) ends at its own load: not judged.
    assert stale.why_stale(repo, dataclasses.replace(FAKE, overloads=True)) is None
    own = dict(data, machine=dict(data["machine"], load_after=[2.06, 1.7, 1.6]))
    (repo / FAKE.data).write_text(json.dumps(own))  # a 2-thread bench's own load: still quiet
    assert stale.why_stale(repo, FAKE) is None
    data["machine"]["commit"] = "unknown"
    (repo / FAKE.data).write_text(json.dumps(data))
    assert stale.why_stale(repo, FAKE) == "the run's commit is unknown"


def test_only_docs_changed_reads_the_python_ast_without_docstrings(repo: Path) -> None:
    def commit(text: str, name: str = "bench/fake.py") -> str:
        (repo / name).write_text(text)
        _git(repo, "add", ".")
        _git(repo, "commit", "-qm", "x")
        return _git(repo, "rev-parse", "HEAD")

    base = 'def f(x):\n    """Doc."""\n    return x + 1\n'
    commit(base)
    docs = commit(base.replace("Doc.", "Docs, longer."))
    assert gitinfo.only_docs_changed(repo, docs, ("bench",))
    assert gitinfo.only_docs_changed(repo, commit(base.replace("Doc.", "Docs, longer.")
                                                  + "# note\n"), ("bench",))
    assert not gitinfo.only_docs_changed(repo, commit(base.replace("+ 1", "+ 2")), ("bench",))
    assert not gitinfo.only_docs_changed(repo, commit("int f() { return 1; }\n", "bench/f.cpp"),
                                         ("bench",))


def test_pdkv_report_list_runs_without_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from pdkv.cli import main; rc = main(['report', "
         "'--list']); assert 'torch' not in sys.modules; sys.exit(rc)"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert all(f.id in out.stdout for f in FIGURES)
    assert PDKV[0] == "{python}"


def test_pdkv_report_list_into_a_closed_pipe_ends_quietly() -> None:
    # `pdkv report --list | head -0`: the reader leaves before the first line (closed here long
    # before the child has imported anything, so its first write meets a closed pipe)
    lister = subprocess.Popen([sys.executable, "-m", "pdkv.cli", "report", "--list"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert lister.stdout is not None and lister.stderr is not None
    lister.stdout.close()
    err = lister.stderr.read().decode()
    assert lister.wait(timeout=60) == 0 and "BrokenPipe" not in err and "Traceback" not in err


# -- converting a command's output ------------------------------------------------------------

def test_default_convert_picks_the_printed_table_by_its_first_header() -> None:
    stdout = "\n".join([
        "pdkv offline benchmark",
        "batch | pdkv tok/s | ratio",           # a plain-text grid
        "------+------------+------",
        "    1 |       12.5 |  1.10",
        "",
        "| goal | value |",                     # a pipe table
        "|---|---|",
        "| decode | 0.93 |",
    ])
    out = {"stdout": stdout, "files": {}, "json": None}
    grid = default_convert(out, header="batch")["table"]
    assert grid["columns"] == ["batch", "pdkv tok/s", "ratio"]
    assert grid["rows"] == [["1", "12.5", "1.10"]]
    assert default_convert(out, header="goal")["table"]["rows"] == [["decode", "0.93"]]
    assert default_convert(out, index=1)["table"]["columns"] == ["goal", "value"]
    with pytest.raises(ValueError, match="no table headed 'step'"):
        default_convert(out, header="step")
    assert default_convert(out, kind="text")["text"][0] == "pdkv offline benchmark"
    # two pipe tables printed with no blank line between them are two tables
    both = {"stdout": "| batch | tok/s |\n|---|---|\n| 1 | 44.7 |\n| prefill B x L | tok/s |\n"
                      "| --- | --- |\n| 1 x 512 | 698.0 |", "files": {}, "json": None}
    assert default_convert(both, header="batch")["table"]["rows"] == [["1", "44.7"]]
    assert default_convert(both, header="prefill")["table"]["rows"] == [["1 x 512", "698.0"]]
    # a JSON whose "table" is the printed markdown (pdkv bench hosts): read from the stdout
    hosts = {"stdout": stdout, "files": {}, "json": {"table": "| goal | value |\n|---|---|"}}
    assert default_convert(hosts, header="goal")["table"]["rows"] == [["decode", "0.93"]]


def test_transfer_and_dcp_converters_read_their_results() -> None:
    sizes = [{"size_mib": 1, "methods": {"tcp": {"best_gbps": 3.876, "median_gbps": 3.68},
                                          "raw_socket": {"best_gbps": 5.58, "median_gbps": 5.0}},
              "ratios": {"tcp/raw_socket": {"best": 0.695, "median": 0.7}}}]
    t = convert.transfer({"json": {"sizes": sizes}})["table"]
    assert t["rows"] == [["1 MiB", "tcp", "3.88", "3.68", "0.69 /raw"],
                         ["1 MiB", "raw_socket", "5.58", "5.00", ""]]
    row = {"kv_bytes_per_rank": 2 * 1024 * 1024, "step_median_ms": 7.81, "step_p90_ms": 8.2,
           "comm_share": 0.0, "kv_ratio": 1.0}
    rows = [{**row, "config": "dcp1", "context_len": 1024},
            {**row, "config": "dcp2", "context_len": 1024, "kv_bytes_per_rank": 1024 * 1024,
             "kv_ratio": 0.5, "comm_share": 0.5}]
    d = convert.dcp({"json": {"rows": rows}})["table"]
    assert d["rows"] == [["1k", "2.00 MiB", "1.00 MiB", "0.50", "7.8 / 8.2 ms", "7.8 / 8.2 ms",
                          "50 %"]]


def test_compare_notes_are_the_reports_generated_text_after_its_tables() -> None:
    from pdkv.bench.compare.report import render_report

    text = render_report([], command="pdkv compare", date="d", machine="m", workload="w 1",
                         notes=["a note"], skipped={"pd+pool": "no pool"},
                         plots=["compare/compare_phases.png"], plot_note=None,
                         sections=[("TTFT phases (mean ms per request)", ["| a |\n|---|"]),
                                   ("Break-even (`pdkv plan`, as a library)", ["n* = 3"])])
    got = convert.compare_notes({"files": {"COMPARE.md": text}})["text"]
    assert got[0] == "Workload: w 1."
    assert got[2] == "Skipped topologies:" and "- n* = 3" in got
    assert "## TTFT phases (mean ms per request)" not in got and "| a |" not in got
    assert got[-1] == "![compare/compare_phases.png](compare/compare_phases.png)"
    with pytest.raises(ValueError, match="no notes"):
        convert.compare_notes({"files": {"COMPARE.md": "- workload: w\n\n| a |\n|---|\n"}})


def test_routing_converter_reads_the_policies() -> None:
    policy = {"routing": "kv_aware", "completed": 192, "requests": 192, "hit_rate": 0.8054,
              "prefix_hits": 95584.0, "prompt_tokens": 118803.0, "ttft_mean_ms": 445.2,
              "ttft_p50_ms": 401.6, "ttft_p99_ms": 2397.0,
              "predictions": {"exact": 190.0, "over": 2.0},
              "decisions": {"no_match": 4.0, "kv_hit": 186.0, "load": 2.0}}
    plain = dict(policy, routing="round_robin", predictions=None, decisions={"round_robin": 192})
    t = convert.routing({"json": {"policies": [policy, plain]}})["table"]
    assert t["columns"][0] == "policy" and t["columns"][-2:] == ["predictions wrong", "decisions"]
    assert t["rows"][0] == ["kv_aware", "192/192", "0.805", "95,584 / 118,803", "445 ms",
                            "402 ms", "2,397 ms", "2 of 192", "kv_hit 186, no_match 4, load 2"]
    assert t["rows"][1][-2:] == ["–", "round_robin 192"]


def test_command_placeholders_are_filled_inside_arguments() -> None:
    fig = Figure("x", "docs/X.md", (*PDKV, "compare", "--out", "{dir}/COMPARE.md", "--json",
                                    "{json}"), ())
    assert runner.argv(fig, "/t/r.json", "/t/out") == [
        sys.executable, "-m", "pdkv.cli", "compare", "--out", "/t/out/COMPARE.md", "--json",
        "/t/r.json"]
    assert fig.command_text() == "pdkv compare --out DIR/COMPARE.md --json PATH"


def test_every_registered_converter_imports() -> None:
    for f in FIGURES:
        assert callable(converter(f)), f.id


def test_printed_output_converters() -> None:
    panel = "\n".join(["120 projections (30 layers of ...), 2 threads",
                       " rows  onednn ms  panel ms  panel/onednn time  panel GFLOP/s",
                       "    1       30.9      19.2               0.62             11"])
    assert convert.panel_linear({"stdout": panel})["table"]["rows"] == [
        ["1", "30.9", "19.2", "0.62", "11"]]
    memory = "\n".join([
        "engine flags: (defaults); RSS in MB (10^6 bytes)",
        f"{'process':<22}{'started':>9}{'1 request':>11}{'anon':>8}{'file':>8}{'shmem':>8}"
        f"{'torch':>7}{'goal':>7}  met",
        f"{'pdkv serve (engine)':<22}{1000:>9}{1109:>11}{900:>8}{200:>8}{9:>8}{'yes':>7}"
        f"{1200:>7}  yes"])
    assert convert.memory({"stdout": memory})["table"]["rows"] == [
        ["pdkv serve (engine)", "1000 MB", "1109 MB", "900 MB", "200 MB", "9 MB", "yes",
         "1200 MB", "yes"]]
    row = {"model": "tiny-swa", "prompt_tokens": 1024, "bytes_received": 1 << 20,
           "formula_bytes": 1 << 20, "transfer_s": 0.0069, "bytes_ratio": 0.531,
           "groups": [{"kind": "sliding_window", "blocks": 4, "block_bytes": 16384}]}
    assert convert.groups({"json": {"rows": [row]}})["table"]["rows"] == [
        ["tiny-swa", "1024", "sliding window 4 × 16,384", "1.00", "6.90", "0.531", "-"]]
