"""Per-peer bounded concurrency on a shared thread pool: a peer that never answers can occupy
at most `per_peer` threads, so work for other peers keeps flowing."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Executor

logger = logging.getLogger(__name__)


class PeerQueues:
    """FIFO per peer key, at most `per_peer` jobs of one peer running at once on `executor`.

    Args:
        executor: where jobs run (its own size bounds the total).
        per_peer: jobs of one peer running at once (>= 1).
        max_queued: jobs of one peer waiting at once; `submit` refuses more.

    Thread-safe; `submit` never blocks.
    """

    def __init__(self, executor: Executor, per_peer: int, max_queued: int = 1024) -> None:
        if per_peer < 1:
            raise ValueError(f"per_peer must be >= 1, got {per_peer}")
        self.executor = executor
        self.per_peer = per_peer
        self.max_queued = max_queued
        self._lock = threading.Lock()
        self._waiting: dict[Hashable, deque[Callable[[], None]]] = {}
        self._running: dict[Hashable, int] = {}

    def submit(self, peer: Hashable, job: Callable[[], None]) -> bool:
        """Queue `job` for `peer`; False (job dropped) when the peer's queue is full."""
        with self._lock:
            queue = self._waiting.setdefault(peer, deque())
            if len(queue) >= self.max_queued:
                return False
            queue.append(job)
            self._dispatch(peer)
        return True

    def running(self, peer: Hashable) -> int:
        """Jobs of `peer` running now."""
        with self._lock:
            return self._running.get(peer, 0)

    def _dispatch(self, peer: Hashable) -> None:
        """Lock held: start waiting jobs of `peer` while it has free slots."""
        queue = self._waiting.get(peer)
        while queue and self._running.get(peer, 0) < self.per_peer:
            job = queue.popleft()
            self._running[peer] = self._running.get(peer, 0) + 1
            try:
                self.executor.submit(self._run, peer, job)
            except RuntimeError:  # executor shut down
                self._running[peer] -= 1
                queue.clear()
        if queue is not None and not queue and not self._running.get(peer):
            self._waiting.pop(peer, None)
            self._running.pop(peer, None)

    def _run(self, peer: Hashable, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception:  # noqa: BLE001 - a job's failure must not stall its peer's queue
            logger.exception("peer job failed")
        finally:
            with self._lock:
                self._running[peer] -= 1
                self._dispatch(peer)
