"""A real engine (tiny-llama-kv2) with --kv-events-config publishing on free loopback ports: a
SUB socket sees BlockStored for a prompt's full blocks with the prefix cache's hashes and
sequence numbers that grow by one; a subscriber that joins late replays what it missed; a
malformed replay request is dropped and counted while the engine keeps serving; /metrics shows
the counters. Every wait has a deadline."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from pdkv.block_hashing import hash_request_tokens
from pdkv.engine.arg_utils import EngineArgs
from pdkv.engine.llm_engine import LLMEngine
from pdkv.kv_events.publisher import END_SEQ, ZmqEventPublisher
from pdkv.kv_events.schema import BlockStored, KVEventBatch, decode_batch, parse_topic_frame
from pdkv.sampling_params import SamplingParams
from pdkv.serve.metrics import ServerMetrics

DEADLINE_S = 20.0
TOPIC = "kv-events"
BLOCK = 16
_prompts = itertools.count(1)

Message = tuple[bytes, int, bytes]  # topic frame, sequence number, payload


@pytest.fixture(scope="module")
def engine(tiny_llama_kv2) -> Iterator[LLMEngine]:
    cfg = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
           "replay_endpoint": "tcp://127.0.0.1:0", "topic": TOPIC}
    eng = LLMEngine.from_engine_args(EngineArgs(
        model=tiny_llama_kv2, num_kv_blocks=64, max_model_len=256, block_size=BLOCK,
        kv_events_config=json.dumps(cfg)))
    yield eng
    eng.shutdown()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def publisher(engine: LLMEngine) -> ZmqEventPublisher:
    pub = engine.kv_event_publisher
    assert isinstance(pub, ZmqEventPublisher)
    return pub


def run(engine: LLMEngine, prompt: list[int]) -> None:
    req, _ = engine.make_request(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    engine.add_request(req)
    end = time.monotonic() + DEADLINE_S
    while engine.has_unfinished_requests():
        assert time.monotonic() < end, "request did not finish"
        engine.step()


def fresh_prompt(n_tokens: int = 2 * BLOCK + 5) -> list[int]:
    """A prompt no earlier test used (so its blocks are stored now, not hit)."""
    k = next(_prompts)
    return [(k * 1000 + i) % 40000 + 1 for i in range(n_tokens)]


def subscribe(ctx: zmq.Context, engine: LLMEngine) -> zmq.Socket:
    """A SUB socket whose subscription is live: prompts run until one message arrives (ZMQ's
    slow joiner), then what is in flight is drained."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(publisher(engine).endpoint)
    end = time.monotonic() + DEADLINE_S
    while not sub.poll(0):
        assert time.monotonic() < end, "subscription never went live"
        run(engine, fresh_prompt())
        sub.poll(100)
    while sub.poll(200):
        sub.recv_multipart()
    return sub


def receive(sub: zmq.Socket, until_seq: int) -> list[Message]:
    out: list[Message] = []
    end = time.monotonic() + DEADLINE_S
    while not out or out[-1][1] < until_seq:
        assert time.monotonic() < end, f"no message up to seq {until_seq}: {out}"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            out.append((topic, int.from_bytes(seq, "big"), payload))
    return out


def receive_stored(sub: zmq.Socket, hashes: list[int]) -> list[Message]:
    """Messages up to and including the batch that stores `hashes` (the publisher's thread
    sends asynchronously, so a counter read after a step may be behind: wait for content)."""
    out: list[Message] = []
    end = time.monotonic() + DEADLINE_S
    while not out or [e.block_hashes for e in stored_events([decode_batch(out[-1][2])])] != [
            hashes]:
        assert time.monotonic() < end, f"no batch stored {hashes}: {[m[1] for m in out]}"
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            out.append((topic, int.from_bytes(seq, "big"), payload))
    return out


