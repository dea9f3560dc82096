"""P/D into DCP on the P2P connector, with in-process fakes (no sockets, no model): the scheduler
half's map of P's blocks onto D's logical blocks, each DCP rank's reads of its own shard, the
producer holding a grant until every reader is done, the refusals of layouts that would need
re-sharding (issue 12), and D's KV rebuilt from its ranks' shards equal to P's position by
position (also when P's blocks come from its prefix cache)."""

from __future__ import annotations

import secrets
import time
from typing import Any

import pytest
import torch
from fake_transfer import FakeEngine, cfg

from pdkv.cache.block_pool import KVCacheBlock
from pdkv.cache.kv_cache_manager import KVCacheBlocks
from pdkv.cache.kv_layout import KVLayout
from pdkv.kv_transfer.connector import p2p_producer
from pdkv.kv_transfer.connector.p2p_consumer import ConsumerSide
from pdkv.kv_transfer.connector.p2p_messages import (
    Claim,
    ClaimReply,
    Notify,
    NotifySpec,
    RecvSpec,
    RemoteEngine,
    SendSpec,
    prompt_digest,
)
from pdkv.kv_transfer.connector.p2p_producer import ProducerSide
from pdkv.kv_transfer.connector.p2p_results import WorkerResults
from pdkv.kv_transfer.connector.p2p_scheduler import P2PConnectorScheduler
from pdkv.request import Request, RequestStatus
from pdkv.sampling_params import SamplingParams

BS = 4  # tokens per physical block (P's and each D rank's)
N = 2  # D's DCP size
P_LAYOUT = {
    "model_digest": "m",
    "dtype": "float32",
    "block_size": BS,
    "num_layers": 2,
    "num_kv_heads": 1,
    "head_size": 8,
    "kv_layout": "cross_layer",
}
D_LAYOUT = {**P_LAYOUT, "tp_size": 2, "dcp_size": N, "interleave": BS, "dcp_replicated": False,
            "num_local_kv_heads": 1}
SHAPE = (48, 2, 2, BS, 1, 8)  # blocks, layers, K/V, block tokens, KV heads, head size
BLOCK_BYTES = 2 * 2 * BS * 1 * 8 * 4
REMOTE = RemoteEngine("P", "127.0.0.1", 1)


# ----------------------------------------------------------------------------- fakes
def view(kv: torch.Tensor) -> memoryview:
    return memoryview(kv.view(-1).view(torch.uint8).numpy())


class Producer:
    """P's worker half (producer side) over a KV cache filled with distinct values."""

    def __init__(self, peers: dict[str, FakeEngine]) -> None:
        self.engine = FakeEngine()
        peers["P"] = self.engine
        self.results = WorkerResults(lambda: None)
        self.kv = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE)
        self.side = ProducerSide(cfg("kv_producer", "P"), KVLayout.from_wire(P_LAYOUT), self.engine,
                                 self.results, [BLOCK_BYTES])
        self.engine.register_region("g0", view(self.kv))

    def hold(self, rid: str, blocks: list[int], tokens: list[int]) -> tuple[str, str]:
        nonce, digest = secrets.token_hex(8), prompt_digest(tokens, None)
        self.side.hold([SendSpec(rid, (blocks,), 30.0, nonce, digest)])
        return nonce, digest

    def notify(self, **kw: Any) -> bool:
        return bool(self.side._handle(Notify(engine_id="P", **kw)).ok)

    def claim(self, rid: str, nonce: str, digest: str, readers: int, reader: int) -> ClaimReply:
        reply = self.side._handle(Claim(rid, nonce, digest, "P", readers=readers, reader=reader))
        assert isinstance(reply, ClaimReply)
        return reply

    def pending(self) -> bool:
        return self.side.has_pending()


def consumer(prod: Producer, peers: dict[str, FakeEngine], rank: int, size: int = N
             ) -> tuple[ConsumerSide, torch.Tensor, WorkerResults]:
    """D's DCP rank `rank`: its own KV cache (zeros) and a control plane wired to `prod`."""
    engine = FakeEngine(peers["P"])
    kv = torch.zeros(SHAPE)
    results = WorkerResults(lambda: None)
    side = ConsumerSide(cfg("kv_consumer", "D"), KVLayout.from_wire(D_LAYOUT), engine, results,
                        [view(kv)], [BLOCK_BYTES], dcp_rank=rank, dcp_size=size)
    side._control = lambda remote, msg, reply_type, deadline: prod.side._handle(msg)  # type: ignore[method-assign]
    return side, kv, results


