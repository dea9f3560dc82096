"""OffloadingConnector in a real engine (SmolLM2) whose KV cache (6 blocks of 16 tokens) is too
small for the working set: re-sent prompts come back from host blocks, a preempted request
resumes by swap-in, and the three eviction modes give the same tokens with the copy counts their
definitions predict. Reference: the same prompts on an engine without offload (greedy).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdkv import LLM, SamplingParams
from pdkv.sched.output import SchedulerOutput

pytestmark = pytest.mark.slow

BLOCK = 16
NUM_BLOCKS = 6
MAX_LEN = NUM_BLOCKS * BLOCK
GREEDY = SamplingParams(temperature=0, max_tokens=8)
LONG = SamplingParams(temperature=0, max_tokens=20)
MODES = ("drop", "reuse", "save_on_evict")


def offload_config(mode: str, cpu_bytes: int = 64 << 20) -> str:
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes, "eviction_mode": mode},
        }
    )


def make_llm(mode: str | None) -> LLM:
    kw: dict[str, Any] = {"num_kv_blocks": NUM_BLOCKS, "max_model_len": MAX_LEN}
    if mode is not None:
        kw["kv_transfer_config"] = offload_config(mode)
    return LLM("smollm2", **kw)


def prompt_ids(llm: LLM, n: int, seed: int) -> list[int]:
    """A real-text prompt of exactly n tokens."""
    tok = llm.get_tokenizer()
    text = " ".join(f"Item {seed}.{i}: the river carries water to the sea." for i in range(n))
    return tok(text)["input_ids"][:n]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def assert_baseline(llm: LLM) -> None:
    """Every block free again, no request left, no host slot pinned."""
    engine = llm.llm_engine
    for pool in engine.scheduler.kv_cache_manager.block_pools:
        assert pool.num_free_blocks == pool.num_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not engine.has_unfinished_requests()
    if engine.connector is not None:
        assert all(i.num_pinned == 0 for i in engine.connector.scheduler.indexes)


class Spy:
    """Records every eviction the block pools report ((group, hash) in order), then passes it
    on to the connector's hook; and every SchedulerOutput."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.llm_engine
        self.evictions: list[tuple[int, bytes]] = []
        self.outputs: list[SchedulerOutput] = []
        hook = engine.connector.scheduler.on_evict  # type: ignore[union-attr]

        def on_evict(group: int, block_hash: bytes, block_id: int) -> None:
            self.evictions.append((group, block_hash))
            hook(group, block_hash, block_id)

        engine.scheduler.kv_cache_manager.set_eviction_hook(on_evict)
        schedule = engine.scheduler.schedule

        def spy_schedule() -> SchedulerOutput:
            out = schedule()
            self.outputs.append(out)
            return out

        engine.scheduler.schedule = spy_schedule  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def plain() -> LLM:
    return make_llm(None)


@pytest.fixture(scope="module")
def prompts(plain) -> dict[str, list[int]]:
    # A: 40 tokens (2 loadable blocks), B: 70 tokens (4 loadable blocks); A+B overflow 6 blocks.
    # C, D: 30 tokens + 20 generated each, run together: 8 blocks wanted, one is preempted.
    return {"A": prompt_ids(plain, 40, 1), "B": prompt_ids(plain, 70, 2),
            "C": prompt_ids(plain, 30, 3), "D": prompt_ids(plain, 30, 4)}


SEQUENCE = ("A", "B", "A", "B")


@pytest.fixture(scope="module")
def reference(plain, prompts) -> dict[str, Any]:
    seq = [run(plain, [prompts[k]])[0].outputs[0].token_ids for k in SEQUENCE]
    pair = [o.outputs[0].token_ids for o in run(plain, [prompts["C"], prompts["D"]], LONG)]
    assert plain.llm_engine.scheduler.num_preemptions > 0, "the C+D workload must preempt"
    return {"sequence": seq, "pair": pair}


@pytest.fixture(scope="module", params=MODES)
def offloaded(request, prompts, reference) -> Any:
    """One engine per mode that ran the A, B, A, B sequence, then C and D together."""
    llm = make_llm(request.param)
    spy = Spy(llm)
    seq = [run(llm, [prompts[k]])[0] for k in SEQUENCE]
    seq_stats = dict(llm.llm_engine.scheduler.kv_stats)
    seq_device_hits = llm.llm_engine.scheduler.kv_cache_manager.prefix_cache_stats.hits
    seq_evictions = list(spy.evictions)
    spy.outputs.clear()
    pair = run(llm, [prompts["C"], prompts["D"]], LONG)
    yield {"mode": request.param, "llm": llm, "spy": spy, "seq": seq, "seq_stats": seq_stats,
           "seq_device_hits": seq_device_hits,
           "seq_evictions": seq_evictions, "pair": pair}
    llm.llm_engine.shutdown()


