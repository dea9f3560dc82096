"""Block pool: ref-counted KV blocks, an LRU free queue and the prefix-cache index (torch-free).

Follows vLLM v1's design (docs/design/prefix_caching.md): a block is free when its ref count is
0; free blocks sit in an LRU queue (least recently freed first) and keep their hash, so a later
request can still hit them until they are popped for reuse, at which point the hash is evicted.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pdkv.block_hashing import BlockHash
from pdkv.kv_events.schema import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
)

logger = logging.getLogger(__name__)

# Id of a pool's null block (when it reserves one): block tables name it where a group keeps no
# block (a sliding-window group's positions before the window).
NULL_BLOCK_ID = 0

# Called with (block hash, block id) of a cached block about to be reused for other content.
EvictionHook = Callable[[BlockHash, int], None]


@dataclass(eq=False)
class KVCacheBlock:
    """One block of the paged KV cache.

    Attributes:
        block_id: index into the KV cache tensor (0 .. num_blocks-1).
        ref_cnt: requests (or connectors) currently holding the block.
        block_hash: set while the block is in the prefix-cache index (it is full and its
            content is final).
        is_null: the pool's reserved null block (vLLM's `null_block`): a placeholder in block
            tables for positions whose KV is never read (sliding-window tokens that left the
            window); never allocated, freed, cached or reference-counted.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    is_null: bool = False


class BlockPool:
    """Owns `num_blocks` blocks of one KV cache group.

    With `reserve_null_block`, block 0 is the null block (`null_block`): it never enters the
    free queue, the index or any count, so `num_free_blocks`, `num_used_blocks` and `usage`
    are over the other `num_blocks - 1` blocks (`num_usable_blocks`). Without it (dense models)
    every block is usable and `null_block` is None.

    Invariants: a usable block is in the free queue iff ref_cnt == 0; a hash maps to at most one
    block; a block with a hash is in the index. Not thread-safe: called only from the engine
    loop.

    With `enable_kv_cache_events`, every change to the index is recorded as a KV cache event
    (vLLM's BlockPool does the same): `cache_full_blocks` -> BlockStored (one per run of blocks
    newly indexed), a hash leaving the index (reuse, invalid content) -> BlockRemoved, a reset
    -> AllBlocksCleared. The engine drains them once per step with `take_events`.

    Raises:
        ValueError: fewer than 1 usable block.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, reserve_null_block: bool = False,
        enable_kv_cache_events: bool = False,
    ) -> None:
        num_usable = num_blocks - (1 if reserve_null_block else 0)
        if num_usable < 1:
            raise ValueError(f"need at least 1 usable block, got num_blocks={num_blocks}"
                             f" (null block reserved: {reserve_null_block})")
        self.num_blocks = num_blocks
        self.num_usable_blocks = num_usable
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = None
        if reserve_null_block:
            self.null_block = self.blocks[NULL_BLOCK_ID]
            self.null_block.is_null = True
        # LRU order: first = evicted first.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks if not b.is_null
        )
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        # Counters (tokens are counted by the manager; these are blocks).
        self.num_evictions = 0
        self.eviction_hook: EvictionHook | None = None
        self.enable_kv_cache_events = enable_kv_cache_events
        self._events: list[Event] = []

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (cached or not): what can be allocated now."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by someone, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    @property
    def num_used_blocks(self) -> int:
        """Usable blocks with ref_cnt > 0 (held by requests or connectors)."""
        return self.num_usable_blocks - len(self._free)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding this content, if it is still cached."""
        return self._cached.get(block_hash)

    # ----------------------------------------------------------------- changes
    def set_eviction_hook(self, hook: EvictionHook | None) -> None:
        """Call `hook(block_hash, block_id)` whenever a cached block is popped for reuse, before
        its hash leaves the index and before `get_new_blocks` returns it (so before anything can
        be scheduled to overwrite it). The block's content is still that of `block_hash` then; a
        hook that saves it (CPU offload) must finish its copy, or queue one that completes,
        before the next forward pass writes the block. Only reuse calls it: `evict_hashes`
        (invalid content) and `reset_prefix_cache` do not. None removes the hook."""
        self.eviction_hook = hook

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop `n` free blocks (LRU first), evicting their cached hashes (the eviction hook, if
        set, sees each evicted (hash, id) first); ref_cnt becomes 1.

        Raises:
            ValueError: fewer than n blocks are free (callers check num_free_blocks first).
        """
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None and self.eviction_hook is not None:
                self.eviction_hook(block.block_hash, block.block_id)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to blocks found by a prefix-cache hit (removing them from the free
        queue when they were free). The null block is skipped."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the tail of the free
        queue in the given order (callers pass a request's blocks tail-first so its last
        blocks are evicted first, as in vLLM). The null block is skipped.

        Raises:
            RuntimeError: a block's ref count is already 0 (double free).
        """
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full block's hash so later requests can reuse it. When another block
        already holds the same content the index keeps the older one. The null block is never
        cached. Records no event (see `cache_full_blocks`).

        Returns:
            True when the block entered the index now.
        """
        if not self.enable_caching or block.is_null or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """`cache_block` for consecutive full blocks of one request, recording what entered the
        index: one BlockStored per run of blocks indexed now (a block skipped, as null, already
        indexed or a duplicate, ends a run; the next run's parent is the hash before it).

        Args:
            blocks: the blocks, in token order.
            block_hashes: their hashes (same length).
            parent_block_hash: hash of the block before blocks[0] (None: blocks[0] is block 0).
            token_ids: the blocks' tokens (len(blocks) * block_size).
            block_size: tokens per block.
        """
        run: list[int] = []
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes)):
            if self.cache_block(block, block_hash):
                run.append(i)
                continue
            self._record_stored(run, block_hashes, parent_block_hash, token_ids, block_size)
            run = []
        self._record_stored(run, block_hashes, parent_block_hash, token_ids, block_size)

    def _record_stored(
        self, run: list[int], block_hashes: Sequence[BlockHash], parent: BlockHash | None,
        token_ids: Sequence[int], block_size: int,
    ) -> None:
        if not run or not self.enable_kv_cache_events:
            return
        first, end = run[0], run[-1] + 1
        self._events.append(BlockStored(
            block_hashes=list(block_hashes[first:end]),
            parent_block_hash=block_hashes[first - 1] if first else parent,
            token_ids=list(token_ids[first * block_size:end * block_size]),
            block_size=block_size, lora_id=None, medium=MEDIUM_GPU, lora_name=None,
        ))

    def take_events(self) -> list[Event]:
        """The events recorded since the last call, oldest first (the engine loop, once per
        step)."""
        events, self._events = self._events, []
        return events

    def evict_hashes(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop blocks from the prefix-cache index (their content is invalid, e.g. a failed
        KV load)."""
        for block in blocks:
            self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, so that no later lookup hits a block cached so far.

        vLLM's semantics (BlockPool.reset_prefix_cache): refused while any block is in use
        (ref_cnt > 0: a running request, a KV load in flight, blocks held for a remote
        reader), because those blocks will be cached again or read by their holders; then
        nothing changes and the result is False. On success the free queue (count and LRU
        order) is untouched; evictions are not counted (nothing was reused).

        Returns:
            True when the index was cleared, False when blocks are in use.
        """
        if self.num_used_blocks:
            logger.warning(
                "not resetting the prefix cache: %d blocks are still in use", self.num_used_blocks
            )
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                self.num_evictions += 1
                if self.enable_kv_cache_events:
                    self._events.append(
                        BlockRemoved(block_hashes=[block.block_hash], medium=MEDIUM_GPU))
            block.block_hash = None