def wait_loaded(results: WorkerResults, rid: str, timeout: float = 10.0) -> str | None:
    deadline = time.monotonic() + timeout
    while True:
        with results.lock:
            if rid in results.recved:
                return results.errors.get(rid)
        assert time.monotonic() < deadline, f"load of {rid} did not end"
        time.sleep(0.005)


# --------------------------------------------------------------------- scheduler half
def d_scheduler(
    layout: dict[str, Any] | None = None, logical_bs: int = BS * N
) -> P2PConnectorScheduler:
    return P2PConnectorScheduler(cfg("kv_consumer", "D"), KVLayout.from_wire(layout or D_LAYOUT),
                                 logical_bs, ["127.0.0.1", 0])


def p_params(n_tokens: int, p_blocks: list[int], **over: Any) -> dict[str, Any]:
    """kv_transfer_params as P's scheduler half makes them."""
    prod = P2PConnectorScheduler(cfg("kv_producer", "P"), KVLayout.from_wire(P_LAYOUT), BS,
                                 ["127.0.0.1", 1])
    r = Request("p", list(range(100, 100 + n_tokens)), SamplingParams(max_tokens=1), BS,
                kv_transfer_params={"do_remote_decode": True})
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = prod.request_finished(r, (p_blocks,))
    assert params is not None
    params.update(over)
    return params


def d_request(n_tokens: int, params: dict[str, Any]) -> Request:
    return Request("d", list(range(100, 100 + n_tokens)), SamplingParams(max_tokens=4), BS * N,
                   kv_transfer_params=params)


def recv_spec(n_tokens: int, p_blocks: list[int], d_hit: list[int], d_new: list[int]) -> RecvSpec:
    """D's RecvSpec for a prompt of `n_tokens` whose first len(d_hit) logical blocks D found in
    its prefix cache."""
    sched = d_scheduler()
    d = d_request(n_tokens, p_params(n_tokens, p_blocks))
    sched.validate_request(d)
    sched.on_new_request(d)
    d.num_computed_tokens = len(d_hit) * BS * N
    n_ext, _ = sched.get_num_new_matched_tokens(d, d.num_computed_tokens)
    blocks = KVCacheBlocks(([KVCacheBlock(b, ref_cnt=1) for b in d_new],))
    sched.update_state_after_alloc(d, blocks, int(n_ext or 0))
    (spec,) = sched.build_connector_meta().reqs_to_recv
    return spec


def test_params_carry_the_producers_sizes_and_endpoints():
    params = p_params(10, [5, 6, 7])
    assert params["tp_size"] == 1 and params["dcp_size"] == 1
    assert params["endpoints"] == [["127.0.0.1", 1]]


def test_scheduler_maps_each_remote_block_to_the_logical_block_holding_it():
    # 30 tokens: P has 8 blocks of 4; D (dcp 2) has 4 logical blocks of 8, the first a prefix hit.
    p_blocks = [40, 41, 42, 43, 44, 45, 46, 47]
    spec = recv_spec(30, p_blocks, d_hit=[11], d_new=[7, 3, 9])
    assert spec.remote_first_block == 2  # K0 = 8 computed tokens // P's block size 4
    assert spec.remote_block_ids == ([42, 43, 44, 45, 46, 47],)
    assert spec.local_block_ids == ([7, 7, 3, 3, 9, 9],)  # D_block_table[(K0 + i) // 2]
    # No prefix hit: every P block, the same local id twice per logical block; a last logical
    # block only half covered by P's blocks gets one pair.
    spec = recv_spec(20, [40, 41, 42, 43, 44], d_hit=[], d_new=[1, 2, 3])
    assert spec.remote_first_block == 0
    assert spec.remote_block_ids == ([40, 41, 42, 43, 44],)
    assert spec.local_block_ids == ([1, 1, 2, 2, 3],)


