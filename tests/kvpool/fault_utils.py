"""What the pool's fault-matrix tests share (test_fault_matrix.py, test_fault_matrix_disk.py):
tiny-llama-kv2 engines with one pool tier, prompts of three loadable chunks, the pool's counters
and the reference text of an engine without the pool."""

from __future__ import annotations

import json
from typing import Any

from pdkv import LLM, SamplingParams

CHUNK = 32
PROMPT_LEN = 100  # (100 - 1) // 32 = 3 chunks loadable: 96 tokens
HIT = 96
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
KW: dict[str, Any] = dict(cpu_linear="torch", num_kv_blocks=64, max_model_len=256)


def prompt(seed: int) -> list[int]:
    return [(i * 7919 + 131 * seed) % 40000 + 100 for i in range(PROMPT_LEN)]


def pool_llm(model: str, tier: dict[str, Any], **extra: Any) -> LLM:
    """An engine whose pool is the one `tier` (chunks of CHUNK tokens; `extra`: more
    KVPoolConnector settings)."""
    cfg = {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"chunk_size": CHUNK, "tiers": [tier], **extra}}
    return LLM(model, kv_transfer_config=json.dumps(cfg), **KW)


def reference_tokens(model: str, seeds: int) -> dict[int, list[int]]:
    """Greedy tokens of prompts 0..seeds-1 on an engine without a pool."""
    plain = LLM(model, **KW)
    outs = plain.generate([{"prompt_token_ids": prompt(s)} for s in range(seeds)], GREEDY)
    plain.llm_engine.shutdown()
    return {s: list(o.outputs[0].token_ids) for s, o in enumerate(outs)}


def generate(llm: LLM, ids: list[int]) -> Any:
    """One request from an empty local prefix cache, so every hit comes from the pool."""
    assert llm.reset_prefix_cache()
    return llm.generate({"prompt_token_ids": ids}, GREEDY)[0]


def stats(llm: LLM) -> dict[str, float]:
    store = llm.llm_engine.runner.connector.store  # type: ignore[union-attr]
    assert store.flush(30.0), "the pool's save queue did not drain"
    return dict(llm.llm_engine.scheduler.kv_stats)


def assert_idle(llm: LLM) -> None:
    sched = llm.llm_engine.scheduler
    assert sched.kv_cache_manager.num_free_blocks == sched.num_blocks
    assert not sched.waiting_for_remote
