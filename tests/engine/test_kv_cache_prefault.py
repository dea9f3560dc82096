"""--kv-cache-prefault: the KV cache's pages are resident right after allocation (RSS grows by
its size at once), and without it they are not; the flag reaches the worker's CacheConfig.
Measured in a fresh process (its RSS from /proc/self/statm), so the test's own heap does not
blur it."""

from __future__ import annotations

import argparse
import subprocess
import sys

from pdkv.engine.arg_utils import EngineArgs

PROBE = r"""
import os, sys, torch
from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pdkv.worker.kv_cache import allocate_kv_cache

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype="float32")
cfg = KVCacheConfig(num_blocks=512, groups=(KVCacheGroupSpec(tuple(range(8)), spec),))
before = rss()
(group,), _ = allocate_kv_cache(cfg, torch.float32, torch.device("cpu"),
                                prefault=sys.argv[1] == "1")
nbytes = group.numel() * group.element_size()
print((rss() - before) / nbytes)
"""


def resident_share(prefault: bool) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, "1" if prefault else "0"],
                         capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.strip())


def test_prefault_makes_the_whole_cache_resident_at_once() -> None:
    # 512 blocks x 8 layers x 2 x 16 x 4 x 64 x 4 bytes = 128 MiB
    assert resident_share(True) > 0.95
    assert resident_share(False) < 0.05  # torch.empty: pages come in on first write


def test_the_flag_reaches_the_cache_config() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "tiny-llama-kv2", "--kv-cache-prefault"])
    assert EngineArgs.from_cli_args(args).create_engine_config().cache_config.prefault
    args = parser.parse_args(["--model", "tiny-llama-kv2"])
    assert not EngineArgs.from_cli_args(args).create_engine_config().cache_config.prefault