def test_scheduler_at_dcp_1_pairs_blocks_one_to_one():
    layout = {
        k: v for k, v in D_LAYOUT.items() if k not in ("tp_size", "dcp_size", "num_local_kv_heads")
    }
    sched = d_scheduler(layout, logical_bs=BS)
    d = Request("d", list(range(100, 110)), SamplingParams(max_tokens=4), BS,
                kv_transfer_params=p_params(10, [5, 6, 7]))
    sched.validate_request(d)
    d.num_computed_tokens = BS
    sched.update_state_after_alloc(
        d, KVCacheBlocks(([KVCacheBlock(b, ref_cnt=1) for b in [8, 9]],)), 6
    )
    (spec,) = sched.build_connector_meta().reqs_to_recv
    assert (spec.remote_first_block, spec.remote_block_ids, spec.local_block_ids) == (
        1,
        ([6, 7],),
        ([8, 9],),
    )


@pytest.mark.parametrize(("layout", "over", "words"), [
    # D tp 2, dcp 2 on a 2-KV-head model: each rank stores 1 of P's 2 heads, and DCP.
    ({**D_LAYOUT, "num_kv_heads": 2, "num_local_kv_heads": 1}, {"num_kv_heads": 2},
     ["stores 1 of the producer's 2 KV heads", "decode_context_parallel_size=2", "issue 12"]),
    # D tp 2, dcp 1 on a 2-KV-head model with another block size: head slicing and re-blocking.
    ({**D_LAYOUT, "dcp_size": 1, "num_kv_heads": 2, "num_local_kv_heads": 1, "block_size": 2 * BS},
     {"num_kv_heads": 2}, ["stores 1 of the producer's 2 KV heads", f"block_size={2 * BS}",
                           f"block_size={BS}", "issue 12"]),
    # P with tp 2.
    (D_LAYOUT, {"tp_size": 2}, ["a prefill engine at tp_size=2", "P must run tp 1", "issue 12"]),
    # P with dcp 2.
    (D_LAYOUT, {"dcp_size": 2}, ["producer dcp_size=2, consumer dcp_size=2", "issue 12"]),
])
def test_layouts_that_need_resharding_are_refused_naming_the_values(layout, over, words):
    params = p_params(10, [5, 6, 7])
    for key in ("tp_size", "dcp_size"):
        if key in over:
            params[key] = over.pop(key)
    params["layout"].update(over)
    sched = d_scheduler(layout)
    with pytest.raises(ValueError) as e:
        sched.validate_request(d_request(10, params))
    for w in words:
        assert w in str(e.value)


def test_the_target_layout_is_accepted():
    d_scheduler().validate_request(d_request(10, p_params(10, [5, 6, 7])))


@pytest.mark.parametrize(("layout", "heads"), [
    ({**D_LAYOUT, "dcp_size": 1}, 1),  # D tp 2 on 1 KV head: replicated on both ranks
    ({**D_LAYOUT, "dcp_size": 1, "num_kv_heads": 2}, 2),  # D tp 2 on 2 KV heads: one each
    ({**D_LAYOUT, "tp_size": 4}, 1),  # vLLM-mode DCP 2 at tp 4: each DCP shard on 2 ranks
])
def test_re_sharding_layouts_are_accepted(layout, heads):
    params = p_params(10, [5, 6, 7])
    params["layout"]["num_kv_heads"] = heads
    d_scheduler(layout, logical_bs=BS * layout["dcp_size"]).validate_request(d_request(10, params))


# ------------------------------------------------------------------------- producer
@pytest.fixture()
def fast_registration(monkeypatch):
    monkeypatch.setattr(p2p_producer, "REGISTRATION_WAIT_S", 0.01)
    monkeypatch.setattr(p2p_producer, "CLAIM_REGISTRATION_WAIT_S", 0.01)


