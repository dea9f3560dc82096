"""Layer-wise push (issue 29, step 1): P writes each layer's KV into the blocks D granted, from
the model forward's `save_kv_layer` hook, over the tcp transfer engine; two engines in one
process, stepped by hand. D first: D's request is admitted with {"do_remote_prefill": true,
"transfer_mode": "push"}, which allocates its blocks and opens a write window (`push_grant`);
P's prefill leg carries the grant. Greedy output equals the colocated engine's and pull mode's;
D received exactly layers x granted blocks x per-layer block bytes; D refuses (and counts) writes
with a wrong nonce, outside its window, of partial layers and a second write of a layer."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import msgspec
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import decode, pump, shutdown  # noqa: E402

from pdkv import LLM, SamplingParams  # noqa: E402
from pdkv.cache.specs import window_first_block  # noqa: E402
from pdkv.kv_transfer.connector.p2p_config import P2PConfig  # noqa: E402
from pdkv.kv_transfer.connector.p2p_messages import PushGrant  # noqa: E402
from pdkv.kv_transfer.engine.base import TransferError, WriteOp  # noqa: E402
from pdkv.kv_transfer.engine.tcp import TcpTransferEngine  # noqa: E402
from pdkv.outputs import RequestOutput  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT_LENS = (30, 150)


def config(role: str, mode: str, timeout: float = 20.0, transfer: str = "tcp",
           policy: str = "fail") -> str:
    return json.dumps({
        "kv_connector": "P2PConnector", "kv_role": role, "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"transfer": transfer, "transfer_mode": mode,
                                      "transfer_timeout": timeout},
    })


def engines(path: str, mode: str, d_timeout: float = 20.0, transfer: str = "tcp",
            policy: str = "fail", **kw: Any) -> tuple[LLM, LLM]:
    p = LLM(path, **kw, kv_transfer_config=config("kv_producer", mode, transfer=transfer))
    d = LLM(path, **kw, kv_transfer_config=config("kv_consumer", mode, d_timeout, transfer,
                                                  policy))
    return p, d


def open_windows(d: LLM, prompts: list[list[int]]) -> list[str]:
    """D first: queue D's requests; step D until each has its window (blocks allocated)."""
    eng = d.llm_engine
    ids = []
    for ids_ in prompts:
        req, text = eng.make_request({"prompt_token_ids": ids_}, GREEDY, kv_transfer_params={
            "do_remote_prefill": True, "transfer_mode": "push"})
        eng.add_request(req, text)
        ids.append(req.request_id)
    conn = push_half(d)
    pump([d], lambda: all(conn.push_grant(r) is not None for r in ids), timeout=60)
    return ids


def push_half(llm: LLM) -> Any:
    """The P2P connector's scheduler half (a MultiConnector's P2P child, P/D with a pool)."""
    conn = llm.llm_engine.scheduler.connector
    return next(c for c in getattr(conn, "children", [conn]) if hasattr(c, "push_grant"))


def grant_of(d: LLM, rid: str) -> PushGrant:
    grant = push_half(d).push_grant(rid)
    assert grant is not None
    return grant


def push_prefill(p: LLM, prompt: list[int], grant: PushGrant) -> RequestOutput:
    """P's leg: max_tokens=1, do_remote_decode, the grant; its steps push layer by layer."""
    eng = p.llm_engine
    req, text = eng.make_request({"prompt_token_ids": prompt},
                                 SamplingParams(temperature=0, max_tokens=1),
                                 kv_transfer_params={"do_remote_decode": True,
                                                     "push_grant": msgspec.to_builtins(grant)})
    eng.add_request(req, text)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for out in eng.step():
            if out.finished and out.request_id == req.request_id:
                return out
    raise TimeoutError("prefill did not finish")


def finish(d: LLM, ids: list[str]) -> list[list[int]]:
    done: dict[str, RequestOutput] = {}

    def step() -> bool:
        for out in d.llm_engine.step():
            if out.finished:
                done[out.request_id] = out
        return all(i in done for i in ids)

    pump([], step, timeout=120)
    return [list(done[i].outputs[0].token_ids) for i in ids]


