"""pin_mmap_threshold really turns glibc's dynamic mmap threshold off (observed with mallinfo2 in
a fresh process: after a 4 MiB buffer is freed, a 1 MiB one still gets its own mmap), leaves an
explicit MALLOC_MMAP_THRESHOLD_ alone, and `pdkv proxy` logs what it did at start-up."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from pdkv.malloc_tuning import pin_mmap_threshold

PROBE = r"""
import ctypes, sys
from pdkv.malloc_tuning import pin_mmap_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
print(pin_mmap_threshold(int(sys.argv[1])))
libc.free(libc.malloc(4 << 20))  # glibc's default now raises its threshold to ~4 MiB
before = libc.mallinfo2().hblks
buf = libc.malloc(1 << 20)
print(libc.mallinfo2().hblks - before)  # 1: the 1 MiB buffer got its own mmap; 0: the heap
libc.free(buf)
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")


def probe(threshold: int, env: dict[str, str] | None = None) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(threshold)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, **(env or {})}, check=True)
    return out.stdout.split("\n")[:2]


@glibc
def test_pinned_threshold_stays_where_it_was_put() -> None:
    assert probe(128 * 1024) == ["pinned at 131072 bytes", "1"]


@glibc
def test_glibc_default_raises_its_threshold_after_a_large_free() -> None:
    # What the pin is for: without it, the 1 MiB buffer comes from the heap.
    assert probe(0) == ["left to glibc (dynamic)", "0"]


@glibc
def test_the_environment_variable_wins() -> None:
    said, _ = probe(128 * 1024, {"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert said == "left to glibc (MALLOC_MMAP_THRESHOLD_=65536 in the environment)"


def test_a_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        pin_mmap_threshold(-1)
