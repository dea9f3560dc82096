"""The shm transfer engine refuses a producer on another host at the handshake: by identity
(unit), between two P2P workers whose identities differ (in process), and for a real producer
in another network namespace (root only: skips with the reason, fails under CI=true). Each
refused pull ends at once with both hosts named, writes nothing, and releases P's grant."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from shm_producer_proc import TOKENS, hold, shm_worker  # noqa: E402
from system_packages import require_reason  # noqa: E402

from pdkv.kv_transfer.connector.p2p_messages import (  # noqa: E402
    P2PConnectorMetadata,
    RecvSpec,
    RemoteEngine,
    prompt_digest,
)
from pdkv.kv_transfer.connector.p2p_worker import P2PConnectorWorker  # noqa: E402
from pdkv.kv_transfer.engine.shm import ShmTransferEngine, host_identity  # noqa: E402
from pdkv.launch.netns import NetnsBridge, unavailable_reason  # noqa: E402

HERE = os.path.dirname(__file__)
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
LAYOUT = {"model_digest": "m", "dtype": "float32", "block_size": 4, "num_layers": 1,
          "num_kv_heads": 1, "head_size": 8, "kv_layout": "cross_layer"}
REFUSED = r"producer .* on host \[.*\] and this consumer on host \[.*\].*use transfer 'tcp' or"
FAST_S = 5.0  # a refused pull ends at the handshake: far below the 10 s transfer_timeout


def _netns_inode() -> int:
    return os.stat("/proc/self/ns/net").st_ino


def test_host_identity_names_this_kernel_and_network_namespace():
    me = host_identity()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert f"boot {f.read().strip()} " in me
    assert f"netns {_netns_inode()}" in me
    assert host_identity() == me  # stable within a process


def test_a_peer_with_another_identity_or_none_is_refused_and_the_same_one_accepted():
    here = ShmTransferEngine(host_id="boot a netns 1")
    there = ShmTransferEngine(host_id="boot a netns 2")
    try:
        assert here.peer_refusal(ShmTransferEngine(host_id="boot a netns 1").peer_info()) is None
        why = here.peer_refusal(there.peer_info())
        assert why is not None
        assert "on host [boot a netns 2]" in why and "on host [boot a netns 1]" in why
        assert "use transfer 'tcp' or 'mooncake'" in why
        assert "an unnamed host" in (here.peer_refusal({"segments": {}}) or "")
    finally:
        here.close()
        there.close()


def _spec(remote: RemoteEngine, nonce: str) -> RecvSpec:
    return RecvSpec("d", remote, "r", ([0, 1],), ([1, 2],), dict(LAYOUT), nonce,
                    prompt_digest(TOKENS, None))


def _pull(cons: P2PConnectorWorker, spec: RecvSpec, timeout: float = 20.0) -> str | None:
    """Submit one pull and step the consumer until it ends; its error (None = loaded)."""
    cons.start_load_kv(P2PConnectorMetadata(reqs_to_recv=[spec]))
    deadline = time.monotonic() + timeout
    while True:
        _, recved = cons.get_finished()
        if spec.request_id in recved:
            return cons.get_load_errors().get(spec.request_id)
        assert time.monotonic() < deadline, "the pull did not end"
        time.sleep(0.01)


@pytest.mark.parametrize("same_host", [True, False])
def test_a_pull_from_a_producer_on_another_host_fails_at_the_handshake(same_host):
    prod, pkv = shm_worker("kv_producer", "P")
    cons, dkv = shm_worker("kv_consumer", "D")
    try:
        if not same_host:  # what a producer in another namespace or on another machine sends
            assert isinstance(prod.engine, ShmTransferEngine)
            prod.engine.host_id = "boot elsewhere netns 1"
        nonce, _ = hold(prod, "r", [1, 2])
        host, port = prod.control_address
        t0 = time.monotonic()
        error = _pull(cons, _spec(RemoteEngine("P", str(host), int(port)), nonce))
        if same_host:  # the control: shm itself works between these two
            assert error is None and torch.equal(dkv[:2], pkv[[1, 2]])
        else:
            assert error is not None and time.monotonic() - t0 < FAST_S
            assert f"producer {host}:{port}: " in error
            assert re.search(REFUSED, error), error
            assert "boot elsewhere netns 1" in error and host_identity() in error
            assert not dkv.any(), "a refused pull wrote into the consumer's KV cache"
        deadline = time.monotonic() + 10  # P's grant ends: done, or D's release
        while "r" not in prod.get_finished()[0]:
            assert time.monotonic() < deadline, "P still holds the refused grant"
            time.sleep(0.01)
    finally:
        prod.shutdown()
        cons.shutdown()


def test_a_producer_in_another_network_namespace_is_refused():
    """A real producer process under `ip netns exec` (same kernel, same /dev/shm: only its
    network namespace differs) is refused; its grant is released."""
    require_reason(unavailable_reason())
    with NetnsBridge(["p"]) as bridge:
        address = bridge.address("p")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            x for x in (ROOT, HERE, os.environ.get("PYTHONPATH", "")) if x))
        proc = subprocess.Popen(
            [*bridge.exec_prefix("p"), sys.executable, os.path.join(HERE, "shm_producer_proc.py"),
             address], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        cons, dkv = shm_worker("kv_consumer", "D")
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # the producer prints its grant once it holds it
            assert line.startswith("{"), line + proc.stdout.read()
            info = json.loads(line)
            assert info["host_id"] != host_identity()
            assert f"netns {_netns_inode()}" not in info["host_id"]
            t0 = time.monotonic()
            error = _pull(cons, _spec(RemoteEngine("P", address, info["port"]), info["nonce"]))
            assert error is not None and time.monotonic() - t0 < FAST_S
            assert f"on host [{info['host_id']}]" in error, error
            assert f"on host [{host_identity()}]" in error, error
            assert not dkv.any()
            out, _ = proc.communicate(timeout=30)
            assert "ended r" in out and proc.returncode == 0, out
        finally:
            cons.shutdown()
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
