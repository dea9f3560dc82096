"""Every OpenAI / vLLM request field through the official `openai` client: each one changes the
output as defined (checked against the offline engine with the same SamplingParams, and against
the field's definition where a response shows it) or gets a 400 naming the field."""

from __future__ import annotations

import json
import math
import re

import openai
import pytest

from pdkv import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Sing along: la la la la la la la la"
MESSAGES = [{"role": "user", "content": "List three colours."}]
N = 8


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _complete(client, max_tokens=N, **kw):
    return client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=max_tokens, **kw)


def _offline(llm, **kw):
    return llm.generate(PROMPT, SamplingParams(max_tokens=N, **kw))[0].outputs


def test_penalties_change_greedy_output_like_offline(client, reference_llm):
    plain = _complete(client, temperature=0).choices[0].text
    for field in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 1.8},
    ):
        extra = {k: v for k, v in field.items() if k == "repetition_penalty"}
        std = {k: v for k, v in field.items() if k != "repetition_penalty"}
        out = _complete(client, temperature=0, extra_body=extra, **std).choices[0].text
        assert out != plain, field
        assert out == _offline(reference_llm, temperature=0, **field)[0].text, field


def test_logit_bias_bans_a_token(client, reference_llm):
    plain = _offline(reference_llm, temperature=0)[0].token_ids
    out = _complete(client, temperature=0, logit_bias={str(plain[0]): -100}, logprobs=0)
    assert (
        out.choices[0].text
        == _offline(reference_llm, temperature=0, logit_bias={plain[0]: -100})[0].text
    )
    assert out.choices[0].text != reference_llm.get_tokenizer().decode(plain)


def test_min_p_keeps_only_tokens_near_the_top(client, reference_llm):
    kw = {"temperature": 1.0, "seed": 11}
    out = _complete(client, logprobs=1, extra_body={"min_p": 0.3}, **kw).choices[0]
    # At temperature 1 with no penalty the raw logprobs are the sampling distribution: every
    # sampled token is at least min_p times as likely as the top one.
    for lp, top in zip(out.logprobs.token_logprobs, out.logprobs.top_logprobs):
        assert lp - max(top.values()) >= math.log(0.3) - 1e-4
    assert out.text == _offline(reference_llm, min_p=0.3, **kw)[0].text


def test_n_with_seed_is_reproducible_and_shares_the_prompt(client, reference_llm):
    kw = {"temperature": 1.0, "seed": 3, "n": 2}
    a = _complete(client, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert a.choices[0].text != a.choices[1].text
    assert [c.text for c in a.choices] == [c.text for c in _offline(reference_llm, **kw)]
    assert a.usage.completion_tokens == 2 * N
    chat = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4, n=2,
                                          temperature=1.0, seed=3, frequency_penalty=1.0)
    assert len(chat.choices) == 2 and chat.choices[1].index == 1
    # Reproducible: the same seed streamed gives the same two sequences.
    stream = _complete(client, stream=True, **kw)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in a.choices]