@pytest.mark.matrix("offload")
def test_resent_prompt_is_served_from_host_blocks(offloaded, prompts, reference):
    mode, seq = offloaded["mode"], offloaded["seq"]
    assert [o.outputs[0].token_ids for o in seq] == reference["sequence"]
    stats = offloaded["seq_stats"]
    # The second A and B: every loadable block back (device hits + host hits), except in
    # "drop", where only what the small device cache kept is reused.
    full = [(len(prompts[k]) - 1) // BLOCK * BLOCK for k in SEQUENCE]
    cached = [o.num_cached_tokens for o in seq]
    assert cached[:2] == [0, 0]
    if mode == "drop":
        assert stats.get("offload:hits", 0) == 0 and stats.get("offload:copies_d2h", 0) == 0
        assert cached[2:] < full[2:]
    else:
        assert cached[2:] == full[2:] == [32, 64]
        # What the device prefix cache did not have came from the host.
        host_tokens = sum(cached) - offloaded["seq_device_hits"]
        assert host_tokens > 0 and stats["offload:hits"] * BLOCK == host_tokens
        assert stats["offload:recompute_tokens_avoided"] == stats["offload:hits"] * BLOCK
        assert stats["offload:copies_h2d"] == stats["offload:hits"]
        assert stats["offload:bytes_h2d"] == stats["offload:copies_h2d"] * block_bytes(
            offloaded["llm"]
        )
    assert_baseline(offloaded["llm"])


def block_bytes(llm: LLM) -> int:
    return llm.llm_engine.runner.kv_cache_config.block_bytes(0)


def test_eviction_modes_copy_what_their_definitions_predict(offloaded):
    """drop: 0 copies; reuse: one per distinct evicted hash (the host never fills here);
    save_on_evict: one per eviction. The workload evicts some hashes twice. On a CPU KV cache a
    step waits exactly while its copies run: no copy, no wait (drop); copies, a wait > 0."""
    mode, evictions, stats = offloaded["mode"], offloaded["seq_evictions"], offloaded["seq_stats"]
    assert len(evictions) > len(set(evictions)), "the workload must evict a hash twice"
    # The host store never fills (64 MiB: about 90 blocks, far more than the workload evicts):
    # no slot is refused, none is evicted, so every count below is the mode's definition.
    assert stats.get("offload:store_skips", 0) == 0
    assert stats.get("offload:host_evictions", 0) == 0
    expected = {"drop": 0, "reuse": len(set(evictions)), "save_on_evict": len(evictions)}
    assert stats.get("offload:copies_d2h", 0) == expected[mode]
    assert stats.get("offload:bytes_d2h", 0) == expected[mode] * block_bytes(offloaded["llm"])
    # reuse skips exactly the repeated evictions; the other modes never skip one.
    repeats = len(evictions) - len(set(evictions))
    assert stats.get("offload:reuse_skips", 0) == (repeats if mode == "reuse" else 0)
    wait = stats.get("offload:exposed_wait_seconds", 0)
    if mode == "drop":
        assert stats.get("offload:copies_h2d", 0) == 0
        assert wait == 0, "no copy was planned, so no step waited"
    else:
        assert wait > 0, "steps that copied blocks waited for those copies"


def test_preempted_request_resumes_by_swap_in(offloaded, reference):
    """C and D run together in a cache too small for both: one is preempted; on resumption at
    most one block of tokens is recomputed (the rest: device prefix hits + host blocks), and the
    tokens equal the reference. "drop" recomputes what was evicted (the check discriminates)."""
    llm, spy = offloaded["llm"], offloaded["spy"]
    assert [o.outputs[0].token_ids for o in offloaded["pair"]] == reference["pair"]
    first_seen: set[str] = set()
    resumed = []
    for out in spy.outputs:
        for new in out.scheduled_new_reqs:
            if new.req_id in first_seen:  # a request sent in full again: it was preempted
                resumed.append(len(new.token_ids) - new.num_computed_tokens)
            first_seen.add(new.req_id)
    assert resumed, "the workload must preempt"
    if offloaded["mode"] == "drop":
        assert max(resumed) > BLOCK
    else:
        assert max(resumed) <= BLOCK
        assert (
            llm.llm_engine.scheduler.kv_stats["offload:hits"]
            > offloaded["seq_stats"]["offload:hits"]
        )
    assert_baseline(llm)
