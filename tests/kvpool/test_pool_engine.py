"""KVPoolConnector in a real engine (SmolLM2): cold then hot per tier, never a wrong hit,
failures turn into recomputation, blocks and pool accounting return to baseline.

Reference: the same prompts on an engine without a pool (greedy, token-identical). Chunks of 64
tokens (block 16) keep prompts short; hit tokens on an n-token prompt are ((n-1)//64)*64.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from pdkv import LLM, SamplingParams
from pdkv.kvpool.tiers.base import Tier
from pdkv.kvpool.tiers.dram import DramTier

pytestmark = pytest.mark.slow

CHUNK = 64
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def pool_config(tiers: list[dict[str, Any]], role: str = "kv_both", **extra: Any) -> str:
    return json.dumps({"kv_connector": "KVPoolConnector", "kv_role": role,
                       "kv_connector_extra_config": {"chunk_size": CHUNK, "tiers": tiers, **extra}})


def make_llm(tiers: list[dict[str, Any]], **kw: Any) -> LLM:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("max_model_len", 1024)
    return LLM("smollm2", kv_transfer_config=pool_config(tiers, **kw.pop("extra", {})), **kw)


def prompt_ids(llm: LLM, n: int, seed: int = 0) -> list[int]:
    """A real-text prompt of exactly n tokens."""
    tok = llm.get_tokenizer()
    text = " ".join(f"Item {seed}.{i}: the river carries water to the sea." for i in range(n))
    return tok(text)["input_ids"][:n]


def store_of(llm: LLM) -> Any:
    return llm.llm_engine.runner.connector.store  # type: ignore[union-attr]


def run(llm: LLM, prompts: list[list[int]], **kw: Any) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, **kw)


def reset_local(llm: LLM) -> None:
    assert llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()


def assert_baseline(llm: LLM) -> None:
    sched = llm.llm_engine.scheduler
    assert sched.kv_cache_manager.num_free_blocks == sched.num_blocks
    assert not sched.kv_state.delayed_free and not sched.waiting_for_remote


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM("smollm2", num_kv_blocks=128, max_model_len=1024)


@pytest.fixture(scope="module")
def prompts(plain) -> list[list[int]]:
    return [prompt_ids(plain, 200, 1), prompt_ids(plain, 129, 2), prompt_ids(plain, 64, 3)]


@pytest.fixture(scope="module")
def reference(plain, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in run(plain, prompts)]


def hits(n: int) -> int:
    return (n - 1) // CHUNK * CHUNK


@pytest.mark.parametrize("tier", [pytest.param("dram", marks=pytest.mark.matrix("pool-dram")),
                                  pytest.param("disk", marks=pytest.mark.matrix("pool-disk"))])
def test_cold_then_hot_is_token_identical_and_hits_whole_chunks(tier, tmp_path, prompts, reference):
    spec = {"name": "dram", "capacity_bytes": 1 << 30} if tier == "dram" else \
        {"name": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}
    llm = make_llm([spec])
    cold = run(llm, prompts)
    assert [o.outputs[0].token_ids for o in cold] == reference
    assert [o.num_cached_tokens for o in cold] == [0, 0, 0]
    assert store_of(llm).flush(30.0)
    reset_local(llm)
    hot = run(llm, prompts)
    assert [o.outputs[0].token_ids for o in hot] == reference
    assert [o.num_cached_tokens for o in hot] == [hits(len(p)) for p in prompts] == [192, 128, 0]
    stats = llm.llm_engine.scheduler.kv_stats
    assert stats["pool:all:hit_tokens"] == 192 + 128
    # Every request's prefix-cache lookup is counted, pool-loaded ones too (vLLM's counters).
    assert llm.llm_engine.scheduler.kv_cache_manager.prefix_cache_stats.queries == 2 * sum(
        map(len, prompts)
    )
    assert stats[f"pool:{tier}:chunks_read"] == 3 + 2
    assert_baseline(llm)
    llm.llm_engine.shutdown()


def test_a_repeated_prompt_writes_no_chunk_the_pool_holds(plain, prompts, reference):
    llm = make_llm([{"name": "dram", "capacity_bytes": 1 << 30}])
    stats = llm.llm_engine.scheduler.kv_stats

    def written() -> float:
        assert store_of(llm).flush(30.0)
        return stats["pool:dram:chunks_written"]

    assert run(llm, prompts[:1])[0].outputs[0].token_ids == reference[0]
    assert written() == 3  # 200 tokens: 3 chunks of 64
    again = run(llm, prompts[:1])[0]  # the local prefix cache serves it
    assert again.num_cached_tokens == 192 and again.outputs[0].token_ids == reference[0]
    assert written() == 3 and stats["pool:all:save_skips"] == 3
    reset_local(llm)
    loaded = run(llm, prompts[:1])[0]  # the pool serves it
    assert loaded.num_cached_tokens == 192 and loaded.outputs[0].token_ids == reference[0]
    assert written() == 3
    longer = prompts[0] + prompts[1][:100]  # 300 tokens: chunks 0-2 held, chunk 3 new
    want = run(plain, [longer])[0].outputs[0].token_ids
    out = run(llm, [longer])[0]
    assert out.outputs[0].token_ids == want and written() == 4
    assert_baseline(llm)
    llm.llm_engine.shutdown()


def test_disk_tier_hits_survive_a_restart_and_a_salt_or_block_size_change_misses(
    tmp_path, prompts, reference
):
    spec = {"name": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}
    first = make_llm([spec])
    run(first, prompts[:1])
    assert store_of(first).flush(30.0)
    first.llm_engine.shutdown()
    again = make_llm([spec])
    out = run(again, prompts[:1])
    assert out[0].outputs[0].token_ids == reference[0] and out[0].num_cached_tokens == 192
    salted = run(again, prompts[:1], cache_salt="tenant-b")
    assert salted[0].num_cached_tokens == 0 and salted[0].outputs[0].token_ids == reference[0]
    reset_local(again)
    empty_salt = run(again, prompts[:1], cache_salt="")  # "" is no salt
    assert empty_salt[0].num_cached_tokens == 192
    again.llm_engine.shutdown()
    other_blocks = make_llm([spec], block_size=32)
    out = run(other_blocks, prompts[:1])
    assert out[0].num_cached_tokens == 0 and out[0].outputs[0].token_ids == reference[0]
    other_blocks.llm_engine.shutdown()


def test_corrupted_and_truncated_files_are_misses_with_the_cold_output(
    tmp_path, prompts, reference
):
    spec = {"name": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}
    llm = make_llm([spec])
    run(llm, prompts[:1])  # 200 tokens: 3 chunks stored
    assert store_of(llm).flush(30.0)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 3
    data = bytearray(files[0].read_bytes())
    data[-100] ^= 0xFF
    files[0].write_bytes(bytes(data))
    files[1].write_bytes(files[1].read_bytes()[:1000])
    reset_local(llm)
    out = run(llm, prompts[:1])
    assert out[0].outputs[0].token_ids == reference[0]
    stats = llm.llm_engine.scheduler.kv_stats
    assert stats.get("pool:disk:failures_corrupt", 0) >= 1
    assert_baseline(llm)
    llm.llm_engine.shutdown()


class VanishingTier(DramTier):
    """A dram tier whose entries disappear right after a lookup saw them (evicted between the
    lookup and the load), once `vanish` is set."""

    vanish = False

    def get(self, key: str) -> bytes | None:
        if self.vanish:
            self.remove(key)
        return super().get(key)


class PausableTier(DramTier):
    """A dram tier whose reads wait on an event the test controls."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.gate = threading.Event()
        self.gate.set()
        self.reading = threading.Event()

    def get(self, key: str) -> bytes | None:
        self.reading.set()
        assert self.gate.wait(60.0)
        return super().get(key)


