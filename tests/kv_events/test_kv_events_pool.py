"""KV events of the KV pool's tiers in a real engine (tiny-llama-kv2, blocks of 16, pool chunks of
32 tokens): a served prompt's chunks are published as BlockStored with the tier as the medium
("DRAM", "DISK"), the chunk size as the block size and the pool's chunk hashes (the hash of each
chunk's last block), which are the hashes a router computes from the token ids
(`pdkv.router.prefix_keys.request_chunk_hashes`); fed into `KVIndex` they give an overlap
covering the prompt's full chunks. A DRAM tier too small for the prompt publishes BlockRemoved
for what it evicts. The batches are read back through the publisher's replay socket (every
batch since seq 0, no slow joiner); every wait has a deadline."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from pdkv.block_hashing import hash_request_tokens
from pdkv.engine.arg_utils import EngineArgs
from pdkv.engine.llm_engine import LLMEngine
from pdkv.kv_events.publisher import END_SEQ, ZmqEventPublisher
from pdkv.kv_events.schema import MEDIUM_GPU, BlockRemoved, BlockStored, Event, decode_batch
from pdkv.kvpool.store import KVPoolStore
from pdkv.router.kv_index import KVIndex
from pdkv.router.prefix_keys import Granularity, request_chunk_hashes
from pdkv.sampling_params import SamplingParams

DEADLINE_S = 30.0
BLOCK = 16
CHUNK = 32
GRAN = Granularity(BLOCK, CHUNK)


def make_engine(model: str, tiers: list[dict[str, Any]], multi: bool = False,
                events: bool = True) -> LLMEngine:
    pool = {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_size": CHUNK, "tiers": tiers}}
    kvt = ({"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [pool]}} if multi else pool)
    cfg = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
           "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv-events"}
    return LLMEngine.from_engine_args(EngineArgs(
        model=model, num_kv_blocks=64, max_model_len=256, block_size=BLOCK,
        kv_transfer_config=json.dumps(kvt),
        kv_events_config=json.dumps(cfg) if events else None))


def store_of(engine: LLMEngine) -> KVPoolStore:
    startup = engine.executor.connector_startup
    assert startup.pool_store is not None
    return startup.pool_store


def prompt(seed: int, n: int = 3 * CHUNK + 5) -> list[int]:
    return [(seed * 1000 + i) % 40000 + 1 for i in range(n)]


def serve(engine: LLMEngine, token_ids: list[int]) -> None:
    """Serve one prompt, let the pool write it, and run one more (empty) step: the step an idle
    engine loop runs when a pool tier's event wakes it, which publishes that event."""
    req, _ = engine.make_request(token_ids, SamplingParams(max_tokens=2, temperature=0.0))
    engine.add_request(req)
    end = time.monotonic() + DEADLINE_S
    while engine.has_unfinished_requests():
        assert time.monotonic() < end, "request did not finish"
        engine.step()
    assert store_of(engine).flush(DEADLINE_S)
    engine.step()


def replay_all(engine: LLMEngine) -> list[Event]:
    """Every event of every batch the engine published so far (seq 0 on), in order."""
    pub = engine.kv_event_publisher
    assert isinstance(pub, ZmqEventPublisher)
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        events: list[Event] = []
        seqs: list[int] = []
        end = time.monotonic() + DEADLINE_S
        while True:
            assert time.monotonic() < end, "replay did not end"
            if not dealer.poll(100):
                continue
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            seqs.append(int.from_bytes(seq, "big"))
            events += decode_batch(payload).events
        assert seqs == list(range(len(seqs)))  # one sequence number per batch, no gap
        return events
    finally:
        ctx.destroy(linger=0)


def pool_events(engine: LLMEngine, until: Any) -> list[Event]:
    """The published events of the pool's media, once `until(events)` holds (the publisher
    thread sends asynchronously: wait for the content, within the deadline)."""
    end = time.monotonic() + DEADLINE_S
    while True:
        events = [e for e in replay_all(engine)
                  if isinstance(e, (BlockStored, BlockRemoved)) and e.medium != MEDIUM_GPU]
        if until(events):
            return events
        assert time.monotonic() < end, f"pool events never matched: {events}"
        time.sleep(0.05)


def stored_hashes(events: list[Event], medium: str) -> list[bytes]:
    return [x for e in events if isinstance(e, BlockStored) and e.medium == medium
            for x in e.block_hashes]


@pytest.fixture(scope="module")
def dram_engine(tiny_llama_kv2) -> Iterator[LLMEngine]:
    eng = make_engine(tiny_llama_kv2, [{"name": "dram", "capacity_bytes": 1 << 26}])
    yield eng
    eng.shutdown()


def check_stored(engine: LLMEngine, token_ids: list[int], medium: str) -> None:
    chunks = request_chunk_hashes(token_ids, GRAN)
    assert len(chunks) == 3
    events = pool_events(engine, lambda ev: stored_hashes(ev, medium)[-3:] == chunks)
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == medium]
    assert {e.block_size for e in stored} == {CHUNK}
    # Parent chain and tokens as the prefix cache reports them, at the chunk granularity.
    mine = [e for e in stored if set(e.block_hashes) <= set(chunks)]
    assert mine[0].parent_block_hash is None
    assert [t for e in mine for t in e.token_ids] == token_ids[:3 * CHUNK]
    for e in mine[1:]:
        assert e.parent_block_hash == chunks[chunks.index(e.block_hashes[0]) - 1]
    # A router's index fed with these events sees the prompt's full chunks in that medium.
    index = KVIndex()
    for e in events:
        index.apply("engine", e)
    blocks = hash_request_tokens(token_ids, BLOCK)
    overlap = index.overlap("engine", blocks, BLOCK)
    assert overlap.blocks == 3 * CHUNK // BLOCK and overlap.engine_blocks == 0
    assert overlap.weighted_blocks == pytest.approx(
        overlap.blocks * index.config.weight(medium))
    # A prompt sharing only the first chunk overlaps by that chunk.
    other = token_ids[:CHUNK] + prompt(999)[: 2 * CHUNK]
    assert index.overlap("engine", hash_request_tokens(other, BLOCK), BLOCK).blocks == 2