def idle(*llms: LLM) -> bool:
    return all(
        not e.llm_engine.has_work()
        and all(pool.num_free_blocks == pool.num_usable_blocks
                for pool in e.llm_engine.scheduler.kv_cache_manager.block_pools)
        for e in llms
    )


def layer_block_bytes(llm: LLM) -> int:
    """Bytes of one layer of one block (every layer alike in these models: one KV group)."""
    runner = llm.llm_engine.runner
    cfg = runner.kv_cache_config
    assert len(cfg.groups) == 1
    return cfg.block_bytes(0) // len(cfg.groups[0].layer_indices)


def run_push_vs_pull_vs_colocated(path: str, prompts: list[list[int]], **kw: Any) -> None:
    p, d = engines(path, "push", **kw)
    try:
        pushed = check_push_matches_colocated(p, d, prompts)
    finally:
        shutdown(p, d)
    p, d = engines(path, "pull", **kw)
    try:
        from pd_utils import prefill

        params = [prefill(p, {"prompt_token_ids": x}).kv_transfer_params for x in prompts]
        outs = decode(p, d, [{"prompt_token_ids": x} for x in prompts], params, GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outs] == pushed
    finally:
        shutdown(p, d)


def check_push_matches_colocated(p: LLM, d: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """P (push mode) generates the colocated reference, then pushes each prompt into D's window;
    D's greedy tokens equal the reference, D counted layers x granted blocks x per-layer block
    bytes received (P as many pushed, one write per (block, layer)), nothing was refused, and
    both engines end with every block free. Returns D's tokens per prompt."""
    refs = [list(o.outputs[0].token_ids)
            for o in p.generate([{"prompt_token_ids": x} for x in prompts], GREEDY)]
    assert p.reset_prefix_cache()
    stats, p_stats = d.llm_engine.scheduler.kv_stats, p.llm_engine.scheduler.kv_stats
    keys = ("kv_bytes_received", "kv_push_refused", "kv_bytes_pushed", "kv_push_writes",
            "kv_push_failures")
    before = {k: stats.get(k, 0.0) + p_stats.get(k, 0.0) for k in keys}  # (counted by one side)
    ids = open_windows(d, prompts)
    grants = [grant_of(d, r) for r in ids]
    linear = any(g.spec.kind == "linear_state"
                 for g in d.llm_engine.runner.kv_cache_config.groups)
    for rid, prompt, grant in zip(ids, prompts, grants):
        out = push_prefill(p, prompt, grant)
        assert out.kv_transfer_params is not None
        assert out.kv_transfer_params["transfer_mode"] == "push"
        assert ("first_token" in out.kv_transfer_params) == linear
        if linear:  # D resumes after P's token (what the proxy hands over)
            assert out.kv_transfer_params["first_token"] == out.outputs[0].token_ids[0]
            d.llm_engine.scheduler.connector.push_first_token(
                rid, out.kv_transfer_params["first_token"])
    pushed = finish(d, ids)
    assert pushed == refs
    cfg = d.llm_engine.runner.kv_cache_config
    windows = [getattr(g.spec, "sliding_window", None) for g in cfg.groups]
    expect_blocks, expect_bytes, writes = 0, 0, 0
    for n, grant in zip(map(len, prompts), grants):
        for gi, (ids_g, window) in enumerate(zip(grant.block_ids, windows)):
            if cfg.groups[gi].spec.kind == "linear_state":  # one state slot
                assert len(ids_g) == 1
                expect_bytes += cfg.block_bytes(gi)
                writes += len(cfg.groups[gi].layer_indices)
                continue
            keep = window_first_block(n - 1, BS, window)  # what D keeps of a window group
            assert ids_g[:keep] == [0] * min(keep, len(ids_g))  # null: nothing to push
            real = len(ids_g) - min(keep, len(ids_g))
            assert real == -(-n // BS) - keep
            assert window is None or 0 not in ids_g[keep:]
            expect_blocks += real
            expect_bytes += real * cfg.block_bytes(gi)
            writes += real * len(cfg.groups[gi].layer_indices)
    assert expect_blocks > 0
    pump([p, d], lambda: idle(p, d), timeout=30)  # P held nothing; D freed its windows
    got = {k: stats.get(k, 0.0) + p_stats.get(k, 0.0) - before[k] for k in keys}
    assert got == {"kv_bytes_received": expect_bytes, "kv_bytes_pushed": expect_bytes,
                   "kv_push_writes": writes,  # one per (layer, block)
                   "kv_push_refused": 0, "kv_push_failures": 0}
    return pushed


def prompts_for(lens: tuple[int, ...]) -> list[list[int]]:
    return [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in lens]


TINY_KW = dict(cpu_linear="torch", num_kv_blocks=48, max_model_len=256, block_size=BS,
               max_num_batched_tokens=32)


@pytest.mark.parametrize("family", ["tiny_llama_kv2", "tiny_mla", "tiny_swa", "tiny_gdn"])
def test_push_matches_colocated_and_pull_and_moves_the_formula(family, request):
    """P chunks its prefill (32 tokens a step): blocks are pushed as each chunk completes them,
    layer by layer, the last partial block with the last chunk."""
    run_push_vs_pull_vs_colocated(request.getfixturevalue(family), prompts_for(PROMPT_LENS),
                                  **TINY_KW)


def test_d_refuses_wrong_nonce_outside_window_partial_and_second_writes(tiny_llama_kv2):
    p, d = engines(tiny_llama_kv2, "push", **TINY_KW)
    client = TcpTransferEngine()
    try:
        prompt = prompts_for((40,))[0]
        refs = [list(o.outputs[0].token_ids)
                for o in p.generate([{"prompt_token_ids": prompt}], GREEDY)]
        (rid,) = open_windows(d, [prompt])
        g = grant_of(d, rid)
        bb = d.llm_engine.runner.kv_cache_config.block_bytes(0)
        lb = layer_block_bytes(d)
        peer = {"host": g.host, "port": g.port}
        garbage = memoryview(bytearray(b"\x7f" * bb))
        outside = next(b for b in range(1, 48) if b not in g.block_ids[0])
        inside = g.block_ids[0][0]

        def refused(ops: list[WriteOp], nonce: str) -> None:
            with pytest.raises(TransferError, match="refused write"):
                client.write(peer, ops, time.monotonic() + 10, (g.request_id, nonce))

        refused([WriteOp("g0", inside * bb, lb, garbage[:lb])], "stale-nonce")
        refused([WriteOp("g0", outside * bb, lb, garbage[:lb])], g.nonce)
        refused([WriteOp("g0", inside * bb + 1, lb - 1, garbage[: lb - 1])], g.nonce)
        refused([WriteOp("g0", inside * bb, lb, garbage[:lb])], "")
        pump([d], lambda: d.llm_engine.scheduler.kv_stats.get("kv_push_refused", 0) >= 4)
        assert d.llm_engine.scheduler.kv_stats["kv_push_refused"] == 4
        # P's real push lands; D's output is the colocated one (no refused byte was written)
        push_prefill(p, prompt, g)
        assert finish(d, [rid]) == refs
        # the finished window is closed: a late write of its first layer is refused
        refused([WriteOp("g0", inside * bb, lb, garbage[:lb])], g.nonce)
        pump([d], lambda: d.llm_engine.scheduler.kv_stats.get("kv_push_refused", 0) >= 5)
    finally:
        client.close()
        shutdown(p, d)


def test_transfer_mode_is_validated():
    assert P2PConfig.from_extra({}).transfer_mode == "pull"
    assert P2PConfig.from_extra({"transfer_mode": "push"}).transfer_mode == "push"
    with pytest.raises(ValueError, match="transfer_mode must be one of"):
        P2PConfig.from_extra({"transfer_mode": "shove"})


def test_window_expires_and_the_load_fails_by_policy(tiny_llama_kv2):
    """Nobody pushes: at the window's lease (D's transfer_timeout, 1 s) the load fails (policy
    fail: the request ends with an error) and D's blocks are free again."""
    p, d = engines(tiny_llama_kv2, "push", d_timeout=1.0, **TINY_KW)
    try:
        prompt = prompts_for((40,))[0]
        (rid,) = open_windows(d, [prompt])
        t0 = time.monotonic()
        out = finish_raw(d, rid)
        assert time.monotonic() - t0 < 10
        assert not out.outputs[0].token_ids
        stats = d.llm_engine.scheduler.kv_stats
        assert stats.get("kv_push_window_expirations") == 1
        assert stats.get("kv_load_failures", 0) >= 1
        pump([d], lambda: idle(d), timeout=30)
    finally:
        shutdown(p, d)


def finish_raw(d: LLM, rid: str) -> RequestOutput:
    got: list[RequestOutput] = []

    def step() -> bool:
        got.extend(o for o in d.llm_engine.step() if o.finished and o.request_id == rid)
        return bool(got)

    pump([], step, timeout=30)
    return got[0]


def test_p_refuses_a_grant_for_another_prompt_and_pull_engines_refuse_push(tiny_llama_kv2):
    p, d = engines(tiny_llama_kv2, "push", **TINY_KW)
    try:
        a, b = prompts_for((40, 41))
        (rid,) = open_windows(d, [a])
        grant = grant_of(d, rid)
        with pytest.raises(ValueError, match="another prompt"):
            p.llm_engine.make_request(
                {"prompt_token_ids": b[:40]}, SamplingParams(max_tokens=1),
                kv_transfer_params={"do_remote_decode": True,
                                    "push_grant": msgspec.to_builtins(grant)})
        forged = msgspec.structs.replace(grant, block_ids=[grant.block_ids[0][:1]])
        with pytest.raises(ValueError, match="blocks per group"):
            p.llm_engine.make_request(
                {"prompt_token_ids": a}, SamplingParams(max_tokens=1),
                kv_transfer_params={"do_remote_decode": True,
                                    "push_grant": msgspec.to_builtins(forged)})
        with pytest.raises(ValueError, match="malformed"):
            p.llm_engine.make_request(
                {"prompt_token_ids": a}, SamplingParams(max_tokens=1),
                kv_transfer_params={"do_remote_decode": True, "push_grant": {"nonce": 1}})
    finally:
        shutdown(p, d)
    p, d = engines(tiny_llama_kv2, "pull", **TINY_KW)
    try:
        with pytest.raises(ValueError, match="transfer_mode 'pull'"):
            d.llm_engine.make_request({"prompt_token_ids": a}, GREEDY, kv_transfer_params={
                "do_remote_prefill": True, "transfer_mode": "push"})
    finally:
        shutdown(p, d)


def test_a_first_token_without_a_window_waiting_for_one_is_refused(tiny_gdn, tiny_llama_kv2):
    p, d = engines(tiny_gdn, "push", **TINY_KW)
    try:
        conn = d.llm_engine.scheduler.connector
        with pytest.raises(ValueError, match="waits for a first token"):
            conn.push_first_token("nobody", 5)
        (rid,) = open_windows(d, prompts_for((40,)))
        conn.push_first_token(rid, 5)
        with pytest.raises(ValueError, match="given already"):  # once
            conn.push_first_token(rid, 6)
    finally:
        shutdown(p, d)
    p, d = engines(tiny_llama_kv2, "push", **TINY_KW)
    try:
        (rid,) = open_windows(d, prompts_for((40,)))
        with pytest.raises(ValueError, match="linear-state"):  # no token needed here
            d.llm_engine.scheduler.connector.push_first_token(rid, 5)
    finally:
        shutdown(p, d)


def test_push_with_a_forged_nonce_is_refused_counted_on_both_sides_and_d_fails(tiny_llama_kv2):
    """P cannot tell a forged nonce (it is D's bearer token): D refuses every write, P counts the
    failed push and sends nothing more of it, and D's window ends at its lease (policy fail)."""
    p, d = engines(tiny_llama_kv2, "push", d_timeout=2.0, **TINY_KW)
    try:
        prompt = prompts_for((40,))[0]
        (rid,) = open_windows(d, [prompt])
        forged = msgspec.structs.replace(grant_of(d, rid), nonce="0" * 32)
        push_prefill(p, prompt, forged)
        p_stats = p.llm_engine.scheduler.kv_stats
        assert p_stats.get("kv_push_failures", 0) >= 1
        assert not p_stats.get("kv_bytes_pushed")
        out = finish_raw(d, rid)
        assert not out.outputs[0].token_ids
        stats = d.llm_engine.scheduler.kv_stats
        assert stats.get("kv_push_refused", 0) >= 1
        assert not stats.get("kv_bytes_received")
        pump([p, d], lambda: idle(p, d), timeout=30)
    finally:
        shutdown(p, d)
