"""Push with a KV pool (issue 29): P and D each run a MultiConnector (P = [P2P producer push,
pool], D = [pool, P2P consumer push]) over one disk tier. D loads from the pool first, so a pool
hit on D shrinks the write window P must fill to the blocks after the hit; a prompt the pool
holds whole (k chunks + 1 token) gets a window without blocks, which completes on D alone.
Greedy output equals the colocated engine's; D's kv_load_bytes split into the pool's chunks and
P's pushed blocks by the formula; every block is free again."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import pump, shutdown  # noqa: E402
from test_pd_push import (  # noqa: E402
    BS,
    GREEDY,
    TINY_KW,
    grant_of,
    idle,
    open_windows,
    prompts_for,
    push_prefill,
)

from pdkv import LLM  # noqa: E402
from pdkv.outputs import RequestOutput  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHUNK = 32


def multi(role: str, pool_dir: str) -> str:
    p2p = {"kv_connector": "P2PConnector", "kv_connector_extra_config": {
        "transfer": "tcp", "transfer_mode": "push", "transfer_timeout": 20.0}}
    pool = {"kv_connector": "KVPoolConnector", "kv_connector_extra_config": {
        "chunk_size": CHUNK,
        "tiers": [{"name": "disk", "path": pool_dir, "capacity_bytes": 1 << 28}]}}
    children = [p2p, pool] if role == "kv_producer" else [pool, p2p]
    return json.dumps({"kv_connector": "MultiConnector", "kv_role": role,
                       "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": {"connectors": children}})


def finish_one(d: LLM, rid: str) -> RequestOutput:
    done: list[RequestOutput] = []

    def step() -> bool:
        done.extend(o for o in d.llm_engine.step() if o.finished and o.request_id == rid)
        return bool(done)

    pump([], step, timeout=120)
    return done[0]


def test_a_pool_hit_on_d_shrinks_the_window_and_a_whole_hit_needs_no_p(tiny_llama_kv2, tmp_path):
    base = prompts_for((2 * CHUNK + 10,))[0]
    whole = prompts_for((3 * CHUNK + 1,))[0]  # the pool can hold all but its last token
    plain = LLM(tiny_llama_kv2, **TINY_KW)
    want = [list(o.outputs[0].token_ids) for o in plain.generate(
        [{"prompt_token_ids": base}, {"prompt_token_ids": whole}], GREEDY)]
    shutdown(plain)
    kw: dict[str, Any] = dict(TINY_KW)
    p = LLM(tiny_llama_kv2, **kw, kv_transfer_config=multi("kv_producer", str(tmp_path)))
    d = LLM(tiny_llama_kv2, **kw, kv_transfer_config=multi("kv_consumer", str(tmp_path)))
    cfg = d.llm_engine.runner.kv_cache_config
    block_bytes = cfg.block_bytes(0)
    p_store = p.llm_engine.runner.connector.children[1].store  # type: ignore[union-attr]
    p_stats = p.llm_engine.scheduler.kv_stats

    def through_push(prompt: list[int]) -> tuple[RequestOutput, Any]:
        (rid,) = open_windows(d, [prompt])
        grant = grant_of(d, rid)
        if any(grant.block_ids):  # (a window without blocks needs no P: the proxy skips it)
            out = push_prefill(p, prompt, grant)
            assert out.kv_transfer_params and out.kv_transfer_params["transfer_mode"] == "push"
        got = finish_one(d, rid)
        assert p_store.flush(30.0)  # P's chunks are in the pool before D looks again
        pump([p, d], lambda: idle(p, d), timeout=30)
        return got, grant

    try:
        n_blocks = -(-len(base) // BS)
        out, grant = through_push(base)  # cold: the pool is empty, P pushes every block
        assert list(out.outputs[0].token_ids) == want[0]
        assert grant.first_block == 0 and len(grant.block_ids[0]) == n_blocks
        assert out.kv_load_bytes == {"p2p": n_blocks * block_bytes}
        assert d.reset_prefix_cache()
        pushed = p_stats["kv_bytes_pushed"]
        out, grant = through_push(base)  # the pool has 2 chunks: P pushes only the rest
        assert list(out.outputs[0].token_ids) == want[0]
        hit_blocks = 2 * CHUNK // BS
        assert grant.first_block == hit_blocks
        assert len(grant.block_ids[0]) == n_blocks - hit_blocks
        assert out.kv_load_bytes == {"pool": hit_blocks * block_bytes,
                                     "p2p": (n_blocks - hit_blocks) * block_bytes}
        assert p_stats["kv_bytes_pushed"] - pushed == (n_blocks - hit_blocks) * block_bytes
        assert d.reset_prefix_cache()
        out, grant = through_push(whole)  # cold whole prompt, saved into the pool by P
        assert list(out.outputs[0].token_ids) == want[1]
        assert d.reset_prefix_cache()
        pushed = p_stats["kv_bytes_pushed"]
        out, grant = through_push(whole)  # the pool holds it whole: no block to write
        assert not any(grant.block_ids)
        assert list(out.outputs[0].token_ids) == want[1]
        assert out.kv_load_bytes == {"pool": 3 * CHUNK // BS * block_bytes}
        assert p_stats["kv_bytes_pushed"] == pushed
        # P still takes such a grant (pushes nothing, answers as a push)
        out = push_prefill(p, whole, grant)
        assert out.kv_transfer_params and out.kv_transfer_params["transfer_mode"] == "push"
        assert p_stats["kv_bytes_pushed"] == pushed
        assert d.llm_engine.scheduler.kv_stats.get("kv_push_refused", 0.0) == 0
    finally:
        shutdown(p, d)


@pytest.fixture
def push_pool_stack(tiny_llama_kv2, tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serve"))
    from server_utils import RemoteServer

    engine = ["--model", tiny_llama_kv2, "--cpu-linear", "torch", "--num-kv-blocks", "48",
              "--max-model-len", "256", "--block-size", str(BS)]
    servers: list[Any] = []
    try:
        for role in ("kv_producer", "kv_consumer"):
            servers.append(RemoteServer(
                ["serve", *engine, "--kv-transfer-config", multi(role, str(tmp_path))],
                wait=False, avoid=tuple(s.port for s in servers)))
        for srv in servers:
            srv.wait_healthy()
        p, d = servers
        servers.append(RemoteServer(["proxy", "--prefill", p.url, "--decode", d.url],
                                    avoid=(p.port, d.port)))
        yield servers
    finally:
        for srv in reversed(servers):
            srv.stop()


def test_through_the_proxy_a_whole_pool_hit_skips_p(push_pool_stack, tiny_llama_kv2):
    """D's MultiConnector reports transfer_mode push (/kv_layout), its P2P child answers the
    window route, and a window without blocks sends no prefill leg to P."""
    import httpx
    from server_utils import metric_value

    p, d, proxy = push_pool_stack
    whole = prompts_for((3 * CHUNK + 1,))[0]
    plain = LLM(tiny_llama_kv2, **TINY_KW)
    want = plain.generate([{"prompt_token_ids": whole}], GREEDY)[0].outputs[0].text
    shutdown(plain)
    assert httpx.get(d.url + "/kv_layout").json()["transfer_mode"] == "push"
    body = {"model": tiny_llama_kv2, "prompt": whole, "max_tokens": GREEDY.max_tokens,
            "temperature": 0, "ignore_eos": True}

    def complete() -> dict[str, Any]:
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def p_legs() -> float:  # prefill legs the proxy sent to P
        return metric_value(httpx.get(proxy.url + "/metrics").text, "pdkv:proxy_requests_total",
                            backend=p.url, leg="prefill")

    cold = complete()
    assert cold["pdkv_timings"]["mode"] == "pd_push"
    assert cold["choices"][0]["text"] == want
    # P's chunks land in the pool asynchronously (HTTP has no flush): reset D's prefix cache and
    # resend until D finds every loadable chunk there, with a deadline.
    before, pushed_tries = p_legs(), 0
    assert before == 1  # (the cold request's prefill leg)
    deadline = time.monotonic() + 60
    while True:
        assert httpx.post(d.url + "/reset_prefix_cache", timeout=30).status_code == 200
        hot = complete()
        if hot["pdkv_timings"]["mode"] == "pd_skip_prefill" or time.monotonic() > deadline:
            break
        pushed_tries += 1
        time.sleep(0.2)
    assert hot["pdkv_timings"]["mode"] == "pd_skip_prefill", hot["pdkv_timings"]
    assert hot["choices"][0]["text"] == want
    assert hot["usage"]["prompt_tokens_details"]["kv_load_bytes"] == {
        "pool": 3 * CHUNK * kv_bytes_per_token(tiny_llama_kv2)}
    assert p_legs() - before == pushed_tries  # no prefill leg for the skipped request
    assert metric_value(httpx.get(proxy.url + "/metrics").text,
                        "pdkv:proxy_prefill_legs_skipped_total") == 1


def kv_bytes_per_token(model_path: str) -> int:
    """The KV formula: layers x (K and V) x KV heads x head size x 4 bytes (float32)."""
    with open(os.path.join(model_path, "config.json")) as f:
        c = json.load(f)
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head * 4
