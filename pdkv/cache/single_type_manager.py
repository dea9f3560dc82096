"""Per-group block bookkeeping, one manager per KV cache spec kind (torch-free).

Mirrors vLLM's `SingleTypeKVCacheManager` family: the group's manager knows how its spec maps
tokens to blocks and how a prefix-cache hit is found; the block pool knows nothing of requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdkv.cache.block_pool import BlockPool, KVCacheBlock
from pdkv.cache.hashing import BlockHash
from pdkv.cache.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


class SingleTypeKVCacheManager:
    """Blocks of every request for one KV cache group.

    Called only from the scheduler (engine loop thread); never blocks.
    """

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are registered in the prefix-cache index.
        self.num_cached_block: dict[str, int] = {}

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Cached blocks covering the longest prefix of at most `max_length` tokens."""
        raise NotImplementedError

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks this request would consume to hold `num_tokens` tokens: new blocks plus
        prefix hits that currently sit in the free queue."""
        num_required = cdiv(num_tokens, self.block_size)
        held = len(self.req_to_blocks.get(request_id, ()))
        num_new = max(0, num_required - held - len(new_computed_blocks))
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return num_new + num_evictable_hits

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Take references on prefix hits and append them to the request's block table."""
        if not new_computed_blocks:
            return
        blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not blocks, "prefix hits are only added to a request that holds no blocks"
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's block table to hold `num_tokens` tokens; returns the new blocks."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new)
        return new

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> None:
        """Register every block that is full within the first `num_tokens` tokens."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_full = min(num_tokens // self.block_size, len(block_hashes), len(blocks))
        start = self.num_cached_block.get(request_id, 0)
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], block_hashes[i])
        self.num_cached_block[request_id] = max(start, num_full)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (so they are evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full causal attention: every token's KV is kept; a hit is a left-to-right prefix run."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        hits: list[KVCacheBlock] = []
        max_blocks = max_length // self.block_size
        for block_hash in block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits


class SlidingWindowManager(FullAttentionManager):
    """Sliding-window attention, first form: keeps every block and hits like full attention
    (correct, since the window's keys are a subset of the prefix; blocks are not freed early)."""


_MANAGERS: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def get_manager_class(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """Manager class for a spec.

    Raises:
        ValueError: no manager handles this spec kind yet.
    """
    try:
        return _MANAGERS[type(spec)]
    except KeyError:
        raise ValueError(f"no KV cache manager for spec {type(spec).__name__}") from None
