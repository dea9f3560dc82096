"""The recipes (pdkv/report/recipes/) and the converters of their figures: the argv each step
assembles, what they read from their steps' results, the step runner's exit codes and deadline,
and the registry rule that a recipe's figure measures the recipe. The results are real outputs:
captured from tiny runs in tests/report/fixtures/ (fixtures/README.md says how), or the runs
behind the guides (docs/push/*.json, docs/reliability/*.json,
docs/figures/plan-handoff-measured.json). No benchmark runs; no torch."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdkv.report import convert, machine, runner
from pdkv.report.figures import Figure
from pdkv.report.recipes import cpu_linear, handoff_measured, push_vs_pull, steps
from pdkv.report.registry import FIGURES

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
REGISTRY = {f.id: f for f in FIGURES}


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


# -- steps -------------------------------------------------------------------------------------

def test_shown_is_the_command_a_user_types() -> None:
    assert steps.shown(steps.pdkv_argv("bench", "transfer", "--result-json", "/tmp/x/t.json"),
                       {"/tmp/x/": ""}) == "pdkv bench transfer --result-json t.json"
    assert steps.shown((sys.executable, "-m", "pdkv.model.cpu_linear", "--dtype", "float32")
                       ) == "python -m pdkv.model.cpu_linear --dtype float32"


def test_step_exit_codes_outside_ok_codes_fail(capsys: pytest.CaptureFixture[str]) -> None:
    exit1 = (sys.executable, "-c", "raise SystemExit(1)")
    assert steps.run(steps.Step(exit1, 30, ok_codes=(0, 1))) == 1
    with pytest.raises(RuntimeError, match="exited 1"):
        steps.run(steps.Step(exit1, 30))
    assert "$ " in capsys.readouterr().out


def test_step_past_its_deadline_is_stopped(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    sleeper = (sys.executable, "-c",
               f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
               "time.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="still running after"):
        steps.run(steps.Step(sleeper, timeout_s=2))
    assert time.monotonic() - t0 < 30
    pid = int(pid_file.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text(
        ).split()[2]


# -- handoff_measured --------------------------------------------------------------------------

def test_handoff_measured_defaults_are_the_guides_run() -> None:
    args = handoff_measured.parse_args([])
    t = handoff_measured.transfer_step(args, "t.json")
    assert t.argv[3:] == ("bench", "transfer", "--sizes", "64,256", "--repeats", "3",
                          "--engines", "tcp,shm", "--result-json", "t.json")
    h = handoff_measured.handoff_step(args, {"tcp": 1259026434.0769064, "shm": 5.7e9}, "h.json")
    assert h.argv[3:] == ("bench", "handoff", "--transfer", "tcp,shm", "--prompt-lens",
                          "1024,4096,8192", "--repeats", "3", "--link-bandwidth",
                          "tcp=1259026434.0769064",
                          "--link-bandwidth", "shm=5700000000.0", "--result-json", "h.json")
    assert h.ok_codes == (0, 1)  # a row outside the tolerance is a finding, not a failure


def test_link_bandwidth_is_the_median_at_the_largest_size() -> None:
    transfer = json.loads(_fixture("transfer-tcp-1-4.json"))
    largest = max(transfer["sizes"], key=lambda s: s["size_mib"])
    got = handoff_measured.link_bandwidths(transfer, ["tcp"])
    assert got == {"tcp": largest["methods"]["tcp"]["median_gbps"] * 1e9}
    assert got["tcp"] != max(transfer["sizes"], key=lambda s: -s["size_mib"])[
        "methods"]["tcp"]["median_gbps"] * 1e9
    with pytest.raises(ValueError, match="no shm row"):
        handoff_measured.link_bandwidths(transfer, ["tcp", "shm"])


def test_handoff_pulls_keeps_the_probe_and_prompt_lines() -> None:
    """On the real output of docs/PLAN.md's run of 2026-12-01 (transfer, then handoff, as the
    recipe prints)."""
    text = convert.handoff_pulls({"stdout": _fixture("handoff-measured-2026-12-01.txt")})["text"]
    assert [line.split(":")[0] for line in text] == [
        f"[{e}] {n}" for e in ("tcp", "shm") for n in ("probe", "1024 tokens", "4096 tokens",
                                                        "8191 tokens")]
    assert text[1] == ("[tcp] 1024 tokens: prefill 11.9 s, handoff 34.2 ms measured / 42.8 ms "
                       "predicted")
    median = ("[tcp] 1024 tokens: prefill 1.6 s, handoff 41.7 ms measured (median of 3: 30.8, "
              "41.7, 54.8) / 23.1 ms predicted (pdkv plan --kv-bytes 47185920 --sched-overhead "
              "0.00619)")  # with --repeats 3
    assert convert.handoff_pulls({"stdout": median})["text"] == [median.split(" (pdkv plan")[0]]
    with pytest.raises(ValueError):
        convert.handoff_pulls({"stdout": "$ pdkv bench transfer\n"})


# -- push_vs_pull ------------------------------------------------------------------------------

def test_push_vs_pull_runs_loopback_without_a_rate_and_caps_the_others() -> None:
    args = push_vs_pull.parse_args([])
    assert args.link_rates == ["loopback", "1gbit", "110mbit"]
    loop = push_vs_pull.handoff_step(args, "loopback", "r.json")
    capped = push_vs_pull.handoff_step(args, "110mbit", "r.json")
    assert loop.argv[3:] == ("bench", "handoff", "--transfer-modes", "pull,push",
                             "--prompt-lens", "2048", "--repeats", "2", "--result-json",
                             "r.json")
    assert capped.argv[-4:-2] == ("--link-rate", "110mbit")
    assert [push_vs_pull.label(x) for x in args.link_rates] == [
        "loopback", "1 Gbit/s", "110 Mbit/s"]
    with pytest.raises(ValueError):
        push_vs_pull.label("fast")
    assert push_vs_pull.plan_argv(2048, 300.0, 1.25e8)[3:] == (
        "plan", "--model", "smollm2", "--prompt-len", "2048", "--prefill-tps", "300.0",
        "--link-bandwidth", "1.25e+08", "--json")


@pytest.mark.parametrize(("link", "result", "plan", "guide_row"), [
    ("loopback", "push-loopback.json", None,
     "| loopback | 6.80 / 7.83 | 1.15 | 88 / 5 | – |"),
    ("1gbit", "push-1gbit.json", "plan-smollm2-2048-1gbit.json",
     "| 1 Gbit/s | 7.92 / 8.85 | 1.12 | 812 / 4 | 757 / 27 |"),
])
def test_push_vs_pull_remakes_the_guides_rows_from_their_runs(
        link: str, result: str, plan: str | None, guide_row: str) -> None:
    """The fixtures are the runs behind docs/PUSH.md's table of c46b527 (docs/push/*.json then);
    the plan fixture is `pdkv plan --json` at the table's 300 tok/s and 1 Gbit/s."""
    got = push_vs_pull.medians(json.loads(_fixture(result)))
    exposed = push_vs_pull.plan_exposed(json.loads(_fixture(plan))) if plan else None
    line = push_vs_pull.table([push_vs_pull.row(link, got, exposed)]).split("\n")[2]
    assert line == guide_row


