"""The pool shared across instances (separate `pdkv serve` processes with different
PYTHONHASHSEED, one redis / one Mooncake Store) and a remote tier that dies mid-run.

Both tiers are remote, so lookups run off the engine thread (the request waits for the answer);
a killed server turns into misses and failure counts, never a hang.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serve"))
from server_utils import RemoteServer, metric_value  # noqa: E402

pytestmark = pytest.mark.slow

CHUNK = 64
PROMPT_LEN = 200  # 3 full chunks are loadable: (200 - 1) // 64 * 64 = 192 tokens


def prompt_ids(n: int) -> list[int]:
    return [(i * 7919) % 20000 + 100 for i in range(n)]


def serve_args_tiers(tiers: list[dict[str, Any]]) -> list[str]:
    cfg = {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"chunk_size": CHUNK, "tiers": tiers}}
    return ["serve", "--model", "smollm2", "--num-kv-blocks", "128", "--max-model-len", "1024",
            "--kv-transfer-config", json.dumps(cfg)]


def complete(url: str, prompt: list[int]) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", timeout=120.0, json={
        "model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def local_llm(tier: dict[str, Any]) -> Any:
    from pdkv import LLM

    cfg = json.dumps({"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"chunk_size": CHUNK, "tiers": [tier]}})
    return LLM("smollm2", num_kv_blocks=128, max_model_len=1024, kv_transfer_config=cfg)


@pytest.mark.matrix("pool-redis", "pool-mooncake")
def test_another_instance_with_another_hash_seed_hits_what_one_stored(
    redis_service, mooncake_service
):
    """Instance B (`pdkv serve`, its own PYTHONHASHSEED) reads a redis and a Mooncake Store
    (tiers [redis, mooncake]); instances A1 and A2 (this process, another seed) each stored one
    prompt in one of them. B hits both fully, with A's greedy output, from the right tier."""
    from pdkv import SamplingParams

    redis_tier = {"name": "redis", "url": redis_service.address}
    mooncake_tier = {"name": "mooncake", "master": mooncake_service.address}
    seed = "2" if os.environ.get("PYTHONHASHSEED") != "2" else "3"
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(RemoteServer, serve_args_tiers([redis_tier, mooncake_tier]),
                               env={"PYTHONHASHSEED": seed})
        prompts = {"redis": prompt_ids(PROMPT_LEN), "mooncake": prompt_ids(PROMPT_LEN)[::-1]}
        stored = {}
        for backend, tier in (("redis", redis_tier), ("mooncake", mooncake_tier)):
            a = local_llm(tier)
            out = a.generate({"prompt_token_ids": prompts[backend]},
                             SamplingParams(temperature=0, max_tokens=8))[0]
            assert out.num_cached_tokens == 0
            stored[backend] = out.outputs[0].text
            assert a.llm_engine.runner.connector.store.flush(30.0)  # type: ignore[union-attr]
            assert (
                a.llm_engine.scheduler.kv_stats[f"pool:{backend}:chunks_written"]
                == PROMPT_LEN // CHUNK
            )
            kv = a.llm_engine.scheduler.kv_cache_manager
            assert kv.num_free_blocks == a.llm_engine.scheduler.num_blocks  # back to baseline
            a.llm_engine.shutdown()
        b = starting.result()
    with b:
        for backend in ("redis", "mooncake"):
            hot = complete(b.url, prompts[backend])
            assert hot["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
            assert hot["choices"][0]["text"] == stored[backend]
            text = httpx.get(b.url + "/metrics", timeout=10.0).text
            assert metric_value(text, "pdkv:kv_pool_chunks_read_total", tier=backend) == 3


def test_redis_killed_mid_run_turns_into_misses_and_failure_counts(tmp_path):
    from pdkv import LLM, SamplingParams
    from pdkv.launch.services import start_redis

    service = start_redis()
    cfg = json.dumps({"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {
                          "chunk_size": CHUNK, "lookup_timeout_s": 10.0,
                          "tiers": [{"name": "redis", "url": service.address, "timeout_s": 1.0}]}})
    llm = LLM("smollm2", num_kv_blocks=128, max_model_len=1024, kv_transfer_config=cfg)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    try:
        first = llm.generate({"prompt_token_ids": prompt_ids(PROMPT_LEN)}, greedy)[0]
        store = llm.llm_engine.runner.connector.store  # type: ignore[union-attr]
        assert store.flush(30.0)
        assert llm.reset_prefix_cache()
        hot = llm.generate({"prompt_token_ids": prompt_ids(PROMPT_LEN)}, greedy)[0]
        assert hot.num_cached_tokens == 192
        service.stop()
        started = time.monotonic()
        after = []
        for _ in range(2):  # the second one after the tier's back-off began
            assert llm.reset_prefix_cache()
            after.append(llm.generate({"prompt_token_ids": prompt_ids(PROMPT_LEN)}, greedy)[0])
        assert time.monotonic() - started < 60.0  # generous: no hang, not a timing claim
        for out in after:
            assert out.outputs[0].token_ids == first.outputs[0].token_ids
            assert out.num_cached_tokens == 0
        assert store.flush(30.0)
        stats = llm.llm_engine.scheduler.kv_stats
        down = sum(v for k, v in stats.items() if k.startswith("pool:redis:failures_"))
        assert down + stats.get("pool:redis:skipped", 0) >= 1
        sched = llm.llm_engine.scheduler
        assert sched.kv_cache_manager.num_free_blocks == sched.num_blocks
    finally:
        service.stop()
        llm.llm_engine.shutdown()