def test_prompt_logprobs_cover_every_prompt_token(client, hf_tokenizer, hf_model):
    """Every prompt token after the first gets its logprob, its rank and the top-1 entry of HF
    transformers' log-softmax over the same model's logits at the position before it."""
    import torch

    out = _complete(client, temperature=0, max_tokens=1, extra_body={"prompt_logprobs": 1})
    plp = out.choices[0].model_extra["prompt_logprobs"]
    ids = hf_tokenizer(PROMPT)["input_ids"]
    assert len(plp) == out.usage.prompt_tokens == len(ids) and plp[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    tol = 2e-3  # float32 on both sides; test_sampling's prompt-vs-decode tolerance
    for pos in range(1, len(ids)):
        row, entries = ref[pos - 1], plp[pos]
        token = ids[pos]
        assert 1 <= len(entries) <= 2 and str(token) in entries, (pos, entries)
        got = entries[str(token)]
        want = row[token].item()
        assert got["logprob"] == pytest.approx(want, abs=tol), (pos, got, want)
        # Its rank: 1 + the tokens HF ranks strictly above it (up to a near-tie).
        assert (1 + int((row > want + tol).sum()) <= got["rank"]
                <= 1 + int((row > want - tol).sum())), (pos, got)
        # The top-1 entry: HF's most likely token (unless HF's top two nearly tie).
        (top_id, top), *_ = sorted(entries.items(), key=lambda kv: kv[1]["rank"])
        assert top["rank"] == 1 and top["logprob"] == pytest.approx(row.max().item(), abs=tol)
        best2 = row.topk(2).values
        if best2[0] - best2[1] > 2 * tol:
            assert int(top_id) == row.argmax().item(), (pos, entries)


def test_structured_output_follows_the_grammar(client, hf_tokenizer):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Invent a person."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    assert out.choices[0].finish_reason == "stop"
    value = json.loads(out.choices[0].message.content)
    # The schema checked by hand (jsonschema is not installed): exactly these keys and types.
    assert set(value) == {"name", "age"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    choices = ["red", "green", "blue"]
    assert (
        _complete(client, temperature=1.0, seed=1, extra_body={"guided_choice": choices})
        .choices[0]
        .text
        in choices
    )
    regex = (
        _complete(client, temperature=0, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
        .choices[0]
        .text
    )
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex)
    obj = _complete(
        client,
        temperature=0,
        max_tokens=30,
        extra_body={"response_format": {"type": "json_object"}},
    )
    text, finish = obj.choices[0].text, obj.choices[0].finish_reason
    # The whole text is in the language of a JSON object, checked by llguidance on its own
    # grammar (not pdkv's compile_grammar): it accepts every token of the text in turn; a
    # finished text is a complete object, one cut by max_tokens a prefix of one.
    accepted, complete = _json_object_prefix(hf_tokenizer, text)
    assert accepted == text, (accepted, text)
    if finish == "stop":
        assert complete and isinstance(json.loads(text), dict), text
    else:
        assert finish == "length" and obj.usage.completion_tokens == 30, (finish, text)


def _json_object_prefix(hf_tokenizer, text: str) -> tuple[str, bool]:
    """The longest prefix of `text` (re-tokenized, whole tokens) that llguidance's JSON-object
    grammar accepts, and whether that prefix is a complete object."""
    import llguidance
    import llguidance.hf
    from llguidance import LLMatcher

    matcher = LLMatcher(
        llguidance.hf.from_tokenizer(hf_tokenizer),
        LLMatcher.grammar_from_json_schema({"type": "object"}),
        log_level=0,
    )
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    n = matcher.try_consume_tokens(ids)
    assert not matcher.is_error(), matcher.get_error()
    prefix = text if n == len(ids) else hf_tokenizer.decode(ids[:n])
    return prefix, matcher.is_accepting()


def test_echo_prepends_the_prompt(client):
    plain = _complete(client, temperature=0).choices[0].text
    assert _complete(client, temperature=0, echo=True).choices[0].text == PROMPT + plain
    out = _complete(client, temperature=0, echo=True, logprobs=1, max_tokens=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == out.usage.prompt_tokens + out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])


def message_fields(message: str) -> list[str]:
    """The request field names a 400's message mentions (words with letters and underscores)."""
    return re.findall(r"[a-z_]+", message)


@pytest.mark.parametrize("prompt", ["", ["a", "b"],
                                    # echo decoded out-of-vocabulary ids first: a 500 (found by
                                    # a 500-case schema fuzzing run)
                                    [5, -3298], [5, 12261179109096629372715008]])
def test_a_prompt_the_server_cannot_take_is_a_400_naming_prompt(client, prompt):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt=prompt, max_tokens=2, echo=True)
    assert e.value.body["param"] == "prompt"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"extra_body": {"tools": [{"type": "function", "function": {"name": "f"}}]}}, "tools"),
    ({"extra_body": {"tool_choice": "required"}}, "tool_choice"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ({"extra_body": {"response_format": {"type": "xml"}}}, "response_format"),
    # A malformed json_schema holder was a 500 ('int' object has no attribute 'get').
    ({"extra_body": {"response_format": {"type": "json_schema", "json_schema": 5}}},
     "response_format"),
    ({"extra_body": {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}},
     "response_format"),
    # A body the model refuses names its field in `param` too.
    ({"extra_body": {"guided_choice": [1, 2]}}, "guided_choice"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice"),  # was param structured_outputs
    ({"extra_body": {"guided_regex": "[0-9"}}, "guided_regex"),
    ({"extra_body": {"guided_json": {"type": "object"}, "guided_regex": "a"}}, "guided_json"),
    ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ({"best_of": 2}, "best_of"),
    ({"suffix": "end"}, "suffix"),
    ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"extra_body": {"min_p": 2}}, "min_p"),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"n": 2, "extra_body": {"kv_transfer_params": {"do_remote_decode": True}}}, "n"),
])
def test_unsupported_or_invalid_field_is_a_400_naming_it(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, **kwargs)
    assert field in e.value.message
    assert e.value.body["param"] in message_fields(
        e.value.message
    )  # error.param names a field of the message


