"""In-process DRAM tier: values in an OrderedDict, LRU eviction by bytes (torch-free)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from pdkv.kvpool.tiers.base import Tier, TierError


class DramTier(Tier):
    """Values held in this process, evicted least-recently-used first to keep the sum of value
    lengths at or under `capacity_bytes`.

    KV events (`set_event_listener`): a put reports the keys it evicted, then the key it stored;
    `remove` reports the key if it was held; `close` reports nothing (the engine is stopping).

    Only `get` and `put` count as a use; `contains_many` does not touch LRU order, so chunks that
    are looked up but never read age out like any other. Thread-safe (one lock, held only for
    dictionary work, never for I/O).

    Args:
        capacity_bytes: most bytes of values held (> 0).

    Raises:
        ValueError: capacity_bytes <= 0.
    """

    name = "dram"
    local_index = True

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._evictions = 0

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key, from memory; no LRU touch."""
        with self._lock:
            return [k in self._entries for k in keys]

    def get(self, key: str) -> bytes | None:
        """The value or None; a hit becomes most recently used."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: str, value: bytes) -> None:
        """Store `value`, evicting LRU entries until it fits. An existing key keeps its value
        (keys are content addresses) and becomes most recently used.

        Raises:
            TierError: kind "full" when len(value) > capacity_bytes (nothing is evicted then).
        """
        size = len(value)
        if size > self.capacity_bytes:
            raise TierError(
                f"value of {size} bytes exceeds dram capacity {self.capacity_bytes}", "full"
            )
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            evicted: list[str] = []
            while self._used + size > self.capacity_bytes:
                old_key, old = self._entries.popitem(last=False)
                self._used -= len(old)
                self._evictions += 1
                evicted.append(old_key)
            self._entries[key] = value
            self._used += size
            # Under the lock: a key's store is reported before any later eviction of it.
            self._report_removed(evicted)
            self._report_stored(key)

    def remove(self, key: str) -> None:
        """Drop `key` if present."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= len(old)
                self._report_removed((key,))

    def bytes_in_use(self) -> int:
        """Sum of the lengths of the values held."""
        with self._lock:
            return self._used

    def take_evictions(self) -> int:
        """Entries evicted for capacity since the last call."""
        with self._lock:
            n, self._evictions = self._evictions, 0
            return n

    def close(self) -> None:
        """Drop every value."""
        with self._lock:
            self._entries.clear()
            self._used = 0