def test_a_grant_with_two_readers_ends_after_done_from_both():
    prod = Producer({})
    nonce, digest = prod.hold("r", [3, 4, 5, 6], list(range(16)))
    assert prod.claim("r", nonce, digest, readers=2, reader=0).ok
    assert prod.notify(request_id="r", kind="done", nbytes=10, nonce=nonce, reader=0, readers=2)
    assert prod.notify(
        request_id="r", kind="done", nbytes=10, nonce=nonce, reader=0, readers=2
    )  # repeated
    assert prod.pending()
    # The second reader can still claim and read its blocks.
    assert prod.claim("r", nonce, digest, readers=2, reader=1).ok
    assert prod.engine.authorizer(("r", nonce), "g0", [(4 * BLOCK_BYTES, BLOCK_BYTES)]) is None
    assert prod.notify(request_id="r", kind="done", nbytes=32, nonce=nonce, reader=1, readers=2)
    assert not prod.pending()
    assert prod.results.take_finished()[0] == {"r"}
    assert prod.results.take_stats()[0]["kv_bytes_sent"] == 42
    assert prod.engine.authorizer(("r", nonce), "g0", [(4 * BLOCK_BYTES, BLOCK_BYTES)]) is not None


def test_a_release_from_any_reader_ends_the_grant_at_once():
    prod = Producer({})
    nonce, digest = prod.hold("r", [3, 4], list(range(8)))
    assert prod.claim("r", nonce, digest, readers=2, reader=0).ok
    assert prod.notify(request_id="r", kind="release", nonce=nonce, reader=1, readers=2)
    assert not prod.pending() and prod.results.take_finished()[0] == {"r"}


def test_one_reader_by_default_as_before():
    prod = Producer({})
    nonce, digest = prod.hold("r", [3], list(range(4)))
    assert prod.claim("r", nonce, digest, readers=1, reader=0).ok
    assert prod.notify(request_id="r", kind="done", nbytes=5, nonce=nonce)
    assert not prod.pending()


def test_early_done_notices_count_per_reader(fast_registration):
    prod = Producer({})
    digest = prompt_digest(list(range(8)), None)
    # Reader 0's "done" for grant (a, n-a) arrives before P registered the grant: not enough.
    assert not prod.notify(request_id="a", kind="done", nonce="n-a", reader=0, readers=2)
    prod.side.hold([SendSpec("a", ([1, 2],), 30.0, "n-a", digest)])
    assert prod.pending()
    # Both readers early: the grant ends as soon as it is registered.
    assert not prod.notify(request_id="b", kind="done", nonce="n-b", reader=1, readers=2)
    assert not prod.notify(request_id="b", kind="done", nonce="n-b", reader=0, readers=2)
    prod.side.hold([SendSpec("b", ([3, 4],), 30.0, "n-b", digest)])
    assert prod.results.take_finished()[0] == {"b"}
    assert prod.side._held.keys() == {("a", "n-a")}
    # A release and a done, both early: the release ends the grant, the done finds nothing.
    assert not prod.notify(request_id="c", kind="release", nonce="n-c", reader=1, readers=2)
    assert not prod.notify(request_id="c", kind="done", nonce="n-c", reader=0, readers=2)
    prod.side.hold([SendSpec("c", ([5],), 30.0, "n-c", digest)])
    assert prod.results.take_finished()[0] == {"c"}


# ------------------------------------------------------------------------- consumer
def run_ranks(prod: Producer, peers: dict[str, FakeEngine], spec: RecvSpec, size: int = N
              ) -> list[tuple[ConsumerSide, torch.Tensor, WorkerResults]]:
    ranks = [consumer(prod, peers, r, size) for r in range(size)]
    try:
        for side, _, _ in ranks:
            side.submit([spec], [])
        for _, _, results in ranks:
            assert wait_loaded(results, spec.request_id) is None
    finally:
        for side, _, _ in ranks:
            side.shutdown()
    return ranks


def grant_spec(
    prod: Producer, n_tokens: int, p_blocks: list[int], d_hit: list[int], d_new: list[int]
) -> RecvSpec:
    """Hold `p_blocks` on P for the prompt and return D's RecvSpec for them (as the scheduler
    makes it)."""
    spec = recv_spec(n_tokens, p_blocks, d_hit, d_new)
    nonce, _ = prod.hold("p", p_blocks, list(range(100, 100 + n_tokens)))
    spec.remote = REMOTE
    spec.remote_nonce = nonce
    return spec