def test_push_vs_pull_refuses_a_skipped_or_partial_run() -> None:
    rows = json.loads(_fixture("push-1gbit.json"))["rows"]
    with pytest.raises(ValueError, match="skipped"):
        push_vs_pull.medians({"skipped": "needs root"})
    with pytest.raises(ValueError, match="no push row"):
        push_vs_pull.medians({"rows": [r for r in rows if r["mode"] == "pull"]})


def test_push_vs_pull_table_is_the_guides() -> None:
    table = push_vs_pull.table([["loopback", "6.80 / 7.83", "1.15", "88 / 5", "–"]])
    lines = table.split("\n")
    assert lines[0].startswith("| link |") and lines[2] == (
        "| loopback | 6.80 / 7.83 | 1.15 | 88 / 5 | – |")
    guide = (ROOT / "docs/PUSH.md").read_text(encoding="utf-8")
    assert lines[0] in guide


# -- cpu_linear --------------------------------------------------------------------------------

def test_cpu_linear_timings_make_one_table_of_both_dtypes() -> None:
    fp32 = cpu_linear.timings(_fixture("cpu-linear-float32.txt"))
    bf16 = cpu_linear.timings(_fixture("cpu-linear-bfloat16.txt"))
    assert sorted(fp32) == [1, 8, 32, 64, 512] and "upcast" in bf16[1]
    lines = cpu_linear.table({"float32": fp32, "bfloat16": bf16}).split("\n")
    head = lines[0].strip("| ").split(" | ")
    assert head[0] == "rows" and "fp32 torch (µs)" in head and "bf16 upcast (µs)" in head
    first = lines[2].strip("| ").split(" | ")
    assert first[0] == "1" and first[head.index("fp32 torch (µs)")] == "1016"
    assert lines[5] == "| 64 | 6460 | 7106 | (pruned) | 6626 |"  # bf16 torch pruned at 64
    with pytest.raises(ValueError):
        cpu_linear.timings("smollm2 float32; CPU flags: avx2\n")


