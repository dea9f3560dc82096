"""Invalid input is rejected with a ValueError naming the problem; the engine keeps serving."""

from __future__ import annotations

import pytest
from conftest import assert_no_leak

from pdkv import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_LEN = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", num_kv_blocks=64, max_model_len=MAX_LEN)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "prompt is empty"),
        ({"prompt_token_ids": []}, "prompt is empty"),
        ({"prompt_token_ids": list(range(MAX_LEN + 5))}, "max_model_len=128"),
        ({"prompt_token_ids": list(range(MAX_LEN))}, "max_model_len=128"),
        ({"prompt_token_ids": [1, 2, 10**9]}, "outside the vocabulary"),
        ({"prompt_token_ids": [1, "a"]}, "must be integers"),
        (3.5, "unsupported prompt type"),
    ],
)
def test_bad_prompt_rejected(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, GREEDY)
    assert_no_leak(llm)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": -3}, "max_tokens must be at least 1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_bad_sampling_params_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_rejected():
    with pytest.raises(ValueError, match="unknown model 'not-a-model'"):
        LLM("not-a-model")


def test_kv_cache_too_small_for_max_model_len_rejected():
    with pytest.raises(ValueError, match="cannot hold one request"):
        LLM("smollm2", num_kv_blocks=4, max_model_len=256)


def test_bad_prompt_in_batch_queues_nothing(llm):
    good = "Name a fruit."
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([good, ""], GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()
    assert_no_leak(llm)


def test_engine_keeps_serving_after_rejections(llm):
    prompts = ["Name a fruit.", "What is two plus two?", "Say hello in French."]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    engine = llm.llm_engine
    ids = []
    for p in prompts:
        req, text = engine.make_request(p, GREEDY)
        engine.add_request(req, text)
        ids.append(req.request_id)
    done = {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    # requests are mid-flight when the bad ones arrive
    for bad in ("", {"prompt_token_ids": list(range(MAX_LEN))}):
        with pytest.raises(ValueError):
            engine.make_request(bad, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        req, text = engine.make_request("again", GREEDY, request_id=ids[0])
        engine.add_request(req, text)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[i] for i in ids] == expected
    assert_no_leak(llm)


def test_abort_waiting_and_running(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reqs = []
    for p in ["One", "Two", "Three", "Four"]:
        req, text = engine.make_request(p, params)
        engine.add_request(req, text)
        reqs.append(req.request_id)
    engine.step()
    engine.step()
    aborted = engine.abort_request([reqs[1], "no-such-id"])
    assert [o.request_id for o in aborted] == [reqs[1]]
    assert aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if reqs[3] not in finished and reqs[3] not in aborted:
            engine.abort_request([reqs[3]])
    assert set(finished) == {reqs[0], reqs[2]}
    assert all(len(finished[r].outputs[0].token_ids) == 16 for r in (reqs[0], reqs[2]))
    assert_no_leak(llm)
