"""Routing policies for the proxy: pick one backend among several (chosen by name).

round_robin and least_loaded look at nothing but the backends; prefix_aware also looks at the
request's chunk hashes (`pdkv.router.prefix_keys`) and at its own record of which chunk hashes
it sent where (approximate, like SGLang's cache-aware router: the proxy does not see evictions;
bounded, least recently routed forgotten first).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass
class Backend:
    """One engine behind the proxy.

    Attributes:
        url: base URL, e.g. http://127.0.0.1:8100.
        inflight: requests the proxy has sent and not yet seen finish.
        active_blocks: prompt blocks of those requests (`Decision.load_blocks` summed; kv_aware's
            load).
    """

    url: str
    inflight: int = 0
    active_blocks: int = 0


@dataclass
class Claim:
    """One request leg's load on its backend: counted in the backend's `inflight` and
    `active_blocks` from `start` to `end`.

    Attributes:
        backend: where the leg goes.
        blocks: the leg's prompt blocks (`Decision.load_blocks`).
        on_end: called once by `end` with what the engine answered of the request (its
            `pdkv_timings` object, or None when there was none), e.g. to check a prediction.
    """

    backend: Backend
    blocks: int = 0
    on_end: Callable[[object], None] | None = None

    def start(self) -> None:
        """The leg was sent."""
        self.backend.inflight += 1
        self.backend.active_blocks += self.blocks

    def end(self, answer: object = None) -> None:
        """The leg ended (answered, failed or cancelled); `answer` as for `on_end`."""
        self.backend.inflight -= 1
        self.backend.active_blocks -= self.blocks
        if self.on_end is not None:
            on_end, self.on_end = self.on_end, None
            on_end(answer)


@dataclass(frozen=True)
class Decision:
    """A routing decision.

    Attributes:
        backend: the chosen backend.
        reason: why: the policy's name for round_robin / least_loaded; for prefix_aware
            "prefix_hit" (the chosen backend holds the longest prefix among those within the load
            bound), "load" (some backend holds a prefix but each that does is over the load bound:
            least loaded), "no_match" (nobody holds any chunk: least loaded), "fallback" (no chunk
            hashes for this request: least loaded).
        matched_chunks: leading chunks of the request the chosen backend holds (per the record;
            kv_aware: leading blocks in the engine's own cache, per the KV event index).
        load_blocks: blocks the request adds to the backend's `active_blocks` until it finishes
            (0 for policies that do not count blocks).
    """

    backend: Backend
    reason: str
    matched_chunks: int = 0
    load_blocks: int = 0


HashesByUrl = Mapping[str, Sequence[bytes]]
"""A request's chunk hashes as each backend cuts it (backends may differ in block/chunk size)."""


class RoutingPolicy(ABC):
    """Chooses a backend for each request leg. Called from the proxy's event loop only."""

    name = ""

    @abstractmethod
    def choose(self, backends: list[Backend]) -> Backend:
        """One of `backends` (non-empty)."""

    def decide(self, backends: list[Backend], hashes: HashesByUrl | None = None) -> Decision:
        """The decision for a request whose chunk hashes are `hashes` (None: unknown)."""
        return Decision(self.choose(backends), self.name)

    @property
    def wants_hashes(self) -> bool:
        """Whether decide() uses the chunk hashes (the proxy computes them only then)."""
        return False

    block_hashes = False
    """Whether the hashes decide() wants are per engine block (chunk size = block size) rather
    than per pool chunk."""


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, backends: list[Backend]) -> Backend:
        return backends[next(self._counter) % len(backends)]