def with_tier(monkeypatch, tier: Tier) -> None:
    from pdkv.kv_transfer.connector import pool
    from pdkv.kvpool.store import KVPoolStore

    monkeypatch.setattr(pool, "build_store", lambda cfg: KVPoolStore([tier]))


def test_entry_evicted_between_lookup_and_load_gives_the_cold_output(
    monkeypatch, prompts, reference
):
    tier = VanishingTier(1 << 30)
    with_tier(monkeypatch, tier)
    llm = make_llm([{"name": "dram"}])
    run(llm, prompts[:1])
    assert store_of(llm).flush(30.0)
    reset_local(llm)
    tier.vanish = True
    out = run(llm, prompts[:1])
    assert out[0].outputs[0].token_ids == reference[0]
    stats = llm.llm_engine.scheduler.kv_stats
    assert stats["kv_load_failures_recompute"] == 1
    assert_baseline(llm)
    llm.llm_engine.shutdown()


def test_abort_during_a_load_frees_blocks_only_after_the_load_ends(monkeypatch, prompts):
    tier = PausableTier(1 << 30)
    with_tier(monkeypatch, tier)
    llm = make_llm([{"name": "dram"}])
    run(llm, prompts[:1])
    assert store_of(llm).flush(30.0)
    reset_local(llm)
    eng = llm.llm_engine
    tier.gate.clear()
    tier.reading.clear()
    req, text = eng.make_request({"prompt_token_ids": prompts[0]}, GREEDY)
    eng.add_request(req, text)
    eng.step()  # lookup (inline, dram) + allocation + load started
    assert tier.reading.wait(30.0)
    assert req.request_id in eng.scheduler.waiting_for_remote
    held = eng.scheduler.num_blocks - eng.scheduler.kv_cache_manager.num_free_blocks
    assert held > 0
    eng.abort_request([req.request_id])
    eng.step()
    assert eng.scheduler.num_blocks - eng.scheduler.kv_cache_manager.num_free_blocks == held
    tier.gate.set()
    deadline = time.monotonic() + 60.0
    while eng.scheduler.kv_cache_manager.num_free_blocks != eng.scheduler.num_blocks:
        assert time.monotonic() < deadline, "blocks of the aborted load were never freed"
        eng.step()
        time.sleep(0.001)
    assert_baseline(llm)
    eng.shutdown()


