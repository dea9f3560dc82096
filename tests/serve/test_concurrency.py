"""64 concurrent streaming clients are batched together and all complete correctly."""

from __future__ import annotations

import asyncio

import openai
import pytest
from conftest import NUM_KV_BLOCKS
from server_utils import wait_for_metric

pytestmark = pytest.mark.slow

N_CLIENTS = 64
MAX_TOKENS = 12


async def _one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str]:
    stream = await client.completions.create(
        model="smollm2", prompt=f"Request {i}: write a sentence about the number {i}.",
        max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    return usage.completion_tokens, usage.prompt_tokens, text


def test_64_concurrent_streams(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        return await asyncio.gather(*(_one(client, i) for i in range(N_CLIENTS)))

    results = asyncio.run(main())
    assert len(results) == N_CLIENTS
    assert all(n == MAX_TOKENS for n, _, _ in results)
    assert all(text for _, _, text in results)
    assert wait_for_metric(server.url, "pdkv:num_free_blocks", NUM_KV_BLOCKS) == NUM_KV_BLOCKS
