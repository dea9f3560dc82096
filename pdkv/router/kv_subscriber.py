"""The router's KV event subscriber: one asyncio task per instance reads its PUB socket (pyzmq's
asyncio sockets, on the router's event loop) and keeps `KVIndex` in step with it.

Per instance (`EventSource`, from its GET /kv_events):
- a SUB socket subscribed to `<topic>|<engine id>|`, so only that engine's batches arrive;
  a message whose topic frame names another engine is dropped and counted (`foreign`);
- at start, a replay from sequence 0 fills what the engine published before (what its buffer
  still holds); then every batch is applied in sequence order:
  - a sequence number below the next expected one is a duplicate (a batch seen in a replay
    too) and is skipped;
  - a gap (a number above the next expected one: a dropped message, a slow joiner) asks the
    replay endpoint for the missing batches; when its buffer no longer holds them (its first
    answer starts later) or there is no replay endpoint or it does not answer in time, the
    instance's entries are cleared (`gaps_unfilled`) and the index starts again from the
    batch at hand: from then on it errs towards "not held";
  - a new epoch in the topic frame is a restart under the same engine id (one set in the
    engine's kv_transfer_config): the instance's entries are cleared (`restarts`) and the
    batches of the new run are replayed from 0. An engine restarted under a new engine id is
    filtered out by the subscription: the owner learns of it from GET /kv_events (a new engine
    id or epoch) and calls `add` again, which clears the instance and follows the new run;
- a message of the wrong shape, a topic frame that is not pdkv's, or a payload that does not
  decode is dropped and counted (`malformed`), never raised.
Protocol: `pdkv.kv_events.publisher` (vLLM's ZMQ transport: topic, 8-byte big-endian sequence,
msgpack KVEventBatch; replay over ROUTER/DEALER ending with sequence -1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, fields, replace
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from pdkv.kv_events.publisher import END_SEQ
from pdkv.kv_events.schema import (
    TOPIC_SEPARATOR,
    EventEncoding,
    KVEventBatch,
    decode_batch,
    parse_topic_frame,
)
from pdkv.router.kv_index import KVIndex

logger = logging.getLogger(__name__)

DEFAULT_REPLAY_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class EventSource:
    """Where one instance publishes (its GET /kv_events, `pdkv.kv_events.base.KVEventsInfo`).

    Attributes:
        url: the backend URL the router routes to (the index's instance key).
        endpoint: its PUB socket (a wildcard host, `*` or 0.0.0.0, is replaced by the URL's).
        replay_endpoint: its ROUTER socket, or None.
        topic: the configured topic.
        engine_id: the engine id its topic frames carry.
        event_encoding: "map" or "array".
        block_size: tokens per block of its engine (what the router cuts prompts at).
        epoch: the run the info came from (None: unknown; the first message tells). The start-up
            replay is taken as that run's; a message of another epoch is a restart.
    """

    url: str
    endpoint: str
    replay_endpoint: str | None
    topic: str
    engine_id: str
    event_encoding: EventEncoding = "map"
    block_size: int = 16
    epoch: int | None = None

    @classmethod
    def from_info(cls, url: str, info: dict[str, object]) -> EventSource:
        """From a GET /kv_events body.

        Raises:
            ValueError: a field is missing or of the wrong type, or the encoding is unknown.
        """
        try:
            encoding = str(info["event_encoding"])
            if encoding not in ("map", "array"):
                raise ValueError(f"unknown event_encoding {encoding!r}")
            replay = info.get("replay_endpoint")
            block_size, epoch = info["block_size"], info["epoch"]
            if not isinstance(block_size, int) or block_size < 1:
                raise ValueError(f"bad block_size {block_size!r}")
            if not isinstance(epoch, int):
                raise ValueError(f"bad epoch {epoch!r}")
            return cls(url, _reachable(str(info["endpoint"]), url),
                       None if replay is None else _reachable(str(replay), url),
                       str(info["topic"]), str(info["engine_id"]),
                       "map" if encoding == "map" else "array", block_size, epoch)
        except KeyError as e:
            raise ValueError(f"GET {url}/kv_events: missing {e}") from None


def _reachable(endpoint: str, url: str) -> str:
    """`endpoint` with a wildcard host (what the engine bound) replaced by the backend's host."""
    scheme, _, rest = endpoint.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme == "tcp" and sep and host in ("*", "0.0.0.0", "[::]", "::"):
        return f"tcp://{urlsplit(url).hostname}:{port}"
    return endpoint


@dataclass
class SubscriberCounters:
    """Cumulative counts of one instance, or summed over every instance (one thread: the
    router's loop).

    Attributes:
        batches: batches applied to the index (from the PUB socket or a replay).
        events: events in those batches.
        replayed: batches of those that came from a replay.
        replays: replay requests sent.
        duplicates: batches skipped because they were already applied.
        gaps_unfilled: gaps a replay could not fill (the instance was cleared).
        restarts: epoch changes seen (the instance was cleared).
        malformed: messages dropped as malformed.
        foreign: messages from an engine id other than the instance's.
    """

    batches: int = 0
    events: int = 0
    replayed: int = 0
    replays: int = 0
    duplicates: int = 0
    gaps_unfilled: int = 0
    restarts: int = 0
    malformed: int = 0
    foreign: int = 0


class KVEventSubscriber:
    """Keeps `index` in step with the KV events of every added instance.

    Args:
        index: the index to update (read by the routing policy on the same loop).
        replay_timeout_s: how long one replay may take before the gap counts as unfilled.
    """

    def __init__(self, index: KVIndex, replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S
                 ) -> None:
        self.index = index
        self.replay_timeout_s = replay_timeout_s
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._counters: dict[str, SubscriberCounters] = {}
        self._next: dict[str, int] = {}  # url -> next expected sequence number
        self._epoch: dict[str, int] = {}

    def counters(self, url: str | None = None) -> SubscriberCounters:
        """A snapshot of `url`'s counters (zeros for one never followed), or of their sum over
        every instance ever followed (None)."""
        if url is not None:
            return replace(self._counters.get(url, SubscriberCounters()))
        total = SubscriberCounters()
        for c in self._counters.values():
            for f in fields(SubscriberCounters):
                setattr(total, f.name, getattr(total, f.name) + getattr(c, f.name))
        return total

    def counted(self) -> list[str]:
        """URLs that have counters (every instance ever followed; counts survive `remove`)."""
        return list(self._counters)

    def _count(self, url: str) -> SubscriberCounters:
        return self._counters.setdefault(url, SubscriberCounters())

    def sources(self) -> list[str]:
        """URLs of the instances followed."""
        return list(self._tasks)

    def add(self, source: EventSource) -> None:
        """Follow `source` (replacing what was followed for its URL). Call on the loop."""
        self.remove(source.url)
        self._tasks[source.url] = asyncio.get_running_loop().create_task(
            self._follow(source), name=f"kv-events {source.url}")

    def remove(self, url: str) -> None:
        """Stop following `url` and forget what it holds."""
        task = self._tasks.pop(url, None)
        if task is not None:
            task.cancel()
        self._next.pop(url, None)
        self._epoch.pop(url, None)
        self.index.clear(url)

    async def close(self) -> None:
        """Stop every task and close the sockets."""
        tasks = list(self._tasks.values())
        for url in list(self._tasks):
            self.remove(url)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.term()

    # ------------------------------------------------------------------ one instance
    async def _follow(self, source: EventSource) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        prefix = TOPIC_SEPARATOR.join((source.topic, source.engine_id, ""))
        sub.setsockopt(zmq.SUBSCRIBE, prefix.encode())
        sub.connect(source.endpoint)
        try:
            self._next[source.url] = 0
            if source.epoch is not None:
                self._epoch[source.url] = source.epoch
            await self._replay(source, 0)
            while True:
                frames = await sub.recv_multipart()
                await self._receive(source, frames)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one instance's failure must not stop the router
            logger.exception("KV events of %s: subscriber stopped", source.url)
        finally:
            sub.close(linger=0)

    async def _receive(self, source: EventSource, frames: list[bytes]) -> None:
        url = source.url
        if len(frames) != 3 or len(frames[1]) != 8:
            self._count(url).malformed += 1
            return
        try:
            _, engine_id, epoch = parse_topic_frame(frames[0])
        except ValueError:
            self._count(url).malformed += 1
            return
        if engine_id != source.engine_id:
            self._count(url).foreign += 1
            return
        seq = int.from_bytes(frames[1], "big")
        known = self._epoch.get(url)
        if known != epoch:
            self._epoch[url] = epoch
            if known is not None:  # the engine restarted: what it held is gone
                self._count(url).restarts += 1
                logger.info("KV events of %s: new epoch %d (restart): entries cleared", url,
                            epoch)
                self.index.clear(url)
                self._next[url] = 0
        expected = self._next.get(url, 0)
        if seq < expected:
            self._count(url).duplicates += 1
            return
        if seq > expected:
            await self._replay(source, expected)
            if seq < self._next[url]:  # the replay brought this one too
                self._count(url).duplicates += 1
                return
            if seq > self._next[url]:  # still missing: start again from here
                self._unfilled(url, self._next[url], seq)
        self._apply(source, seq, frames[2], replayed=False)

    async def _replay(self, source: EventSource, start: int) -> None:
        """Apply the batches the publisher still buffers from `start` on; a first one after
        `start` (the buffer lost some) clears the instance first."""
        if source.replay_endpoint is None:
            return
        url = source.url
        self._count(url).replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(source.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            first = True
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout_s)
                if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
                    self._count(url).malformed += 1
                    continue
                if frames[1] == END_SEQ:
                    return
                seq = int.from_bytes(frames[1], "big")
                if seq < self._next[source.url]:
                    self._count(url).duplicates += 1
                    continue
                if first and seq > start:
                    self._unfilled(source.url, start, seq)
                first = False
                self._apply(source, seq, frames[2], replayed=True)
        except asyncio.TimeoutError:
            logger.warning("KV events of %s: replay from %d not answered in %.1f s", source.url,
                           start, self.replay_timeout_s)
        finally:
            dealer.close(linger=0)

    def _unfilled(self, url: str, expected: int, got: int) -> None:
        self._count(url).gaps_unfilled += 1
        logger.warning("KV events of %s: batches %d..%d lost: entries cleared", url, expected,
                       got - 1)
        self.index.clear(url)

    def _apply(self, source: EventSource, seq: int, payload: bytes, replayed: bool) -> None:
        url = source.url
        self._next[url] = seq + 1
        try:
            batch: KVEventBatch = decode_batch(payload, source.event_encoding)
        except msgspec.DecodeError:
            self._count(url).malformed += 1  # its events are lost: err towards "not held"
            self.index.clear(source.url)
            return
        for event in batch.events:
            self.index.apply(source.url, event)
        self._count(url).batches += 1
        self._count(url).events += len(batch.events)
        self._count(url).replayed += int(replayed)