def test_a_dram_tier_publishes_the_prompts_chunks(dram_engine: LLMEngine) -> None:
    token_ids = prompt(1)
    serve(dram_engine, token_ids)
    check_stored(dram_engine, token_ids, "DRAM")


def test_a_pool_event_wakes_an_idle_engine_loop(dram_engine: LLMEngine) -> None:
    """A chunk written after the engine's last step (the save thread runs behind the engine)
    wakes the loop, whose next (empty) step publishes it."""
    woken = threading.Event()
    dram_engine.set_wakeup(woken.set)
    serve(dram_engine, prompt(7))  # drained: nothing queued now
    woken.clear()
    store = store_of(dram_engine)
    assert store.tier_events is not None
    late = hashlib.sha256(b"late chunk").digest()
    assert store.save(f"pdkv:{dram_engine.connector.namespace.fingerprint}:{late.hex()}",  # type: ignore[union-attr]
                      b"value")
    assert woken.wait(DEADLINE_S), "the engine loop was not woken"
    dram_engine.step()
    pool_events(dram_engine, lambda ev: stored_hashes(ev, "DRAM")[-1:] == [late])


def test_events_dropped_by_a_full_pool_queue_are_counted_by_the_publisher(
        dram_engine: LLMEngine) -> None:
    queue, pub = dram_engine.pool_events, dram_engine.kv_event_publisher
    assert queue is not None and pub is not None
    before = pub.counters().events_dropped
    limit = queue.max_events
    queue.max_events = 1  # the bound a stalled engine loop would hit
    try:
        queue.put([BlockRemoved(block_hashes=[bytes(32)], medium="DRAM")] * 3)
    finally:
        queue.max_events = limit
    dram_engine.step()
    assert pub.counters().events_dropped == before + 2
    assert queue.take_dropped() == 0


def test_a_disk_tier_publishes_the_prompts_chunks(tiny_llama_kv2, tmp_path) -> None:
    eng = make_engine(tiny_llama_kv2, [{"name": "disk", "path": str(tmp_path),
                                       "capacity_bytes": 1 << 26, "fsync": False}])
    try:
        token_ids = prompt(2)
        serve(eng, token_ids)
        check_stored(eng, token_ids, "DISK")
        assert stored_hashes(pool_events(eng, lambda ev: True), "DRAM") == []
    finally:
        eng.shutdown()


def test_a_pool_under_a_multiconnector_publishes_too(tiny_llama_kv2) -> None:
    eng = make_engine(tiny_llama_kv2, [{"name": "dram", "capacity_bytes": 1 << 26}], multi=True)
    try:
        token_ids = prompt(3)
        serve(eng, token_ids)
        check_stored(eng, token_ids, "DRAM")
    finally:
        eng.shutdown()


def test_a_dram_tier_that_evicts_publishes_block_removed(tiny_llama_kv2, dram_engine) -> None:
    # One chunk's value size, as the DRAM engine wrote it (same model, block and chunk size).
    serve(dram_engine, prompt(4))
    stats = store_of(dram_engine).stats()
    value_bytes = stats["pool:dram:bytes_written"] / stats["pool:dram:chunks_written"]
    eng = make_engine(tiny_llama_kv2, [{"name": "dram", "capacity_bytes":
                                        int(1.5 * value_bytes)}])  # room for one chunk
    try:
        token_ids = prompt(5)
        c0, c1, c2 = request_chunk_hashes(token_ids, GRAN)
        serve(eng, token_ids)
        events = pool_events(eng, lambda ev: stored_hashes(ev, "DRAM")[-1:] == [c2])
        facts = [(type(e).__name__, x) for e in events for x in e.block_hashes]  # type: ignore[union-attr]
        assert facts == [("BlockStored", c0), ("BlockRemoved", c0), ("BlockStored", c1),
                         ("BlockRemoved", c1), ("BlockStored", c2)]
        assert {e.medium for e in events} == {"DRAM"}
        index = KVIndex()
        for e in events:
            index.apply("engine", e)
        assert index.num_blocks("engine") == {"DRAM": 1}
        assert index.overlap("engine", hash_request_tokens(token_ids, BLOCK), BLOCK).blocks == 0
    finally:
        eng.shutdown()


def test_without_kv_events_the_tiers_report_nowhere(tiny_llama_kv2) -> None:
    eng = make_engine(tiny_llama_kv2, [{"name": "dram", "capacity_bytes": 1 << 26}], events=False)
    try:
        serve(eng, prompt(6))
        store = store_of(eng)
        assert eng.pool_events is None and store.tier_events is None
        assert all(t.events is None for t in store.tiers)
        assert store.stats()["pool:dram:chunks_written"] == 3
    finally:
        eng.shutdown()
