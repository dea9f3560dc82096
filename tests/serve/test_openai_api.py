"""The server driven by the official `openai` client: completions and chat, streaming and not;
greedy text equals LLM.generate / LLM.chat; usage counts and cached tokens are right."""

from __future__ import annotations

import httpx
import openai
import pytest

from pdkv import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The three most important inventions of the twentieth century are"
MESSAGES = [{"role": "user", "content": "Give me two reasons to learn to cook."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def _greedy(reference_llm, prompt=None, messages=None, n=24):
    params = SamplingParams(temperature=0, max_tokens=n)
    if messages is not None:
        return reference_llm.chat([messages], params)[0]
    return reference_llm.generate(prompt, params)[0]


def test_models_lists_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [
        "smollm2",
        "pdkv-alias",
    ]  # --served-model-name smollm2 pdkv-alias
    out = client.completions.create(model="pdkv-alias", prompt=PROMPT, max_tokens=1)
    assert out.model == "smollm2"  # every name is accepted, the first is reported
    with pytest.raises(
        openai.NotFoundError, match="does not exist; this server serves `smollm2`, `pdkv-alias`"
    ):
        client.completions.create(model="pdkv-alias-2", prompt=PROMPT, max_tokens=1)


def test_completion_matches_offline(client, reference_llm):
    ref = _greedy(reference_llm, PROMPT)
    out = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.choices[0].text == ref.outputs[0].text
    assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.model_extra.get("kv_transfer_params", "missing") is None


def test_completion_stream_matches_offline(client, reference_llm):
    ref = _greedy(reference_llm, PROMPT)
    stream = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.outputs[
        0
    ].finish_reason
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_matches_offline(client, reference_llm):
    ref = _greedy(reference_llm, messages=MESSAGES)
    out = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=24, temperature=0
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_chat_stream_matches_offline(client, reference_llm):
    ref = _greedy(reference_llm, messages=MESSAGES)
    stream = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, max_completion_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_cached_tokens_on_repeated_long_prompt(client):
    long_prompt = " ".join(
        f"Sentence number {i} talks about the sea and the sky." for i in range(20)
    )
    first = client.completions.create(
        model="smollm2", prompt=long_prompt, max_tokens=4, temperature=0
    )
    again = client.completions.create(
        model="smollm2", prompt=long_prompt, max_tokens=4, temperature=0
    )
    n = first.usage.prompt_tokens
    assert n > 64
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert again.choices[0].text == first.choices[0].text


def test_request_id_header_and_logprobs(server):
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2},
        headers={"X-Request-Id": "my-request-1"},
        timeout=60,
    )
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == "my-request-1" == r.headers["X-Request-Id"]
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and len(lp["token_logprobs"]) == 4
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]
    for token_lp, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert token_lp == pytest.approx(max(top.values()))  # greedy picks the top token


def test_tokenize_detokenize_roundtrip(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()
    assert r["count"] == len(r["tokens"]) > 5
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back["prompt"] == PROMPT
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    assert chat["tokens"][0] == 1  # <|im_start|> of the chat template
    # vLLM's field (SmolLM2's tokenizer adds no BOS, so the ids are the same either way)
    plain = httpx.post(server.url + "/tokenize", timeout=30,
                       json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["tokens"] == r["tokens"]


def test_metrics_exposed(server, client):
    client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in (
        "pdkv:time_to_first_token_seconds_count",
        "pdkv:inter_token_latency_seconds_count",
        "pdkv:e2e_request_latency_seconds_count",
        "pdkv:request_queue_time_seconds_count",
        "pdkv:request_prefill_time_seconds_count",
        "pdkv:num_requests_running",
        "pdkv:num_requests_waiting",
        "pdkv:kv_cache_usage_perc",
        "pdkv:num_free_blocks",
        "pdkv:prefix_cache_queries_total",
        "pdkv:prefix_cache_hits_total",
        "pdkv:prompt_tokens_total",
        "pdkv:generation_tokens_total",
    ):
        assert name in text, name


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_text_follows_include_stop_str_in_output(client, reference_llm, include, stream):
    full = _greedy(reference_llm, PROMPT).outputs[0].token_ids
    k = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[full[k]],
                            include_stop_str_in_output=include)
    ref = reference_llm.generate(PROMPT, params)[0].outputs[0]
    extra = {"stop_token_ids": [full[k]], "include_stop_str_in_output": include}
    out = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0,
                                    stream=stream, extra_body=extra)
    chunks = list(out) if stream else [out]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    tok = reference_llm.llm_engine.tokenizer
    assert text == tok.decode(full[: k + 1] if include else full[:k])
