"""`pdkv bench hosts`: a deployment file measured on loopback and on shaped links, one table.
The flag checks run anywhere (under a second); one tiny run (tiny-llama-kv2, 2 prompts, the
loopback case and a 1gbit case in network namespaces, about 25 s on 2 cores) needs root (skips
with the reason, fails under CI=true) and checks the table's rows, the KV bytes D received
against the KV formula and that the namespaces are gone."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys

import pytest
from deploy_harness import ROOT
from system_packages import require_reason

from pdkv.bench import hosts
from pdkv.launch.deploy import load_deployment
from pdkv.launch.netns import (
    LinkShape,
    delay_method,
    list_namespaces,
    unavailable_reason,
)

EXAMPLES = os.path.join(ROOT, "examples", "deploy")
ONE_P_ONE_D = os.path.join(EXAMPLES, "1p1d.toml")
SMOLLM2 = os.path.join(EXAMPLES, "1p1d-smollm2.toml")
# tiny-llama-kv2: 16-token blocks x 4 layers x 2 (K, V) x 2 KV heads x 32 head size x 4 bytes.
BLOCK_BYTES = 16 * 4 * 2 * 2 * 32 * 4


def _args(*argv: str) -> argparse.Namespace:
    return hosts.add_cli_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_cases_parse_and_bad_ones_are_refused():
    assert hosts.parse_cases("loopback, unshaped,1gbit") == [
        hosts.Case("loopback", False, None), hosts.Case("unshaped", True, None),
        hosts.Case("1gbit", True, "1gbit")]
    for text, match in (("", "no case"), ("loopback,loopback", "given twice"),
                        ("1gigabit", "neither loopback, unshaped nor a tc rate")):
        with pytest.raises(ValueError, match=match):
            hosts.parse_cases(text)


@pytest.mark.parametrize("argv, match", [
    (("--link-rates", "loopback,1gbit"), "--link-rates 1gbit: these cases run the hosts in "
     "network namespaces joined by shaped veth links: add --netns"),
    (("--link-rates", "loopback", "--netns"), "--netns: no case of --link-rates runs in "
     "namespaces"),
    (("--link-rates", "loopback,unshaped", "--netns", "--link-delay", "1ms"),
     "--link-delay shapes the rate cases' links: --link-rates has no rate"),
    (("--netns", "--link-delay", "1 fortnight"), "delay must look like 1ms, 250us or 0.5s"),
    (("--link-rates", "loopback", "--input-len", "500", "--output-len", "32"),
     "--input-len 500 + --output-len 32 > prefill0's --max-model-len 512"),
    (("--link-rates", "loopback", "--num-prompts", "0", "--input-len", "40"),
     "--num-prompts must be >= 1"),
])
def test_flags_that_cannot_work_are_refused_before_anything_starts(argv, match, capsys):
    assert hosts.main(_args("--deploy", ONE_P_ONE_D, *argv)) == 2
    assert match in capsys.readouterr().err


def test_a_missing_file_and_netns_without_root_are_refused(monkeypatch, capsys, tmp_path):
    assert hosts.main(_args("--deploy", str(tmp_path / "none.toml"))) == 2
    assert "cannot read the deployment file" in capsys.readouterr().err
    from pdkv.launch import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert hosts.main(_args("--deploy", ONE_P_ONE_D, "--netns", "--input-len", "40",
                            "--log-dir", str(tmp_path))) == 2
    assert "--netns needs root (network namespaces and tc qdiscs)" in capsys.readouterr().err
    # netem's probe says why before it tries anything
    assert netns.netem_unavailable_reason() == "needs root (network namespaces and tc qdiscs)"


def test_each_case_shapes_every_host_link_and_the_documented_run_is_accepted():
    dep = load_deployment(ONE_P_ONE_D)
    rate = hosts.case_deployment(dep, hosts.Case("110mbit", True, "110mbit"), "1ms")
    assert {h.link for h in rate.hosts} == {LinkShape("110mbit", "1ms")}
    bare = hosts.case_deployment(dep, hosts.Case("unshaped", True, None), "1ms")
    assert {h.link for h in bare.hosts} == {LinkShape()}
    # the guide's command: the SmolLM2 file takes 512 + 32 tokens
    args = _args("--deploy", SMOLLM2, "--netns", "--link-rates", "loopback,1gbit,110mbit",
                 "--link-delay", "0.5ms", "--num-prompts", "16")
    assert [c.name for c in hosts.check_args(args, load_deployment(SMOLLM2))] == [
        "loopback", "1gbit", "110mbit"]


def _kv_formula(input_lens: list[int]) -> int:
    """Bytes D pulls: every block P computed, whole (D recomputes the last token, but the
    block holding it moves too)."""
    return sum(math.ceil(n / 16) * BLOCK_BYTES for n in input_lens)


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_llama_kv2")
def test_a_tiny_run_gives_a_row_per_case_with_the_kv_formula(tmp_path, tiny_llama_cache):
    require_reason(unavailable_reason())
    out_json = tmp_path / "hosts.json"
    out = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "bench", "hosts", "--deploy", ONE_P_ONE_D, "--netns",
         "--link-rates", "loopback,1gbit", "--link-delay", "1ms", "--num-prompts", "2",
         "--input-len", "40", "--output-len", "4", "--health-timeout", "90",
         "--request-timeout", "60", "--log-dir", str(tmp_path / "logs"),
         "--json", str(out_json)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, PDKV_CACHE=tiny_llama_cache))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    # how the delay is applied is said before the run and in the row
    how = {"netem": "netem", "delay_line": "delay line"}[delay_method()]
    assert "note: --link-delay 1ms is applied by " + (
        "netem" if how == "netem" else "pdkv's delay line") in out.stdout, text
    link = f"1gbit + 1ms per host link ({how})"
    for line in ("cpu: ", "load average (1 / 5 / 15 min): before ", "commit: ", "publishable: "):
        assert re.search(rf"^{re.escape(line)}", out.stdout, re.M), text
    rows = re.findall(r"^\| (loopback|1gbit) \| (.*?) \| (\d+)/(\d+) \| (.*) \|$", out.stdout,
                      re.M)
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("loopback", "127.0.0.1 (no namespaces)", "2", "2"), ("1gbit", link, "2", "2")], text
    result = json.loads(out_json.read_text())
    for case in result["cases"]:
        for key in ("mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
                    "mean_e2el_ms", "request_throughput"):
            assert case[key] > 0, (case["case"], key, text)
        assert case["kv_bytes_received"] == _kv_formula(case["input_lens"]), (case, text)
        assert case["kv_bytes_per_request"] == case["kv_bytes_received"] / 2
    # the table's KV column is D's counter per request
    assert rows[1][4].endswith(f"| {result['cases'][1]['kv_bytes_per_request']:,.0f}"), text
    run = re.search(r"^namespaces of (pdkv-[0-9a-f]{6}) on (10\.\d+\.\d+)\.0/24", out.stdout,
                    re.M)
    assert run, text
    # loopback: no namespaces; 1gbit: every host's link a tbf at 1 Gbit/s
    assert result["cases"][0]["endpoint"].startswith("http://127.0.0.1:"), text
    assert result["cases"][1]["endpoint"] == f"http://{run.group(2)}.2:8000", text
    links = re.findall(r"^  (node-[pd]): pdkv-.* link (.*)$", out.stdout, re.M)
    assert [h for h, _ in links] == ["node-p", "node-d"], text
    assert all("tbf" in q and "rate 1Gbit" in q for _, q in links), text
    assert f"removed 4 namespaces / links of {run.group(1)}" in out.stdout, text
    assert [n for n in list_namespaces() if n.startswith(run.group(1) + "-")] == []
