"""TP and DCP engines (one worker process per rank, gloo) give the single-rank engine's greedy
tokens, with chunked prefill and with the prefix cache, for interleave 1 and interleave = block
size; DCP hashes prefixes at block_size × dcp tokens; a dead worker ends the engine with an error.

Issue 10, acceptance 1, 3 and 6. The single-rank reference runs in this process; every parallel
engine is one start-up (its worker processes spawn and load their shards once)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from pdkv import LLM, SamplingParams

pytestmark = pytest.mark.slow  # worker processes: `pdkv matrix --quick` leaves these to the suite

BLOCK = 16
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Lengths around the logical block (32 tokens at dcp 2) and the interleave (16), plus longer ones
# that chunk at max_num_batched_tokens=24.
PROMPT_LENS = (15, 16, 17, 33, 60)


# SmolLM2 runs fewer (its worker processes are slower on two cores); both chunk at 24 tokens.
SMOLLM2_LENS = (17, 33)


def prompts(lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    return [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in lens]


def engine(model: str, **kw: Any) -> LLM:
    kw.setdefault("num_kv_blocks", 48)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_batched_tokens", 24)  # prompts over 24 tokens are chunked
    return LLM(model, cpu_linear="torch", block_size=BLOCK, **kw)


def run(llm: LLM, ps: list[list[int]]) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)


def tokens(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_blocks_free(llm: LLM) -> None:
    for pool in llm.llm_engine.scheduler.kv_cache_manager.block_pools:
        assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    assert not llm.llm_engine.has_unfinished_requests()


_REFERENCE: dict[tuple[str, tuple[int, ...]], list[list[int]]] = {}


def reference(model: str, lens: tuple[int, ...]) -> list[list[int]]:
    """Single-rank greedy tokens of prompts(lens) (cached per model folder)."""
    if (model, lens) not in _REFERENCE:
        llm = engine(model)
        try:
            _REFERENCE[model, lens] = tokens(run(llm, prompts(lens)))
        finally:
            llm.llm_engine.shutdown()
    return _REFERENCE[model, lens]


def check_parallel(model: str, lens: tuple[int, ...] = PROMPT_LENS, **kw: Any) -> LLM:
    """Cold run (chunked prefill) and a resend (prefix-cache hits) equal the single rank's tokens;
    returns the engine (the caller shuts it down)."""
    want = reference(model, lens)
    llm = engine(model, **kw)
    try:
        cold = run(llm, prompts(lens))
        assert tokens(cold) == want
        hot = run(llm, prompts(lens))
        assert tokens(hot) == want
        assert sum(o.num_cached_tokens for o in hot) > 0, "the resend hit nothing"
        assert_blocks_free(llm)
    except BaseException:
        llm.llm_engine.shutdown()
        raise
    return llm


TINY_CASES = [
    pytest.param(
        "kv1",
        {"tensor_parallel_size": 2},
        id="kv1-tp2",
        marks=pytest.mark.matrix("tp", model="tiny-llama-kv1"),
    ),
    pytest.param(
        "kv2",
        {"tensor_parallel_size": 2},
        id="kv2-tp2",
        marks=pytest.mark.matrix("tp", model="tiny-llama-kv2"),
    ),
    pytest.param(
        "kv1",
        {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
        id="kv1-tp2-dcp2-i1",
        marks=pytest.mark.matrix("dcp", model="tiny-llama-kv1"),
    ),
    pytest.param(
        "kv1",
        {
            "tensor_parallel_size": 2,
            "decode_context_parallel_size": 2,
            "cp_kv_cache_interleave_size": BLOCK,
        },
        id="kv1-tp2-dcp2-i16",
    ),
    pytest.param(
        "kv2",
        {"decode_context_parallel_size": 2},
        id="kv2-dcp2-replicated-i1",
        marks=pytest.mark.matrix("dcp", model="tiny-llama-kv2"),
    ),
    pytest.param(
        "kv2",
        {"decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": BLOCK},
        id="kv2-dcp2-replicated-i16",
    ),
    # Replicated DCP at tp 2: four processes, DCP groups {0, 2} and {1, 3} (one per TP shard).
    pytest.param(
        "kv2",
        {
            "tensor_parallel_size": 2,
            "decode_context_parallel_size": 2,
            "dcp_replicate_weights": True,
        },
        id="kv2-tp2-dcp2-replicated",
    ),
]


@pytest.mark.parametrize("which,kw", TINY_CASES)
def test_tiny_parallel_matches_single_rank(which, kw, tiny_llama_kv1, tiny_llama_kv2):
    model = tiny_llama_kv1 if which == "kv1" else tiny_llama_kv2
    check_parallel(model, **kw).llm_engine.shutdown()


@pytest.mark.matrix("tp", model="smollm2")
def test_smollm2_tp3_matches_single_rank(model_path):
    check_parallel(model_path, SMOLLM2_LENS, tensor_parallel_size=3).llm_engine.shutdown()


@pytest.mark.matrix("dcp", model="smollm2")
def test_smollm2_dcp2_replicated_matches_single_rank(model_path):
    check_parallel(model_path, SMOLLM2_LENS, decode_context_parallel_size=2,
                   cp_kv_cache_interleave_size=BLOCK).llm_engine.shutdown()


def test_dcp_prefix_hash_granularity_is_the_logical_block(tiny_llama_kv2):
    """dcp 2, block 16: a logical block is 32 tokens, so prompts sharing 150 tokens hit 128 of
    them (4 whole logical blocks), and the second prompt's output is its cold output."""
    shared = [(i * 31 + 7) % 30000 + 200 for i in range(150)]
    first, second = shared + [101] * 20, shared + [202] * 20
    cold = engine(tiny_llama_kv2)
    try:
        want = tokens(run(cold, [second]))
    finally:
        cold.llm_engine.shutdown()
    llm = engine(tiny_llama_kv2, decode_context_parallel_size=2)
    try:
        # 48 blocks x 16 tokens per rank x 4 layers x K/V x 2 heads x 32 x fp32 = 1.5 MiB per rank.
        assert llm.llm_engine.kv_cache_summary() == (
            "48 blocks x 32 tokens (1.5 MiB per rank; tp 1, dcp 2: each rank stores 1/2 of "
            "every request's KV)"
        )
        run(llm, [first])
        out = run(llm, [second])
        assert out[0].num_cached_tokens == 128
        assert tokens(out) == want
        assert_blocks_free(llm)
    finally:
        llm.llm_engine.shutdown()


def test_killed_worker_ends_the_step_with_an_error(tiny_llama_kv1):
    """A worker killed mid-request: the next step raises WorkerDiedError naming the rank (no
    hang; the deadline is the per-reply timeout, far above the time this takes)."""
    from pdkv.executor.multiproc import WorkerDiedError

    llm = engine(tiny_llama_kv1, tensor_parallel_size=2)
    eng = llm.llm_engine
    try:
        req, text = eng.make_request({"prompt_token_ids": prompts()[3]},
                                     SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        eng.add_request(req, text)
        for _ in range(3):
            eng.step()
        pid = eng.runner.pids[1]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker rank 1"):
            for _ in range(1000):
                eng.step()
        assert time.monotonic() - t0 < 60
    finally:
        eng.shutdown()
    assert all(not p.is_alive() for p in eng.runner._procs)
