"""A producer at tp > 1 in the P2P connector, with in-process fakes (no sockets, no model): each
P rank is its own ProducerSide (its KV heads of the same block ids, its own control server and
grant); D's scheduler half turns P's kv_transfer_params ("endpoints", one per P rank) into a
RecvSpec naming every P rank, and each D rank claims, reads and says "done" only to the P ranks
it reads heads from (plan_producer_readers). Bytes moved = what D stores; every P rank's grant
ends after its own readers; notices reach every P rank.

Issue 12 (P tp 2 → D tp 1 and P tp 2 → D tp 2), torch-free planning included."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
import torch
from fake_transfer import FakeEngine, cfg, wait_loaded

from pdkv.cache.block_pool import KVCacheBlock
from pdkv.cache.kv_cache_manager import KVCacheBlocks
from pdkv.cache.kv_layout import KVLayout
from pdkv.kv_transfer.connector.p2p_consumer import ConsumerSide
from pdkv.kv_transfer.connector.p2p_messages import Claim, Notify, SendSpec, prompt_digest
from pdkv.kv_transfer.connector.p2p_producer import ProducerSide
from pdkv.kv_transfer.connector.p2p_results import WorkerResults
from pdkv.kv_transfer.connector.p2p_scheduler import P2PConnectorScheduler
from pdkv.kv_transfer.engine.base import Grant, ReadOp
from pdkv.kv_transfer.reshard import plan_head_reads, plan_producer_readers
from pdkv.parallel.layout import ParallelLayout
from pdkv.request import Request, RequestStatus
from pdkv.sampling_params import SamplingParams

BS, LAYERS, HEAD, NBLOCKS = 4, 2, 8, 24
ENDPOINTS = [["127.0.0.1", 1001], ["127.0.0.1", 1002]]  # P rank r's control port: 1001 + r


# ---------------------------------------------------------------------------- planning
@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_each_producer_rank_has_the_readers_that_read_from_it(heads):
    """Every (P tp, D tp) up to 8 the heads allow: D rank d contacts P rank p iff it reads a head
    from p, except that a P rank nobody reads from gets D rank 0 (which reads nothing there)."""
    for p_tp in (1, 2, 4, 8):
        for d_tp in (1, 2, 4, 8):
            if heads % p_tp and p_tp % heads or heads % d_tp and d_tp % heads:
                continue
            plan = plan_head_reads(p_tp, d_tp, heads)
            readers = plan_producer_readers(p_tp, d_tp, heads)
            assert sorted(readers) == list(range(p_tp))
            for p, ds in readers.items():
                reading = [d for d in range(d_tp) if any(r.p_rank == p for r in plan[d])]
                assert ds == (reading or [0]), (p_tp, d_tp, heads, p)


def test_producer_readers_examples():
    assert plan_producer_readers(2, 1, 2) == {0: [0], 1: [0]}  # D tp 1 reads one head from each
    assert plan_producer_readers(2, 2, 2) == {0: [0], 1: [1]}  # each D rank its P rank
    assert plan_producer_readers(2, 1, 1) == {0: [0], 1: [0]}  # P rank 1 replicates: nothing read
    assert plan_head_reads(2, 1, 1)[0] == [(0, 0, 0, 1)]
    assert plan_producer_readers(2, 4, 2) == {0: [0, 1], 1: [2, 3]}  # D ranks 0, 1 hold head 0
    with pytest.raises(ValueError, match="producer"):
        plan_producer_readers(3, 1, 2)


# -------------------------------------------------------------------------------- fakes
class RankEngine(FakeEngine):
    """A producer rank's engine: its peer_info names the rank."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def peer_info(self) -> dict[str, Any]:
        return {"p_rank": self.rank}


class ReadFromRanks(FakeEngine):
    """A consumer rank's engine: a read goes to the producer rank its peer_info names; `by_rank`
    records the bytes read from each."""

    def __init__(self, sources: list[RankEngine]) -> None:
        super().__init__()
        self.sources = sources
        self.by_rank: dict[int, int] = {}

    def read(
        self, peer: dict[str, Any], ops: list[ReadOp], deadline: float, grant: Grant | None = None
    ) -> int:
        self.source = self.sources[peer["p_rank"]]
        n = super().read(peer, ops, deadline, grant)
        self.by_rank[peer["p_rank"]] = self.by_rank.get(peer["p_rank"], 0) + n
        return n


def layout(heads: int, tp: int) -> dict[str, Any]:
    lay = {
        "model_digest": "m",
        "dtype": "float32",
        "block_size": BS,
        "num_layers": LAYERS,
        "num_kv_heads": heads,
        "head_size": HEAD,
        "kv_layout": "cross_layer",
    }
    if tp > 1:
        lay.update(tp_size=tp, dcp_size=1, interleave=1, dcp_replicated=False,
                   num_local_kv_heads=ParallelLayout(tp_size=tp).kv_heads_per_rank(heads))
    return lay


