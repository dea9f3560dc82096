"""Push mode's faults (issue 29 step 3), two engines in one process stepped by hand
(test_pd_push.py's helpers): P dies after half the layers (a transfer engine that stops writing
for good: D's window ends at its lease and the request follows kv_load_failure_policy, recompute
giving the colocated output, fail an error); D's request aborted with its window open (the window
closes at once, its blocks are free long before the lease, a late push and a second write of a
layer are refused and counted); a window closed while a write still receives ends only when that
write ends."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import pump, shutdown  # noqa: E402
from test_pd_push import (  # noqa: E402
    GREEDY,
    TINY_KW,
    engines,
    finish_raw,
    grant_of,
    idle,
    layer_block_bytes,
    open_windows,
    prompts_for,
    push_prefill,
)

from pdkv.kv_transfer.connector.p2p_messages import WindowSpec  # noqa: E402
from pdkv.kv_transfer.connector.p2p_push import PushReceiver  # noqa: E402
from pdkv.kv_transfer.connector.p2p_results import WorkerResults  # noqa: E402
from pdkv.kv_transfer.engine.base import TransferError, WriteOp  # noqa: E402
from pdkv.kv_transfer.engine.tcp import TcpTransferEngine  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class DiesAfter:
    """P's transfer engine until it has written `layers` layer writes; after that every write
    fails as if P's process were gone (nothing more reaches D)."""

    def __init__(self, inner: Any, layers: int) -> None:
        self.inner = inner
        self.left = layers
        self.refused = 0

    def write(self, peer: Any, ops: list[WriteOp], deadline: float, grant: Any) -> int:
        if self.left <= 0:
            self.refused += 1
            raise TransferError("the prefill engine is gone")
        self.left -= 1
        return self.inner.write(peer, ops, deadline, grant)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_p_dying_after_half_the_layers_ends_at_ds_lease_by_policy(tiny_llama_kv2, policy):
    import json

    from pdkv import LLM

    p, _ = engines(tiny_llama_kv2, "push", **TINY_KW)
    d = LLM(tiny_llama_kv2, **TINY_KW, kv_transfer_config=json.dumps({
        "kv_connector": "P2PConnector", "kv_role": "kv_consumer",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"transfer": "tcp", "transfer_mode": "push",
                                      "transfer_timeout": 2.0}}))
    try:
        prompt = prompts_for((40,))[0]  # 3 blocks, pushed by P's last chunk step
        ref = list(p.generate([{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0].token_ids)
        assert p.reset_prefix_cache()
        layers = p.llm_engine.runner.model.cfg.num_layers
        sender = p.llm_engine.runner.connector.worker.push_sender
        sender.engine = DiesAfter(sender.engine, layers // 2)
        (rid,) = open_windows(d, [prompt])
        grant = grant_of(d, rid)
        push_prefill(p, prompt, grant)
        assert sender.engine.left == 0 and p.llm_engine.scheduler.kv_stats["kv_push_failures"] >= 1
        stats = d.llm_engine.scheduler.kv_stats
        t0 = time.monotonic()
        out = finish_raw(d, rid)
        assert time.monotonic() - t0 < 30
        assert stats.get("kv_push_window_expirations") == 1
        if policy == "recompute":  # D computed the prompt itself: no half-written block read
            assert list(out.outputs[0].token_ids) == ref
        else:
            assert out.outputs[0].finish_reason == "error" and not out.outputs[0].token_ids
        # half the layers of every granted block had landed: the bytes D counted received are 0
        # (a failed window is no transfer), and its blocks are free again
        assert not stats.get("kv_bytes_received")
        pump([p, d], lambda: idle(p, d), timeout=30)
    finally:
        shutdown(p, d)


def test_d_abort_with_an_open_window_frees_it_at_once_and_refuses_late_writes(tiny_llama_kv2):
    p, d = engines(tiny_llama_kv2, "push", d_timeout=120.0, **TINY_KW)
    client = TcpTransferEngine()
    try:
        prompt = prompts_for((40,))[0]
        (rid,) = open_windows(d, [prompt])
        g = grant_of(d, rid)
        bb = d.llm_engine.runner.kv_cache_config.block_bytes(0)
        lb = layer_block_bytes(d)
        peer = {"host": g.host, "port": g.port}
        unit = memoryview(bytearray(lb))
        first = WriteOp("g0", g.block_ids[0][0] * bb, lb, unit)
        assert client.write(peer, [first], time.monotonic() + 10, (g.request_id, g.nonce)) == lb
        with pytest.raises(TransferError, match="refused write"):  # that layer again
            client.write(peer, [first], time.monotonic() + 10, (g.request_id, g.nonce))
        stats = d.llm_engine.scheduler.kv_stats
        pump([d], lambda: stats.get("kv_push_refused", 0) >= 1)
        d.llm_engine.abort_request([rid])
        t0 = time.monotonic()
        pump([d], lambda: idle(d), timeout=60)
        assert time.monotonic() - t0 < 60  # well before the 120 s lease
        assert d.llm_engine.scheduler.connector.push_grant(rid) is None
        push_prefill(p, prompt, g)  # P comes late: every write is refused, P counts it
        assert p.llm_engine.scheduler.kv_stats.get("kv_push_failures", 0) >= 1
        pump([d], lambda: stats.get("kv_push_refused", 0) >= 2)
        assert not stats.get("kv_push_window_expirations")
        assert not stats.get("kv_load_failures")  # an abort is not a failed load
        pump([p, d], lambda: idle(p, d), timeout=30)
    finally:
        client.close()
        shutdown(p, d)


def test_a_window_closed_while_a_write_receives_ends_when_that_write_ends():
    ended: list[str] = []
    results = WorkerResults(lambda: None)
    results.recved = _Recorder(ended)
    rx = PushReceiver(results, block_bytes=[64], layers_per_group=[2])
    rx.open([WindowSpec("r1", "n1", ([3, 4],), 60.0)])
    grant = ("r1", "n1")
    assert rx.authorize(grant, "g0", [(3 * 64, 32)]) is None  # a write starts receiving
    rx.close(["r1"])
    assert ended == []  # its bytes may still arrive: the blocks stay the window's
    assert rx.authorize(grant, "g0", [(4 * 64, 32)]) is not None  # no new write
    rx.on_written(grant, "g0", [(3 * 64, 32)], landed=True)
    assert ended == ["r1"]
    rx.expire()
    assert ended == ["r1"] and rx.next_deadline() is None


class _Recorder(set):
    """WorkerResults.recved that also lists what was added, in order."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def add(self, rid: str) -> None:  # type: ignore[override]
        self.log.append(rid)
        super().add(rid)
