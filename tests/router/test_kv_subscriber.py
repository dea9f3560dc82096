"""The router's KV event subscriber against a real ZmqEventPublisher (no model) and against a
scripted publisher whose every message and replay answer the test chooses: batches reach the
index, a late subscriber replays what it missed, a forced gap is filled from the replay buffer or
clears the instance when the buffer lost it, a restart (new epoch) clears it, and malformed or
foreign messages are dropped and counted. Every wait has a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
import zmq
import zmq.asyncio

from pdkv.block_hashing import hash_request_tokens
from pdkv.kv_events.config import KVEventsConfig
from pdkv.kv_events.publisher import ZmqEventPublisher
from pdkv.kv_events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    topic_frame,
)
from pdkv.router.kv_index import KVIndex
from pdkv.router.kv_subscriber import EventSource, KVEventSubscriber

DEADLINE_S = 20.0
BS = 16
URL = "http://127.0.0.1:1"
H = hash_request_tokens(list(range(1, 10 * BS + 1)), BS)  # 10 blocks


def stored(*idx: int) -> BlockStored:
    return BlockStored([H[i] for i in idx], None, [], BS, None, "GPU", None)


def batch(*events) -> KVEventBatch:
    return KVEventBatch(time.time(), list(events), 0)


async def until(cond: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def held(index: KVIndex) -> int:
    return index.overlap(URL, H, BS).blocks


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 60))


# ------------------------------------------------------------------ a real publisher


def real_publisher(**extra) -> ZmqEventPublisher:
    return ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0", topic="kv", **extra), "eng")


def test_batches_of_a_real_publisher_reach_the_index_and_a_late_subscriber_replays() -> None:
    pub = real_publisher()

    async def body() -> None:
        pub.publish(batch(stored(0, 1, 2)))  # before anyone listens: only a replay has it
        await until(lambda: pub.counters().batches_published == 1, "the first batch sent")
        index = KVIndex()
        sub = KVEventSubscriber(index)
        sub.add(EventSource.from_info(URL, pub.info(BS)))  # type: ignore[arg-type]
        await until(lambda: held(index) == 3, "the replayed blocks")
        assert sub.counters().replayed == 1
        # Live batches now; the SUB socket joins asynchronously, so a batch it missed comes
        # through a replay: either way all of them are applied once, in order.
        for i in range(3, 10):
            pub.publish(batch(stored(i)))
        await until(lambda: held(index) == 10, "the live blocks")
        pub.publish(batch(BlockRemoved([H[5]], "GPU")))
        await until(lambda: held(index) == 5, "the removal")
        c = sub.counters()
        assert c.batches == 9 and c.events == 9 and c.malformed == c.gaps_unfilled == 0
        pub.publish(batch(AllBlocksCleared()))
        await until(lambda: held(index) == 0, "the clear")
        await sub.close()

    try:
        run(body)
    finally:
        pub.shutdown()


def test_a_restart_on_the_same_endpoints_clears_the_instance() -> None:
    first = real_publisher()
    info = first.info(BS)
    ports = {k: info[k] for k in ("endpoint", "replay_endpoint")}  # type: ignore[literal-required]

    async def body() -> None:
        nonlocal first
        index = KVIndex()
        sub = KVEventSubscriber(index)
        sub.add(EventSource.from_info(URL, info))  # type: ignore[arg-type]
        for i in range(5):
            first.publish(batch(stored(i)))
        await until(lambda: held(index) == 5, "the first run's blocks")
        first.shutdown()
        time.sleep(0.05)  # the epoch is in ms: the next run's differs
        second = ZmqEventPublisher(KVEventsConfig(
            enable_kv_cache_events=True, topic="kv", **ports), "eng")  # same engine id, new epoch
        try:
            assert second.epoch != info["epoch"]
            end = time.monotonic() + DEADLINE_S
            while sub.counters().restarts == 0:  # publish until the SUB socket reconnected
                assert time.monotonic() < end, f"restart never seen: {sub.counters()}"
                second.publish(batch(stored(7)))
                await asyncio.sleep(0.05)
            # Block 0 is gone with the old run; only what the new run stored is held.
            await until(lambda: index.num_blocks(URL) == {"GPU": 1}, "the new run's block")
            assert held(index) == 0
        finally:
            second.shutdown()
        await sub.close()

    try:
        run(body)
    finally:
        first.shutdown()


# ------------------------------------------------------------------ a scripted publisher


class Scripted:
    """A PUB and a ROUTER socket the test drives: it chooses every sequence number sent and
    what a replay answers (`buffer`: seq -> batch, the publisher's replay buffer)."""

    def __init__(self, ctx: zmq.asyncio.Context, engine_id: str = "eng", epoch: int = 1) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:0")
        self.topic = topic_frame("kv", engine_id, epoch)
        self.buffer: dict[int, bytes] = {}
        self.replays: list[int] = []
        self._task = asyncio.get_running_loop().create_task(self._serve())

    def source(self) -> EventSource:
        return EventSource(URL, self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                           self.router.getsockopt_string(zmq.LAST_ENDPOINT), "kv", "eng")

    async def send(self, seq: int, b: KVEventBatch, buffered: bool = True) -> None:
        payload = encode_batch(b)
        if buffered:
            self.buffer[seq] = payload
        await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replays.append(first)
            for seq in sorted(self.buffer):
                if seq >= first:
                    await self.router.send_multipart(
                        [client, b"", seq.to_bytes(8, "big"), self.buffer[seq]])
            await self.router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True),
                                              b""])

    async def live(self, sub: KVEventSubscriber, index: KVIndex) -> None:
        """Send seq 0 (block 0) until the subscriber applied it (ZMQ's slow joiner)."""
        await until(lambda: len(self.replays) >= 1, "the start-up replay")
        end = time.monotonic() + DEADLINE_S
        while held(index) < 1:
            assert time.monotonic() < end, "the SUB socket never went live"
            await self.send(0, batch(stored(0)))
            await asyncio.sleep(0.02)

    def close(self) -> None:
        self._task.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)


