"""Host block index of the OffloadingConnector: block hash → host slot, LRU, pins (torch-free).

The scheduler half's bookkeeping of one KV cache group's host buffer (the role of vLLM's
`LRUOffloadingManager`): which block hashes the host holds and in which slot. The bytes live in
the worker half's buffer; this class never touches them. A slot that a load reads in the current
step is pinned so that no store of the same step may take it.
"""

from __future__ import annotations

from collections import OrderedDict

from pdkv.block_hashing import BlockHash


class HostBlockIndex:
    """LRU map of `num_slots` host slots for one KV cache group.

    Args:
        num_slots: host blocks of this group (0: the index stays empty).

    Not thread-safe: the scheduler half calls it from the engine loop thread only.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()  # first = evicted first
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._pins: dict[int, int] = {}
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def slot_of(self, block_hash: BlockHash) -> int | None:
        """The slot holding this hash, or None (no LRU change)."""
        return self._lru.get(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        """Mark the hash most recently used (no-op when absent)."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)

    def allocate(self, block_hash: BlockHash) -> int | None:
        """A slot for a new entry `block_hash` (most recently used): a free slot, else the least
        recently used unpinned entry's slot (that entry is dropped and counted). None when every
        slot is pinned or there are none; then nothing changes.

        Raises:
            ValueError: the hash is already held (callers look it up first).
        """
        if block_hash in self._lru:
            raise ValueError("hash already held by the host index")
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._lru.items() if s not in self._pins), None)
            if victim is None:
                return None
            slot = self._lru.pop(victim)
            self.num_evictions += 1
        self._lru[block_hash] = slot
        return slot

    def pin(self, slot: int) -> None:
        """Keep `slot` from being reused until a matching `unpin`."""
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        """Drop one pin of `slot`.

        Raises:
            RuntimeError: the slot is not pinned.
        """
        count = self._pins.get(slot, 0)
        if count <= 0:
            raise RuntimeError(f"unpin of host slot {slot} that is not pinned")
        if count == 1:
            del self._pins[slot]
        else:
            self._pins[slot] = count - 1

    @property
    def num_pinned(self) -> int:
        return len(self._pins)
