"""Re-sharding in the P2P worker half, with in-process fakes (no sockets, no model): P (tp 1) holds
a request's blocks; D at tp 2 (dcp 1) pulls them with both ranks, each with its global rank as
the grant's reader. On 2 KV heads each rank reads only its head (bytes moved in all = one copy of
P's blocks); on 1 KV head both read whole blocks (two copies). The grant ends after both ranks'
"done", and only rank 0 sends the scheduler's notices."""

from __future__ import annotations

import secrets
import time
from typing import Any

import pytest
import torch
from fake_transfer import FakeEngine, cfg, wait_loaded

from pdkv.cache.block_pool import KVCacheBlock
from pdkv.cache.kv_cache_manager import KVCacheBlocks
from pdkv.cache.kv_layout import KVLayout
from pdkv.kv_transfer.connector.p2p_consumer import ConsumerSide
from pdkv.kv_transfer.connector.p2p_messages import (
    NotifySpec,
    RemoteEngine,
    SendSpec,
    prompt_digest,
)
from pdkv.kv_transfer.connector.p2p_producer import ProducerSide
from pdkv.kv_transfer.connector.p2p_results import WorkerResults
from pdkv.kv_transfer.connector.p2p_scheduler import P2PConnectorScheduler
from pdkv.request import Request, RequestStatus
from pdkv.sampling_params import SamplingParams

BS, LAYERS, HEAD, NBLOCKS, TP = 4, 2, 8, 24, 2
REMOTE = RemoteEngine("P", "127.0.0.1", 1)


def view(kv: torch.Tensor) -> memoryview:
    return memoryview(kv.view(-1).view(torch.uint8).numpy())