def bb(heads: int) -> int:
    return LAYERS * 2 * BS * heads * HEAD * 4


def view(kv: torch.Tensor) -> memoryview:
    return memoryview(kv.view(-1).view(torch.uint8).numpy())


class Run:
    """P at tp 2 holds a prompt's `p_blocks` on both ranks (global KV `kv`, each rank its heads);
    D at `d_tp` pulls them into `d_blocks`. `drop_done_to`: a P rank the consumers never tell
    "done" (break check: its grant must stay held)."""

    def __init__(
        self,
        heads: int,
        d_tp: int,
        p_blocks: list[int],
        d_blocks: list[int],
        p_tp: int = 2,
        drop_done_to: int | None = None,
    ) -> None:
        p_lay, d_lay = layout(heads, p_tp), layout(heads, d_tp)
        p_par, d_par = ParallelLayout(tp_size=p_tp), ParallelLayout(tp_size=d_tp)
        self.kv = torch.randn(NBLOCKS, LAYERS, 2, BS, heads, HEAD)
        tokens = list(range(100, 100 + 4 * len(p_blocks) - 1))
        nonce, digest = secrets.token_hex(8), prompt_digest(tokens, None)
        p_local = p_par.kv_heads_per_rank(heads)
        self.engines, self.producers, self.p_results = [], [], []
        for r in range(p_tp):
            start = p_par.kv_head_start(r, heads)
            eng, res = RankEngine(r), WorkerResults(lambda: None)
            prod = ProducerSide(cfg("kv_producer", "P"), KVLayout.from_wire(p_lay), eng, res,
                                [bb(p_local)])
            eng.register_region(
                "g0", view(self.kv[:, :, :, :, start : start + p_local].contiguous())
            )
            prod.hold([SendSpec("p", (p_blocks,), 30.0, nonce, digest)])
            self.engines.append(eng)
            self.producers.append(prod)
            self.p_results.append(res)
        # P's scheduler half (endpoints from the executor) → params → D's scheduler half.
        p_sched = P2PConnectorScheduler(cfg("kv_producer", "P"), KVLayout.from_wire(p_lay), BS,
                                        list(ENDPOINTS[0]),
                                        control_endpoints=[list(e) for e in ENDPOINTS[:p_tp]])
        req = Request(
            "p",
            tokens,
            SamplingParams(max_tokens=1),
            BS,
            kv_transfer_params={"do_remote_decode": True},
        )
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = p_sched.request_finished(req, (p_blocks,))
        assert (
            params is not None
            and params["tp_size"] == p_tp
            and params["endpoints"] == ENDPOINTS[:p_tp]
        )
        params["remote_nonce"] = nonce
        d_sched = P2PConnectorScheduler(cfg("kv_consumer", "D"), KVLayout.from_wire(d_lay), BS,
                                        ["127.0.0.1", 0])
        d = Request("d", tokens, SamplingParams(max_tokens=4), BS, kv_transfer_params=params)
        d_sched.validate_request(d)
        d_sched.update_state_after_alloc(
            d, KVCacheBlocks(([KVCacheBlock(b, ref_cnt=1) for b in d_blocks],)), len(tokens)
        )
        (spec,) = d_sched.build_connector_meta().reqs_to_recv
        assert [r.port for r in spec.remote_ranks] == [1001 + r for r in range(p_tp)]
        d_local = d_par.kv_heads_per_rank(heads)
        self.d_kvs, self.d_engines, self.contacts = (
            [],
            [],
            [],
        )  # contacts: per D rank, (P rank, message kind)
        self.received: list[int] = []
        sides, results = [], []
        for rank in range(d_tp):
            kv = torch.zeros(NBLOCKS, LAYERS, 2, BS, d_local, HEAD)
            res, eng = WorkerResults(lambda: None), ReadFromRanks(self.engines)
            side = ConsumerSide(cfg("kv_consumer", "D"), KVLayout.from_wire(d_lay), eng, res,
                                [view(kv)], [bb(d_local)],
                                rank=rank, world_size=d_tp)
            seen: list[tuple[int, str]] = []

            def control(
                remote: Any, msg: Any, reply_type: Any, deadline: float, seen: list = seen
            ) -> Any:
                p = remote.port - 1001
                kind = (
                    "claim"
                    if isinstance(msg, Claim)
                    else msg.kind
                    if isinstance(msg, Notify)
                    else "handshake"
                )
                seen.append((p, kind))
                if kind == "done" and p == drop_done_to:
                    from pdkv.kv_transfer.connector.p2p_messages import Ack
                    return Ack(True)
                return self.producers[p]._handle(msg)

            side._control = control  # type: ignore[method-assign]
            self.d_kvs.append(kv)
            self.d_engines.append(eng)
            self.contacts.append(seen)
            sides.append(side)
            results.append(res)
        try:
            for side in sides:
                side.submit([spec], [])
            for res in results:
                wait_loaded(res, "d")
                self.received.append(int(res.take_request_bytes()["d"]["p2p"]))
        finally:
            for side in sides:
                side.shutdown()


