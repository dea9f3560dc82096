"""What the P2P worker half reports to the scheduler each step (finished sends and loads, load
errors, counters), shared by its producer and consumer sides; every method is thread-safe."""

from __future__ import annotations

import threading
from collections.abc import Callable


class WorkerResults:
    """Accumulates results between two `take()` calls and wakes the engine loop when one arrives.

    Args:
        wakeup: returns the engine loop's wake-up callback (or None before it is set); called
            from any thread after a result is recorded.
    """

    def __init__(self, wakeup: Callable[[], Callable[[], None] | None]) -> None:
        self.lock = threading.Lock()
        self._wakeup = wakeup
        self.sent: set[str] = set()
        self.recved: set[str] = set()
        self.bad_blocks: set[tuple[int, int]] = set()  # (KV cache group, block id)
        self.errors: dict[str, str] = {}
        self.stats: dict[str, float] = {}
        self.request_bytes: dict[str, dict[str, float]] = {}
        self.transfer_times: list[float] = []

    def wake(self) -> None:
        """Wake the engine loop (never blocks)."""
        fn = self._wakeup()
        if fn is not None:
            fn()

    def count(self, key: str, value: float = 1.0) -> None:
        """Lock held: add `value` to counter `key`."""
        self.stats[key] = self.stats.get(key, 0.0) + value

    def send_finished(self, rid: str, how: str, nbytes: int = 0) -> None:
        """Lock held: producer request `rid`'s blocks may be freed ("done" after `nbytes` were read,
        "release" unread, "expired" lease)."""
        self.sent.add(rid)
        if how == "done":
            self.count("kv_bytes_sent", nbytes)
        elif how == "expired":
            self.count("lease_expirations")
        elif how == "release":
            self.count("released_unread")
        self.wake()

    def load_succeeded(self, rid: str, nbytes: int, seconds: float, read_ops: int = 0) -> None:
        """A pull of `nbytes` in `read_ops` read operations (ReadOps submitted to the transfer
        engine; counter "kv_read_ops") ended well after `seconds`."""
        with self.lock:
            self.count("kv_bytes_received", nbytes)
            self.count("kv_read_ops", read_ops)
            self.request_bytes[rid] = {"p2p": float(nbytes)}
            self.count("kv_transfers")
            self.transfer_times.append(seconds)
            self.recved.add(rid)
        self.wake()

    def load_failed(self, rid: str, error: str, local_block_ids: tuple[list[int], ...]) -> None:
        """A pull ended in error; its local blocks (per KV cache group) hold undefined data."""
        with self.lock:
            self.errors[rid] = error
            self.count("kv_load_failures")
            self.bad_blocks.update((g, b) for g, group in enumerate(local_block_ids) for b in group)
            self.recved.add(rid)
        self.wake()

    def load_empty(self, rid: str) -> None:
        """A load with nothing to move ended (a push window without blocks: D's KV pool or
        prefix cache held the whole prompt): reported done; no transfer, no bytes counted."""
        with self.lock:
            self.recved.add(rid)
        self.wake()

    def load_abandoned(self, rid: str) -> None:
        """A load that nobody waits for any more (its request was aborted) ended; its blocks may
        be freed. Neither a transfer nor a failure: nothing is counted."""
        with self.lock:
            self.recved.add(rid)
        self.wake()

    def take_finished(self) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) since the last call."""
        with self.lock:
            sent, recved = self.sent, self.recved
            self.sent, self.recved = set(), set()
        return sent, recved

    def take_bad_blocks(self) -> set[tuple[int, int]]:
        with self.lock:
            bad, self.bad_blocks = self.bad_blocks, set()
        return bad

    def take_request_bytes(self) -> dict[str, dict[str, float]]:
        with self.lock:
            out, self.request_bytes = self.request_bytes, {}
        return out

    def take_errors(self) -> dict[str, str]:
        with self.lock:
            errors, self.errors = self.errors, {}
        return errors

    def take_stats(self) -> tuple[dict[str, float], list[float]]:
        with self.lock:
            stats, self.stats = self.stats, {}
            times, self.transfer_times = self.transfer_times, []
        return stats, times
