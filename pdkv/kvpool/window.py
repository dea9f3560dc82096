"""Which blocks of a sliding-window KV cache group the pool stores and loads (torch-free).

Notation (tokens): chunk size C (a multiple of the block size bs), window W (HF semantics: the
query at p reads keys p - W < k <= p), chunk j covers [jC, end_j) with end_j = (j + 1)C.

- Store: chunk j keeps, of a window group, only the blocks that intersect its tail window
  [end_j - W + 1, end_j), clipped to the chunk: its blocks from `first_stored_block` on. A block
  is freed only once all its tokens are < num_computed - W + 1 <= end_j - W + 1, so these are
  still held in the step that computes the chunk's last token.
- Load of a hit ending at L = end_j over F local-hit tokens (block-aligned, F <= L): a window
  group needs only the blocks intersecting [max(F, L - W + 1), L) (the local hit holds the
  window of F; `KVCacheManager.cache_loaded_blocks` keeps exactly the window of L). Each such
  block b lies in chunk k = b·bs // C with end_k <= L, and its last token is >= L - W + 1 >=
  end_k - W + 1, so chunk k's stored tail holds it (also when W - 1 > C reaches back past
  chunk j).

Bytes: a window group stores at most ceil((W - 1) / bs) + 1 blocks per chunk (and at most C/bs)
and loads at most ceil((W - 1) / bs) + 1 blocks per hit, whatever L.
"""

from __future__ import annotations


def first_stored_block(chunk_size: int, block_size: int, window: int | None) -> int:
    """Index, within a chunk, of the first block the pool stores for a group (0 without a window).

    The blocks stored are [first, C / bs): those intersecting [end - W + 1, end), end = the
    chunk's end token, clipped to the chunk; the value does not depend on which chunk.
    """
    if window is None:
        return 0
    return max(0, chunk_size - window + 1) // block_size


def load_first_block(
    num_local_tokens: int, hit_end: int, block_size: int, window: int | None
) -> int:
    """First block index (absolute, in the request) a load of tokens [F, L) writes for a group.

    Args:
        num_local_tokens: F, tokens already in the local prefix cache (block-aligned).
        hit_end: L, the end token of the pool hit (chunk-aligned, >= F).
        block_size: tokens per block.
        window: the group's sliding window in tokens, or None (full attention: F // bs).

    Returns:
        max(F, L - W + 1) // bs for a window group; blocks from there up to L // bs are loaded.
    """
    if window is None:
        return num_local_tokens // block_size
    return max(num_local_tokens, hit_end - window + 1) // block_size
