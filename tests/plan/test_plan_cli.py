"""`pdkv plan` through pdkv.cli.main, text and --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdkv.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDKV_CACHE", str(tmp_path / "cache"))


def run_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["figures"]


def test_seed_example_text(capsys):
    assert main(["plan", "--kv-bytes", "20e9", "--link-bandwidth", "25e9"]) == 0
    out = capsys.readouterr().out
    assert "wire time: 800 ms" in out and "handoff time: 802 ms" in out
    assert "[2e+10 B / 2.5e+10 B/s]" in out  # the assumption sits beside the number


def test_seed_example_json(capsys):
    f = run_json(capsys, "--kv-bytes", "20e9", "--link-bandwidth", "25e9")
    assert f["handoff_s"]["value"] >= 0.8 and f["handoff_s"]["unit"] == "s"
    assert all(v["assumption"] for v in f.values())


def test_smollm2_tcp_loopback(capsys):
    f = run_json(capsys, "--model", "smollm2", "--prompt-len", "2048", "--link", "tcp-loopback")
    assert f["bytes_per_token"]["value"] == 46_080
    assert f["request_bytes"]["value"] == 46_080 * 2048
    assert f["wire_s"]["value"] == pytest.approx(46_080 * 2048 / 2.7e9)


def test_deepseek_dcp_example(capsys):
    f = run_json(capsys, "--model", os.path.join(ROOT, "pdkv/plan/configs/deepseek-v3.json"),
                 "--prompt-len", "32768", "--link", "rdma-400", "--tp", "8", "--dcp", "8",
                 "--prefill-tps", "20000", "--decode-tps", "3000", "--target-ttft", "3")
    assert f["rank_bytes"]["value"] == 70_272 * 4096
    assert f["handoff_layerwise_s"]["value"] < f["handoff_s"]["value"]
    assert f["pd_ratio"]["value"] > 0


def test_bad_dcp_is_an_error(capsys):
    assert main(["plan", "--model", "llama-3.1-70b", "--tp", "8", "--dcp", "3"]) == 2
    assert "must divide" in capsys.readouterr().err


def test_plan_imports_no_torch():
    code = ("import sys; from pdkv.cli import main; "
            "main(['plan', '--model', 'qwen3-next-80b-a3b', '--prompt-len', '1024']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
