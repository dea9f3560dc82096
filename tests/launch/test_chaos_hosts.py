"""`pdkv bench chaos --deploy FILE [--netns]`: the chaos run (client cancels, a prefill restart)
on a deployment file's processes. The flag checks run anywhere; a short round on
examples/deploy/1p1d.toml in network namespaces needs root (skips with the reason, fails under
CI=true) and checks the run's invariants across hosts: every engine up, no failure outside the
restart window, the first request after P's restart (in its namespace, at its address) served,
answers through the proxy equal to P's own, every block free again, the namespaces gone."""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys

import pytest
from deploy_harness import ROOT
from system_packages import require_reason

from pdkv.bench.chaos import cli as chaos
from pdkv.launch.netns import list_namespaces, unavailable_reason

EXAMPLES = os.path.join(ROOT, "examples", "deploy")
ONE_P_ONE_D = os.path.join(EXAMPLES, "1p1d.toml")


def _args(*argv: str) -> argparse.Namespace:
    return chaos.add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))


def _text(path: str) -> str:
    with open(path) as f:
        return f.read()


@pytest.mark.parametrize("argv, match", [
    (("--netns",), "--netns needs --deploy FILE"),
    (("--deploy", ONE_P_ONE_D, "--model", "tiny-llama-kv1"), "takes --model from the file"),
    (("--deploy", ONE_P_ONE_D, "--num-kv-blocks", "32"), "takes --num-kv-blocks from the file"),
    (("--deploy", ONE_P_ONE_D, "--lease", "3"), "takes --lease from the file"),
    (("--deploy", ONE_P_ONE_D, "--kv-load-failure-policy", "recompute"),
     "takes --kv-load-failure-policy from the file"),
])
def test_flags_that_make_no_sense_with_a_deployment_are_refused(argv, match, capsys):
    assert chaos.main(_args(*argv)) == 2
    assert match in capsys.readouterr().err


def test_a_deployment_the_run_cannot_restart_or_count_is_refused(tmp_path, capsys):
    spans = tmp_path / "spans.toml"
    spans.write_text(_text(os.path.join(EXAMPLES, "1p1d-tp2-two-hosts.toml"))
                     .replace("[[prefill]]\n", '[[prefill]]\nworker_hosts = ["node-d1"]\n'
                              'args = ["-tp", "2"]\n', 1))
    assert chaos.main(_args("--deploy", str(spans))) == 2
    assert "prefill0's ranks span hosts (worker_hosts)" in capsys.readouterr().err
    unsized = tmp_path / "unsized.toml"
    unsized.write_text(_text(ONE_P_ONE_D).replace('"--num-kv-blocks", "64", ', ""))
    assert chaos.main(_args("--deploy", str(unsized))) == 2
    assert "prefill0: the chaos run needs --num-kv-blocks" in capsys.readouterr().err
    assert chaos.main(_args("--deploy", str(tmp_path / "none.toml"))) == 2
    assert "cannot read the deployment file" in capsys.readouterr().err


def test_netns_without_root_is_refused_with_the_reason(monkeypatch, capsys, tmp_path):
    from pdkv.launch import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    args = _args("--deploy", ONE_P_ONE_D, "--netns", "--log-dir", str(tmp_path))
    assert chaos.main(args) == 2
    assert "--netns needs root (network namespaces and tc qdiscs)" in capsys.readouterr().err


def _report(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        key, sep, value = line.partition(": ")
        if sep and not key.startswith(("FAILED", "chaos run", " ", "error")):
            out[key] = value
    return out


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_llama_kv2")
def test_a_chaos_round_across_hosts_in_namespaces(tmp_path, tiny_llama_cache):
    """16 requests (about a third cancelled around the prefill's completion), P SIGKILLed after
    half and restarted in node-p's namespace; P's lease 3 s so a grant a cancel left behind
    expires within the run."""
    require_reason(unavailable_reason())
    dep = tmp_path / "1p1d.toml"
    dep.write_text("kv_lease_duration = 3.0\n" + _text(ONE_P_ONE_D))
    out = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "bench", "chaos", "--deploy", str(dep), "--netns",
         "--num-requests", "16", "--max-tokens", "4", "--seed", "0", "--margin", "10",
         "--health-timeout", "90", "--restart-timeout", "90", "--request-timeout", "60",
         "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, PDKV_CACHE=tiny_llama_cache))
    text = out.stdout + out.stderr
    m = re.search(r"^namespaces of (pdkv-[0-9a-f]{6}) on (10\.\d+\.\d+)\.0/24", out.stdout, re.M)
    assert m, text
    run, subnet = m.group(1), m.group(2)
    report = _report(out.stdout)
    assert report.get("requests") == "16", text
    # P restarted with its own command: in node-p's namespace, bound to and advertising its
    # address (the first request after the restart pulls from there: kv_load_failure_policy
    # is fail, so a pull that cannot reach it is an error).
    assert report["restarted"] == f"prefill0 http://{subnet}.1:8100", text
    assert report["first_after_restart"] == "200", text
    assert report["engines_up"] == "True", text
    assert report["failed_outside_restart_window"] == "0", text
    assert report["client_errors_4xx"] == "0", text
    assert int(report["ok"]) > 0 and int(report["cancelled"]) > 0, text
    assert report["answers_equal_colocated"] == "4/4", text
    start = ast.literal_eval(report["free_blocks_start"])
    assert start == {"prefill0": 64.0, "decode0": 64.0}, text
    assert ast.literal_eval(report["free_blocks_end"]) == start, text
    assert out.returncode == 0 and "chaos run: passed" in out.stdout, text
    assert f"removed 4 namespaces / links of {run}" in out.stdout, text
    assert [n for n in list_namespaces() if n.startswith(run + "-")] == []
