"""The pool's fault matrix, remote tiers (issue 28): each fault is forced on a real service
(redis-server, mooncake_master + its store process) under an engine with the pool (tiny-llama-kv2,
greedy). For each: requests keep succeeding with the text of an engine without the pool, the
failure shows in the pool's counters (`pool:<tier>:failures_<kind>`, `pool:all:lookup_timeouts`),
and once the service is back a later request hits the pool again.

Faults are forced deterministically: SIGKILL by PID and a wait for the exit, CONFIG SET, SIGSTOP
until /proc shows the process stopped (redis 7 refuses DEBUG SLEEP unless started with
enable-debug-command, and CLIENT PAUSE blocks the UNPAUSE too), a socket that accepts and never
answers (the engine then runs in a child process with a deadline: a setup() that hangs holds the
GIL). Disk faults: test_fault_matrix_disk.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pdkv import LLM
from pdkv.launch import services
from tests.kvpool.fault_utils import (
    CHUNK,
    HIT,
    KW,
    assert_idle,
    generate,
    prompt,
    reference_tokens,
    stats,
)
from tests.kvpool.fault_utils import pool_llm as fault_pool_llm

REPO_ROOT = Path(__file__).resolve().parents[2]

def pool_llm(model: str, tier: dict[str, Any], **extra: Any) -> LLM:
    """An engine whose pool is the one `tier`; `tier_retry_after_s` 0 unless given, so a tier is
    retried on the next call once its service is back."""
    extra.setdefault("tier_retry_after_s", 0.0)
    return fault_pool_llm(model, tier, **extra)


def until_hit(llm: LLM, ids: list[int], want: list[int], timeout_s: float = 60.0) -> None:
    """Repeat the request until the pool serves all of it (saved by the first try once the tier
    is back, or after the tier's first failed call dropped a dead connection; a try may hit the
    chunks an earlier one managed to save); every output must equal `want`."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = generate(llm, ids)
        assert out.outputs[0].token_ids == want
        if out.num_cached_tokens == HIT:
            return
        assert out.num_cached_tokens in range(0, HIT, CHUNK)  # part of it saved so far
        assert time.monotonic() < deadline, "the tier never served a hit after it came back"
        stats(llm)  # let this try's saves land before the next one


@pytest.fixture(scope="module")
def reference(tiny_llama_kv2) -> dict[int, list[int]]:
    """Greedy tokens of prompts 0..3 on an engine without a pool."""
    return reference_tokens(tiny_llama_kv2, 4)


def _redis_client(svc: services.Service, password: str | None = None) -> Any:
    import redis

    return redis.Redis.from_url(svc.address, password=password, socket_timeout=10.0)


