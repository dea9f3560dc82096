"""The interface every pool tier implements (torch-free).

A tier maps a string key (`pdkv.kvpool.keys.chunk_key`) to an immutable bytes value (a chunk
encoded by `pdkv.kvpool.codec`). Keys are content addresses: two puts of one key carry the same
bytes, so a put of an existing key may keep the old value. A tier never promises a hit: `get` of
a key that `contains` just reported may return None (evicted, expired, lost server), and callers
treat that as a miss. Every call has a deadline: a tier whose server is down raises `TierError`
quickly (it never hangs) and the store turns that into a miss and a failure count.

Thread-safety: the store calls a tier from its save thread and from load/lookup threads at once;
every tier must be safe for that.

KV events (issue 34, `pdkv.kvpool.events`): with a listener set (`set_event_listener`, only when
the engine publishes KV events) a tier reports the keys it stored and the keys it dropped, in the
order they happened to each key (a key's removal is reported after its store: tiers report
inside the lock that orders their own updates). Without one, reporting costs an attribute test.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdkv.kvpool.events import TierEventListener

logger = logging.getLogger(__name__)


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
        events: where stored and dropped keys are reported (None: nowhere, the default).
    """

    name: str = ""
    local_index: bool = False
    events: TierEventListener | None = None

    def set_event_listener(self, listener: TierEventListener | None) -> None:
        """Report stored and dropped keys to `listener` from now on (None: stop). Set once,
        before the tier is used by other threads (the engine, at start-up)."""
        self.events = listener

    def _report_stored(self, key: str) -> None:
        if self.events is not None:
            self.events.stored(self.name, (key,))

    def _report_removed(self, keys: Sequence[str]) -> None:
        if self.events is not None and keys:
            self.events.removed(self.name, keys)

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
        """Bytes of values held, as far as the tier knows (0 when it cannot tell). Called by the
        store's `stats()` after every engine step: it never blocks on a round trip (remote tiers
        answer from a value refreshed in the background, see `BackgroundValue`)."""
        return 0

    def take_evictions(self) -> int:
        """Entries evicted for capacity since the last call."""
        return 0

    def close(self) -> None:
        """Release connections and files; the tier is unusable afterwards."""


class BackgroundValue:
    """A number that costs a round trip to learn, read without waiting for one: `get` returns
    the last fetched value at once and, when that is older than `max_age_s` seconds and no fetch
    is running, starts one on a daemon thread. A fetch that raises keeps the previous value
    (logged at debug level). Thread-safe.

    Args:
        fetch: blocking call that returns the current value (may raise).
        max_age_s: seconds after which `get` starts a new fetch (>= 0).
        name: thread name of the fetches.
        clock: monotonic clock in seconds (tests pass a fake one).
    """

    def __init__(self, fetch: Callable[[], int], max_age_s: float, name: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self._max_age_s = max_age_s
        self._name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._value = 0
        self._at = float("-inf")
        self._running = False

    def get(self) -> int:
        """The last fetched value (0 before the first fetch ends); never blocks on a fetch."""
        with self._lock:
            start = not self._running and self._clock() - self._at >= self._max_age_s
            if start:
                self._running = True
            value = self._value
        if start:
            threading.Thread(target=self.refresh, name=self._name, daemon=True).start()
        return value

    def refresh(self) -> int:
        """Fetch now, on the calling thread (blocks for the round trip); the value kept."""
        try:
            value: int | None = self._fetch()
        except Exception as e:
            logger.debug("%s: fetch failed: %r", self._name, e)
            value = None
        with self._lock:
            self._running = False
            self._at = self._clock()
            if value is not None:
                self._value = value
            return self._value


class OwnEntries:
    """The entries one tier instance put into a shared remote store, with their value sizes, so
    the instance can report the bytes it holds there when the store cannot say cheaply.
    `prune` drops those the store no longer has (evicted, expired, removed by another client).
    Thread-safe.

    Args:
        tier: the tier whose KV events (`Tier.set_event_listener`) report these entries: a
            recorded put as stored, a recorded entry dropped (removed, read as a miss, pruned)
            as removed, both under this object's lock so one key's store is reported first.
            None: no events.
    """

    def __init__(self, tier: Tier | None = None) -> None:
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self._tier = tier

    def add(self, key: str, nbytes: int) -> None:
        """Record a successful put of `nbytes` bytes under `key`."""
        with self._lock:
            self._sizes[key] = nbytes
            if self._tier is not None:
                self._tier._report_stored(key)

    def drop(self, key: str) -> None:
        """Forget `key` (removed, or read as a miss)."""
        with self._lock:
            if self._sizes.pop(key, None) is not None and self._tier is not None:
                self._tier._report_removed((key,))

    def keys(self) -> list[str]:
        """The keys recorded now."""
        with self._lock:
            return list(self._sizes)

    def prune(self, keys: Sequence[str], present: Sequence[bool]) -> int:
        """Forget the `keys` whose `present` is False; the bytes of the entries still recorded."""
        with self._lock:
            gone = [key for key, held in zip(keys, present)
                    if not held and self._sizes.pop(key, None) is not None]
            if gone and self._tier is not None:
                self._tier._report_removed(gone)
            return sum(self._sizes.values())
