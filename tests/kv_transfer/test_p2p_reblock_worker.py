"""Re-blocking in the P2P worker half, with in-process fakes (no sockets, no model): D (blocks of
8 tokens) pulls from P (blocks of 4) and back, from a fresh D and after a local prefix hit; every
token of the prompt lands at D's (block, slot) equal to P's, the producer's authorizer serves the
sub-block ranges of the held blocks and nothing else."""

from __future__ import annotations

import secrets
import time

import pytest
import torch
from fake_transfer import FakeEngine, cfg

from pdkv.cache.block_pool import KVCacheBlock
from pdkv.cache.kv_cache_manager import KVCacheBlocks
from pdkv.cache.kv_layout import KVLayout
from pdkv.kv_transfer.connector.p2p_consumer import ConsumerSide
from pdkv.kv_transfer.connector.p2p_messages import Claim, ClaimReply, SendSpec, prompt_digest
from pdkv.kv_transfer.connector.p2p_producer import ProducerSide
from pdkv.kv_transfer.connector.p2p_results import WorkerResults
from pdkv.kv_transfer.connector.p2p_scheduler import P2PConnectorScheduler
from pdkv.request import Request, RequestStatus
from pdkv.sampling_params import SamplingParams

LAYERS, HEADS, HEAD = 2, 1, 8
BASE = {"model_digest": "m", "dtype": "float32", "num_layers": LAYERS, "num_kv_heads": HEADS,
        "head_size": HEAD, "kv_layout": "cross_layer"}
NBLOCKS = 24


def kv_cache(bs: int, fill: bool) -> torch.Tensor:
    shape = (NBLOCKS, LAYERS, 2, bs, HEADS, HEAD)
    n = torch.Size(shape).numel()
    return (torch.arange(1, n + 1, dtype=torch.float32) if fill else torch.zeros(n)).reshape(shape)


def view(kv: torch.Tensor) -> memoryview:
    return memoryview(kv.view(-1).view(torch.uint8).numpy())


def block_bytes(bs: int) -> int:
    return LAYERS * 2 * bs * HEADS * HEAD * 4


@pytest.mark.parametrize(
    ("p_bs", "d_bs", "hit"), [(4, 8, 0), (8, 4, 0), (4, 8, 8), (8, 4, 4), (8, 4, 12)]
)
def test_d_rebuilds_every_prompt_token_from_p_blocks_of_another_size(p_bs, d_bs, hit):
    n_tokens = 21
    tokens = list(range(100, 100 + n_tokens))
    p_kv, d_kv = kv_cache(p_bs, True), kv_cache(d_bs, False)
    p_blocks = [17, 3, 9, 5, 11, 20][: -(-n_tokens // p_bs)]
    d_table = [6, 14, 2, 8, 19, 1][: -(-n_tokens // d_bs)]
    # P: a held grant over p_blocks, and the params its scheduler half gives D.
    p_engine = FakeEngine()
    prod = ProducerSide(cfg("kv_producer", "P"), KVLayout.from_wire({**BASE, "block_size": p_bs}),
                        p_engine,
                        WorkerResults(lambda: None), [block_bytes(p_bs)])
    p_engine.register_region("g0", view(p_kv))
    p_sched = P2PConnectorScheduler(cfg("kv_producer", "P"),
                                    KVLayout.from_wire({**BASE, "block_size": p_bs}), p_bs,
                                    ["127.0.0.1", 1])
    r = Request(
        "p",
        tokens,
        SamplingParams(max_tokens=1),
        p_bs,
        kv_transfer_params={"do_remote_decode": True},
    )
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p_sched.request_finished(r, (p_blocks,))
    assert params is not None
    prod.hold(p_sched.build_connector_meta().reqs_to_send)
    # D: its scheduler half maps by token; its worker half pulls.
    d_layout = {**BASE, "block_size": d_bs}
    d_sched = P2PConnectorScheduler(cfg("kv_consumer", "D"), KVLayout.from_wire(d_layout), d_bs,
                                    ["127.0.0.1", 0])
    d = Request("d", tokens, SamplingParams(max_tokens=4), d_bs, kv_transfer_params=params)
    d_sched.validate_request(d)
    d.num_computed_tokens = hit
    ext, _ = d_sched.get_num_new_matched_tokens(d, hit)
    d_sched.update_state_after_alloc(
        d, KVCacheBlocks(([KVCacheBlock(b, ref_cnt=1) for b in d_table[hit // d_bs :]],)), ext
    )
    (spec,) = d_sched.build_connector_meta().reqs_to_recv
    d_engine = FakeEngine()
    d_engine.source = p_engine
    results = WorkerResults(lambda: None)
    side = ConsumerSide(cfg("kv_consumer", "D"), KVLayout.from_wire(d_layout), d_engine, results,
                        [view(d_kv)], [block_bytes(d_bs)])
    side._control = lambda remote, msg, reply_type, deadline: prod._handle(msg)  # type: ignore[method-assign]
    side.submit([spec], [])
    deadline = time.monotonic() + 10
    while True:
        with results.lock:
            if "d" in results.recved:
                assert results.errors.get("d") is None, results.errors.get("d")
                break
        assert time.monotonic() < deadline, "the pull did not end"
        time.sleep(0.005)
    side.shutdown()
    for t in range(n_tokens):
        got = d_kv[d_table[t // d_bs], :, :, t % d_bs]
        if t < hit:  # local: never written
            assert not got.any(), f"token {t} (a local hit) was written"
        else:
            assert torch.equal(got, p_kv[p_blocks[t // p_bs], :, :, t % p_bs]), f"token {t}"
    assert (
        results.take_stats()[0]["kv_bytes_received"]
        == (n_tokens - hit) * LAYERS * 2 * HEADS * HEAD * 4
    )
    untouched = [b for b in range(NBLOCKS) if b not in d_table]
    assert not d_kv[untouched].any()
    # Every slot of D past the prompt is untouched too.
    last = d_table[(n_tokens - 1) // d_bs]
    assert not d_kv[last, :, :, (n_tokens - 1) % d_bs + 1 :].any()


def test_the_producer_serves_sub_block_ranges_of_held_blocks_only():
    p_engine = FakeEngine()
    prod = ProducerSide(cfg("kv_producer", "P"), KVLayout.from_wire({**BASE, "block_size": 4}),
                        p_engine,
                        WorkerResults(lambda: None), [block_bytes(4)])
    nonce, digest = secrets.token_hex(8), prompt_digest([1, 2, 3], None)
    prod.hold([SendSpec("r", ([5, 7],), 30.0, nonce, digest)])
    reply = prod._handle(Claim("r", nonce, digest, "P"))
    assert isinstance(reply, ClaimReply) and reply.ok
    bb, row = block_bytes(4), HEADS * HEAD * 4
    assert (
        p_engine.authorizer(("r", nonce), "g0", [(5 * bb + 3 * row, 2 * row), (7 * bb + row, row)])
        is None
    )
    assert p_engine.authorizer(("r", nonce), "g0", [(6 * bb + row, row)]) is not None  # not held
    assert (
        p_engine.authorizer(("r", nonce), "g0", [(5 * bb + bb - row, 2 * row)]) is not None
    )  # spills into 6
