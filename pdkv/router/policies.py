"""Routing policies for the P/D proxy: pick one backend among several (chosen by name)."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class Backend:
    """One engine behind the proxy.

    Attributes:
        url: base URL, e.g. http://127.0.0.1:8100.
        inflight: requests the proxy has sent and not yet seen finish.
    """

    url: str
    inflight: int = 0


class RoutingPolicy(ABC):
    """Chooses a backend for each request leg. Called from the proxy's event loop only."""

    @abstractmethod
    def choose(self, backends: list[Backend]) -> Backend:
        """One of `backends` (non-empty)."""


class RoundRobin(RoutingPolicy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, backends: list[Backend]) -> Backend:
        return backends[next(self._counter) % len(backends)]


class LeastLoaded(RoutingPolicy):
    """Fewest in-flight requests; ties go round-robin."""

    def __init__(self) -> None:
        self._rr = RoundRobin()

    def choose(self, backends: list[Backend]) -> Backend:
        low = min(b.inflight for b in backends)
        return self._rr.choose([b for b in backends if b.inflight == low])


POLICIES: dict[str, type[RoutingPolicy]] = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}


def make_policy(name: str) -> RoutingPolicy:
    """Raises ValueError for an unknown name."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}") from None
