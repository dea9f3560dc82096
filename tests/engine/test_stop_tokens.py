"""Stop tokens and stop strings in the output text, as vLLM: the token that stopped the request
(one of stop_token_ids, or EOS) stays in token_ids but its text is not output, and a matched stop
string is cut, unless include_stop_str_in_output. Expectations are computed from an unstopped
greedy run and the tokenizer."""

from __future__ import annotations

import pytest

from pdkv import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The history of the bicycle begins in the early nineteenth century, when"


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", num_kv_blocks=64, max_model_len=256)


def _greedy(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, **kw))[0].outputs[0]


def test_stop_token_text_is_not_output_unless_asked(llm):
    tok = llm.llm_engine.tokenizer
    ids = _greedy(llm, PROMPT, max_tokens=12, ignore_eos=True).token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # first stop at position k
    stop = ids[k]
    out = _greedy(llm, PROMPT, max_tokens=12, stop_token_ids=[stop])
    assert out.token_ids == ids[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == tok.decode(ids[:k])
    assert tok.decode(ids[: k + 1]) != out.text  # the stop token has text of its own
    kept = _greedy(
        llm, PROMPT, max_tokens=12, stop_token_ids=[stop], include_stop_str_in_output=True
    )
    assert kept.token_ids == ids[: k + 1]
    assert kept.text == tok.decode(ids[: k + 1])


def test_eos_text_is_not_output_even_with_special_tokens(llm):
    tok = llm.llm_engine.tokenizer
    eos = llm.llm_engine.eos_token_id
    prompt = {"prompt_token_ids": tok.encode_chat([{"role": "user", "content": "What is 2+2?"}])}
    out = _greedy(llm, prompt, max_tokens=64, skip_special_tokens=False)
    assert out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert out.text == tok.decode(out.token_ids[:-1], skip_special_tokens=False)
    kept = _greedy(
        llm, prompt, max_tokens=64, skip_special_tokens=False, include_stop_str_in_output=True
    )
    assert kept.text == tok.decode(kept.token_ids, skip_special_tokens=False)
    assert kept.text.endswith(tok.decode([eos], skip_special_tokens=False))


def test_stop_string_kept_only_when_asked(llm):
    full = _greedy(llm, PROMPT, max_tokens=24, ignore_eos=True).text
    stop = full[10:14]
    at = full.index(stop)
    cut = _greedy(llm, PROMPT, max_tokens=24, ignore_eos=True, stop=[stop])
    assert cut.text == full[:at] and cut.stop_reason == stop
    kept = _greedy(
        llm, PROMPT, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    assert kept.text == full[: at + len(stop)] and kept.finish_reason == "stop"