def test_each_rank_reads_only_the_blocks_of_its_shard_and_both_say_done():
    peers: dict[str, FakeEngine] = {}
    prod = Producer(peers)
    spec = grant_spec(prod, 30, [40, 41, 42, 43, 44, 45, 46, 47], d_hit=[11], d_new=[7, 3, 9])
    ranks = run_ranks(prod, peers, spec)
    (e0, e1) = (side.engine for side, _, _ in ranks)
    assert isinstance(e0, FakeEngine) and isinstance(e1, FakeEngine)
    read = [
        [(op.offset // BLOCK_BYTES, op.length // BLOCK_BYTES) for _, op in e.ops] for e in (e0, e1)
    ]
    assert read == [
        [(42, 1), (44, 1), (46, 1)],
        [(43, 1), (45, 1), (47, 1)],
    ]  # (K0 + i) % 2 == rank
    assert not prod.pending() and prod.results.take_stats()[0]["kv_bytes_sent"] == 6 * BLOCK_BYTES


def test_a_rank_with_no_block_to_read_still_claims_and_says_done():
    peers: dict[str, FakeEngine] = {}
    prod = Producer(peers)
    spec = grant_spec(prod, 3, [40], d_hit=[], d_new=[5])  # one P block: rank 1 reads nothing
    ranks = run_ranks(prod, peers, spec)
    assert [len(side.engine.ops) for side, _, _ in ranks] == [1, 0]  # type: ignore[attr-defined]
    assert not prod.pending() and prod.results.take_finished()[0] == {"p"}


def test_the_first_rank_done_does_not_end_the_grant_before_the_other_reads():
    peers: dict[str, FakeEngine] = {}
    prod = Producer(peers)
    # Rank 0 alone: the grant stays held (and readable) for rank 1.
    spec = grant_spec(prod, 16, [40, 41, 42, 43], d_hit=[], d_new=[5, 6])
    side, _, results = consumer(prod, peers, 0)
    side.submit([spec], [])
    assert wait_loaded(results, spec.request_id) is None
    side.shutdown()
    assert prod.pending()
    side1, _, results1 = consumer(prod, peers, 1)
    side1.submit([spec], [])
    assert wait_loaded(results1, spec.request_id) is None
    side1.shutdown()
    assert not prod.pending()


@pytest.mark.parametrize("p_prefix_hit", [False, True])
def test_kv_rebuilt_from_the_ranks_shards_equals_p_position_by_position(p_prefix_hit):
    peers: dict[str, FakeEngine] = {}
    prod = Producer(peers)
    n_tokens = 30
    # With P's prefix cache, its first blocks are older cached blocks, not freshly allocated ones.
    p_blocks = [17, 2, 9, 10, 11, 12, 13, 14] if p_prefix_hit else [10, 11, 12, 13, 14, 15, 16, 17]
    d_hit, d_new = [21], [4, 5, 8]  # D found the first logical block (8 tokens) in its own cache
    spec = grant_spec(prod, n_tokens, p_blocks, d_hit, d_new)
    ranks = run_ranks(prod, peers, spec)
    table = d_hit + d_new
    for pos in range(len(d_hit) * BS * N, n_tokens):
        rank_kv = ranks[(pos // BS) % N][1]
        got = rank_kv[table[pos // (BS * N)], :, :, pos % BS]
        assert torch.equal(got, prod.kv[p_blocks[pos // BS], :, :, pos % BS]), f"position {pos}"
    for _, kv, _ in ranks:  # D's own prefix block is never written
        assert not kv[d_hit[0]].any()


def test_only_dcp_rank_0_sends_the_schedulers_notices():
    peers: dict[str, FakeEngine] = {}
    prod = Producer(peers)
    sent: list[tuple[int, Any]] = []
    ranks = []
    for r in range(N):
        side, _, _ = consumer(prod, peers, r)
        side._control = lambda remote, msg, reply_type, deadline, r=r: (
            sent.append((r, msg)) or prod.side._handle(msg)
        )  # type: ignore[method-assign]
        ranks.append(side)
    nonce, _ = prod.hold("x", [1, 2], list(range(8)))
    try:
        for side in ranks:  # every rank gets the same metadata
            side.submit([], [NotifySpec(REMOTE, "x", "release", nonce)])
        deadline = time.monotonic() + 10
        while prod.pending():
            assert time.monotonic() < deadline, "the release was not delivered"
            time.sleep(0.005)
    finally:
        for side in ranks:
            side.shutdown()
    assert [(r, m.kind) for r, m in sent] == [(0, "release")]
