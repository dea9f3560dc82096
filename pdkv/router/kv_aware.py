"""kv_aware: route to the instance whose cached prefix saves the most prefill against its load,
judged from the KV event index (`pdkv.router.kv_index`), torch-free.

The cost of sending a request of n prompt blocks to instance b, lowest wins (NVIDIA Dynamo's KV
router cost, docs.nvidia.com/dynamo, "Router Design", "Cost Function": overlap weight x potential
prefill blocks + potential decode blocks):

    cost(b) = overlap_weight * (n - weighted_overlap(b)) + active_blocks(b) + n

- weighted_overlap(b): the prompt's leading blocks b holds, each weighted by the best medium
  holding it (1.0 the engine's own cache, less for a pool tier: `KVIndexConfig`), so a prefix in
  b's engine saves more than the same prefix in its disk tier.
- active_blocks(b): prompt blocks of the requests the router sent to b that have not finished
  (`Backend.active_blocks`, kept by the proxy), Dynamo's decode-block load.
Ties go to the fewest in-flight requests, then round-robin. With overlap_weight 0 the policy is
least-loaded by blocks; the larger it is, the more load an instance may carry for its cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pdkv.block_hashing import BlockHash
from pdkv.kv_events.schema import MEDIUM_GPU, BlockStored
from pdkv.router.kv_index import KVIndex, Overlap
from pdkv.router.policies import Backend, Decision, HashesByUrl, LeastLoaded, RoutingPolicy

logger = logging.getLogger(__name__)

DEFAULT_OVERLAP_WEIGHT = 1.0  # Dynamo's default kv-overlap-score-weight


@dataclass(frozen=True)
class KVAwareConfig:
    """kv_aware's cost weights.

    Attributes:
        overlap_weight: blocks of load one prefill block saved is worth (Dynamo's
            kv-overlap-score-weight); >= 0.

    Raises:
        ValueError: overlap_weight < 0.
    """

    overlap_weight: float = DEFAULT_OVERLAP_WEIGHT

    def __post_init__(self) -> None:
        if not self.overlap_weight >= 0:
            raise ValueError(f"overlap_weight must be >= 0, got {self.overlap_weight}")


class KVAware(RoutingPolicy):
    """Lowest cost per the module's formula, over the instances the KV event index knows.

    `hashes` given to decide() must be each backend's block hashes at its engine block size (the
    proxy cuts them with chunk size = block size); `block_size` gives that size for a backend URL
    (default: 16, the engine default, for every backend).
    """

    name = "kv_aware"

    def __init__(self, index: KVIndex, config: KVAwareConfig | None = None,
                 block_size: Callable[[str], int] = lambda url: 16) -> None:
        self.index = index
        self.config = config or KVAwareConfig()
        self.block_size = block_size
        self._ll = LeastLoaded()

    block_hashes = True

    @property
    def wants_hashes(self) -> bool:
        return True

    def choose(self, backends: list[Backend]) -> Backend:
        return self.decide(backends).backend

    def overlaps(self, backends: list[Backend], hashes: HashesByUrl) -> dict[str, Overlap]:
        """What each backend holds of the request, per the index."""
        return {b.url: self.index.overlap(b.url, hashes.get(b.url, ()),
                                          self.block_size(b.url))
                for b in backends}

    def decide(self, backends: list[Backend], hashes: HashesByUrl | None = None) -> Decision:
        if hashes is None:
            chosen = self._ll.choose(backends)
            return Decision(chosen, "fallback")
        overlaps = self.overlaps(backends, hashes)
        w = self.config.overlap_weight
        costs = {}
        for b in backends:
            n = len(hashes.get(b.url, ()))
            costs[b.url] = w * (n - overlaps[b.url].weighted_blocks) + b.active_blocks + n
        low = min(costs.values())
        chosen = self._ll.choose([b for b in backends if costs[b.url] == low])
        best = max(o.weighted_blocks for o in overlaps.values())
        got = overlaps[chosen.url]
        if best == 0:
            reason = "no_match"
        elif got.weighted_blocks == best:
            reason = "kv_hit"
        else:
            reason = "load"  # another instance holds more, but its load outweighs it
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: %s (%s); %s", self.name, chosen.url, reason, ", ".join(
                f"{b.url}: cost {costs[b.url]:.1f} overlap {overlaps[b.url].weighted_blocks:.1f}"
                f" active {b.active_blocks}" for b in backends))
        return Decision(chosen, reason, got.engine_blocks,
                        load_blocks=len(hashes.get(chosen.url, ())))


class KVAwareOracle(KVAware):
    """kv_aware's cost over what each engine's cache really holds: before every decision the
    owner asks each engine (POST /kv_events/held) and calls `set_held`; no events are read. The
    routing benchmark's reference for how good kv_aware's event-fed index is."""

    name = "kv_aware_oracle"

    def __init__(self, config: KVAwareConfig | None = None,
                 block_size: Callable[[str], int] = lambda url: 16) -> None:
        super().__init__(KVIndex(), config, block_size)

    def set_held(self, url: str, held: list[BlockHash], block_size: int) -> None:
        """`url`'s engine holds exactly `held` (a prompt's leading block hashes) of what the next
        decision asks about."""
        self.index.clear(url)
        if held:
            self.index.apply(url, BlockStored(block_hashes=held, parent_block_hash=None,
                                              token_ids=[], block_size=block_size, lora_id=None,
                                              medium=MEDIUM_GPU, lora_name=None))
