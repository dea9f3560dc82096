"""Every numeric field is range-checked at the API (400, OpenAI error JSON), NaN / Infinity /
1e400 and lone surrogates are 400 too, and none of these bad requests disturbs a good request
running at the same time."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from conftest import NUM_KV_BLOCKS
from server_utils import wait_for_metric

from pdkv import SamplingParams

pytestmark = pytest.mark.slow

GOOD = {"prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

# (path, raw JSON body, expected words in the message)
BAD: list[tuple[str, str, str]] = [
    ("/v1/completions", json.dumps({**GOOD, "temperature": 1, "seed": 2**63}), "seed"),
    ("/v1/completions", json.dumps({**GOOD, "temperature": 1, "seed": 2**64}), "seed"),
    ("/v1/completions", json.dumps({**GOOD, "temperature": 1, "seed": -(2**63) - 1}), "seed"),
    ("/v1/completions", json.dumps({**GOOD, "seed": 10**30}), "seed"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 4, "temperature": NaN}', "temperature"),
    (
        "/v1/completions",
        '{"prompt": "Hi", "max_tokens": 4, "temperature": Infinity}',
        "temperature",
    ),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 4, "temperature": 1e400}', "temperature"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 4, "top_p": NaN}', "top_p"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 4, "top_p": -Infinity}', "top_p"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 1e400}', "max_tokens"),
    ("/v1/completions", json.dumps({**GOOD, "top_p": 0}), "top_p"),
    ("/v1/completions", json.dumps({**GOOD, "top_k": -2}), "top_k"),
    ("/v1/completions", json.dumps({**GOOD, "logprobs": 21}), "logprobs"),
    ("/v1/completions", json.dumps({**GOOD, "logprobs": -1}), "logprobs"),
    ("/v1/completions", json.dumps({**GOOD, "max_tokens": 10**30}), "maximum context length"),
    ("/v1/completions", json.dumps({**GOOD, "max_tokens": -5}), "max_tokens"),
    ("/v1/completions", json.dumps({**GOOD, "min_tokens": -1}), "min_tokens"),
    ("/v1/completions", json.dumps({**GOOD, "min_tokens": 5}), "min_tokens"),
    ("/v1/completions", json.dumps({**GOOD, "stop_token_ids": [-1]}), "stop_token_ids"),
    ("/v1/completions", json.dumps({**GOOD, "stop_token_ids": [10**9]}), "stop_token_ids"),
    ("/v1/completions", json.dumps({**GOOD, "stop_token_ids": [7] * 300}), "stop_token_ids"),
    ("/v1/completions", json.dumps({**GOOD, "stop": ["x"] * 300}), "stop"),
    ("/v1/completions", json.dumps({**GOOD, "stop": [""]}), "stop"),
    ("/v1/completions", json.dumps({**GOOD, "n": 0}), "n must be at least 1"),
    ("/v1/completions", json.dumps({**GOOD, "n": 65}), "n must be at most 64"),
    (
        "/v1/chat/completions",
        json.dumps({**CHAT, "top_logprobs": 21, "logprobs": True}),
        "top_logprobs",
    ),
    ("/v1/chat/completions", json.dumps({**CHAT, "temperature": 1, "seed": 2**63}), "seed"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "Hi"}], "top_p": NaN}',
        "top_p",
    ),
    # Lone surrogates (valid JSON escapes, not Unicode) anywhere in a body.
    (
        "/v1/completions",
        '{"prompt": "Hello \\ud800", "max_tokens": 4}',
        "prompt is not valid Unicode",
    ),
    (
        "/v1/completions",
        '{"prompt": "Hi", "stop": ["\\udfff"], "max_tokens": 4}',
        "stop.0 is not valid Unicode",
    ),
    ("/v1/completions", '{"prompt": "Hi", "model": "\\ud800"}', "model is not valid Unicode"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        "messages.0.content is not valid Unicode",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        "not valid Unicode",
    ),
    ("/tokenize", '{"prompt": "\\ud83d"}', "prompt is not valid Unicode"),
]


@pytest.mark.parametrize(
    ("path", "raw", "words"), BAD, ids=[f"{i}-{b[2][:20]}" for i, b in enumerate(BAD)]
)
def test_bad_value_is_400(server, path, raw, words):
    r = httpx.post(
        server.url + path,
        content=raw.encode(),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError"
    assert words in err["message"], err["message"]


def test_invalid_utf8_body_is_openai_400(server):
    r = httpx.post(
        server.url + "/v1/completions",
        content=b'{"prompt": "a\xff\xfe", "max_tokens": 2}',
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == 400


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), -1, 0])
def test_seed_range_limits_are_accepted(server, seed):
    body = {**GOOD, "temperature": 1.0, "seed": seed}
    first = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    again = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]


def test_bad_requests_never_fail_a_concurrent_good_one(server, reference_llm):
    prompt, max_tokens = "The capital of France is", 48
    ref = reference_llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    )

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            good = asyncio.ensure_future(c.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}))
            bad = await asyncio.gather(*(
                c.post(path, content=raw.encode(), headers={"Content-Type": "application/json"})
                for path, raw, _ in BAD))
            return await good, bad

    good, bad = asyncio.run(asyncio.wait_for(main(), 300))
    assert [r.status_code for r in bad] == [400] * len(BAD)
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["text"] == ref[0].outputs[0].text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert wait_for_metric(server.url, "pdkv:num_free_blocks", NUM_KV_BLOCKS) == NUM_KV_BLOCKS
