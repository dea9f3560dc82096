"""P/D edge cases and faults end in bounded time, by policy, with every block back in its pool."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import decode, free_blocks, make_pd, pause_pulls, prefill, pump, settle, shutdown  # noqa: E402

from pdkv import SamplingParams  # noqa: E402
from pdkv.engine.async_llm import AsyncLLM  # noqa: E402
from pdkv.request import RequestStatus  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=16)
PROMPT = "The history of the bicycle begins in the early nineteenth century, when"


@pytest.fixture(scope="module")
def colocated(smollm2_reference):
    """The session's colocated SmolLM2 engine (tests/conftest.py)."""
    return smollm2_reference


@pytest.fixture()
def pd():
    p, d = make_pd("tcp", num_kv_blocks=128)
    yield p, d
    shutdown(p, d)


def _chat_ids(llm, text):
    return llm.llm_engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_client_max_tokens_one(pd, colocated):
    p, d = pd
    params = prefill(p, PROMPT).kv_transfer_params
    one = SamplingParams(temperature=0, max_tokens=1)
    out = decode(p, d, [PROMPT], [params], one)[0]
    ref = colocated.generate(PROMPT, one)[0].outputs[0]
    assert out.outputs[0].token_ids == ref.token_ids and len(ref.token_ids) == 1
    assert out.outputs[0].finish_reason == ref.finish_reason
    settle(p, d)


def test_first_generated_token_is_eos(pd, colocated):
    p, d = pd
    ids = _chat_ids(colocated, "What is the capital of France?")
    answer = colocated.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=32)
    )[0]
    eos = colocated.llm_engine.eos_token_id
    assert answer.outputs[0].token_ids[-1] == eos
    prompt = {"prompt_token_ids": ids + answer.outputs[0].token_ids[:-1]}  # the answer, minus EOS
    pre = prefill(p, prompt)
    assert pre.outputs[0].token_ids == [eos] and pre.kv_transfer_params is not None
    out = decode(p, d, [prompt], [pre.kv_transfer_params], GREEDY)[0]
    assert out.outputs[0].token_ids == [eos] and out.outputs[0].finish_reason == "stop"
    settle(p, d)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_engine_gone_after_returning_params(policy, colocated):
    p, d = make_pd("tcp", policy=policy, num_kv_blocks=128)
    try:
        start_d = free_blocks(d)
        params = prefill(p, PROMPT).kv_transfer_params
        p.llm_engine.runner.connector.shutdown()  # P's control server and data plane vanish
        t0 = time.monotonic()
        out = decode(p, d, [PROMPT], [params], GREEDY)[0]
        assert time.monotonic() - t0 < 30
        if policy == "recompute":
            assert (
                out.outputs[0].token_ids
                == colocated.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
            )
            assert d.llm_engine.scheduler.kv_stats["kv_load_failures_recompute"] == 1
        else:
            assert out.outputs[0].finish_reason == "error"
            assert "KV load failed" in out.error and "unreachable" in out.error
        pump([d], lambda: not d.llm_engine.has_work(), 30)
        assert free_blocks(d) == start_d
    finally:
        shutdown(p, d)


def test_decode_never_pulls_lease_expires():
    p, d = make_pd("tcp", num_kv_blocks=64, p_extra={"kv_lease_duration": 1.0})
    try:
        start = free_blocks(p)
        prefill(p, PROMPT)
        assert free_blocks(p) < start  # held for the consumer
        t0 = time.monotonic()
        pump([p], lambda: free_blocks(p) == start, 10)
        assert 0.8 < time.monotonic() - t0 < 5
        assert p.llm_engine.scheduler.kv_stats["lease_expirations"] == 1
    finally:
        shutdown(p, d)


