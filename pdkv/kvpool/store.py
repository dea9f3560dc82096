"""The pool store: one object that fans lookups, loads and saves out across the tiers
(torch-free).

Reads go fastest tier first and a hit in a slower tier is promoted into the faster ones; writes
are write-through to every tier from one background thread fed by a bounded queue, so `save`
never blocks (a full queue drops the save and counts it). A tier that raises `TierError` of kind
"unavailable" or "timeout" is skipped for `retry_after_s` (its calls count as misses and
`skipped`), then tried again: a dead server costs one fast failure per `retry_after_s`, never a
hang. Every value read is verified with `pdkv.kvpool.codec`; a corrupt one is removed from its
tier, counted, and the next tier is tried. A hit is never wrong data.

Metrics: `stats()` gives cumulative counters per tier ("pool:<tier>:<name>") plus store-wide
ones; `take_observations()` gives load/save time samples since the last call.

KV events (issue 34): `set_tier_events` makes every tier report the chunks it stores and drops
(`pdkv.kvpool.events`); the store itself only forgets a chunk's description once its save was
written to every tier or dropped.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

from pdkv.kvpool.codec import CorruptChunk, decode_chunk
from pdkv.kvpool.events import PoolTierEvents
from pdkv.kvpool.tiers.base import Tier, TierError

logger = logging.getLogger(__name__)

T = TypeVar("T")

FAILURE_KINDS = ("unavailable", "timeout", "io", "full", "corrupt", "other")
"""Failure kinds always present in stats (a tier's other kinds appear when first seen)."""
DOWN_KINDS = frozenset({"unavailable", "timeout"})
"""TierError kinds after which a tier is skipped for retry_after_s."""
COUNTERS = ("lookups", "hits", "chunks_read", "bytes_read", "chunks_written", "bytes_written",
            "save_skips", "evictions", "skipped")


class _Skipped(Exception):
    """Internal: the tier is in its retry_after_s back-off."""


class _TierState:
    """Counters and back-off of one tier (guarded by the store's lock)."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.prefix = f"pool:{tier.name}:"
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        self.counters.update({f"failures_{k}": 0.0 for k in FAILURE_KINDS})
        self.down_until = float("-inf")


class KVPoolStore:
    """Tiers in order, fastest first, behind lookup / get / save.

    Args:
        tiers: the tiers, fastest first; names must be distinct (they label metrics).
        save_queue_size: most saves waiting for the save thread (> 0).
        retry_after_s: seconds a tier is skipped after an "unavailable"/"timeout" error.
        clock: monotonic clock in seconds for the back-off (tests pass a fake one).

    Raises:
        ValueError: no tiers, duplicate tier names, or save_queue_size <= 0.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        save_queue_size: int = 64,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        names = [t.name for t in tiers]
        if not tiers:
            raise ValueError("a pool needs at least one tier")
        if len(set(names)) != len(names):
            raise ValueError(f"pool tier names must be distinct, got {names}")
        if save_queue_size <= 0:
            raise ValueError(f"save_queue_size must be positive, got {save_queue_size}")
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self.save_queue_size = save_queue_size
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._lock = threading.Lock()  # counters, observations, back-off
        self._states = [_TierState(t) for t in self.tiers]
        self._store_counters = {"save_drops": 0.0, "saves": 0.0}
        self._observations: dict[str, list[float]] = {}
        # Save queue: items wait in _queue; _in_flight counts items the thread is writing.
        self._cv = threading.Condition()
        self._queue: deque[tuple[str, bytes]] = deque()
        self._in_flight = 0
        self._closing = False
        self._closed = False
        self.tier_events: PoolTierEvents | None = None
        self._thread = threading.Thread(target=self._save_loop, name="kvpool-save", daemon=True)
        self._thread.start()

    def set_tier_events(self, events: PoolTierEvents) -> None:
        """Report every tier's stored and dropped chunks to `events` from now on (KV events;
        the engine calls it once at start-up, before requests run)."""
        self.tier_events = events
        for tier in self.tiers:
            tier.set_event_listener(events)

    @property
    def all_local(self) -> bool:
        """Every tier answers `contains_many` from process memory (lookup may run inline)."""
        return all(t.local_index for t in self.tiers)

    # -- tier calls with back-off and failure counting ------------------------------------

    def _call(self, st: _TierState, fn: Callable[[], T]) -> T:
        """Run one tier call. Raises _Skipped while the tier backs off and TierError (already
        counted) when the call fails; any other exception from a tier counts as "other"."""
        with self._lock:
            if self._clock() < st.down_until:
                st.counters["skipped"] += 1
                raise _Skipped
        try:
            return fn()
        except TierError as e:
            self._count_failure(st, e.kind, str(e))
            raise
        except Exception as e:
            logger.exception("pool tier %s raised", st.tier.name)
            self._count_failure(st, "other", repr(e))
            raise TierError(f"{st.tier.name}: {e!r}", "other") from e

    def _count_failure(self, st: _TierState, kind: str, why: str = "") -> None:
        """Count one failure of `kind`; an "unavailable"/"timeout" one starts the tier's back-off
        and, once per down period, logs a warning that names the cause (`why`: the error's
        text, e.g. redis's "invalid username-password pair")."""
        with self._lock:
            key = f"failures_{kind}"
            st.counters[key] = st.counters.get(key, 0.0) + 1
            if kind in DOWN_KINDS:
                now = self._clock()
                if st.down_until <= now:  # once per down period, not per call
                    logger.warning("pool tier %s is %s (%s): skipped (misses) for %.1f s, then "
                                   "retried", st.tier.name, kind, why, self.retry_after_s)
                st.down_until = now + self.retry_after_s

    def _add(self, st: _TierState, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                st.counters[k] += v

    def _observe(self, name: str, seconds: float) -> None:
        with self._lock:
            self._observations.setdefault(name, []).append(seconds)

    # -- lookup / get ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> int:
        """Length of the leading run of `keys` present in some tier (see `contains`)."""
        found = self.contains(keys)
        run = 0
        while run < len(found) and found[run]:
            run += 1
        return run

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether some tier holds each of `keys`.

        Tiers are asked fastest first, each only for the keys no earlier tier had (one
        `contains_many` call per tier); a tier that fails or backs off counts as having none.
        Pins nothing, touches no LRU order, so a key reported present may be gone by the time
        it is read. Blocks for a round trip per remote tier: call it off the engine thread
        unless `all_local`. Thread-safe.
        """
        pending = list(range(len(keys)))
        found = [False] * len(keys)
        for st in self._states:
            if not pending:
                break
            asked = [keys[i] for i in pending]
            try:
                present = self._call(st, partial(st.tier.contains_many, asked))
            except (_Skipped, TierError):
                continue
            self._add(st, lookups=len(asked), hits=sum(present))
            for i, p in zip(pending, present):
                found[i] = bool(p)
            pending = [i for i in pending if not found[i]]
        return found

    def get(
        self, key: str, num_tokens: int, group_lengths: Sequence[int]
    ) -> list[memoryview] | None:
        """The chunk's per-group payloads, or None when no tier has a valid copy.

        Fastest tier first; each value is verified (`decode_chunk`): a corrupt one is removed from
        its tier, counted as failures_corrupt, and the next tier is tried. A hit in a slower tier
        is put into every faster tier (failures counted, never raised). Blocks on tier I/O; call
        it from a load thread. Thread-safe.
        """
        for i, st in enumerate(self._states):
            t0 = time.perf_counter()
            try:
                value = self._call(st, partial(st.tier.get, key))
            except (_Skipped, TierError):
                continue
            if value is None:
                continue
            try:
                groups = decode_chunk(value, key, num_tokens, group_lengths)
            except CorruptChunk as e:
                logger.warning("pool tier %s: %s; entry removed", st.tier.name, e)
                self._count_failure(st, "corrupt")
                with contextlib.suppress(_Skipped, TierError):
                    self._call(st, partial(st.tier.remove, key))
                continue
            self._add(st, chunks_read=1, bytes_read=len(value))
            self._observe(f"{st.prefix}load_seconds", time.perf_counter() - t0)
            for faster in self._states[:i]:
                self._put(faster, key, value)
            return groups
        return None

    # -- save -----------------------------------------------------------------------------

    def save(self, key: str, value: bytes) -> bool:
        """Queue `value` to be written to every tier by the save thread. Never blocks.

        Returns:
            True when queued; False when the queue is full or the store is closed (counted as
            save_drops).
        """
        with self._cv:
            if self._closing or len(self._queue) >= self.save_queue_size:
                accepted = False
            else:
                self._queue.append((key, value))
                self._cv.notify_all()
                accepted = True
        with self._lock:
            self._store_counters["saves" if accepted else "save_drops"] += 1
        if not accepted and self.tier_events is not None:
            self.tier_events.forget(key)
        return accepted

    def _put(self, st: _TierState, key: str, value: bytes) -> None:
        t0 = time.perf_counter()
        try:
            self._call(st, partial(st.tier.put, key, value))
        except (_Skipped, TierError):
            return
        self._add(st, chunks_written=1, bytes_written=len(value))
        self._observe(f"{st.prefix}save_seconds", time.perf_counter() - t0)

    def _save_to(self, st: _TierState, key: str, value: bytes) -> None:
        """Write one queued save to a tier unless the tier already holds `key` (counted as
        save_skips). The check is one `contains_many` call: for a remote tier a round trip of a
        few bytes instead of rewriting the whole chunk (a chunk saved again by a producer that
        never looks up, or by a request whose prefix cache hid what the pool holds). A failed
        check is counted as the tier's failure and drops this tier's write, as a failed write
        would; a tier in its back-off is skipped (counted there)."""
        try:
            held = self._call(st, partial(st.tier.contains_many, [key]))
        except (_Skipped, TierError):
            return
        if held and held[0]:
            self._add(st, save_skips=1)
            return
        self._put(st, key, value)

    def _save_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return  # closing and drained
                key, value = self._queue.popleft()
                self._in_flight += 1
            try:
                for st in self._states:
                    self._save_to(st, key, value)
            finally:
                if self.tier_events is not None:
                    self.tier_events.forget(key)
                with self._cv:
                    self._in_flight -= 1
                    self._cv.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued save was attempted on every tier.

        Returns:
            True when done; False when `timeout_s` seconds passed first.
        """
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._in_flight, timeout_s)

    # -- metrics --------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Cumulative counters: per tier "pool:<tier>:<name>" for lookups (keys asked), hits
        (keys found), chunks_read, bytes_read, chunks_written, bytes_written, save_skips (saves
        not written because the tier held the key), evictions, skipped,
        failures_<kind>, and the gauge bytes_in_use; store-wide "pool:all:saves" (values
        accepted), "pool:all:save_drops" and the gauge "pool:all:save_queue_depth" (queued +
        being written)."""
        in_use: list[float] = []
        evicted: list[int] = []
        for st in self._states:
            try:
                evicted.append(st.tier.take_evictions())
                in_use.append(float(st.tier.bytes_in_use()))
            except Exception:
                logger.exception("pool tier %s stats failed", st.tier.name)
                evicted.append(0)
                in_use.append(0.0)
        with self._cv:
            depth = float(len(self._queue) + self._in_flight)
        out: dict[str, float] = {}
        with self._lock:
            for st, n, used in zip(self._states, evicted, in_use):
                st.counters["evictions"] += n
                out.update({st.prefix + k: v for k, v in st.counters.items()})
                out[st.prefix + "bytes_in_use"] = used
            out.update({f"pool:all:{k}": v for k, v in self._store_counters.items()})
        out["pool:all:save_queue_depth"] = depth
        return out

    def take_observations(self) -> dict[str, list[float]]:
        """Histogram samples since the last call: "pool:<tier>:load_seconds" (one verified get,
        read + decode) and "pool:<tier>:save_seconds" (one put, including promotions)."""
        with self._lock:
            obs, self._observations = self._observations, {}
        return obs

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting saves, let the save thread drain the queue for up to `timeout_s`
        seconds (what is left is dropped and counted as save_drops), then close every tier.
        Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        with self._cv:
            dropped = len(self._queue)
            self._queue.clear()
        with self._lock:
            self._store_counters["save_drops"] += dropped
        for st in self._states:
            try:
                st.tier.close()
            except Exception:
                logger.exception("pool tier %s close failed", st.tier.name)