class LeastLoaded(RoutingPolicy):
    """Fewest in-flight requests; ties go round-robin."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._rr = RoundRobin()

    def choose(self, backends: list[Backend]) -> Backend:
        low = min(b.inflight for b in backends)
        return self._rr.choose([b for b in backends if b.inflight == low])


DEFAULT_MAX_IMBALANCE = 0.5
DEFAULT_MAX_ENTRIES = 1 << 16


@dataclass(frozen=True)
class PrefixAwareConfig:
    """prefix_aware's bounds.

    Attributes:
        max_imbalance: a backend takes a request for its prefix only while its in-flight count,
            this request included, stays within (1 + max_imbalance) × the mean in-flight count
            over all backends (this request included), or is 1: 0.5 means at most 50 % above
            the mean; a value >= N - 1 (N backends) never binds.
        max_entries: most (backend, chunk hash) pairs remembered (about 200 bytes each: the
            default 65,536 is ~13 MB); the least recently routed go first.
    Raises:
        ValueError: max_imbalance < 0 or max_entries < 1.
    """

    max_imbalance: float = DEFAULT_MAX_IMBALANCE
    max_entries: int = DEFAULT_MAX_ENTRIES

    def __post_init__(self) -> None:
        if not self.max_imbalance >= 0:
            raise ValueError(f"max_imbalance must be >= 0, got {self.max_imbalance}")
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {self.max_entries}")


class PrefixAware(RoutingPolicy):
    """Longest recorded prefix within the load bound; ties and misses go least loaded.

    A backend "holds" chunk i of a request when the proxy routed a request with that chunk hash
    to it and has not forgotten it; since a chunk hash covers every earlier token, the held prefix
    is the leading run of chunk hashes recorded for it. Every decision records the request's chunk
    hashes for the chosen backend, the first chunk as the most recent, so memory pressure drops
    the deepest chunks first (a radix tree's leaves).
    """

    name = "prefix_aware"

    def __init__(self, config: PrefixAwareConfig | None = None) -> None:
        self.config = config or PrefixAwareConfig()
        self._ll = LeastLoaded()
        self._seen: OrderedDict[tuple[str, bytes], None] = OrderedDict()

    @property
    def wants_hashes(self) -> bool:
        return True

    def __len__(self) -> int:
        """(backend, chunk hash) pairs remembered."""
        return len(self._seen)

    def choose(self, backends: list[Backend]) -> Backend:
        return self.decide(backends).backend

    def matched(self, url: str, hashes: Sequence[bytes]) -> int:
        """Leading chunks of `hashes` recorded for backend `url`."""
        n = 0
        for h in hashes:
            if (url, h) not in self._seen:
                break
            n += 1
        return n

    def record(self, url: str, hashes: Sequence[bytes]) -> None:
        """Remember that `url` now holds `hashes`; forget the least recent beyond the bound."""
        for h in reversed(hashes):
            key = (url, h)
            if key in self._seen:
                self._seen.move_to_end(key)
            else:
                self._seen[key] = None
        while len(self._seen) > self.config.max_entries:
            self._seen.popitem(last=False)

    def forget(self, url: str) -> None:
        """Drop everything recorded for `url` (e.g. the backend restarted empty)."""
        for key in [k for k in self._seen if k[0] == url]:
            del self._seen[key]

    def decide(self, backends: list[Backend], hashes: HashesByUrl | None = None) -> Decision:
        if hashes is None:
            return Decision(self._ll.choose(backends), "fallback")
        total = sum(b.inflight for b in backends)
        cap = max(1.0, (1.0 + self.config.max_imbalance) * (total + 1) / len(backends))
        matches = {b.url: self.matched(b.url, hashes.get(b.url, ())) for b in backends}
        eligible = [b for b in backends if b.inflight + 1 <= cap]
        best = max((matches[b.url] for b in eligible), default=0)
        if best > 0:
            chosen = self._ll.choose([b for b in eligible if matches[b.url] == best])
            reason = "prefix_hit"
        else:
            chosen = self._ll.choose(backends)
            reason = "load" if any(matches.values()) else "no_match"
        self.record(chosen.url, hashes.get(chosen.url, ()))
        return Decision(chosen, reason, matches[chosen.url])


POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix_aware": PrefixAware,
}
"""The policies that need nothing but their config."""

KV_EVENT_POLICIES = ("kv_aware", "kv_aware_oracle")
"""Policies that read the KV event index (`pdkv.router.kv_aware`; the proxy builds them, with
its subscriber): kv_aware, and kv_aware_oracle, the same cost over each engine's cache as the
engine reports it just before every decision (a benchmark's upper bound, one request to every
engine per decision)."""

POLICY_NAMES = (*POLICIES, *KV_EVENT_POLICIES)
"""Every routing policy name (`--routing`)."""


def make_policy(name: str, prefix_aware: PrefixAwareConfig | None = None) -> RoutingPolicy:
    """The policy called `name`; `prefix_aware` configures that one policy.

    Raises:
        ValueError: an unknown name.
    """
    if name == "prefix_aware":
        return PrefixAware(prefix_aware)
    if name in KV_EVENT_POLICIES:
        raise ValueError(f"routing policy {name!r} needs a KV event index: "
                         "pdkv.router.kv_aware builds it")
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICY_NAMES)}"
                         ) from None
