"""glibc malloc's mmap threshold, pinned for long-running processes that hold few live bytes.

glibc serves an allocation of at least M_MMAP_THRESHOLD bytes (128 KiB at start) with its own
mmap and gives it back to the kernel on free. Its default is dynamic: freeing such a chunk raises
the threshold to that chunk's size (up to 32 MiB on 64-bit), so later buffers of that size come
from the heap instead, and the heap's free space is rarely returned (mallopt(3), "M_MMAP_THRESHOLD";
glibc malloc/malloc.c, "mp_.no_dyn_threshold"). In the proxy that turns a few large temporary
buffers into an RSS that keeps growing by the free list it keeps: the soak measured it at ~500
bytes per request while the live bytes stayed flat (docs/RELIABILITY.md, "The soak").

Setting the threshold explicitly, as `MALLOC_MMAP_THRESHOLD_` would, also turns the dynamic
adjustment off. This is for the proxy, which allocates little and rarely more than 128 KiB at a
time; an engine allocates large activation tensors every step, and pinning the threshold there
would turn each of them into an mmap/munmap pair and page faults, so engines keep glibc's default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_MMAP_THRESHOLD = -3  # glibc malloc.h
ENV_VAR = "MALLOC_MMAP_THRESHOLD_"
DEFAULT_PROXY_THRESHOLD = 128 * 1024  # bytes; glibc's own starting value


def pin_mmap_threshold(threshold: int) -> str:
    """Pin glibc's mmap threshold at `threshold` bytes in this process (dynamic adjustment off).

    Args:
        threshold: bytes; 0 leaves glibc's dynamic default alone.

    Returns:
        What was done, for a start-up log line: "pinned at N bytes", "left to glibc (…)" with the
        reason (0 asked, `MALLOC_MMAP_THRESHOLD_` already set in the environment, which glibc
        applied itself, or not glibc).

    Raises:
        ValueError: `threshold` is negative, or glibc's mallopt refused it.
    """
    if threshold < 0:
        raise ValueError(f"mmap threshold must be >= 0 bytes, got {threshold}")
    if threshold == 0:
        return "left to glibc (dynamic)"
    if ENV_VAR in os.environ:
        return f"left to glibc ({ENV_VAR}={os.environ[ENV_VAR]} in the environment)"
    if platform.libc_ver()[0] != "glibc":
        return "left to the C library (not glibc)"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(threshold)) != 1:
        raise ValueError(f"glibc refused an mmap threshold of {threshold} bytes")
    return f"pinned at {threshold} bytes"
