"""`pdkv` flag parsing without a model: positional MODEL, vLLM's engine flags, no abbreviated
flags, "did you mean" hints, HF-id resolution offline, KV sizing from free memory."""

from __future__ import annotations

import argparse
import os

import pytest

from pdkv.cli import build_parser
from pdkv.cli_parser import PdkvArgumentParser, suggestion
from pdkv.config import CacheConfig
from pdkv.engine.arg_utils import EngineArgs
from pdkv.model import registry
from pdkv.worker.memory import kv_budget_bytes


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def _error(
    parser: argparse.ArgumentParser, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> str:
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_serve_takes_the_model_positionally_or_as_flag(parser):
    args = parser.parse_args(["serve", "HuggingFaceTB/SmolLM2-135M-Instruct", "--port", "9"])
    assert EngineArgs.from_cli_args(args).model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert EngineArgs.from_cli_args(parser.parse_args(["serve", "--model", "m2"])).model == "m2"
    assert EngineArgs.from_cli_args(parser.parse_args(["serve"])).model == "smollm2"
    with pytest.raises(ValueError, match="two models given"):
        EngineArgs.from_cli_args(parser.parse_args(["serve", "m1", "--model", "m2"]))


def test_vllm_engine_flags(parser):
    args = parser.parse_args(
        [
            "serve",
            "smollm2",
            "--served-model-name",
            "a",
            "b",
            "--kv-cache-dtype",
            "auto",
            "--gpu-memory-utilization",
            "0.5",
            "--enforce-eager",
            "--disable-log-requests",
            "--log-stats-interval",
            "0.5",
        ]
    )
    assert (
        args.served_model_name == ["a", "b"]
        and args.disable_log_requests
        and args.log_stats_interval == 0.5
    )
    ea = EngineArgs.from_cli_args(args)
    assert ea.served_model_name == "a"  # the first is reported
    assert (ea.gpu_memory_utilization, ea.enforce_eager, ea.kv_cache_dtype) == (0.5, True, "auto")


def test_kv_cache_dtype_values():
    """int8 / fp8 (= fp8_e4m3) are quantized KV (pdkv/model/kv_quant.py); the model dtype is
    auto; anything else is refused naming the accepted values."""
    cfg = EngineArgs(kv_cache_dtype="fp8").create_engine_config()
    assert cfg.cache_config.cache_dtype == "fp8_e4m3"
    assert (
        EngineArgs(kv_cache_dtype="float32").create_engine_config().cache_config.cache_dtype
        == "auto"
    )
    with pytest.raises(ValueError, match="'int8', 'fp8'"):
        EngineArgs(kv_cache_dtype="fp4").create_engine_config()
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)


def test_kv_budget_is_the_fraction_of_free_memory():
    assert kv_budget_bytes(10 << 30, 0.25) == (10 << 30) // 4
    with pytest.raises(ValueError):
        kv_budget_bytes(1 << 30, 0.0)


def test_abbreviations_are_refused_and_typos_get_a_suggestion(parser, capsys):
    err = _error(
        parser, ["serve", "--max-num", "3"], capsys
    )  # argparse's default would take --max-num-seqs
    assert "unrecognized arguments: --max-num" in err and "did you mean --max-num-seqs?" in err
    assert "did you mean --model?" in _error(parser, ["serve", "--modle", "x"], capsys)
    assert "did you mean --num-prompts?" in _error(
        parser, ["bench", "serve", "--num-prompt", "3"], capsys
    )
    assert "did you mean --num-prefill?" in _error(parser, ["up", "--num-prefil", "2"], capsys)
    assert "did you mean 'serve'?" in _error(parser, ["serv"], capsys)


def test_suggestions_come_from_the_chosen_subcommand():
    root = PdkvArgumentParser(prog="x")
    sub = root.add_subparsers(dest="cmd")
    sub.add_parser("a").add_argument("--alpha-beta")
    sub.add_parser("b").add_argument("--alpha-bets")
    assert sub.choices["a"].allow_abbrev is False
    msg = "unrecognized arguments: --alpha-bet"
    assert suggestion(root, ["a", "--alpha-bet"], msg) == "did you mean --alpha-beta?"
    assert suggestion(root, ["b", "--alpha-bet"], msg) == "did you mean --alpha-bets?"
    assert suggestion(root, ["a", "--zzz"], "unrecognized arguments: --zzz") == ""


def test_hf_id_of_an_alias_resolves_offline(monkeypatch):
    monkeypatch.setattr(registry, "_materialize", lambda spec: "/models/" + spec.folder_name)
    assert (
        registry.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
        == "/models/SmolLM2-135M-Instruct"
    )


def test_hf_id_from_the_local_cache_or_a_message_saying_how_to_get_it(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="huggingface-cli download org/tiny"):
        registry.resolve_model("org/tiny")
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (snap / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="without config.json and \\*.safetensors"):
        registry.resolve_model("org/tiny")
    (snap / "model.safetensors").write_bytes(b"")
    assert os.path.samefile(registry.resolve_model("org/tiny"), snap)


def test_an_unknown_flag_shows_the_usage_of_its_subcommand(capsys):
    from pdkv.cli import main

    with pytest.raises(SystemExit) as e:
        main(["up", "--mdoe", "pd"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("usage: pdkv up ")
        and "pdkv up: error: unrecognized arguments: --mdoe; did you mean --mode?" in err
    )


def test_generate_logs_the_engines_start_up_lines(tiny_llama_kv2):
    """`pdkv generate` sets up logging as `pdkv serve` does: the --cpu-linear auto table shows."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pdkv.cli", "generate", "--model", tiny_llama_kv2,
                           "--cpu-linear", "auto", "--max-tokens", "2", "--prompt", "hi"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pdkv.model.cpu_linear: cpu-linear auto table [" in proc.stderr
    assert "1 request, 2 output tokens" in proc.stdout


def test_profile_step_takes_num_threads():
    from pdkv.bench.model.profile_step import build_parser as profile_parser

    assert profile_parser().parse_args(["--num-threads", "1"]).num_threads == 1


def test_one_thread_is_singular_in_up_listing():
    from pdkv.launch.topology import Child

    assert (
        Child("p0", "http://x", [], {}, role="prefill", threads=1).describe()
        == "p0: prefill, http://x, 1 thread, log -"
    )
    assert ", 2 threads," in Child("p0", "http://x", [], {}, role="prefill", threads=2).describe()
