"""The ZMQ publisher alone (pdkv/kv_events/publisher.py): a full queue drops and counts, never
blocks the engine; a busy endpoint is a start-up error naming the field; shutdown sends what
was queued and ends within its deadline; the configured event_encoding is what goes out, live
and replayed."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from pdkv.kv_events.config import KVEventsConfig
from pdkv.kv_events.publisher import END_SEQ, ZmqEventPublisher
from pdkv.kv_events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    EventEncoding,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

DEADLINE_S = 10.0


def config(**kw: object) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0", **kw)


def batch() -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[AllBlocksCleared()])


def wait_until(cond, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_full_queue_drops_and_counts() -> None:
    pub = ZmqEventPublisher(config(max_queue_size=1), "e1")
    release = threading.Event()
    sent: list[KVEventBatch] = []
    send = pub._send

    def slow_send(b: KVEventBatch) -> None:  # the thread is stuck sending the first batch
        release.wait(DEADLINE_S)
        sent.append(b)
        send(b)

    pub._send = slow_send  # type: ignore[method-assign]
    try:
        pub.publish(batch())
        wait_until(lambda: pub._queue.empty(), "the thread to take the first batch")
        t0 = time.monotonic()
        pub.publish(batch())  # fills the queue
        pub.publish(batch())  # no room: dropped at once
        assert time.monotonic() - t0 < 1.0
        assert pub.counters().batches_dropped == 1
        release.set()
        wait_until(lambda: pub.counters().batches_published == 2, "two batches sent")
        assert len(sent) == 2
    finally:
        release.set()
        pub.shutdown()


def test_busy_endpoint_names_the_field() -> None:
    first = ZmqEventPublisher(config(replay_endpoint="tcp://127.0.0.1:0"), "e1")
    try:
        with pytest.raises(ValueError, match="endpoint"):
            ZmqEventPublisher(
                KVEventsConfig(enable_kv_cache_events=True, endpoint=first.endpoint), "e2")
        with pytest.raises(ValueError, match="replay_endpoint"):
            ZmqEventPublisher(config(replay_endpoint=first.replay_endpoint), "e3")
        with pytest.raises(ValueError, match="engine id"):
            ZmqEventPublisher(config(), "a|b")
    finally:
        first.shutdown()


def test_shutdown_sends_what_was_queued() -> None:
    pub = ZmqEventPublisher(config(), "e1")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    try:
        # Wait until the subscription is live: publish until one arrives.
        end = time.monotonic() + DEADLINE_S
        while not sub.poll(50):
            assert time.monotonic() < end, "no subscription"
            pub.publish(batch())
        while sub.poll(200):
            sub.recv_multipart()
        before = pub.counters().batches_published
        for _ in range(5):
            pub.publish(batch())
        t0 = time.monotonic()
        pub.shutdown(timeout_s=2.0)
        assert time.monotonic() - t0 < 2.5
        assert not pub._thread.is_alive()
        assert pub.counters().batches_published == before + 5
        seqs = []
        while sub.poll(500):
            _, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            decode_batch(payload)
        assert seqs == list(range(before, before + 5))
        pub.publish(batch())  # after shutdown: dropped, counted, no error
        assert pub.counters().batches_dropped == 1
    finally:
        sub.close()
        ctx.term()


@pytest.mark.parametrize("encoding, event", [
    ("map", {"type": "BlockRemoved", "block_hashes": [b"h" * 32], "medium": "GPU"}),
    ("array", ["BlockRemoved", [b"h" * 32], "GPU"]),
])
def test_configured_encoding_is_published_and_replayed(encoding: EventEncoding,
                                                       event: object) -> None:
    pub = ZmqEventPublisher(config(replay_endpoint="tcp://127.0.0.1:0",
                                   event_encoding=encoding), "e1")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    sent = KVEventBatch(ts=1.5, events=[BlockRemoved(block_hashes=[b"h" * 32], medium="GPU")])
    try:
        end = time.monotonic() + DEADLINE_S
        while not sub.poll(50):
            assert time.monotonic() < end, "no subscription"
            pub.publish(sent)
        _, seq, payload = sub.recv_multipart()
        assert msgspec.msgpack.decode(payload) == [1.5, [event], 0]
        assert decode_batch(payload, encoding) == KVEventBatch(1.5, sent.events, 0)
        assert payload == encode_batch(KVEventBatch(1.5, sent.events, 0), encoding)
        dealer.send_multipart([b"", seq])
        replayed = []
        while True:
            assert dealer.poll(int(DEADLINE_S * 1000)), "replay did not end"
            _, rseq, rpayload = dealer.recv_multipart()
            if rseq == END_SEQ:
                break
            replayed.append(rpayload)
        assert replayed and all(p == payload for p in replayed)
    finally:
        pub.shutdown()
        sub.close()
        dealer.close()
        ctx.term()
