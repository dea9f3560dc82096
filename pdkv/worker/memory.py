"""Free memory of a device, for `--gpu-memory-utilization` (KV cache sizing)."""

from __future__ import annotations

import os

import torch


def free_memory_bytes(device: torch.device) -> int:
    """Bytes free now: on a CUDA device `torch.cuda.mem_get_info` (free device memory), on the
    CPU the kernel's MemAvailable (/proc/meminfo; elsewhere free physical pages)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def kv_budget_bytes(free_bytes: int, utilization: float) -> int:
    """The KV cache budget: `utilization` (0, 1] of `free_bytes` (measured after the weights
    are loaded, so they are already excluded).

    Raises:
        ValueError: utilization outside (0, 1].
    """
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    return int(free_bytes * utilization)
