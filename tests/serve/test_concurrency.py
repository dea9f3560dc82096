"""Concurrent clients: 64 streams are batched together (several requests observed running at
once) and each equals `LLM.generate`; 200 over-long prompts tokenized concurrently (then rejected
with 400) do not disturb 8 decoding streams."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
from conftest import MAX_MODEL_LEN, NUM_KV_BLOCKS
from server_utils import metric_value, wait_for_metric

from pdkv import SamplingParams

pytestmark = pytest.mark.slow

N_CLIENTS = 64
MAX_TOKENS = 12


def _prompt(i: int) -> str:
    return f"Request {i}: write a sentence about the number {i}."


async def _one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[int, int, str]:
    stream = await client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    return usage.completion_tokens, usage.prompt_tokens, text


class _RunningWatcher:
    """Polls pdkv:num_requests_running in a thread; `peak` is the most seen at once."""

    def __init__(self, url: str) -> None:
        self.url, self.peak = url, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=10) as c:
            while not self._stop.is_set():
                running = metric_value(
                    c.get(self.url + "/metrics").text, "pdkv:num_requests_running"
                )
                self.peak = max(self.peak, running)
                self._stop.wait(0.02)

    def __enter__(self) -> _RunningWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)


def _reference(reference_llm, prompts: list[str], max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in reference_llm.generate(prompts, params)]


def test_64_concurrent_streams_are_batched_and_match_offline(server, reference_llm):
    prompts = [_prompt(i) for i in range(N_CLIENTS)]

    async def main():
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300
        )
        return await asyncio.gather(*(_one(client, p, MAX_TOKENS) for p in prompts))

    with _RunningWatcher(server.url) as watcher:
        results = asyncio.run(main())
    assert all(n == MAX_TOKENS for n, _, _ in results)
    assert [text for _, _, text in results] == _reference(reference_llm, prompts, MAX_TOKENS)
    assert watcher.peak > 1, "requests were never running together (no batching)"
    assert wait_for_metric(server.url, "pdkv:num_free_blocks", NUM_KV_BLOCKS) == NUM_KV_BLOCKS


def test_overlong_prompts_tokenized_concurrently_do_not_disturb_streams(server, reference_llm):
    n_long, n_streams, max_tokens = 200, 8, 24
    long_prompts = [
        f"{i} " + "the quick brown fox jumps over the lazy dog " * 150 for i in range(n_long)
    ]
    stream_prompts = [_prompt(100 + i) for i in range(n_streams)]

    async def reject(client: httpx.AsyncClient, prompt: str) -> httpx.Response:
        return await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})

    async def main():
        oai = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300
        )
        limits = httpx.Limits(max_connections=n_long + 8)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
            streams = [asyncio.ensure_future(_one(oai, p, max_tokens)) for p in stream_prompts]
            rejected = await asyncio.gather(*(reject(client, p) for p in long_prompts))
        # A new connection: one of the 200 idle keep-alive ones may be closed by the server
        # (keep-alive timeout) just as it is reused on a loaded machine (httpx.ReadError).
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            tokenized = await client.post("/tokenize", json={"prompt": long_prompts[0]})
        return await asyncio.gather(*streams), rejected, tokenized

    outputs, rejected, tokenized = asyncio.run(asyncio.wait_for(main(), 600))
    assert [r.status_code for r in rejected] == [400] * n_long
    assert all("maximum context length" in r.json()["error"]["message"] for r in rejected)
    assert tokenized.status_code == 200 and tokenized.json()["count"] > MAX_MODEL_LEN
    assert [text for _, _, text in outputs] == _reference(reference_llm, stream_prompts, max_tokens)
    assert all(n == max_tokens for n, _, _ in outputs)
    assert wait_for_metric(server.url, "pdkv:num_free_blocks", NUM_KV_BLOCKS) == NUM_KV_BLOCKS
