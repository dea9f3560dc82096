"""KV cache events of the KV pool's tiers (issue 34), torch-free.

With `--kv-events-config` on, every chunk a pool tier of this engine stores or drops becomes a
vLLM-layout event in the engine's next KV event batch (docs/KV_EVENTS.md, "Pool tier events"):

- `BlockStored` with `medium` the tier's name upper-cased ("DRAM", "DISK", "REDIS", "MOONCAKE"),
  `block_size` the pool's chunk size in tokens and `block_hashes` the chunk hash, which is the
  engine block hash of the chunk's last block (`pdkv.kvpool.keys.chunk_hashes`): what
  `pdkv.router.kv_index.KVIndex.overlap` matches a medium of bigger blocks against.
  `parent_block_hash` (the previous chunk's hash, None for chunk 0) and `token_ids` (the chunk's
  tokens) are filled for chunks this engine computed and saved (`PoolTierEvents.describe`); a
  chunk written without a description (a promotion of a hit in a slower tier into a faster one,
  long after its save) has None and no token ids, as vLLM's OffloadingConnector sends for all of
  its tier events (vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py,
  `take_events`).
- `BlockRemoved` with that medium for a chunk the tier dropped: evicted for capacity, removed as
  corrupt, or (remote tiers) an entry this engine wrote that it found gone.

Threads: tiers call `PoolTierEvents.stored` / `removed` from the store's save thread and the
load threads, inside their own locks, so one key's stored event is queued before its removal.
The events go into one bounded `PoolEventQueue` that the engine loop drains once per step into
the step's batch; a full queue drops the event and counts it (a pool thread never waits).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdkv.block_hashing import BlockHash
from pdkv.kv_events.schema import BlockRemoved, BlockStored, Event

DEFAULT_MAX_EVENTS = 65_536
"""Events the queue holds between two engine steps before it drops new ones."""
DEFAULT_MAX_DESCRIBED = 1024
"""Chunk descriptions (parent hash, tokens) kept for saves not yet written to every tier."""


class TierEventListener(Protocol):
    """What a tier calls when it stores or drops entries (`Tier.set_event_listener`). Both
    methods never block on I/O and may be called with the tier's lock held."""

    def stored(self, tier: str, keys: Sequence[str]) -> None:
        """`keys` were written into tier `tier` by this process."""

    def removed(self, tier: str, keys: Sequence[str]) -> None:
        """`keys` left tier `tier` (evicted, removed, or found gone)."""


class PoolEventQueue:
    """The bounded, thread-safe path from pool threads to the engine loop's per-step batch.

    Args:
        max_events: events held before new ones are dropped (counted; >= 1).
        wakeup: called (outside the lock, on the recording thread) when the queue goes from
            empty to non-empty, so an idle engine loop steps and publishes; it must not block.

    Raises:
        ValueError: max_events < 1.
    """

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS,
                 wakeup: Callable[[], None] | None = None) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.max_events = max_events
        self._lock = threading.Lock()
        self._events: deque[Event] = deque()
        self._dropped = 0
        self._wakeup = wakeup

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        """Replace the wakeup callback (the engine sets it once, at start-up)."""
        self._wakeup = wakeup

    def put(self, events: Sequence[Event]) -> None:
        """Queue `events` in order; those that do not fit are dropped and counted. Never
        blocks (any thread)."""
        with self._lock:
            was_empty = not self._events
            room = self.max_events - len(self._events)
            self._events.extend(events[:room])
            self._dropped += max(0, len(events) - room)
            woke = was_empty and bool(self._events)
        wakeup = self._wakeup
        if woke and wakeup is not None:
            wakeup()

    def take(self) -> list[Event]:
        """Every queued event, oldest first, with each run of consecutive BlockStored events of
        one medium that chain (each one's parent is the previous one's last hash) merged into
        one event. Called by the engine loop once per step."""
        with self._lock:
            if not self._events:
                return []
            events = list(self._events)
            self._events.clear()
        return merge_stored(events)

    def take_dropped(self) -> int:
        """Events dropped (queue full) since the last call."""
        with self._lock:
            n, self._dropped = self._dropped, 0
            return n

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)


