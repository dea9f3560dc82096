"""Per-group block bookkeeping, one manager per KV cache spec kind (torch-free).

Mirrors vLLM's `SingleTypeKVCacheManager` family: the group's manager knows how its spec maps
tokens to blocks and how a prefix-cache hit is found; the block pool knows nothing of requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdkv.block_hashing import BlockHash
from pdkv.cache.block_pool import BlockPool, KVCacheBlock
from pdkv.cache.specs import (
    CompressedKVSpec,
    CompressorStateSpec,
    FullAttentionSpec,
    KVCacheSpec,
    LinearStateSpec,
    MLASpec,
    SlidingWindowSpec,
)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


class SingleTypeKVCacheManager:
    """Blocks of every request for one KV cache group.

    A request's block table has one entry per block of its tokens; managers that drop KV early
    (sliding window) put the pool's null block at the positions they no longer hold.
    Called only from the scheduler (engine loop thread); never blocks.
    """

    # Whether the group's pool must reserve a null block (see BlockPool).
    needs_null_block = False

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
        """Block table entries for the longest prefix-cache hit of at most `max_length` tokens
        (whole blocks): its length times block_size is the hit in tokens."""
        raise NotImplementedError

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the request's blocks that no query from position `num_computed_tokens` on will
        read. Full attention reads every earlier token: nothing to do."""

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks this request would consume to hold `num_tokens` tokens: new blocks plus
        prefix hits that currently sit in the free queue."""
        num_required = cdiv(num_tokens, self.block_size)
        held = len(self.req_to_blocks.get(request_id, ()))
        num_new = max(0, num_required - held - len(new_computed_blocks))
        num_evictable_hits = sum(
            1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null
        )
        return num_new + num_evictable_hits

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Take references on prefix hits and append them to the request's block table (null
        entries are appended untouched)."""
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
        self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Register every block that is full within the first `num_tokens` tokens (null
        entries are skipped: they hold nothing). `token_ids` (the request's tokens) go into the
        pool's BlockStored events when it records them."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_full = min(num_tokens // self.block_size, len(block_hashes), len(blocks))
        start = self.num_cached_block.get(request_id, 0)
        if num_full > start:
            bs = self.block_size
            self.block_pool.cache_full_blocks(
                blocks[start:num_full], block_hashes[start:num_full],
                block_hashes[start - 1] if start else None,
                token_ids[start * bs:num_full * bs], bs,
            )
        self.num_cached_block[request_id] = max(start, num_full)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (so they are evicted first); null entries
        are skipped by the pool."""
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


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention (vLLM's `SlidingWindowManager`, rewritten).

    The query at position p reads keys p - W < k <= p (W = spec.sliding_window). Before the
    query at `num_computed_tokens` runs, every block whose tokens all lie below
    `num_computed_tokens - W + 1` is freed (cached ones stay evictable in the free queue with
    their hash) and replaced by the null block. A prefix hit of L tokens needs only the blocks
    of tokens [L - (W - 1), L).

    Attributes:
        num_blocks_freed_early: blocks released by `remove_skipped_blocks` since start.

    Raises:
        ValueError: the pool has no null block.
    """

    needs_null_block = True

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, block_pool, group_id)
        assert isinstance(spec, SlidingWindowSpec)
        if block_pool.null_block is None:
            raise ValueError("a sliding-window group's pool must reserve a null block")
        self.null_block: KVCacheBlock = block_pool.null_block
        self.sliding_window = spec.sliding_window
        self.num_blocks_freed_early = 0

    def num_window_blocks(self) -> int:
        """Blocks a hit ending on a block boundary needs: those of the W - 1 tokens before it,
        ceil((W - 1) / block_size)."""
        return cdiv(self.sliding_window - 1, self.block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Largest L <= max_length (whole blocks) whose window blocks are all cached: searched
        right to left for a run of `num_window_blocks()` cached blocks, or a run reaching block
        0 (a hit shorter than the window). Entries before the run are the null block."""
        max_blocks = min(max_length // self.block_size, len(block_hashes))
        need = self.num_window_blocks()
        if need == 0:  # W == 1: a query reads only itself
            return [self.null_block] * max_blocks
        run: list[KVCacheBlock] = []  # cached blocks from index i on, right to left
        for i in range(max_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[i])
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == need:
                return [self.null_block] * i + run[::-1]
        return run[::-1]  # the cached run from block 0 (a hit shorter than the window), or []

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free every block all of whose tokens are below num_computed_tokens - W + 1 (never
        read again) and put the null block in its place; tail first, stopping at the first
        null entry (the entries before it are null already)."""
        first_needed = num_computed_tokens - self.sliding_window + 1
        blocks = self.req_to_blocks.get(request_id)
        if first_needed <= 0 or not blocks:
            return
        removed: list[KVCacheBlock] = []
        for i in range(min(first_needed // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break
            removed.append(blocks[i])
            blocks[i] = self.null_block
        self.block_pool.free_blocks(removed)
        self.num_blocks_freed_early += len(removed)


class LinearStateManager(SingleTypeKVCacheManager):
    """Linear-attention state (vLLM's `MambaManager`). A block of this group is one state slot.

    Without prefix caching a request holds exactly one slot, from its first allocation until it
    finishes or is preempted, whatever its length; nothing is ever cached, so a lookup never hits
    (the coordinator takes the shortest hit over the groups: a hybrid model gets no hit at all).

    With prefix caching every block is a checkpoint (vLLM's mamba "all" mode): the request's table
    has one slot per block of its tokens, like full attention, and entry i holds the state after
    the last computed token of block i, so once block i is full it holds the state after exactly
    (i + 1) * block_size tokens and is registered under block hash i. The worker (per step) reads
    the state of position c from entry (c - 1) // block_size and writes the state at every block
    boundary it crosses and at its last token into the entries of those blocks (entries of earlier
    blocks are only read: a shared cached checkpoint is never written). A hit of L tokens is the
    last cached checkpoint at or below L: the table is the null block up to it, then that slot.
    Memory: one slot per block while a request runs (the state bytes per block of
    `LinearStateSpec.page_size_bytes` per layer); finished requests' checkpoints stay evictable.
    """

    needs_null_block = True

    @property
    def checkpoints(self) -> bool:
        """Whether every block keeps a state checkpoint (prefix caching on)."""
        return self.block_pool.enable_caching

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        if not self.checkpoints:
            return []
        assert self.block_pool.null_block is not None
        for i in range(min(max_length // self.block_size, len(block_hashes)) - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[i])
            if block is not None:
                return [self.block_pool.null_block] * i + [block]
        return []

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Checkpoints: as full attention. One slot: 1 for a request that holds none, else 0."""
        if self.checkpoints:
            return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks)
        return 0 if self.req_to_blocks.get(request_id) or num_tokens <= 0 else 1

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Checkpoints: a slot per block of `num_tokens` tokens. One slot: the request's slot on
        its first allocation ([] after)."""
        if self.checkpoints:
            return super().allocate_new_blocks(request_id, num_tokens)
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if blocks or num_tokens <= 0:
            return []
        blocks.extend(self.block_pool.get_new_blocks(1))
        return list(blocks)

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Checkpoints: register every full block (its slot holds the state at its end). One
        slot: nothing (it holds the state after the request's last token, which no hash names)."""
        if self.checkpoints:
            super().cache_blocks(request_id, block_hashes, num_tokens, token_ids)


    def keep_loaded_slot(self, request_id: str, num_tokens: int) -> None:
        """A connector loaded only the state after `num_tokens` tokens, into the table entry
        (num_tokens - 1) // block_size (P/D moves one slot). Checkpoints: free every earlier
        entry that is neither a cached prefix hit nor null (never written: its state must not be
        registered under a hash) and put the null block in its place. One slot: nothing to do."""
        blocks = self.req_to_blocks.get(request_id)
        if not self.checkpoints or not blocks or num_tokens <= 0:
            return
        assert self.block_pool.null_block is not None
        removed: list[KVCacheBlock] = []
        for i in range(min((num_tokens - 1) // self.block_size, len(blocks))):
            if not blocks[i].is_null and blocks[i].block_hash is None:
                removed.append(blocks[i])
                blocks[i] = self.block_pool.null_block
        self.block_pool.free_blocks(removed)


_MANAGERS: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    MLASpec: FullAttentionManager,  # causal over the whole context, as vLLM's MLA layers
    LinearStateSpec: LinearStateManager,
    # DeepSeek-V4: entries of whole windows per block (a cached prefix holds exactly its
    # windows' entries), and the compressor state kept like linear state
    CompressedKVSpec: FullAttentionManager,
    CompressorStateSpec: LinearStateManager,
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