def test_chat_rejects_tools_and_ignores_unknown_fields(client):
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=2, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    out = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=2,
                                         tool_choice="none", extra_body={"no_such_field": 1})
    assert out.choices[0].finish_reason == "length"


def test_unknown_field_is_logged_not_rejected(caplog):
    from pdkv.serve.protocol import ChatCompletionRequest

    with caplog.at_level("WARNING", logger="pdkv.serve.protocol"):
        req = ChatCompletionRequest.model_validate(
            {"messages": MESSAGES, "no_such_field": 1, "top_k": 3}
        )
    assert req.top_k == 3
    assert "ignored: ['no_such_field']" in caplog.text


def test_tokenize_takes_add_special_tokens_as_vllm(caplog):
    """/tokenize's add_special_tokens (sent by `pdkv bench serve`, as vLLM's benchmark does) is
    a field, not an ignored one, and reaches the tokenizer: a prompt gets the tokenizer's
    special tokens unless it is false, rendered chat messages only when it is true."""
    from pdkv.serve.protocol import TokenizeRequest
    from pdkv.tokenizer import Tokenizer

    with caplog.at_level("WARNING", logger="pdkv.serve.protocol"):
        req = TokenizeRequest.model_validate({"prompt": "hi", "add_special_tokens": False})
    assert req.add_special_tokens is False and "ignored" not in caplog.text
    assert TokenizeRequest.model_validate({"prompt": "hi"}).add_special_tokens is None

    class FakeHF:  # BOS = 1 when special tokens are added, as a Llama tokenizer does
        chat_template = "x"

        def encode(self, text, add_special_tokens=True):
            return ([1] if add_special_tokens else []) + [len(text)]

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "chat"

    tok = Tokenizer.__new__(Tokenizer)
    tok._tok = FakeHF()
    assert tok.encode("abc") == [1, 3] and tok.encode("abc", False) == [3]
    msgs = [{"role": "user", "content": "x"}]
    assert tok.encode_chat(msgs) == [4] and tok.encode_chat(msgs, True, True) == [1, 4]


def test_merge_streams_error_closes_the_other_sequences():
    import asyncio

    from pdkv.outputs import RequestOutput
    from pdkv.serve.fanout import merge_streams

    closed = []

    async def seq(i, fail):
        try:
            yield RequestOutput(f"r-{i}", None, [1], [], finished=False)
            if fail:
                raise RuntimeError("engine failed")
            await asyncio.Event().wait()  # never finishes by itself
        finally:
            closed.append(i)

    async def run():
        got = []
        with pytest.raises(RuntimeError, match="engine failed"):
            async for i, out in merge_streams([seq(0, False), seq(1, True)]):
                got.append((i, out.request_id))
        return got

    got = asyncio.run(run())
    assert sorted(got) == [(0, "r-0"), (1, "r-1")]
    assert sorted(closed) == [0, 1]


def test_aliased_field_is_not_called_ignored(caplog):
    """response_format.json_schema.schema is a field under an alias (schema_): a body that uses
    it gets no "ignored" warning, and the schema is read."""
    from pdkv.serve.protocol import ChatCompletionRequest

    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    with caplog.at_level("WARNING", logger="pdkv.serve.protocol"):
        req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert req.response_format is not None and req.response_format.json_schema is not None
    assert req.response_format.json_schema.schema_ == schema
    assert "ignored" not in caplog.text
