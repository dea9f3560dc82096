"""`pdkv proxy` as a process: its health flags reach the app and its log says why it answered
a 502 (level, logger, request, leg, backend, error); it pins glibc's mmap threshold at start-up
and says so (docs/RELIABILITY.md, the soak's proxy RSS)."""

from __future__ import annotations

import os
import platform
import sys

import httpx
from fake_engines import FakeControl, FakeEngine

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serve"))
from server_utils import RemoteServer  # noqa: E402


def test_a_502_is_explained_in_the_proxys_log(tmp_path, monkeypatch):
    log = tmp_path / "proxy.log"
    monkeypatch.setenv("PDKV_TEST_SERVER_LOG", str(log))
    control = FakeControl()
    p, d = FakeEngine("kv_producer"), FakeEngine("kv_consumer")
    p.control_port = control.port
    proxy = RemoteServer(["proxy", "--prefill", p.url, "--decode", d.url,
                          "--health-check-interval-secs", "3600",
                          "--health-check-timeout-secs", "2"], timeout=60)
    try:
        assert httpx.get(proxy.url + "/health", timeout=10).status_code == 200
        d.stop()  # D goes away; the next periodic probe is an hour away
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4},
                       headers={"X-Request-Id": "cli-502"}, timeout=30)
        assert r.status_code == 502
    finally:
        proxy.stop()
        p.stop()
        control.stop()
    text = log.read_text()
    assert (
        f"WARNING pdkv.router.proxy_legs: 502: request cli-502: decode leg to {d.url} failed: "
        "ConnectError" in text
    ), text
    if platform.libc_ver()[0] == "glibc":
        assert "(round_robin); glibc mmap threshold pinned at 131072 bytes\n" in text, text
