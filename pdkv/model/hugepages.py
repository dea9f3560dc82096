"""Packed weights on transparent huge pages (2 MiB), so decode streams them with fewer TLB misses.

A decode step at batch 1 reads every weight once; on 4 KiB pages that is a TLB miss every 4 KiB
and a page walk the hardware prefetcher does not cross. Linux backs an anonymous mapping with
2 MiB pages where transparent huge pages (THP) are on for it: always, or after
madvise(MADV_HUGEPAGE) when /sys/kernel/mm/transparent_hugepage/enabled says "madvise"
(Documentation/admin-guide/mm/transhuge.rst). Only whole 2 MiB-aligned ranges can be huge.

`HugePageArena` hands out tensors from slabs: each slab is one torch allocation with 2 MiB of
slack, its 2 MiB-aligned interior advised MADV_HUGEPAGE before anything touches it, then carved
into consecutive tensors (each aligned to 64 bytes, a cache line). A tensor larger than a slab
gets a slab of its own. Untouched slab space is never made resident (the last slab's tail).
Where THP is "never", madvise is not available, or the platform is not Linux, the arena still
works and the pages stay 4 KiB (`advised` says so).

`python -m pdkv.bench.model.weight_stream` measures what it gives a model's batch-1 linears
(docs/SPEED.md, "Huge pages").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
"""x86-64's transparent huge page: 2 MiB."""

DEFAULT_SLAB_BYTES = 32 << 20
"""Bytes per slab: at most this much minus one tensor is left unused at the end of a slab."""

ALIGN_BYTES = 64
"""Alignment of each tensor inside a slab (a cache line)."""

MADV_HUGEPAGE = 14
"""madvise(2) advice (asm-generic/mman-common.h)."""

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The bracketed word of `path` ("always", "madvise" or "never"), None where it cannot be
    read (not Linux, no THP)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded once (Linux only: callers check the platform first)."""
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _madvise_huge(addr: int, length: int) -> bool:
    """madvise(addr, length, MADV_HUGEPAGE); True when the kernel took it."""
    if not sys.platform.startswith("linux") or length <= 0:
        return False
    libc = _libc()
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return int(libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), MADV_HUGEPAGE)) == 0


def release_freed_heap() -> bool:
    """Return the free pages of the C heap to the system: glibc's `malloc_trim(0)`, which since
    glibc 2.8 releases whole free pages anywhere in the heap, not only at its top (malloc_trim(3)).

    Why: the loader reads each plain weight onto the heap, and packing copies it into the arena
    (mmap'd slabs) and frees it. Those freed pages lie below allocations that stay, so glibc keeps
    them resident: about 250 MB of SmolLM2's engine RSS before this call (docs/MEMORY.md).

    Returns:
        True when memory was released; False when none was, or the C library has no
        malloc_trim (musl, macOS, Windows).
    """
    if not sys.platform.startswith("linux"):
        return False
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


class HugePageArena:
    """Tensors carved from 2 MiB-aligned slabs advised MADV_HUGEPAGE (module doc).

    Args:
        slab_bytes: bytes per slab (a multiple of 2 MiB).

    Attributes:
        advised: True when at least one slab was advised and THP is not "never" (the pages can
            be huge); False: 4 KiB pages.
        bytes_used: bytes handed out (tensors plus alignment).
        bytes_reserved: bytes of the slabs (address space; resident only where touched).

    Raises:
        ValueError: slab_bytes not a positive multiple of 2 MiB.
    """

    def __init__(self, slab_bytes: int = DEFAULT_SLAB_BYTES) -> None:
        if slab_bytes <= 0 or slab_bytes % HUGE_PAGE_BYTES:
            raise ValueError(f"slab_bytes must be a positive multiple of {HUGE_PAGE_BYTES}, "
                             f"got {slab_bytes}")
        self.slab_bytes = slab_bytes
        self._slab: torch.Tensor | None = None  # uint8 view of the current slab's interior
        self._offset = 0
        self.advised = False
        self.bytes_used = 0
        self.bytes_reserved = 0
        self._mode = thp_mode()

    def _new_slab(self, nbytes: int) -> None:
        size = math.ceil(nbytes / HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        raw = torch.empty(size + HUGE_PAGE_BYTES, dtype=torch.uint8)
        start = (-raw.data_ptr()) % HUGE_PAGE_BYTES
        slab = raw[start : start + size]  # a view: keeps `raw`'s storage alive
        if _madvise_huge(slab.data_ptr(), size) and self._mode in ("always", "madvise"):
            self.advised = True
        self._slab, self._offset = slab, 0
        self.bytes_reserved += size

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of `shape` and `dtype` from the arena."""
        nbytes = math.prod(shape) * dtype.itemsize
        pad = (-self._offset) % ALIGN_BYTES
        if self._slab is None or self._offset + pad + nbytes > self._slab.numel():
            self._new_slab(max(nbytes, self.slab_bytes))
            pad = 0
        assert self._slab is not None
        start = self._offset + pad
        out = self._slab[start : start + nbytes].view(dtype).view(shape)
        self._offset = start + nbytes
        self.bytes_used += pad + nbytes
        return out

    def describe(self) -> str:
        """One log line: what was placed and on which pages."""
        pages = (f"advised for 2 MiB pages (THP {self._mode})" if self.advised else
                 f"on 4 KiB pages (THP {self._mode or 'not available'})")
        return (f"{self.bytes_used / 2**20:.1f} MiB of packed weights in "
                f"{self.bytes_reserved / 2**20:.0f} MiB of slabs {pages}")
