"""`pdkv up --deploy examples/deploy/1p1d-mooncake.toml --netns` on tiny-llama-kv2: P, D and a
Mooncake Store pool each in a network namespace. D reads P's KV with Mooncake's transfer
engine bound to the namespace addresses: the proxy answers as the colocated engine, D's metrics
count exactly the KV formula, every block is free again. P writes the prompt's chunks into the
Mooncake Store on the pool host (mooncake_master and the store process bound to its address)
and D, its prefix cache reset, reads them from there. Root only, and the mooncake package and
mooncake_master needed: skips with the reason, fails under CI=true. One deployment for the
module (about 20 s on 2 cores)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from deploy_harness import (
    ROOT,
    Up,
    colocated_answers,
    complete,
    kv_bytes,
    metric,
    wait_metric,
)
from system_packages import require_reason

from pdkv.launch.netns import list_namespaces, unavailable_reason
from pdkv.launch.services import mooncake_unavailable

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

EXAMPLE = os.path.join(ROOT, "examples", "deploy", "1p1d-mooncake.toml")
NUM_KV_BLOCKS = 64  # the example's --num-kv-blocks
CHUNK = 64  # the example's chunk_size
MOONCAKE = 'tier="mooncake"'
# 33 tokens: no whole chunk, so the pool has nothing for it and D pulls all 3 blocks from P.
PROMPT = [(i * 7919 + 13) % 40000 + 100 for i in range(33)]
POOL_PROMPT = [(i * 104729 + 7) % 40000 + 100 for i in range(130)]  # 2 whole chunks loadable


@pytest.fixture(scope="module")
def references(tiny_llama_kv2) -> list[tuple[str, int]]:
    """(text, tokens) of the colocated engine's greedy completions of PROMPT and POOL_PROMPT."""
    return colocated_answers(tiny_llama_kv2, [PROMPT, POOL_PROMPT], NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def up(tmp_path_factory, tiny_llama_cache) -> Iterator[Up]:
    """The example running in namespaces; after the module, stopped (exit 0) and its
    namespaces gone."""
    require_reason(unavailable_reason())
    require_reason(mooncake_unavailable())
    tmp = tmp_path_factory.mktemp("deploy-mooncake")
    up = Up(tmp, tiny_llama_cache, "--netns", deploy=EXAMPLE)
    run = ""
    try:
        run = up.wait_for(r"^namespaces of (pdkv-[0-9a-f]{6})").group(1)
        up.wait_for(r"^ready: (http://\S+)")
        yield up
    finally:
        rc = up.stop()
    assert rc == 0, up.text()
    assert not [n for n in list_namespaces() if n.startswith(run + "-")]


def _address(up: Up, host: str) -> str:
    return up.wait_for(rf"^  {host}: \S+ ([\d.]+),").group(1)


def test_pd_over_mooncake_transfer_engine_across_namespaces(up, tiny_llama_kv2, references):
    endpoint = up.wait_for(r"^ready: (http://\S+)").group(1)
    p, d = up.url("prefill0"), up.url("decode0")
    p_addr, d_addr = _address(up, "node-p"), _address(up, "node-d")
    before = metric(d, "pdkv:kv_transfer_bytes_received_total")
    assert complete(endpoint, PROMPT) == references[0]
    assert metric(d, "pdkv:kv_transfer_bytes_received_total") - before == kv_bytes(
        tiny_llama_kv2, len(PROMPT))
    for url in (p, d):
        assert wait_metric(url, "pdkv:num_free_blocks", NUM_KV_BLOCKS) == NUM_KV_BLOCKS
    # Each side's Mooncake transfer engine serves its P2P handshake on its own host's address.
    logs = os.path.dirname(up.wait_for(r"^  prefill0: .*, log (\S+)$").group(1))
    for name, address in (("prefill0", p_addr), ("decode0", d_addr)):
        with open(os.path.join(ROOT, logs, f"{name}.log"), errors="replace") as f:
            text = f.read()
        assert re.search(rf"P2P handshake, listening on {re.escape(address)}:\d+", text), name


def test_pool_in_a_mooncake_store_on_its_own_host(up, references):
    """P saves the prompt's chunks into the Mooncake Store whose master runs on the pool host;
    D, its prefix cache reset, reads them from there and answers as colocated."""
    pool = up.wait_for(r"^pool: mooncake on node-pool at ([\d.]+):50051 ").group(1)
    assert pool == _address(up, "node-pool")
    endpoint = up.wait_for(r"^ready: (http://\S+)").group(1)
    p, d = up.url("prefill0"), up.url("decode0")
    assert complete(endpoint, POOL_PROMPT) == references[1]
    chunks = len(POOL_PROMPT) // CHUNK
    # Saves are asynchronous: P's store counters reach its /metrics at its next engine step,
    # so a put that ends after the request's last step shows only once P steps again. A short
    # prompt (no whole chunk: it writes nothing) makes it step; at most 4 times.
    written = 0.0
    for _ in range(4):
        deadline = time.monotonic() + 10
        while (written := metric(p, "pdkv:kv_pool_chunks_written_total", MOONCAKE)) < chunks \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        if written >= chunks:
            break
        assert complete(endpoint, PROMPT) == references[0]
    skipped = metric(p, "pdkv:kv_pool_skipped_total", MOONCAKE)
    failed = metric(p, "pdkv:kv_pool_failures_total", MOONCAKE)
    assert written == chunks, f"P wrote {written} of {chunks} chunks ({skipped} skipped, " \
                              f"{failed} failed)"
    read = metric(d, "pdkv:kv_pool_chunks_read_total", MOONCAKE)  # D may have read them already
    assert httpx.post(d + "/reset_prefix_cache", timeout=30).status_code == 200
    assert complete(endpoint, POOL_PROMPT) == references[1]
    assert metric(d, "pdkv:kv_pool_chunks_read_total", MOONCAKE) - read == chunks
    for url in (p, d):
        assert wait_metric(url, "pdkv:num_free_blocks", NUM_KV_BLOCKS) == NUM_KV_BLOCKS

