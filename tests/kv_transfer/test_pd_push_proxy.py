"""Push mode through the proxy (issue 29 step 2): P and D as processes with transfer_mode "push",
`pdkv proxy` in front. D first: the proxy sends the decode leg to D, asks D for the write window
(GET /v1/kv/push_grant/{request_id}), sends the prefill leg to P with it; P writes each layer
into D's blocks. Greedy output equals the colocated engine's, D's kv_load_bytes equal the KV
formula for the blocks it granted, nothing stays allocated on either engine."""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serve"))
sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import pd_config  # noqa: E402
from server_utils import RemoteServer, metric_value, wait_for_metric  # noqa: E402

pytestmark = pytest.mark.slow

BLOCKS = 256
BS = 16
ENGINE = ["--model", "smollm2", "--num-kv-blocks", str(BLOCKS), "--max-model-len", "512"]


@pytest.fixture(scope="module")
def push_stack():
    servers: list[RemoteServer] = []
    try:
        for role in ("kv_producer", "kv_consumer"):
            # D without prefix caching: every prompt block is granted (the chat prompts share a
            # prefix, and a local hit would shrink the window: tests/kv_transfer/test_pd_push.py)
            own = ["--no-enable-prefix-caching"] if role == "kv_consumer" else []
            servers.append(RemoteServer(
                ["serve", *ENGINE, *own, "--kv-transfer-config",
                 pd_config(role, "tcp", transfer_mode="push", transfer_timeout=30.0)],
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


def kv_bytes_per_token(model_path: str) -> int:
    """The KV formula: layers x (K and V) x KV heads x head size x 4 bytes (float32)."""
    with open(os.path.join(model_path, "config.json")) as f:
        c = json.load(f)
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head * 4


def test_push_through_the_proxy_matches_colocated_and_moves_the_formula(
        push_stack, parity_prompts, parity_reference_24, model_path):
    p, d, proxy = push_stack
    per_token = kv_bytes_per_token(model_path)
    picks = list(range(0, len(parity_prompts), 3))

    def one(i: int) -> tuple[int, dict]:
        r = httpx.post(proxy.url + "/v1/completions", timeout=180, json={
            "model": "smollm2", "prompt": parity_prompts[i], "max_tokens": 24,
            "temperature": 0})
        assert r.status_code == 200, r.text
        return i, r.json()

    with ThreadPoolExecutor(2) as pool:  # two at once: two windows open on D together
        answers = list(pool.map(one, picks))
    for i, body in answers:
        n = len(parity_prompts[i])
        assert body["choices"][0]["text"] == parity_reference_24[i].outputs[0].text, f"{n} tokens"
        assert body["pdkv_timings"]["mode"] == "pd_push"
        granted = -(-n // BS)  # every prompt block was pushed
        moved = body["usage"]["prompt_tokens_details"]["kv_load_bytes"]
        assert moved == {"p2p": granted * BS * per_token}, f"{n} tokens"
    # A stream through the same flow.
    i = picks[1]
    with httpx.stream("POST", proxy.url + "/v1/completions", timeout=180, json={
            "model": "smollm2", "prompt": parity_prompts[i], "max_tokens": 24,
            "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == \
        parity_reference_24[i].outputs[0].text
    assert events[-1]["pdkv_timings"]["mode"] == "pd_push"
    # P held nothing after its prefills; D freed every block once its requests ended.
    assert metric_value(httpx.get(p.url + "/metrics").text, "pdkv:kv_blocks_held") == 0
    assert wait_for_metric(p.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
    assert wait_for_metric(d.url, "pdkv:num_free_blocks", BLOCKS) == BLOCKS
    d_metrics, p_metrics = httpx.get(d.url + "/metrics").text, httpx.get(p.url + "/metrics").text
    assert "pdkv:kv_push_refused_total" in d_metrics
    assert metric_value(d_metrics, "pdkv:kv_push_refused_total") == 0
    pushed = sum(-(-len(parity_prompts[i]) // BS) for i in picks + [picks[1]]) * BS * per_token
    assert metric_value(p_metrics, "pdkv:kv_bytes_pushed_total") == pushed


def test_the_window_route_answers_each_case(push_stack):
    p, d, _ = push_stack
    r = httpx.get(d.url + "/v1/kv/push_grant/nobody", params={"timeout": 0.2}, timeout=10)
    assert r.status_code == 504 and "nobody" in r.json()["error"]["message"]
    r = httpx.get(d.url + "/v1/kv/push_grant/nobody", params={"timeout": 0}, timeout=10)
    assert r.status_code == 400
    r = httpx.get(p.url + "/v1/kv/push_grant/nobody", params={"timeout": 0.2}, timeout=10)
    assert r.status_code == 404  # a producer receives no pushes
    layout = httpx.get(d.url + "/kv_layout").json()
    assert layout["transfer_mode"] == "push"
    assert layout["push_block_sizes"] == "any"  # one full-attention group: re-blocks pushes
    url = "/v1/kv/push_first_token/nobody"
    r = httpx.post(d.url + url, json={"first_token": 5}, timeout=10)
    assert r.status_code == 400 and "waits for a first token" in r.json()["error"]["message"]
    r = httpx.post(d.url + url, json={"first_token": 10**9}, timeout=10)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    assert httpx.post(p.url + url, json={"first_token": 5}, timeout=10).status_code == 404


def test_a_decode_leg_whose_client_leaves_before_p_starts_frees_its_window(push_stack):
    """D's side of a client gone before P starts: the decode leg opened its window; its client
    leaves; D aborts the request and frees the window's blocks at once, not at the 30 s lease."""
    _, d, _ = push_stack
    ids = list(range(100, 180))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(d.url + "/v1/completions", timeout=3.0, headers={"X-Request-Id": "gone-1"},
                   json={"model": "smollm2", "prompt": ids, "max_tokens": 4,
                         "kv_transfer_params": {"do_remote_prefill": True,
                                                "transfer_mode": "push"}})
    assert wait_for_metric(d.url, "pdkv:num_free_blocks", BLOCKS, timeout=15) == BLOCKS
    r = httpx.get(d.url + "/v1/kv/push_grant/gone-1", params={"timeout": 0.1}, timeout=10)
    assert r.status_code == 504  # the window is gone with its request


@pytest.mark.parametrize("family", ["tiny_swa", "tiny_mla", "tiny_gdn"])
def test_hybrid_models_through_the_proxy_match_colocated(family, request):
    """A sliding-window model (only the blocks D keeps are pushed), an MLA model and a Gated
    DeltaNet model (one state slot per linear group, P's token handed to D by the proxy), each as
    P and D processes behind the proxy: greedy output equals the colocated engine's, and D's
    kv_load_bytes equal, per KV cache group, the blocks it keeps times the group's block bytes."""
    from pdkv import LLM, SamplingParams
    from pdkv.cache.specs import window_first_block

    path = request.getfixturevalue(family)
    lens = (30, 100, 150)
    prompts = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in lens]
    ref = LLM(path, num_kv_blocks=64, max_model_len=256, cpu_linear="torch")
    try:
        outs = ref.generate([{"prompt_token_ids": x} for x in prompts],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        cfg = ref.llm_engine.runner.kv_cache_config
        windows = [getattr(g.spec, "sliding_window", None) for g in cfg.groups]
        linear = [g.spec.kind == "linear_state" for g in cfg.groups]

        def kept(n: int, g: int) -> int:  # blocks (slots) of group g that D receives
            return 1 if linear[g] else -(-n // BS) - window_first_block(n - 1, BS, windows[g])

        expect = [sum(kept(n, g) * cfg.block_bytes(g) for g in range(len(windows)))
                  for n in lens]
    finally:
        ref.llm_engine.shutdown()
    engine = ["--model", path, "--num-kv-blocks", "64", "--max-model-len", "256",
              "--cpu-linear", "torch"]
    servers: list[RemoteServer] = []
    try:
        for role in ("kv_producer", "kv_consumer"):
            servers.append(RemoteServer(
                ["serve", *engine, "--no-enable-prefix-caching", "--kv-transfer-config",
                 pd_config(role, "tcp", transfer_mode="push")],
                wait=False, avoid=tuple(s.port for s in servers)))
        for srv in servers:
            srv.wait_healthy()
            # not one full-attention group: pushes only between equal block sizes
            assert httpx.get(srv.url + "/kv_layout").json()["push_block_sizes"] == "equal"
        servers.append(RemoteServer(["proxy", "--prefill", servers[0].url, "--decode",
                                     servers[1].url], avoid=tuple(s.port for s in servers)))
        for x, out, nbytes in zip(prompts, outs, expect):
            r = httpx.post(servers[2].url + "/v1/completions", timeout=120, json={
                "model": path, "prompt": x, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["pdkv_timings"]["mode"] == "pd_push"
            assert body["choices"][0]["text"] == out.outputs[0].text, f"{len(x)} tokens"
            assert body["usage"]["prompt_tokens_details"]["kv_load_bytes"] == {"p2p": nbytes}
    finally:
        for srv in reversed(servers):
            srv.stop()