def _kill(proc: Any) -> None:
    """SIGKILL a process this test started and wait for it to exit."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10.0)


# -- redis --------------------------------------------------------------------------------------


def test_redis_killed_then_restarted_on_its_port_misses_counts_and_comes_back(
    own_redis, tiny_llama_kv2, reference
):
    llm = pool_llm(tiny_llama_kv2, {"name": "redis", "url": own_redis.address, "timeout_s": 1.0})
    try:
        assert generate(llm, prompt(0)).outputs[0].token_ids == reference[0]
        stats(llm)
        hot = generate(llm, prompt(0))
        assert hot.num_cached_tokens == HIT and hot.outputs[0].token_ids == reference[0]
        _kill(own_redis.procs[0])
        for seed in (0, 1):  # a stored prompt and a new one: both misses, both right
            out = generate(llm, prompt(seed))
            assert out.outputs[0].token_ids == reference[seed] and out.num_cached_tokens == 0
        after = stats(llm)
        assert after["pool:redis:failures_unavailable"] >= 2  # lookups and saves
        assert_idle(llm)
        port = int(own_redis.address.rsplit(":", 1)[1].split("/")[0])
        with services.start_redis(port=port):  # empty: nothing survived the kill
            until_hit(llm, prompt(1), reference[1])
            hits = stats(llm)["pool:redis:hits"]
            assert hits >= after["pool:redis:hits"] + 3
        assert_idle(llm)
    finally:
        llm.llm_engine.shutdown()


class _ResumeLater:
    """SIGCONT `proc` after `after_s` seconds unless cancelled first: the test's own SIGCONT
    comes once its request returns, so a request that waited for the stopped server instead of
    its deadline still ends (and fails its assertions) instead of hanging."""

    def __init__(self, proc: subprocess.Popen[bytes], after_s: float = 60.0) -> None:
        self._timer = threading.Timer(after_s, proc.send_signal, (signal.SIGCONT,))
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()


def _wait_stopped(pid: int) -> None:
    """Wait (deadline 10 s) until /proc shows process `pid` stopped by SIGSTOP."""
    deadline = time.monotonic() + 10.0
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.01)


def test_redis_stalled_during_a_lookup_times_out_as_a_miss(own_redis, tiny_llama_kv2, reference):
    llm = pool_llm(tiny_llama_kv2, {"name": "redis", "url": own_redis.address, "timeout_s": 30.0},
                   lookup_timeout_s=0.2)
    pid = own_redis.procs[0].pid
    try:
        generate(llm, prompt(0))
        stats(llm)
        # SIGSTOP: the server answers nothing until SIGCONT, so the lookup cannot beat its
        # deadline (the tier's own 30 s socket timeout never fires).
        own_redis.procs[0].send_signal(signal.SIGSTOP)
        safety = _ResumeLater(own_redis.procs[0])
        try:
            _wait_stopped(pid)
            slow = generate(llm, prompt(0))
        finally:
            safety.cancel()
            own_redis.procs[0].send_signal(signal.SIGCONT)
        assert slow.outputs[0].token_ids == reference[0] and slow.num_cached_tokens == 0
        counts = stats(llm)
        assert counts["pool:all:lookup_timeouts"] == 1
        assert counts["pool:redis:failures_timeout"] == 0  # late, not failed
        hot = generate(llm, prompt(0))  # the server answers again: a hit
        assert hot.num_cached_tokens == HIT and hot.outputs[0].token_ids == reference[0]
        assert_idle(llm)
    finally:
        llm.llm_engine.shutdown()


def test_redis_out_of_memory_fails_writes_counted_and_reads_still_hit(
    own_redis, tiny_llama_kv2, reference
):
    llm = pool_llm(tiny_llama_kv2, {"name": "redis", "url": own_redis.address, "timeout_s": 5.0})
    admin = _redis_client(own_redis)
    try:
        generate(llm, prompt(0))
        before = stats(llm)
        assert before["pool:redis:chunks_written"] == 3
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # below what the server already uses: writes refused
        out = generate(llm, prompt(1))
        assert out.outputs[0].token_ids == reference[1] and out.num_cached_tokens == 0
        full = stats(llm)
        assert full["pool:redis:failures_full"] == 3
        assert full["pool:redis:chunks_written"] == 3
        hot = generate(llm, prompt(0))  # reads are served
        assert hot.num_cached_tokens == HIT and hot.outputs[0].token_ids == reference[0]
        admin.config_set("maxmemory", 0)
        until_hit(llm, prompt(1), reference[1])
        assert stats(llm)["pool:redis:chunks_written"] == 6
        assert_idle(llm)
    finally:
        admin.close()
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("auth", ["none", "wrong"])
def test_redis_password_mismatch_is_counted_and_named_never_a_crash(
    own_redis, tiny_llama_kv2, reference, auth, caplog
):
    admin = _redis_client(own_redis)
    admin.config_set("requirepass", "s3cret")
    admin.close()
    url = own_redis.address if auth == "none" else own_redis.address.replace("//", "//:wrong@")
    llm = pool_llm(tiny_llama_kv2, {"name": "redis", "url": url, "timeout_s": 5.0})
    try:
        with caplog.at_level(logging.WARNING, logger="pdkv.kvpool.store"):
            for seed in (0, 0):
                out = generate(llm, prompt(seed))
                assert out.outputs[0].token_ids == reference[0] and out.num_cached_tokens == 0
        counts = stats(llm)
        assert counts["pool:redis:failures_unavailable"] >= 2
        assert counts["pool:redis:chunks_written"] == 0
        said = caplog.text.lower()
        assert "authenticat" in said or "password" in said, caplog.text  # the cause is named
        fixed = _redis_client(own_redis, password="s3cret")
        fixed.config_set("requirepass", "" if auth == "none" else "wrong")  # the tier's now
        fixed.close()
        until_hit(llm, prompt(0), reference[0])
        assert_idle(llm)
    finally:
        llm.llm_engine.shutdown()


# -- mooncake -----------------------------------------------------------------------------------


def _mooncake_tier(svc: services.Service) -> dict[str, Any]:
    return {"name": "mooncake", "master": svc.address, "timeout_s": 2.0,
            "local_buffer_bytes": 16 << 20}


def _failures(counts: dict[str, float], tier: str) -> float:
    return sum(v for k, v in counts.items() if k.startswith(f"pool:{tier}:failures_"))


def _start_store_process(svc: services.Service, log: Any) -> subprocess.Popen[bytes]:
    """Another store process mounting 64 MiB into `svc`'s master (as start_mooncake does),
    ready once it printed "ready" (deadline 60 s)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if x)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdkv.kvpool.mooncake_store_server", "--master", svc.address,
             "--segment-bytes", str(64 << 20), "--local-hostname", "127.0.0.1",
             "--parent-pid", str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60.0
    while b"ready" not in (text := Path(log).read_bytes()):
        assert proc.poll() is None, text[-2000:]
        assert time.monotonic() < deadline, "the new store process never got ready"
        time.sleep(0.05)
    return proc


