"""The recipes of pdkv/report/recipes/ without a server: stopping a child by its process group
within the deadlines, the readiness waits, `pdkv bench serve`'s failures, and each recipe run
end to end against tests/report/fake_pdkv.py (the `pdkv` argv, no engine) that hands back the
bench serve results of a real small run (tests/report/recipe_results/, per-request arrays
dropped): the printed table is the one `pdkv report` converts with the figure's registered
converter, and a failed request or a server that never gets ready is exit status 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pdkv.procgroup import pid_alive
from pdkv.report.figures import converter
from pdkv.report.recipes import common, procs
from pdkv.report.registry import FIGURES

HERE = Path(__file__).resolve().parent
FAKE = HERE / "fake_pdkv.py"
RESULTS = HERE / "recipe_results"
REGISTRY = {f.id: f for f in FIGURES}
RECIPES = {"pd-colocated-vs-1p1d": "colocated_vs_pd", "serving-bench-serve": "serving",
           "ttft-proxy-after": "ttft_proxy"}
# Figures re-made by `pdkv report` that still have no one command (none left): a new figure
# without one fails the rule below.
NO_COMMAND_YET: set[str] = set()
FAST = procs.Deadlines(ready_s=20.0, bench_s=20.0, term_s=5.0, kill_s=5.0, poll_s=0.05)


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- the registry rule ------------------------------------------------------------------------

def test_every_rerun_figure_has_a_command() -> None:
    missing = {f.id for f in FIGURES if f.rerun and not f.command}
    assert missing <= NO_COMMAND_YET, f"figures re-run without a command: {missing}"
    assert not NO_COMMAND_YET - missing, (f"{NO_COMMAND_YET - missing} have a command now: "
                                          "take them out of NO_COMMAND_YET")
    for f in FIGURES:
        assert bool(f.command) != bool(f.how) or not f.rerun, (
            f"{f.id}: `how` is for a figure without a command")


@pytest.mark.parametrize("fid", sorted(RECIPES))
def test_recipe_figures_run_their_module_with_flags_it_knows(fid: str) -> None:
    f = REGISTRY[fid]
    module = f"pdkv.report.recipes.{RECIPES[fid]}"
    assert f.command[:3] == ("{python}", "-m", module) and not f.how
    assert f"pdkv/report/recipes/{RECIPES[fid]}.py" in f.measures
    assert "pdkv/report/recipes/procs.py" in f.measures
    recipe = importlib.import_module(module)
    args = recipe.add_cli_args(argparse.ArgumentParser()).parse_args(list(f.command[3:]))
    assert args.num_prompts == f.requests_per_point
    assert all((HERE.parents[1] / p).exists() for p in f.measures), f.measures


# -- stopping by process group, readiness, deadlines ------------------------------------------

SPAWNS_AND_SLEEPS = """import subprocess, sys, time
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print("kid", kid.pid, flush=True)
print("ready: http://127.0.0.1:1  (OpenAI API at ...)", flush=True)
time.sleep(300)
"""


def test_a_ready_server_and_what_it_started_are_stopped_on_exit(tmp_path: Path) -> None:
    log = str(tmp_path / "up.log")
    with procs.running(_py(SPAWNS_AND_SLEEPS), log, procs.ready_line, FAST) as url:
        assert url == "http://127.0.0.1:1"
        kid = int(next(x for x in Path(log).read_text().split("\n") if x.startswith("kid"))
                  .split()[1])
        assert pid_alive(kid)
    assert _gone(kid), "the server's own child outlived the stop (not its process group?)"


def test_a_server_is_stopped_when_the_work_against_it_fails(tmp_path: Path) -> None:
    log = str(tmp_path / "up.log")
    with pytest.raises(procs.BenchFailed), \
            procs.running(_py(SPAWNS_AND_SLEEPS), log, procs.ready_line, FAST):
        pid = int(Path(log).read_text().split()[1])
        raise procs.BenchFailed("the benchmark failed")
    assert _gone(pid)


def test_sigterm_ignored_then_sigkill_after_the_deadline(tmp_path: Path) -> None:
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('up', flush=True); time.sleep(300)")
    child = procs.Child(_py(code), str(tmp_path / "c.log"))
    child.wait_ready(lambda c: "x" if "up" in Path(c.log_path).read_text() else None, 10, 0.05)
    t0 = time.monotonic()
    child.stop(term_s=0.5, kill_s=5.0)
    took = time.monotonic() - t0
    assert child.proc.returncode == -signal.SIGKILL and 0.4 < took < 5.0, (child.proc.returncode,
                                                                           took)


def test_never_ready_is_refused_at_the_deadline_and_the_child_stopped(tmp_path: Path) -> None:
    log = str(tmp_path / "up.log")
    deadlines = procs.Deadlines(ready_s=0.5, term_s=5.0, kill_s=5.0, poll_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(procs.NotReady, match="not ready after 0 s"), \
            procs.running(_py("import os, time; print(os.getpid(), flush=True); time.sleep(300)"),
                          log, procs.ready_line, deadlines):
        pytest.fail("not ready, yet yielded")
    assert time.monotonic() - t0 < 5.0
    assert _gone(int(Path(log).read_text().split()[0]))


def test_a_server_that_exits_is_not_ready_and_its_log_is_quoted(tmp_path: Path) -> None:
    with pytest.raises(procs.NotReady, match=r"exited with 3(.|\n)*no model here"), \
            procs.running(_py("print('no model here'); raise SystemExit(3)"),
                          str(tmp_path / "s.log"), procs.healthy("http://127.0.0.1:1"), FAST):
        pytest.fail("exited, yet yielded")


def test_pdkv_up_argv_puts_the_log_dir_before_the_engine_flags(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_running(argv: list[str], log: str, ready: object, d: procs.Deadlines) -> object:
        seen.append([*argv, log])
        return None

    monkeypatch.setattr(procs, "running", fake_running)
    procs.up(["--mode", "pd", "--", "--num-kv-blocks", "8"], "L", FAST)
    procs.up(["--mode", "pd", "--"], "L", FAST)
    assert seen[0][3:] == ["up", "--mode", "pd", "--log-dir", "L", "--", "--num-kv-blocks", "8",
                           "L/up.log"]
    assert seen[1][3:] == ["up", "--mode", "pd", "--log-dir", "L", "L/up.log"]


@pytest.mark.parametrize("code, match", [
    ("raise SystemExit(1)", "exited with 1"),
    ("import time; time.sleep(300)", "ran past 0 s"),
    ("pass", "wrote no result JSON"),
])
def test_bench_serve_failures(code: str, match: str, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "pdkv_argv", lambda *a: _py(code))
    deadlines = procs.Deadlines(bench_s=0.5, term_s=5.0, kill_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(procs.BenchFailed, match=match):
        procs.bench_serve([], str(tmp_path / "r.json"), str(tmp_path / "b.log"), deadlines)
    assert time.monotonic() - t0 < 5.0  # the deadline, not the child's 300 s sleep


def test_a_recipe_error_is_exit_status_one(capsys: pytest.CaptureFixture[str]) -> None:
    def body() -> int:
        raise procs.NotReady("never ready")

    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        assert common.run(body) == common.EXIT_FAILED
        assert common.run(lambda: 0) == 0
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
    assert "error: never ready" in capsys.readouterr().err


# -- each recipe end to end against the fake pdkv ---------------------------------------------

ARGV = {
    "pd-colocated-vs-1p1d": ["--num-prompts", "2", "--output-len", "4"],
    "serving-bench-serve": ["--num-prompts", "2"],
    "ttft-proxy-after": ["--num-prompts", "2", "--concurrencies", "1,2"],
}


SHOWN = {  # a row of each table from the fixtures (the real run's numbers; no load average)
    "pd-colocated-vs-1p1d": (3, ["TTFT mean / median / P99 (ms)", "3222.59 / 3222.59 / 3587.45",
                                 "4052.78 / 4052.78 / 4817.24"]),
    "serving-bench-serve": (3, ["TTFT mean / P50 / P99 (ms)", "2366.01 / 2366.01 / 2704.83"]),
    "ttft-proxy-after": (3, ["chat, c=2", "1.07 / 1.10", "0.43 / 0.62", "0.03 / 0.04",
                             "0.41 / 0.60", "0.20 / 0.23"]),
}


def _run_recipe(fid: str, results: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                capsys: pytest.CaptureFixture[str]) -> tuple[int, str, list[int]]:
    pids = tmp_path / "pids"
    pids.touch()
    monkeypatch.setenv("FAKE_PDKV_PIDS", str(pids))
    monkeypatch.setenv("FAKE_PDKV_RESULTS", str(results))
    monkeypatch.setattr(procs, "pdkv_argv", lambda *a: [sys.executable, str(FAKE), *a])
    recipe = importlib.import_module(f"pdkv.report.recipes.{RECIPES[fid]}")
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        rc = recipe.main([*ARGV[fid], "--log-dir", str(tmp_path / "logs"),
                          "--ready-timeout", "20", "--bench-timeout", "20"])
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
    out = capsys.readouterr().out
    return rc, out, [int(x) for x in pids.read_text().split()]


def _load(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(path.read_text())
    return result


@pytest.mark.parametrize("fid", sorted(RECIPES))
def test_recipe_prints_the_figure_table_and_stops_everything(
        fid: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, pids = _run_recipe(fid, RESULTS / RECIPES[fid], tmp_path, monkeypatch, capsys)
    assert rc == 0, out
    table = converter(REGISTRY[fid])({"stdout": out, "files": {}, "json": None})["table"]
    guide = json.loads((HERE.parents[1] / REGISTRY[fid].data).read_text())["table"]
    assert table["columns"] == guide["columns"]
    labels = [r[0] for r in guide["rows"]]
    if fid == "ttft-proxy-after":  # the guide's form, for the concurrencies of ARGV
        assert labels[:2] == ["completions, c=1", "chat, c=1"]
        labels = [f"{ep}, c={c}" for c in (1, 2) for ep in ("completions", "chat")]
    assert [r[0] for r in table["rows"]] == labels
    assert [r[:-1] if fid == "ttft-proxy-after" else r for r in table["rows"]][
        SHOWN[fid][0]] == SHOWN[fid][1], "each run's result in its own row and column"
    assert all(all(c not in ("", "-") for c in r) for r in table["rows"]), table["rows"]
    assert pids and all(_gone(p) for p in pids), "a process of the recipe outlived it"


@pytest.mark.parametrize("fid", sorted(RECIPES))
def test_a_failed_request_is_exit_status_one(fid: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results"
    results.mkdir()
    files = sorted((RESULTS / RECIPES[fid]).glob("*.json"))
    for i, path in enumerate(files):
        r = _load(path)
        if i == len(files) - 1:  # the last file: one request of one run failed
            r["failed"] = 1
        (results / path.name).write_text(json.dumps(r))
    rc, out, pids = _run_recipe(fid, results, tmp_path, monkeypatch, capsys)
    assert rc == common.EXIT_FAILED and "|---|" in out  # the table, then the failure
    assert all(_gone(p) for p in pids)


def test_a_server_never_ready_is_exit_status_one(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(procs, "ready_line", lambda child: None)
    pids = tmp_path / "pids"
    pids.touch()
    monkeypatch.setenv("FAKE_PDKV_PIDS", str(pids))
    monkeypatch.setattr(procs, "pdkv_argv", lambda *a: [sys.executable, str(FAKE), *a])
    from pdkv.report.recipes import ttft_proxy

    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        rc = ttft_proxy.main(["--num-prompts", "2", "--log-dir", str(tmp_path / "logs"),
                              "--ready-timeout", "1"])
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
    assert rc == common.EXIT_FAILED
    captured = capsys.readouterr()
    assert "not ready after 1 s" in captured.err and "|" not in captured.out
    assert all(_gone(int(p)) for p in pids.read_text().split())


# -- the tables from bench serve results ------------------------------------------------------

def test_tables_format_the_result_keys() -> None:
    from pdkv.report.recipes import colocated_vs_pd, serving, ttft_proxy

    base = {"duration": 109.236, "request_throughput": 0.2197, "output_throughput": 7.03,
            "mean_ttft_ms": 7693.361, "median_ttft_ms": 8824.8, "p99_ttft_ms": 10979.24,
            "mean_tpot_ms": 306.75, "p99_tpot_ms": 501.78, "mean_itl_ms": 306.67,
            "p99_itl_ms": 3671.15, "mean_e2el_ms": 17202.7, "p99_e2el_ms": 19216.83}
    cols, rows = colocated_vs_pd.table([base, {**base, "duration": 125.55}])
    assert cols == ["", "colocated", "1P1D (tcp)"]
    assert rows[0] == ["duration (s)", "109.24", "125.55"]
    assert rows[3] == ["TTFT mean / median / P99 (ms)", "7693.36 / 8824.80 / 10979.24",
                       "7693.36 / 8824.80 / 10979.24"]
    with pytest.raises(ValueError, match="one per mode"):
        colocated_vs_pd.table([base])
    r = {**base, "completed": 32, "failed": 0, "request_goodput": 0.84, "good_requests": 32,
         "total_token_throughput": 321.38,
         "server_metrics": {"prefix_cache_hit_rate": 0.7514, "prefix_cache_hits": 8416.0,
                            "prefix_cache_queries": 11200.0}}
    _, rows = serving.table(r)
    assert rows[0] == ["successful / failed requests", "32 / 0"]
    assert rows[1] == ["request throughput, goodput (req/s)", "0.22, 0.84 (32 good)"]
    assert rows[-1] == ["prefix-cache hit rate (server counters)",
                        "75.14 % (8416 of 11200 prompt tokens)"]
    assert serving.table({**r, "server_metrics": None})[1][-1][1] == "-"
    stats = {"mean_ms": 1.0, "p50_ms": 0.471, "p99_ms": 1.2}
    run = ttft_proxy.Run("chat", 16, {"ttft_phases": {"phases": {"proxy": stats},
                                                      "proxy_parts": {"body": stats}}}, 0.66, 0.96)
    assert ttft_proxy.row(run) == ["chat, c=16", "0.47 / 1.20", "0.47 / 1.20", "-", "-", "-",
                                   "0.66 → 0.96"]
    with pytest.raises(procs.RecipeError, match="no ttft_phases.phases.proxy"):
        ttft_proxy.row(ttft_proxy.Run("chat", 1, {"ttft_phases": None}, 0.0, 0.0))



def test_tables_of_the_real_run_are_what_the_recipes_printed() -> None:
    """The fixtures' tables, as the recipes printed them in the run the fixtures come from."""
    from pdkv.report.recipes import colocated_vs_pd, serving

    pd = [_load(RESULTS / "colocated_vs_pd" / f"{m}.json") for m in ("colocated", "pd")]
    _, rows = colocated_vs_pd.table(pd)
    assert rows[0] == ["duration (s)", "7.72", "9.00"]
    assert rows[3] == ["TTFT mean / median / P99 (ms)", "3222.59 / 3222.59 / 3587.45",
                       "4052.78 / 4052.78 / 4817.24"]
    assert rows[5] == ["ITL mean / P99 (ms)", "133.03 / 233.53", "59.91 / 72.84"]
    _, rows = serving.table(_load(RESULTS / "serving" / "serve.json"))
    assert rows[1] == ["request throughput, goodput (req/s)", "0.33, 0.00 (0 good)"]
    assert rows[-1] == ["prefix-cache hit rate (server counters)",
                        "2.29 % (16 of 700 prompt tokens)"]


def test_sigterm_to_a_recipe_stops_what_it_started(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import os
    import threading

    monkeypatch.setattr(procs, "ready_line", lambda child: None)  # waits for its deadline
    pids = tmp_path / "pids"
    pids.touch()
    monkeypatch.setenv("FAKE_PDKV_PIDS", str(pids))
    monkeypatch.setattr(procs, "pdkv_argv", lambda *a: [sys.executable, str(FAKE), *a])
    from pdkv.report.recipes import ttft_proxy

    def term_when_started() -> None:
        deadline = time.monotonic() + 20
        while not pids.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    killer = threading.Thread(target=term_when_started)
    try:
        killer.start()
        rc = ttft_proxy.main(["--log-dir", str(tmp_path / "logs"), "--ready-timeout", "60"])
    finally:
        killer.join()
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
    assert rc == 130 and "interrupted" in capsys.readouterr().err
    (pid,) = [int(p) for p in pids.read_text().split()]
    assert _gone(pid)