def test_cpu_linear_pruned_backend_shows_as_pruned() -> None:
    lines = cpu_linear.table({"bfloat16": {1: {"torch": 5, "upcast": 6}, 64: {"upcast": 7}}}
                             ).split("\n")
    assert lines[3] == "| 64 | (pruned) | 7 |"


# -- the soak ----------------------------------------------------------------------------------

def test_soak_converter_reads_the_real_hour_summaries() -> None:
    """docs/reliability/: the first hour-long run (two RSS checks failed) and the second
    (passed), the summaries `pdkv bench soak` wrote."""
    second = (ROOT / "docs/reliability/soak-1h-148bf97.json").read_text()
    rows = dict(convert.soak({"files": {"summary.json": second}})["table"]["rows"])
    assert rows["requests"] == "21,670 in 3,613 s (6.0/s): 1,954 cancelled, 19,716 ok"
    assert rows["greedy answers compared with the reference"] == (
        "11,813: 11,813 equal, 0 near ties, 0 wrong")
    assert rows["structured answers that break their grammar"] == (
        "0 of 3,326 structured requests")
    assert rows["free blocks at the idle end"] == "1,024 / 1,024 on prefill, decode, colocated"
    assert rows["RSS slope after the first 10 min (%/h; limit 5)"].startswith(
        "redis 0.02, prefill 0.04, decode 1.9")
    assert rows["P's lease expirations"] == "3, of 1,954 cancels"
    assert rows["checks"] == "passed"
    first = (ROOT / "docs/reliability/soak-1h-12031d4.json").read_text()
    rows = dict(convert.soak({"files": {"summary.json": first}})["table"]["rows"])
    assert rows["checks"].startswith("prefill: RSS grows 5.7 %/h")
    short = {**json.loads(second), "rss_slope_judged": False, "rss_slope_window_s": 20.0}
    rows = dict(convert.soak({"files": {"summary.json": json.dumps(short)}})["table"]["rows"])
    assert rows["RSS slope after the first 10 min (%/h; limit 5)"] == (
        "not judged: 20 s after the warm-up < 600 s")
    with pytest.raises(KeyError):
        convert.soak({"files": {}})


def test_soak_converter_reads_a_real_short_soak() -> None:
    """fixtures/soak-summary-short.json: the suite's 30-second form, run through `pdkv report`'s
    runner (its {dir}); the slope is not judged that short."""
    summary = _fixture("soak-summary-short.json")
    rows = dict(convert.soak({"files": {"summary.json": summary}})["table"]["rows"])
    assert rows["RSS slope after the first 10 s (%/h; limit 5)"] == (
        "not judged: 20 s after the warm-up < 600 s")
    assert rows["free blocks at the idle end"] == "512 / 512 on prefill, decode, colocated"
    assert rows["checks"] == "passed"
    assert rows["requests"].startswith(f"{json.loads(summary)['requests']:,} in 3")