def merge_stored(events: Sequence[Event]) -> list[Event]:
    """`events` with each run of adjacent BlockStored events of one medium and block size that
    chain (the later one's parent is the earlier one's last hash, and both or neither carry
    token ids) merged into one event, as the prefix cache reports one run of blocks. The order
    of every other event is kept."""
    out: list[Event] = []
    for e in events:
        prev = out[-1] if out else None
        if (isinstance(e, BlockStored) and isinstance(prev, BlockStored)
                and e.medium == prev.medium and e.block_size == prev.block_size
                and e.parent_block_hash is not None
                and e.parent_block_hash == prev.block_hashes[-1]
                and bool(e.token_ids) == bool(prev.token_ids)):
            out[-1] = BlockStored(
                block_hashes=[*prev.block_hashes, *e.block_hashes],
                parent_block_hash=prev.parent_block_hash,
                token_ids=[*prev.token_ids, *e.token_ids], block_size=prev.block_size,
                lora_id=None, medium=prev.medium, lora_name=None)
        else:
            out.append(e)
    return out


@dataclass(frozen=True)
class ChunkDescription:
    """What the pool key does not say about a chunk.

    Attributes:
        parent_hash: the previous chunk's hash (None: chunk 0).
        token_ids: the chunk's tokens (chunk_size of them).
    """

    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]


class PoolTierEvents:
    """Turns one pool store's tier reports (keys) into KV events for one engine.

    Only keys of this engine's pool namespace (`pdkv:<fingerprint>:<hash hex>`) are reported: a
    disk directory shared with other engines evicts their files too, and those are not this
    engine's chunks.

    Args:
        queue: where the events go (the engine's).
        fingerprint: this engine's pool namespace fingerprint (`PoolNamespace.fingerprint`).
        chunk_size: tokens per pool chunk (the events' block_size).
        max_described: descriptions kept (oldest dropped first; >= 1).

    Raises:
        ValueError: chunk_size or max_described < 1.
    """

    def __init__(self, queue: PoolEventQueue, fingerprint: str, chunk_size: int,
                 max_described: int = DEFAULT_MAX_DESCRIBED) -> None:
        if chunk_size < 1 or max_described < 1:
            raise ValueError(f"chunk_size ({chunk_size}) and max_described ({max_described}) "
                             "must be >= 1")
        self.queue = queue
        self.chunk_size = chunk_size
        self.max_described = max_described
        self._prefix = f"pdkv:{fingerprint}:"
        self._lock = threading.Lock()
        self._described: OrderedDict[str, ChunkDescription] = OrderedDict()

    def describe(self, key: str, parent_hash: BlockHash | None, token_ids: Sequence[int]) -> None:
        """Remember `key`'s parent hash and tokens for its stored events (the scheduler half,
        when it sends the chunk to be saved; engine loop thread)."""
        with self._lock:
            self._described[key] = ChunkDescription(parent_hash, tuple(token_ids))
            self._described.move_to_end(key)
            while len(self._described) > self.max_described:
                self._described.popitem(last=False)

    def forget(self, key: str) -> None:
        """Drop `key`'s description (the store wrote, or dropped, its save)."""
        with self._lock:
            self._described.pop(key, None)

    def _hash(self, key: str) -> BlockHash | None:
        if not key.startswith(self._prefix):
            return None
        try:
            return bytes.fromhex(key[len(self._prefix):])
        except ValueError:
            return None

    def stored(self, tier: str, keys: Sequence[str]) -> None:
        """Queue one BlockStored per key of this namespace (tier threads)."""
        events: list[Event] = []
        medium = tier.upper()
        for key in keys:
            h = self._hash(key)
            if h is None:
                continue
            with self._lock:
                desc = self._described.get(key)
            events.append(BlockStored(
                block_hashes=[h], parent_block_hash=desc.parent_hash if desc else None,
                token_ids=list(desc.token_ids) if desc else [], block_size=self.chunk_size,
                lora_id=None, medium=medium, lora_name=None))
        if events:
            self.queue.put(events)

    def removed(self, tier: str, keys: Sequence[str]) -> None:
        """Queue one BlockRemoved for the keys of this namespace (tier threads)."""
        hashes = [h for h in map(self._hash, keys) if h is not None]
        if hashes:
            self.queue.put([BlockRemoved(block_hashes=hashes, medium=tier.upper())])
