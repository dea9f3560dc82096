"""`--kv-events-config`: vLLM's `KVEventsConfig` fields (vllm/config/kv_events.py), frozen.

Differences from vLLM, on purpose: the endpoints default to loopback (`tcp://127.0.0.1:5557`;
vLLM's default `tcp://*:5557` listens on every interface), the JSON is checked strictly
(unknown fields and bad values are errors naming the field), and `event_encoding` (pdkv only)
picks the events' msgpack form: "map" as vLLM v0.26+ sends (vLLM PR #42892), or "array" as
vLLM 0.25 and earlier did (pdkv/kv_events/schema.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from pdkv.kv_events.schema import EVENT_ENCODINGS, EventEncoding

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """Where and how an engine publishes its KV cache events.

    Attributes:
        enable_kv_cache_events: record block stored / removed / cleared events (off by default).
        publisher: "zmq" or "null" (records nothing); "" (unset) means "zmq" when events are
            enabled, else "null" (vLLM's rule).
        endpoint: the PUB socket's address; it is bound (a `*` or `0.0.0.0` host listens on every
            interface: ask for it explicitly).
        replay_endpoint: the ROUTER socket answering replay requests (None: no replay).
        buffer_steps: batches kept for replay (one batch per engine step with events).
        hwm: ZMQ send high-water mark of the PUB socket (messages beyond it are dropped by ZMQ
            for a slow subscriber).
        max_queue_size: batches waiting for the publisher thread; a batch that finds the queue
            full is dropped and counted.
        topic: first part of the topic frame (subscribers filter on it).
        event_encoding: pdkv only (vLLM has no such field): how each event is encoded inside
            the batch, "map" (default: field-name maps tagged by "type", as current vLLM, v0.26
            and later) or "array" (positional, as vLLM 0.25 and earlier; for consumers that
            read only that form). The batch itself is a positional array either way.
    """

    enable_kv_cache_events: bool = False
    publisher: str = ""
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    event_encoding: EventEncoding = "map"

    def __post_init__(self) -> None:
        if not self.publisher:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"publisher must be one of {PUBLISHERS}, got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.endpoint, str) or not self.endpoint:
            raise ValueError(f"endpoint must be a ZMQ address, got {self.endpoint!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError(f"replay_endpoint must be a string, got {self.replay_endpoint!r}")
        if self.event_encoding not in EVENT_ENCODINGS:
            raise ValueError(f"event_encoding must be one of {EVENT_ENCODINGS} (\"map\": vLLM "
                             f"v0.26+, \"array\": vLLM <= 0.25), got {self.event_encoding!r}")

    @property
    def active(self) -> bool:
        """Events are recorded and published."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @staticmethod
    def from_json(text: str) -> KVEventsConfig:
        """Parse the CLI's JSON.

        Raises:
            ValueError: invalid JSON, unknown fields or bad values (named).
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(KVEventsConfig)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown --kv-events-config fields {unknown}; known: {sorted(known)}")
        if data.get("publisher") is None:
            data.pop("publisher", None)
        if not isinstance(data.get("enable_kv_cache_events", False), bool):
            raise ValueError("enable_kv_cache_events must be true or false")
        return KVEventsConfig(**data)