def test_runner_collects_the_json_a_command_writes_into_its_folder() -> None:
    fig = Figure("x", "docs/X.md", (sys.executable, "-c",
                                    "import sys; open(sys.argv[1] + '/summary.json', 'w')"
                                    ".write('{\"a\": 1}')", "{dir}"), ())
    probe = machine.Probe(load=lambda: (0.0, 0.0, 0.0), cores=lambda: 64)
    got = runner.measure(ROOT, fig, probe, force=False)
    assert json.loads(got.output["files"]["summary.json"]) == {"a": 1}


def test_sigterm_to_pdkv_report_stops_the_figures_command(tmp_path: Path) -> None:
    """SIGTERM to `pdkv report` (a queue being stopped) ends the figure's command too: before,
    Python's default action ended the report at once and left the command (`pdkv compare` and
    its engines) running."""
    pidfile = tmp_path / "child.pid"
    child = (f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid()));"
             " time.sleep(120)")
    script = (
        "import sys\n"
        "from pdkv.report import cli, machine, runner\n"
        "from pdkv.report.figures import Figure\n"
        f"fig = Figure('x', 'docs/X.md', (sys.executable, '-c', {child!r}), ())\n"
        "cli.stop_on_sigterm()\n"
        "runner.measure(cli.ROOT, fig, machine.Probe(load=lambda: (0.0,) * 3, "
        "cores=lambda: 64), force=False)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, "the command never ran"
            time.sleep(0.1)
        pid = int(pidfile.read_text())
        proc.terminate()
        assert proc.wait(60) == 143
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_runner_keeps_the_output_of_a_failed_run(tmp_path: Path) -> None:
    """With an output folder, what the command wrote stays there after it failed (the soak's
    logs are how a failed hour is understood), and the next run starts from an empty one."""
    write = ("import sys, pathlib; pathlib.Path(sys.argv[1], 'engine.log').write_text('boom');"
             " sys.exit(3)")
    fig = Figure("x", "docs/X.md", (sys.executable, "-c", write, "{dir}"), ())
    probe = machine.Probe(load=lambda: (0.0, 0.0, 0.0), cores=lambda: 64)
    kept = tmp_path / "report" / "x"
    (kept / "out").mkdir(parents=True)
    (kept / "out" / "old.log").write_text("an earlier run")
    with pytest.raises(RuntimeError, match="exited 3"):
        runner.measure(ROOT, fig, probe, force=False, output_dir=kept)
    assert sorted(p.name for p in (kept / "out").iterdir()) == ["engine.log"]
    assert (kept / "out" / "engine.log").read_text() == "boom"


# -- registry ----------------------------------------------------------------------------------

@pytest.mark.parametrize("figure", [f for f in FIGURES if any(
    a.startswith("pdkv.report.recipes.") for a in f.command)], ids=lambda f: f.id)
def test_a_recipes_figure_measures_the_recipe_and_what_it_imports(figure: Figure) -> None:
    """A change to the recipe, or to a recipes module it uses (directly or through another, such
    as how it runs its steps), makes the figure stale."""
    module = next(a for a in figure.command if a.startswith("pdkv.report.recipes."))
    todo, used = [module], set()
    while todo:
        name = todo.pop()
        path = name.replace(".", "/") + ".py"
        if path in used:
            continue
        assert (ROOT / path).is_file(), path
        used.add(path)
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            todo += [n for n in names if n.startswith("pdkv.report.recipes.")
                     and (ROOT / (n.replace(".", "/") + ".py")).is_file()]
    assert len(used) >= 2, (figure.id, used)  # the recipe and at least its step runner
    for path in sorted(used):
        assert path in figure.measures, (figure.id, path)


def test_the_new_recipes_figures_have_commands() -> None:
    for fid in ("learning-handoff-quiet", "plan-handoff-measured", "push-vs-pull",
                "speed-cpu-linear-us"):
        assert REGISTRY[fid].command and not REGISTRY[fid].how, fid
    assert REGISTRY["reliability-soak"].convert == "pdkv.report.convert:soak"
    assert not REGISTRY["speed-vs-llamacpp"].rerun