def test_mooncake_store_process_killed_misses_counts_and_a_new_one_brings_it_back(
    own_mooncake, tiny_llama_kv2, reference, tmp_path
):
    llm = pool_llm(tiny_llama_kv2, _mooncake_tier(own_mooncake))
    replacement = None
    try:
        generate(llm, prompt(0))
        stats(llm)
        assert generate(llm, prompt(0)).num_cached_tokens == HIT
        _kill(own_mooncake.procs[1])  # the memory goes with it
        for seed in (0, 1):
            out = generate(llm, prompt(seed))
            assert out.outputs[0].token_ids == reference[seed] and out.num_cached_tokens == 0
        counts = stats(llm)
        assert _failures(counts, "mooncake") >= 1  # the writes found no segment
        assert_idle(llm)
        replacement = _start_store_process(own_mooncake, tmp_path / "store.log")
        until_hit(llm, prompt(1), reference[1])
        assert_idle(llm)
    finally:
        llm.llm_engine.shutdown()
        if replacement is not None:
            replacement.terminate()
            replacement.wait(10.0)


def test_mooncake_master_killed_misses_counts_and_a_restart_on_its_port_brings_it_back(
    own_mooncake, tiny_llama_kv2, reference
):
    llm = pool_llm(tiny_llama_kv2, _mooncake_tier(own_mooncake))
    try:
        generate(llm, prompt(0))
        stats(llm)
        _kill(own_mooncake.procs[0])
        for seed in (0, 1):
            out = generate(llm, prompt(seed))
            assert out.outputs[0].token_ids == reference[seed] and out.num_cached_tokens == 0
        counts = stats(llm)
        assert counts["pool:mooncake:failures_unavailable"] >= 2
        assert_idle(llm)
        _kill(own_mooncake.procs[1])  # its segment belonged to the dead master
        port = int(own_mooncake.address.rsplit(":", 1)[1])
        with services.start_mooncake(segment_bytes=64 << 20, port=port):  # master + store, empty
            until_hit(llm, prompt(1), reference[1])
            assert_idle(llm)
    finally:
        llm.llm_engine.shutdown()