def replay(ctx: zmq.Context, engine: LLMEngine, start: int) -> list[tuple[int, bytes]]:
    """(seq, payload) of every buffered batch from `start` on, through a DEALER (it reads the
    whole streamed answer; a REQ socket takes one message per request) up to the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(publisher(engine).replay_endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])  # what a REQ socket would send
    out: list[tuple[int, bytes]] = []
    end = time.monotonic() + DEADLINE_S
    while True:
        assert time.monotonic() < end, f"replay from {start} did not end: {[s for s, _ in out]}"
        if not dealer.poll(100):
            continue
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == END_SEQ:
            assert payload == b""
            dealer.close()
            return out
        out.append((int.from_bytes(seq, "big"), payload))


def stored_events(batches: list[KVEventBatch]) -> list[BlockStored]:
    return [e for b in batches for e in b.events if isinstance(e, BlockStored)]


def test_block_stored_with_prefix_cache_hashes(engine: LLMEngine, ctx: zmq.Context) -> None:
    sub = subscribe(ctx, engine)
    prompt = fresh_prompt()
    run(engine, prompt)
    hashes = hash_request_tokens(prompt, BLOCK)
    assert len(hashes) == 2
    msgs = receive_stored(sub, hashes)
    first = msgs[0][1]
    assert [seq for _, seq, _ in msgs] == list(range(first, first + len(msgs)))  # no gap
    msgs = msgs[-1:]  # the prompt's batch (earlier ones may be in flight from before)
    pub = publisher(engine)
    assert parse_topic_frame(msgs[0][0]) == (TOPIC, pub.engine_id, pub.epoch)
    # The default encoding, vLLM v0.26+'s: a positional batch of events that are maps.
    assert pub.config.event_encoding == "map"
    plain = [msgspec.msgpack.decode(p) for _, _, p in msgs]
    assert all(isinstance(b, list) and len(b) == 3 for b in plain)
    stored_maps = [e for b in plain for e in b[1] if e["type"] == "BlockStored"]
    assert [list(e) for e in stored_maps] == [
        ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
         "medium", "lora_name"]]
    assert stored_maps[0]["block_hashes"] == hashes
    batches = [decode_batch(p) for _, _, p in msgs]
    assert all(b.data_parallel_rank == 0 for b in batches)
    stored = stored_events(batches)
    assert [e.block_hashes for e in stored] == [hashes]
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == prompt[:2 * BLOCK]
    assert (stored[0].block_size, stored[0].medium) == (BLOCK, "GPU")
    pool = engine.scheduler.kv_cache_manager.block_pools[0]
    assert all(pool.get_cached_block(h) is not None for h in hashes)  # the prefix cache's own


def test_late_subscriber_replays_the_gap(engine: LLMEngine, ctx: zmq.Context) -> None:
    early = subscribe(ctx, engine)
    for _ in range(3):
        run(engine, fresh_prompt())
    late = subscribe(ctx, engine)  # joins after those batches: a forced gap
    run(engine, fresh_prompt())
    newest = publisher(engine).counters().batches_published - 1
    first_seen = receive(late, newest)[0][1]
    assert first_seen > 0
    seen_early = {seq: payload for _, seq, payload in receive(early, newest)}
    replayed = replay(ctx, engine, 0)
    seqs = [s for s, _ in replayed]
    # buffer_steps (10 000) keeps them all, from 0 with no gap; the publisher thread may have
    # sent a batch more since `newest` was read.
    assert seqs == list(range(len(seqs))) and len(seqs) >= newest + 1
    for seq, payload in replayed:
        decode_batch(payload)
        if seq in seen_early:
            assert payload == seen_early[seq]  # the very bytes that were published
    assert publisher(engine).counters().replay_requests >= 1


def test_malformed_replay_is_dropped_and_counted(engine: LLMEngine, ctx: zmq.Context) -> None:
    pub = publisher(engine)
    before = pub.counters().replay_malformed
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    dealer.send(b"not a replay request")  # no empty delimiter frame
    dealer.send_multipart([b"", b"\x00\x01\x02"])  # start seq of 3 bytes
    dealer.send_multipart([b"", (0).to_bytes(8, "big"), b"extra"])  # one frame too many
    end = time.monotonic() + DEADLINE_S
    while pub.counters().replay_malformed < before + 3:
        assert time.monotonic() < end, f"malformed requests not counted: {pub.counters()}"
        run(engine, fresh_prompt())  # the engine keeps serving meanwhile
    assert not dealer.poll(200)  # nothing answered to a malformed request
    # The publisher and the engine still work: a new prompt is published and replayable.
    sub = subscribe(ctx, engine)
    prompt = fresh_prompt()
    run(engine, prompt)
    newest, payload = receive_stored(sub, hash_request_tokens(prompt, BLOCK))[-1][1:]
    assert replay(ctx, engine, newest)[0] == (newest, payload)
    metrics = ServerMetrics("tiny")
    metrics.kv_events.watch(pub.counters)
    text = metrics.render().decode()
    counters = pub.counters()
    assert (f'pdkv:kv_events_batches_published_total{{engine="0",model_name="tiny"}} '
            f"{float(counters.batches_published)}") in text
    assert (f'pdkv:kv_events_replay_malformed_total{{engine="0",model_name="tiny"}} '
            f"{float(counters.replay_malformed)}") in text
    assert "pdkv:kv_events_batches_dropped_total" in text
    assert 'pdkv:kv_events_events_dropped_total{engine="0",model_name="tiny"} 0.0' in text
