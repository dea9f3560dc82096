"""`pdkv serve` processes: an idle prefill engine holding blocks for a consumer sleeps (little
CPU) yet still frees the blocks at lease expiry; an engine whose step fails exits with status 1
and `pdkv up` reports it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_utils import RemoteServer, cpu_seconds, metric_value

pytestmark = pytest.mark.slow

NUM_KV_BLOCKS = 64
LEASE_S = 8.0


def _producer_args(lease_s: float) -> list[str]:
    cfg = {"kv_connector": "P2PConnector", "kv_role": "kv_producer",
           "kv_connector_extra_config": {"transfer": "tcp", "kv_lease_duration": lease_s}}
    return [
        "serve",
        "--model",
        "smollm2",
        "--num-kv-blocks",
        str(NUM_KV_BLOCKS),
        "--max-model-len",
        "256",
        "--kv-transfer-config",
        json.dumps(cfg),
    ]


def _metric(url: str, name: str, **labels: str) -> float:
    return metric_value(httpx.get(url + "/metrics", timeout=10).text, name, **labels)


def test_idle_producer_holding_blocks_sleeps_and_lease_still_expires():
    with RemoteServer(_producer_args(LEASE_S)) as srv:
        body = {"prompt": "The history of the bicycle begins in the early nineteenth century, when",
                "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["kv_transfer_params"]["remote_block_ids"]
        assert _metric(srv.url, "pdkv:num_blocks_held_for_remote") > 0
        # Nobody pulls: the process must sleep until the lease deadline, not spin steps.
        time.sleep(0.5)  # let the request's own work (response, thread pools) settle
        c0, t0 = cpu_seconds(srv.proc.pid), time.monotonic()
        time.sleep(3.0)
        c1, t1 = cpu_seconds(srv.proc.pid), time.monotonic()
        share = (c1 - c0) / (t1 - t0)
        assert share < 0.05, f"idle producer used {share:.1%} of a core"
        # ... and still wakes up for the lease: the blocks go back without any request.
        deadline = time.monotonic() + LEASE_S + 30
        while _metric(srv.url, "pdkv:num_blocks_held_for_remote") > 0:
            assert time.monotonic() < deadline, "held blocks were not freed at lease expiry"
            time.sleep(0.25)
        assert _metric(srv.url, "pdkv:num_free_blocks") == NUM_KV_BLOCKS
        assert _metric(srv.url, "pdkv:kv_lease_expirations_total") == 1


def _read_lines(stream, lines: list[str]) -> None:
    for raw in iter(stream.readline, b""):
        lines.append(raw.decode(errors="replace"))


def test_failed_step_ends_serve_with_error_and_up_reports_it(tmp_path):
    env = dict(os.environ, PDKV_FAULT_STEP_RAISE_AT="4", PDKV_NUM_THREADS="2")
    cmd = [
        sys.executable,
        "-m",
        "pdkv.cli",
        "up",
        "--mode",
        "colocated",
        "--log-dir",
        str(tmp_path),
        "--health-timeout",
        "240",
        "--",
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "256",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=_read_lines, args=(s, lines), daemon=True)
               for s, lines in ((proc.stdout, out), (proc.stderr, err))]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("ready: ") for line in out):
            assert proc.poll() is None, f"pdkv up exited early: {''.join(err)}"
            assert time.monotonic() < deadline, "pdkv up not ready in time"
            time.sleep(0.5)
        url = next(line for line in out if line.startswith("ready: ")).split()[1]
        # Steps 1-3 run this request's prefill and first decodes; step 4 raises.
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 50,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 503, r.text
        assert "engine died" in r.json()["error"]["message"]
        assert proc.wait(60) == 1
        for t in readers:
            t.join(10)
        assert "engine exited (1)" in "".join(err), "".join(err)
        log = (tmp_path / "engine.log").read_text(errors="replace")
        assert "injected fault at engine step 4" in log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(30)