def test_mooncake_master_stopped_mid_run_is_refused_by_the_probe_then_comes_back(
    own_mooncake, tiny_llama_kv2, reference
):
    llm = pool_llm(tiny_llama_kv2, _mooncake_tier(own_mooncake))
    master = own_mooncake.procs[0]
    try:
        generate(llm, prompt(0))
        stats(llm)
        master.send_signal(signal.SIGSTOP)  # accepts connections (kernel), answers nothing
        safety = _ResumeLater(master)
        try:
            _wait_stopped(master.pid)
            for seed in (0, 1):
                out = generate(llm, prompt(seed))
                assert out.outputs[0].token_ids == reference[seed] and out.num_cached_tokens == 0
            counts = stats(llm)
        finally:
            safety.cancel()
            master.send_signal(signal.SIGCONT)
        assert counts["pool:mooncake:failures_timeout"] >= 1
        until_hit(llm, prompt(1), reference[1])
        assert_idle(llm)
    finally:
        llm.llm_engine.shutdown()


def test_engine_with_a_master_that_never_answers_serves_without_the_tier(
    tiny_llama_kv2, reference, tmp_path
):
    """setup() against such a master would hold the GIL for 20 x 30 s, so the engine runs in a
    child process with a deadline: it must start, serve the reference text with the tier's
    failures counted as timeouts, then (a real master on that port) hit the pool."""
    pytest.importorskip("mooncake.store")
    listener = socket.socket()  # the kernel accepts into the backlog; nothing ever answers
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    tier = {"name": "mooncake", "master": f"127.0.0.1:{port}", "timeout_s": 1.0}
    cfg = {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"chunk_size": CHUNK, "tiers": [tier],
                                         "tier_retry_after_s": 0.0}}
    code = (
        "import json, sys\n"
        "from pdkv import LLM, SamplingParams\n"
        f"llm = LLM({tiny_llama_kv2!r}, kv_transfer_config=json.dumps({cfg!r}), **{KW!r})\n"
        f"ids = {prompt(0)!r}\n"
        "greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)\n"
        "def run():\n"
        "    assert llm.reset_prefix_cache()\n"
        "    out = llm.generate({'prompt_token_ids': ids}, greedy)[0]\n"
        "    store = llm.llm_engine.runner.connector.store\n"
        "    assert store.flush(30.0)\n"
        "    return out.outputs[0].token_ids, out.num_cached_tokens\n"
        "print(json.dumps(run()), flush=True)\n"
        "s = llm.llm_engine.scheduler.kv_stats\n"
        "print(json.dumps(s['pool:mooncake:failures_timeout']), flush=True)\n"
        "sys.stdin.readline()  # the parent has started a real master on the port\n"
        "for _ in range(20):\n"
        "    tokens, cached = run()\n"
        "    print(json.dumps([tokens, cached]), flush=True)\n"
        f"    if cached == {HIT}:\n"
        "        break\n"
        "llm.llm_engine.shutdown()\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if x)
    log = tmp_path / "child.log"
    with open(log, "wb") as err:
        child = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=err, text=True)
    killer = threading.Timer(120.0, child.kill)  # a hang fails the test instead of holding it
    killer.start()
    try:
        assert child.stdout is not None and child.stdin is not None
        first = child.stdout.readline()
        assert first, f"the engine did not serve; its log:\n{log.read_text()[-3000:]}"
        tokens, cached = json.loads(first)
        assert tokens == reference[0] and cached == 0
        assert json.loads(child.stdout.readline()) >= 1  # the tier's calls timed out, counted
        listener.close()
        with services.start_mooncake(segment_bytes=64 << 20, port=port):
            child.stdin.write("go\n")
            child.stdin.flush()
            seen = []
            for line in child.stdout:
                tokens, cached = json.loads(line)
                assert tokens == reference[0]
                seen.append(cached)
                if cached == HIT:
                    break
            assert seen and seen[-1] == HIT, seen
            assert child.wait(60.0) == 0
    finally:
        killer.cancel()
        listener.close()
        if child.poll() is None:
            child.kill()
            child.wait(30.0)
