"""Sampling behaviour on the real model: seeds, stop strings, stop tokens, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
from conftest import assert_no_leak

from pdkv import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", num_kv_blocks=64, max_model_len=256)


def _tokens(llm, params, prompt=PROMPT):
    return llm.generate(prompt, params)[0].outputs[0]


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    a = _tokens(llm, p).token_ids
    b = _tokens(llm, p).token_ids
    c = _tokens(llm, SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)).token_ids
    assert a == b
    assert a != c
    # Batched with other requests, the seeded request draws the same tokens.
    outs = llm.generate([PROMPT, "Hello there", PROMPT], [p, SamplingParams(max_tokens=5), p])
    assert outs[0].outputs[0].token_ids == a == outs[2].outputs[0].token_ids
    assert_no_leak(llm)


def test_stop_string_truncates_and_finishes(llm):
    greedy = _tokens(llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    words = greedy.text.split()
    stop = words[len(words) // 2]
    out = _tokens(llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert stop not in out.text
    assert greedy.text.startswith(out.text)
    assert len(out.token_ids) < len(greedy.token_ids)


def test_stop_token_ids_and_min_tokens(llm):
    greedy = _tokens(llm, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop_tok = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_tok)
    out = _tokens(llm, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]))
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == greedy.token_ids[: first + 1]
    # min_tokens masks the stop token until enough tokens were produced.
    out = _tokens(
        llm, SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 2, stop_token_ids=[stop_tok])
    )
    assert len(out.token_ids) >= first + 2


def test_eos_ends_chat_answer(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == llm.llm_engine.eos_token_id
    assert "Paris" in out.text


def test_logprobs_greedy_token_is_top(llm):
    out = _tokens(llm, SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))
    assert len(out.logprobs) == 6
    total = 0.0
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp
        assert lp[tok] == pytest.approx(max(lp.values()))
        assert all(v <= 0 for v in lp.values()) and len(lp) >= 3
        total += lp[tok]
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-6)


def test_max_model_len_caps_output(llm):
    prompt = {"prompt_token_ids": [1] + list(range(100, 350))}  # 251 tokens, max_model_len 256
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 256
