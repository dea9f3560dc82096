"""`pdkv up --mode colocated --pool TIER`: the engine serves a repeated prompt from the pool after
`POST /reset_prefix_cache`, and the tier's server (redis) is stopped with the topology, also
when the topology fails to start."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from system_packages import in_ci

from pdkv.ports import free_port

CHUNK = 32
PROMPT = " ".join(f"Step {i}: the river carries water down to the sea." for i in range(12))


def _redis_ready() -> bool:
    try:
        from pdkv.launch.services import start_redis  # noqa: F401
    except ImportError:
        return False
    import shutil

    return shutil.which("redis-server") is not None


# Skips on a developer box without redis-server; under CI=true (which installs it) the test runs and
# fails.
needs_redis = pytest.mark.skipif(not _redis_ready() and not in_ci(),
                                 reason="needs redis-server (sudo apt-get install -y redis-server)")


def _up(tmp_path, tier: str, port: int, *engine: str) -> tuple[subprocess.Popen[bytes], str]:
    out = tmp_path / "up.out"
    cmd = [
        sys.executable,
        "-m",
        "pdkv.cli",
        "up",
        "--mode",
        "colocated",
        "--pool",
        tier,
        "--pool-chunk-size",
        str(CHUNK),
        "--port",
        str(port),
        "--log-dir",
        str(tmp_path / "logs"),
        "--threads-per-engine",
        "2",
        "--",
        *engine,
    ]
    with open(out, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, str(out)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _server_pids(out_path: str) -> list[int]:
    m = re.search(r"\(pids \[([\d, ]+)\]\)", _read(out_path))
    assert m, "the launcher did not print the pool server's pids"
    return [int(p) for p in m.group(1).split(",")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _complete(url: str) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
@pytest.mark.parametrize(
    "tier", [pytest.param("redis", marks=needs_redis)]
)  # dram: test_pool_engine
def test_up_colocated_pool_serves_a_repeated_prompt_from_the_pool(tmp_path, tier):
    port = free_port(set())
    url = f"http://127.0.0.1:{port}"
    proc, out = _up(tmp_path, tier, port, "--num-kv-blocks", "64", "--max-model-len", "512")
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, _read(out)
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "pdkv up not healthy in time"
            time.sleep(0.3)
        pids = _server_pids(out) if tier == "redis" else []
        cold = _complete(url)
        n = cold["usage"]["prompt_tokens"]
        expected = (n - 1) // CHUNK * CHUNK
        assert n > 3 * CHUNK and cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # Saves are asynchronous and HTTP has no flush: retry (reset + send) until the pool has
        # every chunk, with a deadline. Each hot request's hit must come from the pool only.
        deadline = time.monotonic() + 30
        while True:
            assert httpx.post(url + "/reset_prefix_cache", timeout=30).status_code == 200
            hot = _complete(url)
            cached = hot["usage"]["prompt_tokens_details"]["cached_tokens"]
            if cached == expected or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert cached == expected
        assert hot["choices"][0]["text"] == cold["choices"][0]["text"]
        metrics = httpx.get(url + "/metrics", timeout=10).text
        pattern = r"^pdkv:kv_pool_chunks_read_total\{[^}]*tier=\"" + tier + r"\"[^}]*\} (\S+)$"
        m = re.search(pattern, metrics, re.M)
        assert m and float(m.group(1)) >= expected // CHUNK, metrics
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(60)
    assert rc == 0, _read(out)
    assert _wait_gone(pids) == []


@needs_redis
def test_up_pool_redis_is_stopped_when_the_engine_fails_to_start(tmp_path):
    proc, out = _up(tmp_path, "redis", free_port(set()), "--no-such-engine-flag")
    rc = proc.wait(120)
    text = _read(out)
    assert rc == 1, text
    pids = _server_pids(out)
    assert _wait_gone(pids) == [], f"redis-server left running: {pids}"


def test_up_pd_with_a_dram_pool_is_a_clear_error_and_other_tiers_get_a_multiconnector():
    import argparse
    import json

    from pdkv.launch import launcher
    from pdkv.router.pool_topology import pool_kv_transfer_config, pool_tier_spec

    parser = launcher.add_cli_args(argparse.ArgumentParser())
    with pytest.raises(ValueError, match=r"use --pool disk, redis or mooncake"):
        launcher.main(parser.parse_args(["--mode", "pd", "--pool", "dram"]))
    args = parser.parse_args(["--mode", "pd", "--pool", "disk"])
    topo = launcher.build_topology(args, pool_kv_transfer_config(pool_tier_spec("disk", None)))
    configs = {c.name: json.loads(c.cmd[c.cmd.index("--kv-transfer-config") + 1])
               for c in topo.children if "--kv-transfer-config" in c.cmd}
    p, d = configs["prefill0"], configs["decode0"]
    assert p["kv_connector"] == d["kv_connector"] == "MultiConnector"
    assert [
        (c["kv_connector"], c["kv_role"]) for c in p["kv_connector_extra_config"]["connectors"]
    ] == [("P2PConnector", "kv_producer"), ("KVPoolConnector", "kv_producer")]
    assert [
        (c["kv_connector"], c["kv_role"]) for c in d["kv_connector_extra_config"]["connectors"]
    ] == [("KVPoolConnector", "kv_consumer"), ("P2PConnector", "kv_consumer")]
