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


def test_prompt_bytes_exact_and_in_whole_blocks_as_pd_moves_them(capsys):
    """37 tokens are 1,704,960 B of KV, but P/D moves 3 whole blocks of 16: 2,211,840 B (what
    `pdkv up --demo` reports as moved); the handoff is planned on the blocks."""
    f = run_json(capsys, "--model", "smollm2", "--prompt-len", "37")
    assert f["request_bytes"]["value"] == f["rank_bytes"]["value"] == 46_080 * 37 == 1_704_960
    assert (
        f["request_block_bytes"]["value"]
        == f["rank_block_bytes"]["value"]
        == 46_080 * 48
        == 2_211_840
    )
    assert f["handoff_bytes"]["value"] == 2_211_840
    assert f["wire_s"]["value"] == pytest.approx(2_211_840 / 2.7e9)
    f = run_json(capsys, "--model", "smollm2", "--prompt-len", "37", "--block-size", "32")
    assert f["handoff_bytes"]["value"] == 46_080 * 64


def test_afd_estimate_uses_the_models_dtype_unless_told(capsys):
    f = run_json(capsys, "--model", "smollm2", "--prompt-len", "37")  # an fp32 model here
    assert f["afd_layer_direction"]["value"] == 576 * 37 * 4
    assert "fp32, the model's dtype" in f["afd_layer_direction"]["assumption"]
    f = run_json(capsys, "--model", "smollm2", "--prompt-len", "37", "--act-dtype", "bf16")
    assert f["afd_layer_direction"]["value"] == 576 * 37 * 2


def test_handoff_names_the_pull_case_and_the_layerwise_case(capsys):
    assert main(["plan", "--model", "smollm2", "--prompt-len", "1024", "--link", "tcp-loopback",
                 "--prefill-tps", "500"]) == 0
    out = capsys.readouterr().out
    assert "nothing hidden" not in out
    assert "KV published once the prefill ends, as pull mode (the default) does" in out
    assert "layer-wise push (transfer_mode push): hidden:" in out
    assert "layer-wise push (transfer_mode push): handoff:" in out


def test_sliding_window_blocks_are_those_of_the_window():
    from pdkv.modelspec.groups import SlidingWindow

    g = SlidingWindow(num_layers=1, num_kv_heads=1, head_dim=8, window=40)
    assert g.block_tokens_held(30, 16) == 32  # blocks 0..1
    # D resumes at token 99, boundary 96: keeps tokens 57.. -> blocks 3..6 (window_first_block)
    assert g.block_tokens_held(100, 16) == 64
    assert g.block_tokens_held(1024, 16) == 64  # boundary 1008: blocks 60..63 (⌈39/16⌉ + 1)
    assert g.block_tokens_held(0, 16) == 0
    from pdkv.cache.specs import window_first_block

    for n in range(1, 300):
        last = (n - 1) // 16
        assert g.block_tokens_held(n, 16) == (last - window_first_block(n - 1, 16, 40) + 1) * 16
