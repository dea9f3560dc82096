"""`pdkv bench serve` against a deterministic mock OpenAI SSE server (no model).

The mock (tests/bench/mock_openai_server.py) streams each request with known gaps: 100 ms,
a role-only / empty chunk, 50 ms, "a", 40 ms, "bc" (two tokens in one chunk), 60 ms, "d",
then usage (completion_tokens=4) and [DONE]. Timing checks allow scheduling jitter on a
loaded machine: a measured time may be up to EARLY_MS early and LATE_MS late.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from mock_openai_server import COMPLETION_TOKENS, GAPS_S, MockServer  # noqa: E402

from pdkv.bench.serve import BenchConfig, add_cli_args, main, run_serve_bench  # noqa: E402

EARLY_MS = 5.0
LATE_MS = 150.0  # a loaded 2-core box delays the client by tens, at times over a hundred, ms
TTFT_MS = (GAPS_S[0] + GAPS_S[1]) * 1000  # 150: the empty/role chunk does not count
ITL_MS = [GAPS_S[2] * 1000, GAPS_S[3] * 1000]  # [40, 60]: "bc" is one gap, not two
E2EL_MS = sum(GAPS_S) * 1000  # 250
# When the mock sends each content chunk ("a", "bc", "d"), from the request's arrival: [150,
# 190, 250]. The client starts its clock before sending and reads a chunk only after it is
# sent, so no arrival (time from the start) comes before its due time: lower bounds from the
# mock's sleeps hold on any machine, however loaded.
DUE_MS = [TTFT_MS, TTFT_MS + ITL_MS[0], E2EL_MS]


def _near(measured_ms: float, nominal_ms: float, early: float = EARLY_MS,
          late: float = LATE_MS) -> bool:
    return nominal_ms - early <= measured_ms <= nominal_ms + late


@pytest.fixture(scope="module")
def server():
    # Server and client share this process: hand the GIL over every 0.5 ms (default 5 ms) so
    # the mock's chunk timings are not blurred by the benchmark's own thread.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        with MockServer() as srv:
            yield srv
    finally:
        sys.setswitchinterval(interval)


@pytest.fixture()
def mock(server):
    server.state.reset()
    return server


def _run(mock, log=None, **kw) -> dict:
    kw = {"base_url": mock.base_url, "num_prompts": 1, "input_len": 8, "output_len": 4,
          "disable_tqdm": True, **kw}
    return run_serve_bench(BenchConfig(**kw), log=log or (lambda s: None))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_request_timings_match_the_mock(mock, endpoint):
    r = _run(mock, endpoint=endpoint, num_prompts=1)
    assert r["completed"] == 1 and r["failed"] == 0, r["errors"]
    # vLLM's top-level keys of a --save-result file
    assert (
        r["backend"] == ("openai-chat" if endpoint == "chat" else "openai")
        and r["num_prompts"] == 1
    )
    assert r["model_id"] == r["config"]["model"] and r["tokenizer_id"] and len(r["date"]) == 15
    ttft_ms, e2el_ms = r["ttfts"][0] * 1000, r["latencies"][0] * 1000
    itl_ms = [g * 1000 for g in r["itls"][0]]
    assert _near(ttft_ms, TTFT_MS), ttft_ms
    assert len(itl_ms) == 2, itl_ms
    arrivals = [ttft_ms, ttft_ms + itl_ms[0], ttft_ms + itl_ms[0] + itl_ms[1]]
    for arrival, due in zip(arrivals, DUE_MS):
        assert arrival >= due - EARLY_MS, (arrivals, DUE_MS)
    # Each ITL spans at least the mock's sleep between the two chunks, less how late the first
    # of them was read (a chunk read late shortens the next gap): that lateness is at most its
    # arrival minus its due time. So an ITL of 0 (or one shortened by a miscounted chunk) fails;
    # the upper bound only allows for a loaded machine.
    for i, (got, gap) in enumerate(zip(itl_ms, ITL_MS)):
        read_late = arrivals[i] - DUE_MS[i]
        assert gap - read_late - EARLY_MS <= got <= gap + LATE_MS, (itl_ms, arrivals)
    # The ITLs are the gaps between the content chunks: they end at "d", before [DONE].
    assert arrivals[-1] <= e2el_ms + 1e-6, (arrivals, e2el_ms)
    assert _near(e2el_ms, E2EL_MS), e2el_ms
    # Output tokens from usage (4), not from the 3 content chunks.
    assert r["output_lens"] == [COMPLETION_TOKENS] and r["usage_missing"] == [False]
    assert r["total_output_tokens"] == COMPLETION_TOKENS
    # TPOT = (E2EL - TTFT) / (tokens - 1) of this very request, exactly.
    tpot_ms = (e2el_ms - ttft_ms) / (COMPLETION_TOKENS - 1)
    assert r["tpots"][0] * 1000 == pytest.approx(tpot_ms, rel=1e-12)
    assert r["mean_tpot_ms"] == pytest.approx(tpot_ms, rel=1e-12)
    assert abs(tpot_ms - (E2EL_MS - TTFT_MS) / 3) <= LATE_MS / 2
    assert r["mean_ttft_ms"] == pytest.approx(ttft_ms) and r["mean_e2el_ms"] == pytest.approx(
        e2el_ms
    )
    assert r["median_itl_ms"] == pytest.approx(sum(itl_ms) / 2)
    # prompt tokens from usage: the mock counts the prompt's words.
    assert r["input_lens"] == [8] and r["total_input_tokens"] == 8
    assert r["duration"] >= r["latencies"][0]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_request_payload(mock, endpoint):
    _run(mock, endpoint=endpoint, api_key="sk-test", output_len=7)
    (payload,) = mock.state.payloads
    assert payload["model"] == "mock-model"  # from /v1/models
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}
    assert payload["max_tokens"] == 7 and payload["temperature"] == 0
    assert payload["ignore_eos"] is True
    if endpoint == "chat":
        assert payload["messages"][0]["role"] == "user" and "prompt" not in payload
        assert len(payload["messages"][0]["content"].split()) == 8
    else:
        assert len(payload["prompt"].split()) == 8 and "messages" not in payload
    assert mock.state.auth_headers == ["Bearer sk-test"]


def test_usage_missing_falls_back_to_chunk_count(mock):
    mock.state.usage = False
    r = _run(mock)
    assert r["output_lens"] == [3] and r["usage_missing"] == [True]
    assert r["num_usage_missing"] == 1
    assert r["input_lens"] == [8]  # the client-side /tokenize count


def test_failing_request_is_counted_and_excluded(mock, tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "one two three", "output_len": 5}, {"prompt": "please FAIL now"},
            {"prompt": "four five"}]
    path.write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    r = _run(mock, dataset="jsonl", dataset_path=str(path), num_prompts=10, output_len=9)
    assert r["completed"] == 2 and r["failed"] == 1
    assert r["errors"][0] == "" and r["errors"][2] == ""
    assert r["errors"][1].startswith("HTTP 400") and "marker prompt rejected" in r["errors"][1]
    assert r["ttfts"][1] is None and r["itls"][1] == [] and r["output_lens"][1] == 0
    assert r["total_input_tokens"] == 3 + 2  # usage of the two good requests only
    assert [p["max_tokens"] for p in mock.state.payloads] == [5, 9, 9]
    assert _near(r["mean_e2el_ms"], E2EL_MS)


def test_goodput_end_to_end(mock):
    r = _run(mock, num_prompts=3, goodput={"ttft": 1000.0, "e2el": 2000.0})
    assert r["good_requests"] == 3
    assert r["request_goodput"] == pytest.approx(3 / r["duration"])
    r = _run(mock, num_prompts=3, goodput={"ttft": 1000.0, "tpot": 1.0})
    assert r["good_requests"] == 0 and r["request_goodput"] == 0.0


def test_percentiles_reported(mock):
    r = _run(mock, num_prompts=3, percentiles=[25.0, 99.9])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert f"p25_{metric}_ms" in r and f"p99.9_{metric}_ms" in r
        assert f"p99_{metric}_ms" not in r
    assert r["p25_ttft_ms"] <= r["p99.9_ttft_ms"]


def test_max_concurrency_limits_in_flight(mock):
    r = _run(mock, num_prompts=6, max_concurrency=2)
    assert r["completed"] == 6
    assert mock.state.max_in_flight == 2
    assert r["max_concurrent_requests"] <= 2
    # 6 requests, 2 at a time, ~250 ms each: about 3 rounds.
    assert r["duration"] >= 3 * E2EL_MS / 1000 - 0.015
    assert max(r["queue_times"]) > 0.2
    mock.state.reset()
    r = _run(mock, num_prompts=6)
    assert mock.state.max_in_flight == 6 and r["max_concurrent_requests"] == 6


def test_request_rate_spreads_arrivals(mock):
    r = _run(mock, num_prompts=4, request_rate=20.0, seed=1)
    # Arrivals are rescaled so the last one is at n / rate = 0.2 s.
    assert r["start_times"][-1] == pytest.approx(0.2, abs=0.02)
    assert r["start_times"] == sorted(r["start_times"])
    assert r["duration"] >= 0.2 + E2EL_MS / 1000 - 0.01


def test_tokenize_based_prompt_lengths(mock):
    r = _run(mock, num_prompts=12, input_len=20, range_ratio=0.5, seed=5)
    assert r["config"]["tokenizer"] == "server"
    lens = [len(p["prompt"].split()) for p in mock.state.payloads]
    assert sorted(lens) == sorted(r["input_lens"])
    assert all(10 <= n <= 30 for n in lens) and len(set(lens)) > 1
    ids = [int(w[1:]) for p in mock.state.payloads for w in p["prompt"].split()]
    assert all(100 <= i < 49152 for i in ids)
    # Deterministic in the seed.
    first = sorted(p["prompt"] for p in mock.state.payloads)
    mock.state.reset()
    _run(mock, num_prompts=12, input_len=20, range_ratio=0.5, seed=5)
    assert sorted(p["prompt"] for p in mock.state.payloads) == first
    mock.state.reset()
    _run(mock, num_prompts=12, input_len=20, range_ratio=0.5, seed=6)
    assert sorted(p["prompt"] for p in mock.state.payloads) != first


def test_prefix_repetition_prompts(mock):
    r = _run(mock, dataset="prefix-repetition", num_prompts=8, prefix_len=6, input_len=4,
             num_prefixes=2, vocab_size=1000)
    assert r["completed"] == 8
    words = [p["prompt"].split() for p in mock.state.payloads]
    assert all(len(w) == 10 for w in words)
    prefixes = {tuple(w[:6]) for w in words}
    assert len(prefixes) == 2
    assert len({tuple(w) for w in words}) == 8  # suffixes differ
    assert all(100 <= int(t[1:]) < 1000 for w in words for t in w)


def test_tokenize_asks_without_special_tokens_and_retries_plain(mock):
    _run(mock, num_prompts=2, input_len=5)
    assert mock.state.tokenize_bodies and all(
        b["add_special_tokens"] is False for b in mock.state.tokenize_bodies)
    mock.state.reset()
    mock.state.strict_tokenize = True
    r = _run(mock, num_prompts=2, input_len=5)
    assert r["config"]["tokenizer"] == "server" and r["input_lens"] == [5, 5]
    assert "add_special_tokens" not in mock.state.tokenize_bodies[-1]


def test_vocab_size_beyond_the_model_is_a_clear_error(mock, capsys):
    mock.state.vocab_size = 1000
    args = add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--base-url", mock.base_url, "--num-prompts", "2", "--input-len", "50",
         "--disable-tqdm", "--vocab-size", "49152"])
    assert main(args) == 1
    assert "--vocab-size" in capsys.readouterr().err
    assert mock.state.payloads == []


def test_word_fallback_without_tokenize(mock):
    mock.state.tokenize = False
    messages: list[str] = []
    r = _run(mock, num_prompts=3, input_len=12, log=messages.append)
    assert r["config"]["tokenizer"] == "words"
    assert any("/tokenize" in m for m in messages)
    assert [len(p["prompt"].split()) for p in mock.state.payloads] == [12, 12, 12]
    assert r["completed"] == 3


def test_metrics_scrape_delta(mock):
    r = _run(mock, num_prompts=5)
    totals = {
        "prefix_cache_queries": 50.0,
        "prefix_cache_hits": 20.0,
        "kv_p2p_bytes_received": 5000.0,
        "prefix_cache_hit_rate": 0.4,
    }
    assert r["server_metrics"] == {**totals, "sources": {mock.base_url + "/metrics": totals}}
    mock.state.metrics = False
    assert _run(mock, num_prompts=1)["server_metrics"] is None
    mock.state.metrics = True
    assert _run(mock, num_prompts=1, scrape_metrics=False)["server_metrics"] is None
    url = mock.base_url + "/metrics"
    assert _run(mock, num_prompts=2, base_url=mock.base_url + "/", metrics_url=url)[
        "server_metrics"]["prefix_cache_queries"] == 20.0


def test_unreachable_server_fails_requests_not_the_run(mock):
    r = _run(mock, base_url="http://127.0.0.1:9", model="m", num_prompts=2, request_timeout=5)
    assert r["completed"] == 0 and r["failed"] == 2
    assert all(e for e in r["errors"]) and r["server_metrics"] is None
    assert r["config"]["tokenizer"] == "words"


def test_cli_main_end_to_end(mock, tmp_path, capsys):
    out = tmp_path / "serve.json"
    parser = add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args([
        "--base-url", mock.base_url, "--endpoint", "/v1/chat/completions", "--num-prompts", "4",
        "--input-len", "16", "--output-len", "4", "--request-rate", "inf",
        "--max-concurrency", "2", "--goodput", "ttft:1000", "tpot:500", "--percentiles",
        "50,99", "--result-json", str(out), "--disable-tqdm", "--seed", "7",
    ])
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Mean TTFT (ms):" in printed
    assert "Request goodput (req/s):" in printed and "Prefix cache hit rate (%):" in printed
    data = json.loads(out.read_text())
    assert data["completed"] == 4 and data["good_requests"] == 4
    assert data["config"]["endpoint"] == "chat" and data["config"]["seed"] == 7
    assert data["request_rate"] == "inf" and data["max_concurrency"] == 2
    assert len(data["itls"]) == 4 and all(len(x) == 2 for x in data["itls"])
    assert math.isclose(data["server_metrics"]["prefix_cache_hit_rate"], 0.4)
    assert "TTFT Phases" in printed and "client_residual" in printed
    phases = data["ttft_phases"]  # the mock's timings: queue 20 + prefill 100 = 120 ms
    assert phases["num_requests"] == 4 and phases["mean_phase_sum_ms"] == pytest.approx(120.0)
    assert phases["phases"]["prefill"]["mean_ms"] == pytest.approx(100.0)
    assert data["pdkv_timings"][0]["phases"] == {"queue": 0.02, "prefill": 0.1}
    assert mock.state.max_in_flight == 2


def test_cli_main_fails_when_nothing_succeeds(capsys):
    parser = add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--base-url", "http://127.0.0.1:9", "--disable-tqdm",
                              "--num-prompts", "1", "--no-metrics"])
    assert main(args) == 1  # no --model and no /v1/models
    assert "--model not given" in capsys.readouterr().err
    with pytest.raises(ValueError):
        BenchConfig(dataset="jsonl")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_multi_turn_conversations_extend_turn_by_turn(mock, endpoint):
    r = _run(mock, dataset="multi-turn", endpoint=endpoint, num_prompts=3, num_turns=3, input_len=5,
             output_len=4, max_concurrency=1)
    assert r["completed"] == 9
    sent = mock.state.payloads
    assert len(sent) == 9
    for c in range(3):  # turn-major order: request t*3 + c is conversation c's turn t
        turns = [sent[t * 3 + c] for t in range(3)]
        if endpoint == "chat":
            msgs = [p["messages"] for p in turns]
            assert [len(m) for m in msgs] == [1, 3, 5]
            for t in (1, 2):
                assert msgs[t][: len(msgs[t - 1])] == msgs[t - 1]  # the earlier turns, unchanged
                assert msgs[t][-2]["role"] == "assistant" and msgs[t][-1]["role"] == "user"
                assert (
                    len(msgs[t][-2]["content"].split()) == 4
                    and len(msgs[t][-1]["content"].split()) == 5
                )
        else:
            prompts = [p["prompt"] for p in turns]
            assert prompts[1].startswith(prompts[0]) and prompts[2].startswith(prompts[1])
            assert prompts[0].endswith("Assistant:")
    first = [str(p.get("messages") or p.get("prompt")) for p in sent]
    mock.state.reset()
    _run(mock, dataset="multi-turn", endpoint=endpoint, num_prompts=3, num_turns=3, input_len=5,
         output_len=4, max_concurrency=1)
    assert [
        str(p.get("messages") or p.get("prompt")) for p in mock.state.payloads
    ] == first  # seeded, same order