def scripted(test: Callable[[Scripted, KVEventSubscriber, KVIndex], Awaitable[None]]) -> None:
    async def body() -> None:
        ctx = zmq.asyncio.Context()
        fake = Scripted(ctx)
        index = KVIndex()
        sub = KVEventSubscriber(index, replay_timeout_s=5.0)
        sub.add(fake.source())
        try:
            await fake.live(sub, index)
            await test(fake, sub, index)
        finally:
            await sub.close()
            fake.close()
            ctx.term()

    run(body)


def test_a_gap_is_filled_from_the_replay_buffer() -> None:
    async def t(fake: Scripted, sub: KVEventSubscriber, index: KVIndex) -> None:
        fake.buffer[1] = encode_batch(batch(stored(1)))  # published, but lost on the way
        await fake.send(2, batch(stored(2)))
        await until(lambda: held(index) == 3, "blocks 0-2")
        assert fake.replays[-1] == 1  # asked from the first missing one
        c = sub.counters()
        assert c.gaps_unfilled == 0 and c.replayed >= 2

    scripted(t)


def test_a_gap_the_buffer_lost_clears_the_instance() -> None:
    async def t(fake: Scripted, sub: KVEventSubscriber, index: KVIndex) -> None:
        fake.buffer.clear()  # the replay buffer no longer has 1 (nor 0)
        await fake.send(2, batch(stored(2)), buffered=False)
        await until(lambda: sub.counters().gaps_unfilled == 1, "the unfilled gap")
        await until(lambda: index.num_blocks(URL) == {"GPU": 1}, "block 2 alone")
        assert held(index) == 0  # block 0 was forgotten: the run from 0 is broken
        await fake.send(3, batch(stored(0, 1)))
        await until(lambda: held(index) == 3, "0-2 again")  # in order, nothing replayed

    scripted(t)


