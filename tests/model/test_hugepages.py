"""HugePageArena (pdkv/model/hugepages.py): tensors carved from 2 MiB-aligned slabs advised for
transparent huge pages; panels packed into it equal the plain packing and give the panel
kernel's exact outputs; the heap pages packing frees go back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import pytest
import torch

from pdkv.model.hugepages import HUGE_PAGE_BYTES, HugePageArena, release_freed_heap, thp_mode
from pdkv.model.panel_linear import pack_panels, panel_linear_unavailable


def _vm_flags(addr: int) -> list[str]:
    """VmFlags of the mapping of this process that holds `addr` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_tensors_are_aligned_disjoint_and_a_large_one_gets_its_own_slab():
    arena = HugePageArena(slab_bytes=HUGE_PAGE_BYTES)
    a = arena.empty((3, 5), torch.float32)  # 60 bytes
    b = arena.empty((7,), torch.bfloat16)
    c = arena.empty((HUGE_PAGE_BYTES,), torch.uint8)  # bigger than what is left: a new slab
    for t in (a, b, c):
        assert t.is_contiguous() and t.data_ptr() % 64 == 0
    assert b.data_ptr() >= a.data_ptr() + 60
    assert c.data_ptr() % HUGE_PAGE_BYTES == 0
    a.fill_(1.0)
    b.fill_(2.0)
    c.fill_(3)
    assert a.sum() == 15 and b.float().sum() == 14 and int(c[-1]) == 3
    assert arena.bytes_reserved == 2 * HUGE_PAGE_BYTES
    assert arena.bytes_used == 64 + 14 + HUGE_PAGE_BYTES
    with pytest.raises(ValueError, match="multiple of"):
        HugePageArena(slab_bytes=HUGE_PAGE_BYTES + 4096)


def test_slabs_are_advised_for_huge_pages_where_the_kernel_allows():
    mode = thp_mode()
    if mode not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {mode or 'not available'} here")
    arena = HugePageArena()
    t = arena.empty((1 << 20,), torch.float32)
    assert arena.advised
    assert "hg" in _vm_flags(t.data_ptr())  # MADV_HUGEPAGE on the slab's mapping
    assert f"2 MiB pages (THP {mode})" in arena.describe()


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(str(f)) == "madvise"
    assert thp_mode(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [48, 50])  # whole panels; a padded last panel
def test_panels_packed_into_the_arena_equal_the_plain_packing(dtype, n):
    torch.manual_seed(0)
    w = torch.randn(n, 40).to(dtype)
    arena = HugePageArena()
    arena.empty((5,), torch.float32).fill_(float("nan"))  # a used arena, not fresh zeros
    junk = arena.empty((4, 40, 16), dtype)
    junk.fill_(7.0)
    del junk  # the slab's bytes after it are untouched; the padding must still be zeroed
    packed = pack_panels(w, arena)
    assert torch.equal(packed, pack_panels(w))
    if panel_linear_unavailable(w) is None:
        x = torch.randn(3, 40)
        plain = torch.ops.pdkv.panel_linear(x, pack_panels(w), n, None)
        assert torch.equal(torch.ops.pdkv.panel_linear(x, packed, n, None), plain)


def test_a_padded_panel_on_reused_bytes_is_zeroed():
    """The arena's bytes may hold anything: the rows past N of the last panel are zeros."""
    arena = HugePageArena()
    w = torch.ones(17, 8)
    first = arena.empty((2, 8, 16), torch.float32)
    first.fill_(5.0)
    arena._offset = 0  # the same bytes again (as a slab reused would be)
    packed = pack_panels(w, arena)
    assert packed.data_ptr() == first.data_ptr()
    assert torch.equal(packed[1, :, 1:], torch.zeros(8, 15))


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                    reason="glibc's malloc_trim is Linux-only")
def test_freed_heap_pages_below_a_live_allocation_are_released():
    # What packing leaves behind: memory read onto the heap, freed, below something that stays.
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if getattr(libc, "malloc_trim", None) is None:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block, count = 64 << 10, 1024  # 64 MiB in blocks below the mmap threshold: on the heap
    ptrs, keep = [], []
    for _ in range(count):
        ptrs.append(libc.malloc(block))
        ctypes.memset(ptrs[-1], 1, block)  # resident
        keep.append(libc.malloc(block))  # stays, between the freed blocks: no free run can
        ctypes.memset(keep[-1], 1, block)  # merge with its neighbours or reach the heap's top
    for p in ptrs:
        libc.free(p)
    before = _rss_anon_kib()
    assert release_freed_heap()
    released = before - _rss_anon_kib()
    for p in keep:
        libc.free(p)
    assert released > (count * block >> 10) // 2, f"released {released} KiB"