@pytest.mark.parametrize("d_tp", [1, 2])
def test_d_pulls_each_head_once_from_a_p_rank_holding_it(d_tp):
    p_blocks, d_blocks = [9, 3, 14], [5, 6, 2]
    run = Run(2, d_tp, p_blocks, d_blocks)
    lay = ParallelLayout(tp_size=d_tp)
    for rank, kv in enumerate(run.d_kvs):
        start, n = lay.kv_head_start(rank, 2), lay.kv_heads_per_rank(2)
        for pb, db in zip(p_blocks, d_blocks):
            assert torch.equal(kv[db], run.kv[pb, :, :, :, start : start + n]), (rank, db)
        assert not kv[0].any()  # nothing outside the request's blocks written
    # Bytes moved = what D stores: every head of every block once.
    assert sum(run.received) == len(p_blocks) * bb(2)
    if d_tp == 2:  # each D rank reads (and talks) only to the P rank holding its head
        assert [e.by_rank for e in run.d_engines] == [
            {0: len(p_blocks) * bb(1)},
            {1: len(p_blocks) * bb(1)},
        ]
        assert [{p for p, _ in seen} for seen in run.contacts] == [{0}, {1}]
    else:  # D tp 1 reads head 0 from P rank 0, head 1 from P rank 1
        assert run.d_engines[0].by_rank == {0: len(p_blocks) * bb(1), 1: len(p_blocks) * bb(1)}
    for prod, res in zip(run.producers, run.p_results):
        assert not prod.has_pending()  # every P rank's grant ended: its blocks may be freed
        assert res.take_stats()[0]["kv_bytes_sent"] == len(p_blocks) * bb(1)


def test_a_replicated_head_is_read_once_and_the_other_p_rank_is_still_released():
    """tiny-llama-kv1's case: P tp 2 replicates the one KV head; D tp 1 reads it from P rank 0
    only, claims P rank 1's grant and says "done" there with nothing read."""
    run = Run(1, 1, [4, 5], [7, 8])
    assert torch.equal(run.d_kvs[0][[7, 8]], run.kv[[4, 5]])
    assert run.received == [2 * bb(1)] and run.d_engines[0].by_rank == {0: 2 * bb(1)}
    assert ("claim" in [k for p, k in run.contacts[0] if p == 1]) and (1, "done") in run.contacts[0]
    assert not any(prod.has_pending() for prod in run.producers)


def test_a_p_rank_without_its_done_notice_keeps_its_blocks():
    run = Run(2, 2, [1, 2], [3, 4], drop_done_to=1)
    assert [prod.has_pending() for prod in run.producers] == [False, True]


def test_schedulers_notices_reach_every_p_rank():
    d_sched = P2PConnectorScheduler(cfg("kv_consumer", "D"), KVLayout.from_wire(layout(2, 1)), BS,
                                    ["127.0.0.1", 0])
    tokens = list(range(10))
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "r",
              "remote_block_ids": [[1, 2, 3]], "remote_host": "127.0.0.1", "remote_port": 1001,
              "remote_nonce": "n", "prompt_digest": prompt_digest(tokens, None), "tp_size": 2,
              "endpoints": ENDPOINTS, "num_tokens": len(tokens), "layout": layout(2, 2)}
    d = Request("d", tokens, SamplingParams(max_tokens=4), BS, kv_transfer_params=params)
    d_sched.validate_request(d)
    d_sched.on_new_request(d)
    d_sched.request_finished(d, ([],))  # aborted before pulling: release the grant on every rank
    notes = d_sched.build_connector_meta().notifications
    assert [(n.kind, n.remote.port) for n in notes] == [("release", 1001), ("release", 1002)]


def test_a_p_at_tp_2_into_dcp_is_refused_naming_both():
    d_lay = {**layout(2, 2), "dcp_size": 2, "num_local_kv_heads": 1}
    d_sched = P2PConnectorScheduler(cfg("kv_consumer", "D"), KVLayout.from_wire(d_lay), 2 * BS,
                                    ["127.0.0.1", 0])
    tokens = list(range(10))
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "r",
              "remote_block_ids": [[1, 2, 3]], "remote_host": "127.0.0.1", "remote_port": 1001,
              "remote_nonce": "n", "prompt_digest": prompt_digest(tokens, None), "tp_size": 2,
              "endpoints": ENDPOINTS, "num_tokens": len(tokens), "layout": layout(2, 2)}
    with pytest.raises(ValueError) as e:
        d_sched.validate_request(
            Request("d", tokens, SamplingParams(max_tokens=4), BS, kv_transfer_params=params)
        )
    assert "a prefill engine at tp_size=2 into a DCP decode engine" in str(e.value)
    assert "decode_context_parallel_size=2" in str(e.value)