@pytest.mark.matrix("pd-colocated-pool")
def test_chunked_prefill_stores_every_full_chunk_and_another_instance_loads_them(
    tmp_path, plain, reference, prompts
):
    spec = {"name": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}
    long_prompt = prompt_ids(plain, 400, 7)
    want = run(plain, [long_prompt])[0].outputs[0].token_ids
    a = make_llm([spec], max_num_batched_tokens=48)  # the prompt spans 9 steps
    assert run(a, [long_prompt])[0].outputs[0].token_ids == want
    assert store_of(a).flush(30.0)
    assert a.llm_engine.scheduler.kv_stats["pool:disk:chunks_written"] == 400 // CHUNK
    assert_baseline(a)
    a.llm_engine.shutdown()
    b = make_llm([spec], max_num_batched_tokens=48)
    out = run(b, [long_prompt])[0]
    assert out.outputs[0].token_ids == want and out.num_cached_tokens == hits(400) == 384
    assert_baseline(b)
    b.llm_engine.shutdown()


def test_roles_producer_only_saves_consumer_only_loads(tmp_path, prompts, reference):
    spec = {"name": "disk", "path": str(tmp_path), "capacity_bytes": 1 << 30}
    prod = LLM("smollm2", num_kv_blocks=128, max_model_len=1024,
               kv_transfer_config=pool_config([spec], role="kv_producer"))
    run(prod, prompts[:1])
    assert store_of(prod).flush(30.0)
    reset_local(prod)
    assert run(prod, prompts[:1])[0].num_cached_tokens == 0  # a producer never loads
    prod.llm_engine.shutdown()
    cons = LLM("smollm2", num_kv_blocks=128, max_model_len=1024,
               kv_transfer_config=pool_config([spec], role="kv_consumer"))
    out = run(cons, prompts)
    assert [o.outputs[0].token_ids for o in out] == reference
    assert out[0].num_cached_tokens == 192 and out[1].num_cached_tokens == 0  # never saved
    assert cons.llm_engine.scheduler.kv_stats.get("pool:all:saves", 0) == 0
    cons.llm_engine.shutdown()
