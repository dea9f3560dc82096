"""Layer-wise push over the one-sided transfer engines (issue 29 step 4): shm (P copies into D's
KV cache in shared memory) and mooncake (Mooncake writes into D's registered KV cache), every
write reserved with D first (engine/push_control.py). Two engines in one process, stepped by hand
(test_pd_push.py's helpers): greedy output equals the colocated engine's and D received exactly
layers x granted blocks x per-layer block bytes; a refused reservation leaves D's block bytes
untouched (a sentinel survives); a P that dies between reserve and commit, after copying half a
layer, leaves the window to its lease and D recomputes (no half-written block is read)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest
from system_packages import in_ci

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import pump, shutdown  # noqa: E402
from test_pd_push import (  # noqa: E402
    GREEDY,
    PROMPT_LENS,
    TINY_KW,
    check_push_matches_colocated,
    engines,
    finish,
    finish_raw,
    grant_of,
    idle,
    layer_block_bytes,
    open_windows,
    prompts_for,
    push_prefill,
)

from pdkv import LLM  # noqa: E402
from pdkv.kv_transfer.engine.base import TransferEngine, TransferError, WriteOp  # noqa: E402
from pdkv.kv_transfer.engine.push_control import ControlReply, Reserve  # noqa: E402
from pdkv.kv_transfer.wire import connect, recv_msg, send_msg  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _mooncake_available() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


ONE_SIDED = [
    "shm",
    pytest.param("mooncake", marks=pytest.mark.skipif(
        not _mooncake_available() and not in_ci(),
        reason="mooncake-transfer-engine-non-cuda / libibverbs1 not installed")),
]


@pytest.fixture(scope="module", params=ONE_SIDED)
def pd(request, tiny_llama_kv2) -> Any:
    """One P / D pair in push mode per one-sided engine (policy fail: a load that fails shows)."""
    p, d = engines(tiny_llama_kv2, "push", transfer=request.param, **TINY_KW)
    yield request.param, p, d
    shutdown(p, d)


def kv_bytes(llm: LLM) -> memoryview:
    """Group 0's KV cache of `llm` as bytes (block b: [b * block_bytes, (b + 1) * block_bytes))."""
    import torch

    return llm.llm_engine.runner.kv_cache_groups[0].view(-1).view(torch.uint8).numpy().data


def client_for(transfer: str, source: memoryview) -> TransferEngine:
    """A producer-side engine of `transfer` that may write from `source`."""
    if transfer == "shm":
        from pdkv.kv_transfer.engine.shm import ShmTransferEngine

        return ShmTransferEngine()
    from pdkv.kv_transfer.engine.mooncake import MooncakeTransferEngine

    eng = MooncakeTransferEngine()
    eng.register_region("src", source)  # Mooncake writes from registered memory
    return eng


def test_push_matches_colocated_and_moves_the_formula(pd):
    _, p, d = pd
    check_push_matches_colocated(p, d, prompts_for(PROMPT_LENS))


def test_a_refused_reservation_writes_no_byte_into_ds_blocks(pd):
    transfer, p, d = pd
    prompt = prompts_for((40,))[0]  # 3 blocks; D needs no more for 8 output tokens
    ref = list(p.generate([{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0].token_ids)
    assert p.reset_prefix_cache()
    (rid,) = open_windows(d, [prompt])
    g = grant_of(d, rid)
    bb = d.llm_engine.runner.kv_cache_config.block_bytes(0)
    lb = layer_block_bytes(d)
    region = kv_bytes(d)
    inside = g.block_ids[0][0]
    outside = next(b for b in range(1, 48) if b not in g.block_ids[0])
    for b in (inside, outside):
        region[b * bb : (b + 1) * bb] = b"\xa5" * bb
    sentinel = b"\xa5" * bb
    garbage = memoryview(bytearray(b"\x7f" * bb))
    client = client_for(transfer, garbage)
    stats = d.llm_engine.scheduler.kv_stats
    refused0 = stats.get("kv_push_refused", 0)
    peer = {"host": g.host, "port": g.port}
    try:
        for block, length, nonce in ((inside, lb, "forged-nonce"),  # D's bearer token
                                     (outside, lb, g.nonce),  # outside the window
                                     (inside, lb // 2, g.nonce)):  # half a layer
            with pytest.raises(TransferError, match="refused write"):
                client.write(peer, [WriteOp("g0", block * bb, length, garbage[:length])],
                             time.monotonic() + 20, (g.request_id, nonce))
        assert bytes(region[inside * bb : (inside + 1) * bb]) == sentinel
        assert bytes(region[outside * bb : (outside + 1) * bb]) == sentinel
        pump([d], lambda: stats.get("kv_push_refused", 0) >= refused0 + 3)
        assert stats["kv_push_refused"] == refused0 + 3
        push_prefill(p, prompt, g)  # P's real push overwrites every layer of the granted blocks
        assert finish(d, [rid]) == [ref]
        assert bytes(region[outside * bb : (outside + 1) * bb]) == sentinel  # never written
        pump([p, d], lambda: idle(p, d), timeout=30)
    finally:
        client.close()


def test_p_dying_between_reserve_and_commit_leaves_the_window_to_its_lease(tiny_llama_kv2):
    """A fake P reserves the first layer of D's first granted block, copies half its bytes into
    D's shared KV cache and dies (its control connection closes without a commit): the write
    ends not landed, the window expires at D's 2 s lease and policy recompute computes the
    prompt on D, giving the colocated output (the half-written block is not read)."""
    p, d = engines(tiny_llama_kv2, "push", d_timeout=2.0, transfer="shm", policy="recompute",
                   **TINY_KW)
    try:
        prompt = prompts_for((40,))[0]
        ref = list(p.generate([{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0].token_ids)
        (rid,) = open_windows(d, [prompt])
        g = grant_of(d, rid)
        bb = d.llm_engine.runner.kv_cache_config.block_bytes(0)
        lb = layer_block_bytes(d)
        first = g.block_ids[0][0] * bb
        sock = connect(g.host, g.port, 10)
        send_msg(sock, Reserve("g0", [(first, lb)], g.request_id, g.nonce))
        reply = recv_msg(sock, ControlReply, time.monotonic() + 10)
        assert reply.ok and "g0" in reply.target["segments"]
        kv_bytes(d)[first : first + lb // 2] = b"\x7f" * (lb // 2)  # half the layer landed
        sock.close()  # P died
        stats = d.llm_engine.scheduler.kv_stats
        t0 = time.monotonic()
        out = finish_raw(d, rid)
        assert time.monotonic() - t0 < 30
        assert stats.get("kv_push_window_expirations") == 1
        assert list(out.outputs[0].token_ids) == ref
        assert not stats.get("kv_bytes_received")  # a failed window is no transfer
        pump([p, d], lambda: idle(p, d), timeout=30)
    finally:
        shutdown(p, d)


@pytest.mark.parametrize("transfer", ["tcp", "shm", "mooncake"])
def test_kv_layout_reports_push_over_every_engine_that_writes(transfer):
    """GET /kv_layout's transfer_mode (what the proxy reads to run the push flow)."""
    from pdkv.serve.kv_push import transfer_mode

    assert transfer_mode("P2PConnector", {"transfer": transfer, "transfer_mode": "push"}) == "push"
