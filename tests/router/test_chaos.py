"""The chaos run's short form (CI): 50 requests, lease 3 s, one P restart, real processes."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from pdkv.bench.chaos.load import CANCELLED, LoadResult, Outcome, make_plan

pytestmark = pytest.mark.slow


def test_plan_is_seeded_and_cancels_around_the_prefill():
    a = make_plan(200, 3, 0.3, prefill_s=0.2, window_s=0.05, max_tokens=8)
    assert a == make_plan(200, 3, 0.3, prefill_s=0.2, window_s=0.05, max_tokens=8)
    cancels = [p.cancel_after for p in a if p.cancel_after is not None]
    assert 30 < len(cancels) < 90 and all(0.175 <= c <= 0.225 for c in cancels)
    assert (
        all(1 <= p.max_tokens <= 8 for p in a)
        and any(p.stream for p in a)
        and not all(p.stream for p in a)
    )


def test_only_failures_overlapping_the_restart_window_are_excused():
    r = LoadResult(window=(10.0, 20.0))
    r.outcomes = [Outcome(502, 9.0, 10.5), Outcome(500, 19.0, 21.0), Outcome(502, 21.0, 22.0),
                  Outcome(0, 1.0, 2.0), Outcome(200, 1.0, 2.0), Outcome(CANCELLED, 1.0, 1.1)]
    assert r.counts() == {"requests": 6, "ok": 1, "cancelled": 1, "client_errors_4xx": 0,
                          "failed_in_restart_window": 2, "failed_outside_restart_window": 2}


def test_chaos_short_form(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdkv.cli",
            "bench",
            "chaos",
            "--num-requests",
            "50",
            "--lease",
            "3",
            "--max-tokens",
            "8",
            "--seed",
            "0",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = out.stdout + out.stderr
    report = {}
    for line in out.stdout.splitlines():
        key, sep, value = line.partition(": ")
        if sep and not key.startswith(("FAILED", "chaos run")):
            report[key] = value
    assert report.get("requests") == "50", text
    assert report["engines_up"] == "True", text
    assert report["failed_outside_restart_window"] == "0", text
    assert report["client_errors_4xx"] == "0", text
    assert int(report["cancelled"]) > 0 and int(report["ok"]) > 0, text
    assert ast.literal_eval(report["free_blocks_end"]) == ast.literal_eval(
        report["free_blocks_start"]
    ), text
    failed = [line for line in out.stdout.splitlines() if line.startswith("FAILED")]
    assert report["first_after_restart"] == "200", text
    assert out.returncode == 0 and not failed, text