def test_abort_while_queued_on_decode_releases_prefill_blocks(pd):
    p, d = pd
    start_p, start_d = free_blocks(p), free_blocks(d)
    params = prefill(p, PROMPT).kv_transfer_params
    req, text = d.llm_engine.make_request(PROMPT, GREEDY, kv_transfer_params=params)
    d.llm_engine.add_request(req, text)
    d.llm_engine.abort_request([req.request_id])  # before any step: never pulled
    pump([p, d], lambda: free_blocks(p) == start_p and not d.llm_engine.has_work(), 10)
    assert p.llm_engine.scheduler.kv_stats.get("released_unread") == 1
    assert "lease_expirations" not in p.llm_engine.scheduler.kv_stats
    assert free_blocks(d) == start_d


def test_client_gone_before_the_loop_adds_the_request_releases_prefill_blocks(pd):
    """The serving path (AsyncLLM on D): the client leaves after generate() queued the request
    but before D's loop added it. D's loop is held inside a command (a gate the test opens), so
    that order is forced. D must still tell P to release the grant at once, not let the lease
    run out (the soak's lease expirations)."""
    p, d = pd
    start_p, start_d = free_blocks(p), free_blocks(d)
    params = prefill(p, PROMPT).kv_transfer_params
    llm = AsyncLLM(d.llm_engine)
    llm.start()
    entered, gate = threading.Event(), threading.Event()

    def hold(_engine) -> None:  # runs on D's loop thread: nothing else runs until the gate opens
        entered.set()
        gate.wait(30)

    holder = threading.Thread(target=llm.call, args=(hold, 60), daemon=True)
    try:
        holder.start()
        assert entered.wait(30)
        req, text = llm.make_request(PROMPT, GREEDY, kv_transfer_params=params)

        async def leave_early() -> None:
            gen = llm.generate(req, text)
            first = asyncio.ensure_future(gen.__anext__())
            deadline = time.monotonic() + 30
            while req.request_id not in llm._streams:  # generate() queued the add
                assert time.monotonic() < deadline and not first.done()
                await asyncio.sleep(0.001)
            first.cancel()  # the client is gone: generate()'s finally queues the abort
            with contextlib.suppress(asyncio.CancelledError):
                await first

        asyncio.run(leave_early())
        gate.set()
        holder.join(30)
        pump([p], lambda: free_blocks(p) == start_p, 30)
        assert p.llm_engine.scheduler.kv_stats.get("released_unread") == 1
        assert "lease_expirations" not in p.llm_engine.scheduler.kv_stats
        deadline = time.monotonic() + 30
        while llm.call(lambda e: e.has_work() or free_blocks(d) != start_d):
            assert time.monotonic() < deadline, "D kept work or blocks"
            time.sleep(0.01)
    finally:
        gate.set()
        llm.shutdown()


def test_abort_during_pull_frees_after_pull(pd):
    p, d = pd
    start_p, start_d = free_blocks(p), free_blocks(d)
    params = prefill(p, PROMPT).kv_transfer_params
    paused = pause_pulls(d)  # D's read blocks until the test opens the gate
    eng = d.llm_engine
    req, text = eng.make_request(PROMPT, GREEDY, kv_transfer_params=params)
    eng.add_request(req, text)
    eng.step()  # allocates and starts the pull
    pump([p], paused.entered.is_set, 30)  # P registers the grant; the pull is inside its read now
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    eng.abort_request([req.request_id])
    for _ in range(5):  # steps while the read is blocked: the blocks stay held
        eng.step()
        p.llm_engine.step()
    assert free_blocks(d) < start_d and req.request_id in eng.scheduler._delayed_free
    paused.gate.set()
    settle(p, d)
    assert free_blocks(p) == start_p and free_blocks(d) == start_d
    assert req.request_id not in eng.scheduler._delayed_free


def test_abort_during_decode(pd):
    p, d = pd
    start_p, start_d = free_blocks(p), free_blocks(d)
    params = prefill(p, PROMPT).kv_transfer_params
    eng = d.llm_engine
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    req, text = eng.make_request(PROMPT, long, kv_transfer_params=params)
    eng.add_request(req, text)
    pump([p, d], lambda: req.num_output_tokens >= 3, 30)
    outs = eng.abort_request([req.request_id])
    assert outs and outs[0].outputs[0].finish_reason == "abort"
    settle(p, d)
    assert free_blocks(p) == start_p and free_blocks(d) == start_d
