"""`pdkv up --deploy examples/deploy/1p1d-tp2-two-hosts.toml --netns` (tiny-llama-kv2): P tp 1,
D tp 2 with D's rank 1 on a host of its own (`pdkv serve --headless`, joined to D's engine over
TCP control channels and gloo across the bridge). One deployment serves both checks:

1. through the proxy a few prompts give the colocated engine's greedy tokens, D received exactly
   the prompt's KV bytes (each rank its KV heads), every block is free again, and rank 1 ran on
   its own host (its node's address in the logs);
2. then node-d1's link is cut: the engine fails fast naming the lost rank (its /health, then
   its process, end within a bounded time), a request gets an error instead of hanging, and
   `pdkv up` reports the dead engine and exits 1; the namespaces are removed.

Root only (network namespaces): skips with the reason, fails under CI=true."""

from __future__ import annotations

import os
import re
import time

import httpx
import pytest
from deploy_harness import MAX_TOKENS, ROOT, Up, complete, wait_metric
from system_packages import require_reason

from pdkv import LLM, SamplingParams
from pdkv.launch.netns import list_namespaces, set_link, unavailable_reason

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

EXAMPLE = os.path.join(ROOT, "examples", "deploy", "1p1d-tp2-two-hosts.toml")
HOSTS = ["node-p", "node-d0", "node-d1"]  # the file's order: set_link's index
NUM_KV_BLOCKS = 64
PROMPTS = [[(i * 7919 + 13) % 40000 + 100 for i in range(33)],
           [(i * 104729 + 7) % 40000 + 100 for i in range(20)],
           [(i * 31 + 5) % 40000 + 100 for i in range(48)]]
# tiny-llama-kv2: 4 layers, 2 KV heads of 32, float32; blocks of 16 tokens move whole.
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 4
LOST_WITHIN_S = 60.0  # dead-peer detection is ~5 s; generous for a loaded 2-core box


@pytest.fixture(scope="module")
def references(tiny_llama_kv2) -> list[tuple[str, int]]:
    llm = LLM(tiny_llama_kv2, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=512)
    try:
        out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        llm.llm_engine.shutdown()
    return [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in out]


def test_d_tp2_across_two_hosts_matches_colocated_and_fails_fast_when_a_host_is_cut(
    tmp_path, tiny_llama_cache, references
):
    require_reason(unavailable_reason())
    up = Up(tmp_path, tiny_llama_cache, "--netns", deploy=EXAMPLE)
    run = None
    try:
        run = up.wait_for(r"^namespaces of (pdkv-[0-9a-f]{6}) on ").group(1)
        d1 = up.wait_for(r"^  node-d1: \S+ ([\d.]+),").group(1)
        endpoint = up.wait_for(r"^ready: (http://\S+)").group(1)
        p, d = up.url("prefill0"), up.url("decode0")
        assert re.search(r"^  decode0-node1: decode ranks of node 1 of 2 \(headless", up.text(),
                         re.M), up.text()

        received = 0.0
        for prompt, want in zip(PROMPTS, references, strict=True):
            assert complete(endpoint, prompt) == want
            blocks = -(-len(prompt) // 16)
            received += blocks * 16 * KV_BYTES_PER_TOKEN
            assert wait_metric(d, "pdkv:kv_transfer_bytes_received_total", received) == received
        for url in (p, d):
            assert wait_metric(url, "pdkv:num_free_blocks", NUM_KV_BLOCKS) == NUM_KV_BLOCKS
        logs = tmp_path / "logs"
        node1 = (logs / "decode0-node1.log").read_text()
        assert f"rank 1 connected to the leader from {d1}" in node1
        assert f"ranks on other nodes: 1 at {d1}" in (logs / "decode0.log").read_text()

        # node-d1's link down: rank 1 is silent; D's engine must notice and die on its own.
        set_link(run, HOSTS.index("node-d1"), up=False)
        t0 = time.monotonic()
        while True:
            try:
                healthy = httpx.get(d + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                healthy = False
            if not healthy:
                break
            assert time.monotonic() - t0 < LOST_WITHIN_S, "D still healthy with rank 1 cut off"
            time.sleep(0.2)
        try:
            r = httpx.post(endpoint + "/v1/completions", timeout=LOST_WITHIN_S, json={
                "model": "tiny-llama-kv2", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                "temperature": 0})
            assert r.status_code != 200, r.text
        except httpx.HTTPError:
            pass  # refused or cut: an error, not a hang
        rc = up.proc.wait(LOST_WITHIN_S)
        assert rc == 1, up.text()
        assert re.search(r"^decode0 exited \(1\); stopping all", up.text(), re.M), up.text()
        log = (logs / "decode0.log").read_text()
        assert re.search(r"worker ranks \[1\] are gone|worker rank 1 \(on node 1 at "
                         rf"{re.escape(d1)}\) (was lost|connection broken)", log), log[-3000:]
    finally:
        if run is not None and up.proc.poll() is None:
            set_link(run, HOSTS.index("node-d1"), up=True)
        up.stop()
    assert run is not None
    assert [n for n in list_namespaces() if n.startswith(run + "-")] == []
