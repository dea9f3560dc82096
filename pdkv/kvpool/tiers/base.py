"""The interface every pool tier implements (torch-free).

A tier maps a string key (`pdkv.kvpool.keys.chunk_key`) to an immutable bytes value (a chunk
encoded by `pdkv.kvpool.codec`). Keys are content addresses: two puts of one key carry the same
bytes, so a put of an existing key may keep the old value. A tier never promises a hit: `get` of
a key that `contains` just reported may return None (evicted, expired, lost server), and callers
treat that as a miss. Every call has a deadline: a tier whose server is down raises `TierError`
quickly (it never hangs) and the store turns that into a miss and a failure count.

Thread-safety: the store calls a tier from its save thread and from load/lookup threads at once;
every tier must be safe for that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class TierError(Exception):
    """A tier operation failed (server down, I/O error, timeout). `kind` names the failure for
    metrics: "unavailable", "timeout", "io", "full", "corrupt", "other"."""

    def __init__(self, message: str, kind: str = "other") -> None:
        super().__init__(message)
        self.kind = kind


class Tier(ABC):
    """One storage tier of the pool.

    Attributes:
        name: the tier's name in config and metrics ("dram", "disk", "redis", "mooncake").
        local_index: True when `contains_many` answers from process memory (no round trip), so
            the engine thread may call it inline; False for remote tiers (called off-thread).
    """

    name: str = ""
    local_index: bool = False

    @abstractmethod
    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present (one round trip for remote tiers). Does not pin or touch
        LRU order (a lookup that is never followed by a read keeps nothing alive).

        Raises:
            TierError: the tier cannot answer.
        """

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value, or None on a miss. Counts as a use for LRU.

        Raises:
            TierError: the tier cannot answer (a miss is None, not an error).
        """

    @abstractmethod
    def put(self, key: str, value: bytes) -> None:
        """Store `value` under `key` (evicting LRU entries to stay under capacity). A failed put
        leaves no entry behind.

        Raises:
            TierError: not stored (kind "full" when the value cannot fit at all).
        """

    @abstractmethod
    def remove(self, key: str) -> None:
        """Drop `key` if present (used when a value fails its checksum)."""

    def bytes_in_use(self) -> int:
        """Bytes of values held, as far as the tier knows (0 when it cannot tell)."""
        return 0

    def take_evictions(self) -> int:
        """Entries evicted for capacity since the last call."""
        return 0

    def close(self) -> None:
        """Release connections and files; the tier is unusable afterwards."""
