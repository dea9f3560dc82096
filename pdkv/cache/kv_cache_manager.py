"""KV cache manager: per-request block tables over every KV cache group (torch-free).

The scheduler talks only to this class (vLLM's `KVCacheManager`): look up prefix hits, allocate
slots for the tokens of a step, free a request, read block ids. Internally one
`SingleTypeKVCacheManager` and one `BlockPool` per group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdkv.block_hashing import BlockHash
from pdkv.cache.block_pool import BlockPool, KVCacheBlock
from pdkv.cache.single_type_manager import (
    LinearStateManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    get_manager_class,
)
from pdkv.cache.specs import KVCacheConfig
from pdkv.kv_events.schema import Event
from pdkv.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks per group, opaque to the scheduler except for their ids."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group."""
        return tuple([b.block_id for b in group] for group in self.blocks)

    def __len__(self) -> int:
        return len(self.blocks[0]) if self.blocks else 0


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since start (tokens)."""

    queries: int = 0
    hits: int = 0
    requests: int = 0


class KVCacheManager:
    """Allocates and frees the blocks of requests across all KV cache groups.

    Args:
        kv_cache_config: groups and blocks per group.
        enable_caching: prefix caching on/off.
        max_model_len: longest sequence in tokens.
        enable_kv_cache_events: the block pools record KV cache events (`take_events`).

    Called only from the engine loop thread; no method blocks.
    """

    def __init__(
        self, kv_cache_config: KVCacheConfig, enable_caching: bool, max_model_len: int,
        enable_kv_cache_events: bool = False,
    ) -> None:
        self.config = kv_cache_config
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_size = kv_cache_config.groups[0].spec.block_size
        if any(g.spec.block_size != self.block_size for g in kv_cache_config.groups):
            raise ValueError("all KV cache groups must share one block size")
        # A null block only where the group's manager needs one (sliding window); a dense
        # model's single pool keeps every block usable.
        self.block_pools = [
            BlockPool(
                kv_cache_config.num_blocks, enable_caching,
                reserve_null_block=get_manager_class(g.spec).needs_null_block,
                enable_kv_cache_events=enable_kv_cache_events,
            )
            for g in kv_cache_config.groups
        ]
        self.managers: list[SingleTypeKVCacheManager] = [
            get_manager_class(g.spec)(g.spec, pool, i)
            for i, (g, pool) in enumerate(zip(kv_cache_config.groups, self.block_pools))
        ]
        self.prefix_cache_stats = PrefixCacheStats()

    # ------------------------------------------------------------------ queries
    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the most loaded group (what limits admission)."""
        return min(p.num_free_blocks for p in self.block_pools)

    @property
    def usage(self) -> float:
        """KV cache usage fraction in [0, 1] (max over groups)."""
        return max(p.usage for p in self.block_pools)

    @property
    def num_blocks_freed_early(self) -> int:
        """Sliding-window blocks released before their request finished, since start (all
        groups)."""
        return sum(
            m.num_blocks_freed_early for m in self.managers if isinstance(m, SlidingWindowManager)
        )

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table per group (a sliding-window group has the null block's id
        at positions it no longer holds)."""
        return tuple(m.block_ids(request_id) for m in self.managers)

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request holds, all groups, null-block entries not counted."""
        return sum(
            1 for m in self.managers for b in m.req_to_blocks.get(request_id, ()) if not b.is_null
        )

    def empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.managers))

    # ------------------------------------------------------------------ lookup
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest prefix-cache hit of the request, in whole blocks.

        Each group finds its own hit (full attention: the cached prefix; sliding window: the
        longest length whose window blocks are cached); the hit is the longest length L that
        every group can give (vLLM's HybridKVCacheCoordinator): groups are searched again with
        max_length = the shortest hit so far until all agree. At least one token is always left to
        compute (its logits give the next token), so the hit is capped at num_tokens - 1. A request
        asking for prompt_logprobs gets no hit (every prompt position's logits are needed; vLLM
        skips the cache read too). Side-effect free (may be called again next step).

        Returns:
            (blocks per group, number of computed tokens they cover).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self.empty_blocks(), 0
        max_length = request.num_tokens - 1
        while True:
            hits = [
                m.find_longest_cache_hit(request.block_hashes, max_length) for m in self.managers
            ]
            num_blocks = min(len(h) for h in hits)
            if all(len(h) == num_blocks for h in hits):
                return KVCacheBlocks(tuple(hits)), num_blocks * self.block_size
            # A hit found under a shorter max_length is never longer: this ends.
            max_length = num_blocks * self.block_size

    def num_cached_leading(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `block_hashes` the prefix cache holds now (in the first
        KV cache group: the one whose hashes the KV events publish). Safe to call from another
        thread (dictionary lookups only): the answer is a snapshot."""
        pool = self.block_pools[0]
        for i, h in enumerate(block_hashes):
            if pool.get_cached_block(h) is None:
                return i
        return len(block_hashes)

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup in the prefix-cache statistics."""
        if not self.enable_caching:
            return
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += num_query_tokens
        self.prefix_cache_stats.hits += num_hit_tokens

    # -------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_new_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        num_reserved_blocks: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens of the request.

        Args:
            request: the request (its num_computed_tokens are already in its blocks).
            num_new_tokens: tokens to compute in this step.
            new_computed_blocks: prefix-cache hits to attach (first scheduling only).
            num_new_computed_tokens: tokens covered by those hits.
            num_external_computed_tokens: tokens a KV connector will load into new blocks.
            num_reserved_blocks: blocks of every group that must stay free afterwards.

        First every group drops the blocks no query from `request.num_computed_tokens` on
        reads (sliding window; vLLM does this before counting too), so they count as free.

        Returns:
            The newly allocated blocks per group, or None when the pool is too small now, or
            would keep fewer than `num_reserved_blocks` free (nothing else is changed then).
        """
        for m in self.managers:
            m.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        hits = new_computed_blocks.blocks if new_computed_blocks else tuple(
            [] for _ in self.managers
        )
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = min(
            num_computed + num_external_computed_tokens + num_new_tokens, self.max_model_len
        )
        need = [
            m.get_num_blocks_to_allocate(request.request_id, total, h)
            for m, h in zip(self.managers, hits)
        ]
        if any(n + num_reserved_blocks > p.num_free_blocks
               for n, p in zip(need, self.block_pools)):
            return None
        new_blocks = []
        for m, h in zip(self.managers, hits):
            m.save_new_computed_blocks(request.request_id, h)
            new_blocks.append(m.allocate_new_blocks(request.request_id, total))
        if self.enable_caching:
            # Blocks filled by this step's tokens are final once the step runs; tokens coming
            # from a connector are cached only after their load completes.
            num_final = min(num_computed + num_new_tokens, request.num_tokens)
            if num_external_computed_tokens == 0:
                self.cache_blocks(request, num_final)
        return KVCacheBlocks(tuple(new_blocks))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks within its first `num_tokens` tokens."""
        if not self.enable_caching:
            return
        for m in self.managers:
            m.cache_blocks(
                request.request_id, request.block_hashes, num_tokens, request.all_token_ids)

    def cache_loaded_blocks(self, request: Request, num_tokens: int) -> None:
        """A KV connector finished loading: the request's KV is valid for its first
        `num_tokens` tokens and `request.num_computed_tokens` is already set to where it
        resumes. First drop the sliding-window blocks outside the window of the block boundary
        at or before that position, then register the full blocks left: a P/D decode engine
        loads only the window-group blocks inside that window (so that a later request with
        the same prompt can hit up to that boundary), the others hold garbage and must never
        be cached under a valid hash. (The request's next allocation frees the extra block;
        it stays cached.) A linear-state group keeps only the slot of the load's end (and its
        cached prefix hits): the other slots a load allocated were never written."""
        boundary = request.num_computed_tokens // self.block_size * self.block_size
        for m in self.managers:
            m.remove_skipped_blocks(request.request_id, boundary)
            if isinstance(m, LinearStateManager):
                m.keep_loaded_slot(request.request_id, num_tokens)
        self.cache_blocks(request, num_tokens)

    def free(self, request: Request) -> None:
        """Release every block of the request (idempotent; null blocks stay reserved)."""
        for m in self.managers:
            m.free(request.request_id)

    def take_events(self) -> list[Event]:
        """KV cache events recorded since the last call, group by group (each group's pool
        records its own: a model with several groups reports a block's hash once per group
        that indexes it; the wire format of the vLLM revision pdkv matches has no group
        field). Empty unless the manager was made with `enable_kv_cache_events`."""
        return [e for pool in self.block_pools for e in pool.take_events()]

    def set_eviction_hook(self, hook: Callable[[int, BlockHash, int], None] | None) -> None:
        """Call `hook(group index, block hash, block id)` whenever a cached block of any group is
        popped for reuse (see `BlockPool.set_eviction_hook`); None removes it."""
        for g, pool in enumerate(self.block_pools):
            pool.set_eviction_hook(None if hook is None else _group_hook(hook, g))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash in every group (vLLM's semantics, see
        BlockPool.reset_prefix_cache): all or nothing, refused (False, nothing changed) while
        any group has a block in use. The prefix-cache statistics stay cumulative."""
        if any(p.num_used_blocks for p in self.block_pools):
            used = max(p.num_used_blocks for p in self.block_pools)
            logger.warning("not resetting the prefix cache: %d blocks are still in use", used)
            return False
        return all([p.reset_prefix_cache() for p in self.block_pools])


def _group_hook(
    hook: Callable[[int, BlockHash, int], None], group: int
) -> Callable[[BlockHash, int], None]:
    """`hook` with its group index bound (one pool per group)."""
    return lambda block_hash, block_id: hook(group, block_hash, block_id)
