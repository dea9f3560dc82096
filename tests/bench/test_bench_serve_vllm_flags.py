"""`pdkv bench serve` with vLLM's flag names, the ShareGPT file format and the model's own
tokenizer for a server without /tokenize (mock server, no model; the tokenizer is SmolLM2's)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from mock_openai_server import MockServer  # noqa: E402

from pdkv.bench.serve import BenchConfig, run_serve_bench  # noqa: E402
from pdkv.bench.serve.cli import config_from_args, result_path  # noqa: E402
from pdkv.bench.serve.datasets import WordTokenizer  # noqa: E402
from pdkv.bench.serve.sharegpt import sharegpt_dataset  # noqa: E402
from pdkv.cli import build_parser  # noqa: E402


def _conv(q: str, a: str) -> dict:
    return {
        "id": q[:5],
        "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}],
    }


def test_vllm_flag_names_are_aliases(tmp_path):
    args = build_parser().parse_args(
        [
            "bench",
            "serve",
            "--backend",
            "openai-chat",
            "--dataset-name",
            "random",
            "--random-input-len",
            "32",
            "--random-output-len",
            "8",
            "--random-range-ratio",
            "0.1",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--num-prompts",
            "3",
        ]
    )
    cfg = config_from_args(args)
    assert (cfg.endpoint, cfg.dataset, cfg.input_len, cfg.output_len, cfg.range_ratio) == (
        "chat",
        "random",
        32,
        8,
        0.1,
    )
    assert (
        config_from_args(
            build_parser().parse_args(["bench", "serve", "--backend", "openai"])
        ).endpoint
        == "completions"
    )
    # --ignore-eos (vLLM's flag) and pdkv's default are on; --no-ignore-eos turns it off
    assert (
        cfg.ignore_eos
        and config_from_args(
            build_parser().parse_args(["bench", "serve", "--ignore-eos"])
        ).ignore_eos
    )
    assert not config_from_args(
        build_parser().parse_args(["bench", "serve", "--no-ignore-eos"])
    ).ignore_eos
    assert config_from_args(
        build_parser().parse_args(["bench", "serve", "--metric-percentiles", "25,75"])
    ).percentiles == [25.0, 75.0]
    path = result_path(
        args, {"config": {"model": "org/m", "endpoint": "chat"}, "request_rate": "inf"}
    )
    assert (
        path is not None
        and path.startswith(str(tmp_path / "pdkv-chat-infqps-org_m-"))
        and path.endswith(".json")
    )
    args.result_filename = "r.json"
    assert result_path(args, {}) == str(tmp_path / "r.json")


def test_sharegpt_samples_first_two_turns_with_vllm_filters(tmp_path):
    data = [_conv("one two three four five", "a b c d e f"),
            _conv("too short", "a b c d e"),  # prompt < 4 tokens: skipped
            {"conversations": [{"from": "human", "value": "only one turn here ok"}]},  # < 2 turns
            _conv("six seven eight nine", "x y z w")]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    samples = asyncio.run(sharegpt_dataset(WordTokenizer(), str(path), num_prompts=10, seed=0))
    assert sorted((s.prompt, s.prompt_len, s.output_len) for s in samples) == [
        ("one two three four five", 5, 6), ("six seven eight nine", 4, 4)]
    fixed = asyncio.run(
        sharegpt_dataset(WordTokenizer(), str(path), num_prompts=10, seed=0, output_len=2)
    )
    assert len(fixed) == 2 and {s.output_len for s in fixed} == {
        2
    }  # the 2-word prompt is still too short
    short = asyncio.run(
        sharegpt_dataset(WordTokenizer(), str(path), num_prompts=10, seed=0, output_len=1)
    )
    assert len(short) == 2  # a fixed output length is taken as given
    assert (
        len(asyncio.run(sharegpt_dataset(WordTokenizer(), str(path), num_prompts=1, seed=3))) == 1
    )
    path.write_text("{}")
    with pytest.raises(ValueError, match="JSON list"):
        asyncio.run(sharegpt_dataset(WordTokenizer(), str(path), 1, 0))


def test_without_tokenize_the_model_tokenizer_counts_input_tokens(tmp_path, hf_tokenizer):
    prompts = ["The capital of France is Paris, and it is a beautiful city.",
               "Explain in two sentences why the sky is blue."]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([_conv(p, "an answer of a few words") for p in prompts]))
    with MockServer() as mock:
        mock.state.tokenize = False
        messages: list[str] = []
        r = run_serve_bench(
            BenchConfig(
                base_url=mock.base_url,
                dataset="sharegpt",
                dataset_path=str(path),
                num_prompts=2,
                tokenizer="smollm2",
                disable_tqdm=True,
                scrape_metrics=False,
            ),
            log=messages.append,
        )
        mock.state.usage = False  # no usage: the client-side count is what gets reported
        r2 = run_serve_bench(
            BenchConfig(
                base_url=mock.base_url,
                dataset="sharegpt",
                dataset_path=str(path),
                num_prompts=2,
                tokenizer="smollm2",
                disable_tqdm=True,
                scrape_metrics=False,
            ),
            log=messages.append,
        )
    assert r["config"]["tokenizer"] == "local" and r["completed"] == 2
    assert any("counting tokens with the tokenizer of 'smollm2'" in m for m in messages)
    expected = {p: len(hf_tokenizer.encode(p, add_special_tokens=False)) for p in prompts}
    assert all(n != len(p.split()) for p, n in expected.items())  # not a word count
    sent = [p["prompt"] for p in mock.state.payloads[-2:]]
    assert sorted(r2["input_lens"]) == sorted(expected[p] for p in sent)
