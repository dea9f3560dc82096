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
    p = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True
    )
    a = _tokens(llm, p).token_ids
    b = _tokens(llm, p).token_ids
    c = _tokens(
        llm, SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    ).token_ids
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
        llm,
        SamplingParams(
            temperature=0, max_tokens=20, min_tokens=first + 2, stop_token_ids=[stop_tok]
        ),
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
    tok_hf = llm.get_tokenizer()
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp
        assert lp[tok].logprob == pytest.approx(max(v.logprob for v in lp.values()))
        assert all(v.logprob <= 0 for v in lp.values()) and len(lp) >= 3
        assert lp[tok].rank == 1 and sorted(v.rank for v in lp.values()) == [1, 2, 3]
        assert lp[tok].decoded_token == tok_hf.decode([tok])
        total += lp[tok].logprob
    assert math.isclose(out.cumulative_logprob, total, rel_tol=1e-6)


def test_max_model_len_caps_output(llm):
    prompt = {"prompt_token_ids": [1] + list(range(100, 350))}  # 251 tokens, max_model_len 256
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 256


def test_penalties_and_bias_change_greedy_output(llm):
    song = "Sing along: la la la la la la la la"
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = _tokens(llm, base, song).token_ids
    freq = _tokens(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                       frequency_penalty=2.0), song).token_ids
    assert freq != plain
    # A frequency penalty of 2 makes repeats rarer than in the plain greedy output.
    assert len(freq) - len(set(freq)) < len(plain) - len(set(plain))
    banned = plain[0]
    out = _tokens(llm, SamplingParams(temperature=0, max_tokens=4, logit_bias={banned: -100}))
    assert banned not in out.token_ids


def test_n_sequences_share_prompt_and_seed_reproduces(llm):
    p = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    a = llm.generate(PROMPT, p)[0]
    b = llm.generate(PROMPT, p)[0]
    assert [c.index for c in a.outputs] == [0, 1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids
    # Sequence 1 is the request with seed + 1.
    one = _tokens(llm, SamplingParams(temperature=1.0, seed=6, max_tokens=8, ignore_eos=True))
    assert one.token_ids == a.outputs[1].token_ids
    assert_no_leak(llm)


def test_prompt_logprobs_match_decode_logprobs(llm):
    greedy = _tokens(llm, SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True))
    ids = llm.get_tokenizer().encode(PROMPT) + greedy.token_ids
    p = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    for _ in range(2):  # the second run would hit the prefix cache: it is not read for these
        out = llm.generate({"prompt_token_ids": ids}, p)[0]
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        assert all(ids[i] in plp[i] and len(plp[i]) >= 2 for i in range(1, len(ids)))
        n = len(greedy.token_ids)
        for tok, pos, lp in zip(greedy.token_ids, range(len(ids) - n, len(ids)), greedy.logprobs):
            assert plp[pos][tok].rank == 1
            assert plp[pos][tok].logprob == pytest.approx(lp[tok].logprob, abs=2e-3)
            assert plp[pos][tok].decoded_token == lp[tok].decoded_token
    assert_no_leak(llm)


def test_structured_output_in_a_mixed_batch(llm):
    from pdkv.sampling_params import StructuredOutputsParams

    choice = SamplingParams(temperature=1.0, seed=2, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    free = SamplingParams(temperature=0, max_tokens=6)
    outs = llm.generate([PROMPT, PROMPT], [choice, free])
    assert outs[0].outputs[0].text in ("alpha", "beta")
    assert outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].text == _tokens(llm, free).text  # the mask stays in its row
    with pytest.raises(ValueError, match="grammar is invalid"):
        llm.generate(
            PROMPT, SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-"))
        )
    assert_no_leak(llm)