def test_a_replay_that_starts_after_the_gap_clears_the_instance_first() -> None:
    async def t(fake: Scripted, sub: KVEventSubscriber, index: KVIndex) -> None:
        fake.buffer = {3: encode_batch(batch(stored(3)))}  # 1 and 2 fell out of the buffer
        await fake.send(4, batch(stored(4)))
        await until(lambda: index.num_blocks(URL) == {"GPU": 2}, "blocks 3 and 4 alone")
        assert sub.counters().gaps_unfilled == 1 and held(index) == 0

    scripted(t)


def test_a_batch_seen_twice_is_applied_once() -> None:
    async def t(fake: Scripted, sub: KVEventSubscriber, index: KVIndex) -> None:
        await fake.send(1, batch(stored(1)))
        await fake.send(2, batch(BlockRemoved([H[1]], "GPU")))
        await until(lambda: sub.counters().batches >= 3, "batches 1 and 2")
        fake.buffer.clear()  # a replay now has nothing before 3
        await fake.send(1, batch(stored(1)), buffered=False)  # again (replay and SUB both may)
        await fake.send(3, batch(stored(5)))
        await until(lambda: sub.counters().batches >= 4, "batch 3")
        # Block 1 stays removed, and batch 3 followed 2 without a gap (had the duplicate been
        # applied, 3 would have looked like a gap after 1 that the buffer cannot fill).
        assert held(index) == 1 and index.num_blocks(URL) == {"GPU": 2}
        assert sub.counters().gaps_unfilled == 0 and sub.counters().duplicates >= 1

    scripted(t)


def test_malformed_and_foreign_messages_are_dropped_and_counted() -> None:
    async def t(fake: Scripted, sub: KVEventSubscriber, index: KVIndex) -> None:
        seq1 = (1).to_bytes(8, "big")
        good = encode_batch(batch(stored(1)))
        await fake.pub.send_multipart([fake.topic, seq1])  # two frames
        await fake.pub.send_multipart([fake.topic, b"\x01", good])  # a 1-byte sequence
        await fake.pub.send_multipart([b"kv|eng|not-a-number", seq1, good])  # topic frame
        await fake.pub.send_multipart([b"kv|eng|x|5", seq1, good])  # engine "x", same prefix
        await until(lambda: sub.counters().malformed == 3, "three malformed")
        assert sub.counters().foreign == 1 and held(index) == 1
        await fake.send(1, batch(stored(1)))  # the subscriber goes on
        await until(lambda: held(index) == 2, "block 1")
        fake.buffer[2] = b"\xc1 not msgpack"
        await fake.pub.send_multipart([fake.topic, (2).to_bytes(8, "big"), fake.buffer[2]])
        await until(lambda: sub.counters().malformed == 4, "the bad payload")
        assert held(index) == 0  # its events are lost: the instance starts again
        assert sub.sources() == [URL]

    scripted(t)


def test_event_source_from_info_checks_fields_and_rewrites_a_wildcard_host() -> None:
    info = {"publisher": "zmq", "endpoint": "tcp://0.0.0.0:5557", "replay_endpoint": "tcp://*:5558",
            "topic": "kv", "engine_id": "e", "epoch": 1, "event_encoding": "array",
            "block_size": 32}
    src = EventSource.from_info("http://10.1.2.3:8000", info)
    assert (src.endpoint, src.replay_endpoint) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")
    assert (src.event_encoding, src.block_size) == ("array", 32)
    assert src.epoch == 1
    for bad in ({"event_encoding": "json"}, {"block_size": 0}, {"epoch": "1"}, {"topic": None}):
        broken = {**info, **bad}
        if bad.get("topic", 1) is None:
            del broken["topic"]
        with pytest.raises(ValueError):
            EventSource.from_info("http://h:1", broken)