def layouts(heads: int) -> tuple[dict[str, Any], dict[str, Any]]:
    p = {
        "model_digest": "m",
        "dtype": "float32",
        "block_size": BS,
        "num_layers": LAYERS,
        "num_kv_heads": heads,
        "head_size": HEAD,
        "kv_layout": "cross_layer",
    }
    d = {**p, "tp_size": TP, "dcp_size": 1, "interleave": 1, "dcp_replicated": False,
         "num_local_kv_heads": max(1, heads // TP)}
    return p, d


def bb(heads: int) -> int:
    return LAYERS * 2 * BS * heads * HEAD * 4


def run(
    heads: int, n_tokens: int, p_blocks: list[int], d_blocks: list[int]
) -> tuple[torch.Tensor, list[torch.Tensor], ProducerSide, WorkerResults, list[WorkerResults]]:
    """P holds `p_blocks` for the prompt; D's scheduler half maps them onto `d_blocks`; both D
    ranks pull. Returns P's KV, each rank's KV, P's side and results, and each rank's results."""
    p_lay, d_lay = layouts(heads)
    p_kv = torch.arange(1, NBLOCKS * bb(heads) // 4 + 1, dtype=torch.float32).reshape(
        NBLOCKS, LAYERS, 2, BS, heads, HEAD)
    p_engine, p_results = FakeEngine(), WorkerResults(lambda: None)
    prod = ProducerSide(cfg("kv_producer", "P"), KVLayout.from_wire(p_lay), p_engine, p_results,
                        [bb(heads)])
    p_engine.register_region("g0", view(p_kv))
    tokens = list(range(100, 100 + n_tokens))
    nonce, digest = secrets.token_hex(8), prompt_digest(tokens, None)
    prod.hold([SendSpec("p", (p_blocks,), 30.0, nonce, digest)])
    # D's scheduler half builds the RecvSpec from P's kv_transfer_params.
    p_sched = P2PConnectorScheduler(cfg("kv_producer", "P"), KVLayout.from_wire(p_lay), BS,
                                    ["127.0.0.1", 1])
    r = Request(
        "p", tokens, SamplingParams(max_tokens=1), BS, kv_transfer_params={"do_remote_decode": True}
    )
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p_sched.request_finished(r, (p_blocks,))
    assert params is not None
    d_sched = P2PConnectorScheduler(cfg("kv_consumer", "D"), KVLayout.from_wire(d_lay), BS,
                                    ["127.0.0.1", 0])
    d = Request("d", tokens, SamplingParams(max_tokens=4), BS, kv_transfer_params=params)
    d_sched.validate_request(d)
    d_sched.update_state_after_alloc(
        d, KVCacheBlocks(([KVCacheBlock(b, ref_cnt=1) for b in d_blocks],)), n_tokens
    )
    (spec,) = d_sched.build_connector_meta().reqs_to_recv
    spec.remote, spec.remote_nonce = REMOTE, nonce
    local = d_lay["num_local_kv_heads"]
    d_kvs, sides, results = [], [], []
    for rank in range(TP):
        kv = torch.zeros(NBLOCKS, LAYERS, 2, BS, local, HEAD)
        res = WorkerResults(lambda: None)
        side = ConsumerSide(cfg("kv_consumer", "D"), KVLayout.from_wire(d_lay),
                            FakeEngine(p_engine), res, [view(kv)], [bb(local)],
                            rank=rank, world_size=TP)
        side._control = lambda remote, msg, reply_type, deadline: prod._handle(msg)  # type: ignore[method-assign]
        d_kvs.append(kv)
        sides.append(side)
        results.append(res)
    try:
        for side in sides:
            side.submit([spec], [])
        for res in results:
            wait_loaded(res, "d")
    finally:
        for side in sides:
            side.shutdown()
    return p_kv, d_kvs, prod, p_results, results


@pytest.mark.parametrize(("heads", "copies"), [(2, 1), (1, 2)])
def test_each_rank_pulls_its_heads_and_bytes_moved_are_what_d_stores(heads, copies):
    p_blocks, d_blocks = [9, 3, 14], [5, 6, 2]
    p_kv, d_kvs, prod, p_results, results = run(heads, 11, p_blocks, d_blocks)
    local = max(1, heads // TP)
    for rank, kv in enumerate(d_kvs):
        start = rank * local if heads >= TP else 0  # ParallelLayout.kv_head_start
        for pb, db in zip(p_blocks, d_blocks):
            assert torch.equal(kv[db], p_kv[pb, :, :, :, start : start + local]), (rank, db)
        assert not kv[0].any()  # nothing outside the request's blocks written
    received = [res.take_request_bytes()["d"]["p2p"] for res in results]
    assert received == [len(p_blocks) * bb(local)] * TP
    assert sum(received) == copies * len(p_blocks) * bb(heads)
    assert not prod.has_pending()  # both ranks said done
    assert p_results.take_stats()[0]["kv_bytes_sent"] == copies * len(p_blocks) * bb(heads)


def test_only_global_rank_0_sends_the_schedulers_notices():
    p_lay, d_lay = layouts(2)
    p_engine, p_results = FakeEngine(), WorkerResults(lambda: None)
    prod = ProducerSide(cfg("kv_producer", "P"), KVLayout.from_wire(p_lay), p_engine, p_results,
                        [bb(2)])
    p_engine.register_region("g0", view(torch.zeros(NBLOCKS * bb(2) // 4)))
    nonce = "n"
    prod.hold([SendSpec("x", ([1, 2],), 30.0, nonce, prompt_digest([1], None))])
    sent: list[int] = []
    sides = []
    for rank in range(TP):  # dcp_rank is 0 on both: the global rank decides
        side = ConsumerSide(cfg("kv_consumer", "D"), KVLayout.from_wire(d_lay),
                            FakeEngine(p_engine), WorkerResults(lambda: None),
                            [], [], rank=rank, world_size=TP)
        side._control = lambda remote, msg, reply_type, deadline, r=rank: (
            sent.append(r) or prod._handle(msg)
        )  # type: ignore[method-assign]
        sides.append(side)
    try:
        for side in sides:
            side.submit([], [NotifySpec(REMOTE, "x", "release", nonce)])
        deadline = time.monotonic() + 10
        while prod.has_pending():
            assert time.monotonic() < deadline, "the release was not delivered"
            time.sleep(0.005)
    finally:
        for side in sides:
            side.shutdown()
    assert sent == [0]
