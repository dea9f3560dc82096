"""The proxy's record of what a shared KV pool holds (torch-free), for skipping prefill legs.

Under P/D with a pool (`pdkv up --mode pd --pool …`), P saves the full chunks of every prompt it
prefilled. The proxy remembers those chunk hashes (the pool's own, `pdkv.router.prefix_keys`);
when every loadable chunk of a new request is remembered, the proxy can send the request
straight to D, which loads the chunks from the pool and computes the rest itself. The record is a
belief, not a lookup: an entry P has not finished saving, or one the pool evicted, is simply
computed by D (correct output, a slower first token). Bounded: least recently used hashes go
first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_MAX_ENTRIES = 65536
"""Chunk hashes remembered (32 B each plus dict overhead: a few MB)."""


class PoolRecord:
    """Chunk hashes the proxy believes the pool holds.

    Args:
        max_entries: most hashes remembered (LRU).

    Raises:
        ValueError: max_entries < 1.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, hashes: Sequence[bytes]) -> None:
        """Remember the chunks a prefill leg completed (P saved them)."""
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.max_entries:
            self._hashes.popitem(last=False)

    def covers(self, hashes: Sequence[bytes]) -> bool:
        """True when `hashes` is non-empty and every one is remembered (those are then used)."""
        if not hashes or any(h not in self._hashes for h in hashes):
            return False
        for h in hashes:
            self._hashes.move_to_end(h)
        return True


def loadable_chunks(num_prompt_tokens: int, chunk_size: int) -> int:
    """Chunks a pool can serve of an n-token prompt: ⌊(n − 1)/C⌋ (the last token is computed)."""
    return max(0, (num_prompt_tokens - 1) // chunk_size)
