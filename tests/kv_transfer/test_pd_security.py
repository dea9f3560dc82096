"""P/D identities end to end with in-process engines: replayed, reused, forged and foreign
kv_transfer_params never decode on another request's KV (policy fail -> error, recompute -> the
correct output); a reused X-Request-Id works after a replay; a restarted producer on the same
port moves KV again; a black-hole producer stalls nobody else."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import free_blocks, pump, shutdown  # noqa: E402

from pdkv import LLM, SamplingParams  # noqa: E402
from pdkv.outputs import RequestOutput  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8)
TEXT = "The history of the bicycle begins in the early nineteenth century, when"
TIMEOUT = 4.0


def kv_config(role: str, policy: str = "fail", engine_id: str = "", **extra: Any) -> str:
    return json.dumps(
        {
            "kv_connector": "P2PConnector",
            "kv_role": role,
            "engine_id": engine_id,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"transfer": "tcp", "transfer_timeout": TIMEOUT, **extra},
        }
    )


def engine(role: str, policy: str = "fail", engine_id: str = "", **extra: Any) -> LLM:
    return LLM(
        "smollm2",
        num_kv_blocks=96,
        max_model_len=256,
        enable_prefix_caching=role == "kv_producer",
        kv_transfer_config=kv_config(role, policy, engine_id, **extra),
    )


@pytest.fixture(scope="module")
def prompts():
    p = engine("kv_producer")
    ids = p.llm_engine.tokenizer.encode(TEXT)
    other = list(ids)
    other[len(other) // 2] = (other[len(other) // 2] + 7) % 1000 + 10  # same length, another prompt
    a, b = {"prompt_token_ids": ids}, {"prompt_token_ids": other}
    refs = [o.outputs[0].token_ids for o in p.generate([a, b], GREEDY)]
    yield p, (a, refs[0]), (b, refs[1])
    shutdown(p)


def prefill(p: LLM, prompt: Any, rid: str | None = None) -> dict[str, Any]:
    eng = p.llm_engine
    req, text = eng.make_request(
        prompt,
        SamplingParams(temperature=0, max_tokens=1),
        request_id=rid,
        kv_transfer_params={"do_remote_decode": True},
    )
    eng.add_request(req, text)
    out: list[RequestOutput] = []
    pump(
        [],
        lambda: bool(
            out.extend(o for o in eng.step() if o.finished and o.request_id == req.request_id)
            or out
        ),
        60,
    )
    assert out[0].kv_transfer_params is not None
    return dict(out[0].kv_transfer_params)


def decode(
    producers: list[LLM],
    d: LLM,
    items: list[tuple[Any, dict[str, Any]]],
    rid: str | None = None,
    timeout: float = 60.0,
) -> list[RequestOutput]:
    eng = d.llm_engine
    ids = []
    for prompt, params in items:
        req, text = eng.make_request(prompt, GREEDY, request_id=rid, kv_transfer_params=params)
        eng.add_request(req, text)
        ids.append(req.request_id)
    done: dict[str, RequestOutput] = {}

    def step() -> bool:
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        for p in producers:
            p.llm_engine.step()
        return len(done) == len(ids)

    pump([], step, timeout)
    return [done[i] for i in ids]


def received(d: LLM) -> float:
    return d.llm_engine.scheduler.kv_stats.get("kv_bytes_received", 0.0)


def check(out: RequestOutput, policy: str, ref: list[int], error: str) -> None:
    if policy == "fail":
        assert out.outputs[0].finish_reason == "error", out.outputs[0].token_ids
        assert out.error is not None and "KV load failed" in out.error and error in out.error
    else:
        assert out.outputs[0].token_ids == ref


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_params_only_ever_load_their_own_prompts_kv(prompts, policy):
    p, (a, ref_a), (b, ref_b) = prompts
    d = engine("kv_consumer", policy)
    try:
        start_p, start_d = free_blocks(p), free_blocks(d)
        # A legitimate request under X-Request-Id "same".
        first = prefill(p, a, "same")
        assert decode([p], d, [(a, first)], "same")[0].outputs[0].token_ids == ref_a
        # The same params replayed after D finished (P freed or reused those blocks).
        check(decode([p], d, [(a, first)], "same")[0], policy, ref_a, "unknown or expired")
        # A new legitimate request with the same X-Request-Id moves KV again.
        before = received(d)
        again = prefill(p, a, "same")
        assert decode([p], d, [(a, again)], "same")[0].outputs[0].token_ids == ref_a
        assert received(d) > before
        # Params of another prompt of the same length: refused before reading anything ...
        params_b = prefill(p, b)
        before = received(d)
        check(decode([p], d, [(a, params_b)])[0], policy, ref_a, "prompt_digest")
        assert received(d) == before
        # ... and the grant stays usable by its own prompt.
        assert decode([p], d, [(b, params_b)])[0].outputs[0].token_ids == ref_b
        # Forged block ids (other blocks of P's pool) are not read.
        forged = prefill(p, a)
        forged["remote_block_ids"] = [[(i + 1) % 96 for i in g] for g in forged["remote_block_ids"]]
        before = received(d)
        check(decode([p], d, [(a, forged)])[0], policy, ref_a, "not the blocks")
        assert received(d) == before
        failures = d.llm_engine.scheduler.kv_stats[f"kv_load_failures_{policy}"]
        assert failures == 3
        pump([p, d], lambda: free_blocks(p) == start_p and not d.llm_engine.has_work(), 30)
        assert free_blocks(d) == start_d
    finally:
        shutdown(d)


def test_params_that_contradict_themselves_are_refused_at_admission(prompts):
    """Params whose layout claims another block size (so their block count does not fit the
    prompt), or whose fields have the wrong types: refused when the request is made (the
    server's 400), naming the field; nothing allocated, nothing read, and the real grant is
    still there for the genuine params."""
    p, (a, ref_a), _ = prompts
    d = engine("kv_consumer")
    try:
        start_d = free_blocks(d)
        params = prefill(p, a)
        n = len(a["prompt_token_ids"])
        assert len(params["remote_block_ids"][0]) == -(-n // 16)
        layout = params["layout"]
        for forged, match in (
            (
                {**params, "block_size": 4, "layout": {**layout, "block_size": 4}},
                r"remote_block_ids\[0\] lists .* layout.block_size 4",
            ),
            (
                {**params, "layout": {**layout, "block_size": "16"}},
                "layout.block_size must be a positive integer",
            ),
            (
                {**params, "layout": {**layout, "block_size": 0}},
                "layout.block_size must be a positive integer",
            ),
            # a layout block size the params' own block_size contradicts (whatever the count)
            (
                {**params, "layout": {**layout, "block_size": 32}},
                "block_size=16 and layout.block_size=32 differ",
            ),
            ({**params, "layout": None}, "layout must be an object"),
            (
                {
                    **params,
                    "remote_block_ids": [[str(b) for b in g] for g in params["remote_block_ids"]],
                },
                r"remote_block_ids\[0\] must be a list of non-negative integer block ids",
            ),
        ):
            with pytest.raises(ValueError, match=match):
                d.llm_engine.make_request(a, GREEDY, kv_transfer_params=forged)
        assert free_blocks(d) == start_d and not d.llm_engine.has_work() and received(d) == 0
        assert decode([p], d, [(a, params)])[0].outputs[0].token_ids == ref_a
    finally:
        shutdown(d)


def test_the_servers_400_names_kv_transfer_params_in_error_param():
    from pdkv.serve.fields import field_in

    assert (
        field_in("kv_transfer_params.remote_block_ids[0] lists 1 blocks but ...")
        == "kv_transfer_params"
    )
    assert (
        field_in("kv_transfer_params cover 9 tokens but the prompt has 10") == "kv_transfer_params"
    )


def test_a_black_hole_producer_stalls_nobody_else(prompts):
    p, (a, ref_a), (b, ref_b) = prompts
    d = engine("kv_consumer", "fail")
    hole = socket.create_server(("127.0.0.1", 0), backlog=64)  # accepts (backlog), never answers
    try:
        dead = []
        for _ in range(5):  # more than the pull threads the old shared pool had
            params = prefill(p, a)
            params.update(remote_engine_id="dead", remote_port=hole.getsockname()[1])
            dead.append((a, params))
        good = [(a, prefill(p, a)), (b, prefill(p, b))]
        t0 = time.monotonic()
        eng = d.llm_engine
        reqs = []
        for prompt, params in dead + good:
            req, text = eng.make_request(prompt, GREEDY, kv_transfer_params=params)
            eng.add_request(req, text)
            reqs.append(req)
        good_reqs = reqs[len(dead):]
        outs: dict[str, RequestOutput] = {}
        loaded_before_first_dead_ended: list[bool] = []
        dead_ended_at: list[float] = []

        def step() -> bool:
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
                    if o.request_id in {r.request_id for r in good_reqs}:
                        continue
                    dead_ended_at.append(time.monotonic() - t0)
                    if not loaded_before_first_dead_ended:
                        loaded_before_first_dead_ended.append(
                            all(
                                r.request_id not in eng.scheduler.waiting_for_remote
                                for r in good_reqs
                            )
                        )
            p.llm_engine.step()
            return len(outs) == len(reqs)

        pump([], step, 8 * TIMEOUT)
        # The healthy producer's pulls ended before the black hole's first deadline.
        assert loaded_before_first_dead_ended == [True]
        assert [outs[r.request_id].outputs[0].token_ids for r in good_reqs] == [ref_a, ref_b]
        for r in reqs[: len(dead)]:
            o = outs[r.request_id]
            assert o.outputs[0].finish_reason == "error" and "KV load failed" in str(o.error)
        # Each ends at its own deadline, stamped at submit (not one timeout per wave of two).
        assert len(dead_ended_at) == 5 and max(dead_ended_at) < 2 * TIMEOUT
    finally:
        hole.close()
        shutdown(d)


def test_a_restarted_producer_on_the_same_port_moves_kv_again(prompts):
    _, (a, ref_a), _ = prompts
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = engine("kv_consumer", "recompute")
    p1 = engine("kv_producer", engine_id="prefill-0", kv_port=port, kv_host="0.0.0.0")
    p2 = None
    try:
        params = prefill(p1, a)
        assert params["remote_host"] not in ("0.0.0.0", "")  # the bind address is never advertised
        assert decode([p1], d, [(a, params)])[0].outputs[0].token_ids == ref_a
        shutdown(p1)  # killed; D cached its handshake and data connection
        p2 = engine("kv_producer", engine_id="prefill-0", kv_port=port, kv_host="0.0.0.0")
        before = received(d)
        assert decode([p2], d, [(a, prefill(p2, a))])[0].outputs[0].token_ids == ref_a
        assert received(d) > before  # moved, not recomputed
        assert "kv_load_failures_recompute" not in d.llm_engine.scheduler.kv_stats
    finally:
        shutdown(*[e for e in (d, p2) if e is not None])
