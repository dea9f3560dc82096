"""The publisher seam: what the engine calls to publish a step's KV events, its counters, and
the registry of publishers by name (vLLM's EventPublisherFactory idea; no pyzmq imported here).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TypedDict

from pdkv.kv_events.config import KVEventsConfig
from pdkv.kv_events.schema import KVEventBatch


@dataclass
class KVEventCounters:
    """Cumulative counts of one publisher (each field is written by one thread only:
    `batches_dropped` (a full queue) and `events_dropped` by the engine thread, the others by the
    publisher thread; readers see a recent value).

    Attributes:
        batches_published: batches sent on the PUB socket.
        events_published: events in those batches.
        batches_dropped: batches not sent (queue full, or the send failed).
        replay_requests: well-formed replay requests answered.
        replay_malformed: replay requests dropped as malformed (wrong frames, a start sequence
            that is not 8 bytes).
        events_dropped: events dropped before they reached a batch: the KV pool tiers' event
            queue (`pdkv.kvpool.events.PoolEventQueue`) was full.
    """

    batches_published: int = 0
    events_published: int = 0
    batches_dropped: int = 0
    replay_requests: int = 0
    replay_malformed: int = 0
    events_dropped: int = 0


class KVEventsInfo(TypedDict):
    """Where and how one engine publishes (GET /kv_events, what a router subscribes with).

    Attributes:
        publisher: the publisher's name (`KVEventsConfig.publisher`).
        endpoint: the PUB socket's bound address (the real port, also when `:0` was asked).
        replay_endpoint: the ROUTER socket's bound address, or None (no replay).
        topic: the configured topic; every message's topic frame is
            `<topic>|<engine_id>|<epoch>` (schema.topic_frame).
        engine_id: the engine id in that frame.
        epoch: this run's epoch in that frame (ms since the Unix epoch at start).
        event_encoding: "map" or "array" (schema.EventEncoding).
        block_size: tokens per block of the engine's BlockStored events (its logical block).
    """

    publisher: str
    endpoint: str
    replay_endpoint: str | None
    topic: str
    engine_id: str
    epoch: int
    event_encoding: str
    block_size: int


class KVEventPublisher(ABC):
    """Publishes the KV event batches of one engine."""

    @abstractmethod
    def publish(self, batch: KVEventBatch) -> None:
        """Hand one step's batch over for sending. Called by the engine loop thread once per step
        that has events; never blocks: a batch that cannot be queued is dropped and counted."""

    @abstractmethod
    def count_dropped_events(self, n: int) -> None:
        """Add `n` to `events_dropped` (engine loop thread; events lost before a batch)."""

    @abstractmethod
    def counters(self) -> KVEventCounters:
        """A snapshot of the counters (any thread; for /metrics and tests)."""

    @abstractmethod
    def info(self, block_size: int) -> KVEventsInfo:
        """Where and how to subscribe (`block_size`: the engine's tokens per block)."""

    @abstractmethod
    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Send what is queued, then close, within `timeout_s` (batches still queued then are
        dropped). Called once, by the engine's owner at shutdown; blocks at most `timeout_s`."""


# Publishers by name (`KVEventsConfig.publisher`), imported when chosen: "module:class".
_PUBLISHERS: dict[str, str] = {"zmq": "pdkv.kv_events.publisher:ZmqEventPublisher"}


def create_publisher(config: KVEventsConfig, engine_id: str) -> KVEventPublisher | None:
    """The publisher `config` names, started (its sockets bound), or None when events are off
    (`publisher` "null" or `enable_kv_cache_events` false).

    Raises:
        ValueError: unknown publisher, or its endpoint cannot be used (named).
    """
    if not config.active:
        return None
    target = _PUBLISHERS.get(config.publisher)
    if target is None:
        raise ValueError(f"unknown KV event publisher {config.publisher!r}")
    module, name = target.split(":")
    cls = getattr(importlib.import_module(module), name)
    publisher: KVEventPublisher = cls(config, engine_id)
    return publisher
