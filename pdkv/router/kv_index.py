"""The router's index of which instance holds which KV blocks, fed by KV cache events (torch-free).

Each instance (a backend URL) publishes vLLM-layout KV events (`pdkv.kv_events`): BlockStored /
BlockRemoved for its own KV cache (medium "GPU", whatever the device) and, for a KV pool, for
each tier it writes (the tier as the medium, blocks of the tier's chunk size). The index keeps,
per instance and medium, the set of block hashes held and the tokens per block of that medium,
and answers one question: how long a prefix of a prompt each instance holds, block by block, in
the best medium that holds each block.

A block hash covers every token before it (`pdkv.block_hashing`), so a prompt's held prefix is
the leading run of its block hashes found in the index; a medium with bigger blocks (a pool
chunk of k engine blocks, hashed by its last block) holds engine block i when it holds the hash
of the last engine block of i's chunk. What the index cannot see: a block the engine evicted
whose BlockRemoved has not arrived yet, and anything from before a subscriber joined unless a
replay filled it; the subscriber clears an instance on an epoch change (a restart) and on a gap a
replay could not fill, so the index errs towards "not held". AllBlocksCleared (the engine's
POST /reset_prefix_cache) clears only the engine's own cache (medium GPU): a reset leaves the pool
tiers' chunks where they are, and the engine still loads them.

Bounded: at most `max_blocks_per_instance` hashes per instance and medium; beyond it the oldest
stored are dropped first (the engine's LRU evicts roughly in that order too).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdkv.block_hashing import BlockHash
from pdkv.kv_events.schema import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, Event

DEFAULT_MEDIUM_WEIGHTS: Mapping[str, float] = {
    MEDIUM_GPU: 1.0,  # the engine's own KV cache: a prefix-cache hit, no copy
    "CPU": 0.8,  # vLLM's CPU offload medium
    "DRAM": 0.8,  # pdkv pool tiers: a copy from local memory
    "DISK": 0.5,  # a read from a local file system
    "REDIS": 0.4,  # over the network
    "MOONCAKE": 0.5,  # over the network, RDMA where it has it
}
"""How much a block held in each medium is worth against one the engine must compute (1.0 = the
engine's own cache). Starting values, not measured: a tier's load costs less than a prefill of
the same tokens on every machine pdkv targets, and more the farther the tier is."""

DEFAULT_UNKNOWN_MEDIUM_WEIGHT = 0.3
DEFAULT_MAX_BLOCKS_PER_INSTANCE = 1 << 18


@dataclass(frozen=True)
class KVIndexConfig:
    """The index's weights and bound.

    Attributes:
        medium_weights: weight of a block in each medium (upper-case medium name), 0..1.
        unknown_medium_weight: weight of a medium not in `medium_weights`.
        max_blocks_per_instance: most hashes kept per instance and medium (32 bytes + set and
            dict overhead, ~150 bytes each: the default 262,144 is ~40 MB per instance and
            medium at worst).

    Raises:
        ValueError: a weight outside [0, 1] or max_blocks_per_instance < 1.
    """

    medium_weights: Mapping[str, float] = field(
        default_factory=lambda: dict(DEFAULT_MEDIUM_WEIGHTS))
    unknown_medium_weight: float = DEFAULT_UNKNOWN_MEDIUM_WEIGHT
    max_blocks_per_instance: int = DEFAULT_MAX_BLOCKS_PER_INSTANCE

    def __post_init__(self) -> None:
        for name, w in [*self.medium_weights.items(), ("unknown", self.unknown_medium_weight)]:
            if not 0.0 <= w <= 1.0:
                raise ValueError(f"medium weight of {name} must be in [0, 1], got {w}")
        if self.max_blocks_per_instance < 1:
            raise ValueError(
                f"max_blocks_per_instance must be >= 1, got {self.max_blocks_per_instance}")

    def weight(self, medium: str) -> float:
        """The weight of `medium` (case-insensitive)."""
        return self.medium_weights.get(medium.upper(), self.unknown_medium_weight)


@dataclass(frozen=True)
class Overlap:
    """What one instance holds of a prompt.

    Attributes:
        blocks: leading engine blocks held in some medium.
        engine_blocks: leading engine blocks held in the engine's own cache (medium GPU): what
            the engine's prefix cache should report as cached, times the block size.
        weighted_blocks: sum over the `blocks` held of the best weight among the media that
            hold each one.
    """

    blocks: int = 0
    engine_blocks: int = 0
    weighted_blocks: float = 0.0


@dataclass
class _Medium:
    block_size: int  # tokens per block of this medium (0: none seen yet)
    hashes: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)


class KVIndex:
    """Instance -> medium -> held block hashes. Called from one thread (the router's loop)."""

    def __init__(self, config: KVIndexConfig | None = None) -> None:
        self.config = config or KVIndexConfig()
        self._held: dict[str, dict[str, _Medium]] = {}

    # ------------------------------------------------------------------ updates
    def apply(self, instance: str, event: Event) -> None:
        """Apply one event of `instance`'s. A medium of None is the engine's cache (vLLM's
        publisher leaves it None in some versions). AllBlocksCleared (no medium in vLLM's
        schema; only the prefix cache sends it) drops the engine cache's hashes only."""
        if isinstance(event, AllBlocksCleared):
            media = self._held.get(instance)
            if media is not None:
                media.pop(MEDIUM_GPU, None)
                if not media:
                    del self._held[instance]
            return
        medium = (event.medium or MEDIUM_GPU).upper()
        media = self._held.setdefault(instance, {})
        if isinstance(event, BlockStored):
            held = media.get(medium)
            if held is None or held.block_size != event.block_size:
                # A new medium, or its block size changed (a restart with other settings that
                # the epoch did not reveal): what was known of it is of no use.
                held = media[medium] = _Medium(event.block_size)
            for h in event.block_hashes:
                held.hashes[h] = None
                held.hashes.move_to_end(h)
            while len(held.hashes) > self.config.max_blocks_per_instance:
                held.hashes.popitem(last=False)
        elif isinstance(event, BlockRemoved):
            held = media.get(medium)
            if held is not None:
                for h in event.block_hashes:
                    held.hashes.pop(h, None)

    def clear(self, instance: str) -> None:
        """Forget everything `instance` holds (a restart, AllBlocksCleared, an unfilled gap)."""
        self._held.pop(instance, None)

    # ------------------------------------------------------------------ queries
    def num_blocks(self, instance: str) -> dict[str, int]:
        """Hashes held per medium of `instance` (for the index-size metric)."""
        return {m: len(h.hashes) for m, h in self._held.get(instance, {}).items()}

    def instances(self) -> list[str]:
        """Instances with anything recorded."""
        return list(self._held)

    def overlap(self, instance: str, block_hashes: Sequence[BlockHash], block_size: int
                ) -> Overlap:
        """How much of a prompt `instance` holds.

        Args:
            instance: the backend URL the events came from.
            block_hashes: the prompt's full blocks' hashes at the engine's block size, in order
                (`pdkv.block_hashing.hash_request_tokens`).
            block_size: the engine's tokens per block (a medium whose blocks are k times bigger
                holds engine block i when it holds the hash of block (i // k + 1) * k - 1).

        Raises:
            ValueError: block_size < 1.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        media = self._held.get(instance)
        if not media:
            return Overlap()
        n = len(block_hashes)
        per_medium = []  # (weight, blocks per medium block, hashes)
        for name, held in media.items():
            if held.block_size % block_size or not held.hashes:
                continue  # a granularity the prompt's hashes cannot be matched at
            per_medium.append((name, self.config.weight(name), held.block_size // block_size,
                               held.hashes))
        blocks = engine = 0
        weighted = 0.0
        for i in range(n):
            best = -1.0
            in_engine = False
            for name, w, k, hashes in per_medium:
                last = (i // k + 1) * k - 1
                if last < n and block_hashes[last] in hashes:
                    best = max(best, w)
                    in_engine = in_engine or name == MEDIUM_GPU
            if best < 0:
                break
            blocks += 1
            weighted += best
            if in_engine and engine == i:
                engine += 1
        return Overlap(blocks, engine, weighted)
