"""Pool keys: reproducible across processes, every namespace field and cache_salt change them."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

import pdkv
from pdkv.block_hashing import hash_request_tokens
from pdkv.cache.kv_layout import KVLayout
from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pdkv.kvpool.keys import (
    PoolNamespace,
    chunk_hashes,
    chunk_key,
    describe_group,
    max_loadable_tokens,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(pdkv.__file__)))

BASE = PoolNamespace(
    model_digest="abc123", dtype="float32", block_size=16, kv_layout="cross_layer",
    groups=("full_attention:layers=0-29:block_size=16:dtype=float32:head_size=64:num_kv_heads=3",),
    chunk_size=64,
)

_SCRIPT = """
from pdkv.block_hashing import hash_request_tokens
from pdkv.kvpool.keys import PoolNamespace, chunk_hashes, chunk_key
ns = PoolNamespace(model_digest="abc123", dtype="float32", block_size=16, kv_layout="cross_layer",
                   groups=("g",), chunk_size=64)
tokens = list(range(1000, 1200))
bh = hash_request_tokens(tokens, 16, cache_salt="tenant")
print(" ".join(chunk_key(ns.fingerprint, h) for h in chunk_hashes(bh, 16, 64, len(tokens))))
"""


def test_keys_reproducible_across_processes() -> None:
    out = []
    for seed in ("1", "98765"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=REPO_ROOT)
        res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                             text=True, timeout=60, check=True)
        out.append(res.stdout.split())
    ns = PoolNamespace(model_digest="abc123", dtype="float32", block_size=16,
                       kv_layout="cross_layer", groups=("g",), chunk_size=64)
    tokens = list(range(1000, 1200))
    bh = hash_request_tokens(tokens, 16, cache_salt="tenant")
    here = [chunk_key(ns.fingerprint, h) for h in chunk_hashes(bh, 16, 64, len(tokens))]
    assert len(here) == 3
    assert out[0] == out[1] == here


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_digest", "abc124"),
        ("dtype", "bfloat16"),
        ("block_size", 32),
        ("kv_layout", "other"),
        (
            "groups",
            ("full_attention:layers=0-29:block_size=16:dtype=float32:head_size=64:num_kv_heads=4",),
        ),
        ("groups", BASE.groups * 2),
        ("chunk_size", 128),
        ("tp_rank", 1),
        ("tp_size", 2),
        ("dcp_rank", 1),
        ("dcp_size", 2),
        ("kv_quant", "fp8"),
    ],
)
def test_fingerprint_changes_with_each_field(field: str, value: object) -> None:
    extra = {"tp_size": 2} if field == "tp_rank" else {"dcp_size": 2} if field == "dcp_rank" else {}
    changed = dataclasses.replace(BASE, **{field: value, **extra})
    if extra:  # a rank needs its size raised too; check the rank alone also moves the key
        assert changed.fingerprint != dataclasses.replace(BASE, **extra).fingerprint
    assert changed.fingerprint != BASE.fingerprint
    assert len(BASE.fingerprint) == 32 and int(BASE.fingerprint, 16) >= 0


def test_fingerprint_stable_for_equal_fields() -> None:
    assert dataclasses.replace(BASE).fingerprint == BASE.fingerprint


def _kv_config(heads: int = 3, dtype: str = "float32", layers: int = 30) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=64, dtype=dtype)
    return KVCacheConfig(num_blocks=8, groups=(KVCacheGroupSpec(tuple(range(layers)), spec),))


LAYOUT = {"model_digest": "abc123", "dtype": "float32", "block_size": 16, "num_layers": 30,
          "num_kv_heads": 3, "head_size": 64, "kv_layout": "cross_layer"}


def test_from_layout() -> None:
    ns = PoolNamespace.from_layout(KVLayout.from_wire(LAYOUT), _kv_config(), chunk_size=64,
                                   tp_rank=1, tp_size=2)
    assert ns.groups == (
        "full_attention:layers=0-29:block_size=16:dtype=float32:head_size=64:num_kv_heads=3",
    )
    assert (ns.block_size, ns.chunk_size, ns.tp_rank, ns.tp_size) == (16, 64, 1, 2)
    base = PoolNamespace.from_layout(KVLayout.from_wire(LAYOUT), _kv_config(), 64).fingerprint
    assert PoolNamespace.from_layout(KVLayout.from_wire(LAYOUT), _kv_config(heads=4),
                                     64).fingerprint != base
    assert PoolNamespace.from_layout(KVLayout.from_wire(LAYOUT), _kv_config(layers=29),
                                     64).fingerprint != base
    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64)
    assert describe_group(KVCacheGroupSpec((0, 2, 4), spec)).startswith(
        "full_attention:layers=0,2,4:"
    )


@pytest.mark.parametrize("chunk_size", [0, -16, 24, 8])
def test_from_layout_rejects_bad_chunk_size(chunk_size: int) -> None:
    with pytest.raises(ValueError, match="multiple of block_size"):
        PoolNamespace.from_layout(KVLayout.from_wire(LAYOUT), _kv_config(), chunk_size)


def test_rank_out_of_range_rejected() -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        dataclasses.replace(BASE, tp_rank=1)


def test_cache_salt_changes_chunk_hashes() -> None:
    tokens = list(range(50, 50 + 128))

    def keys(salt: str | None) -> list[bytes]:
        return chunk_hashes(hash_request_tokens(tokens, 16, cache_salt=salt), 16, 64, len(tokens))

    assert keys("") == keys(None)
    assert len(keys(None)) == 2
    a, b, none = keys("a"), keys("b"), keys(None)
    # the salt is in the first block, and by chaining in every later chunk too
    assert all(x != y for x, y in zip(a, none)) and all(x != y for x, y in zip(a, b))


def test_chunk_hashes_picks_last_block_of_each_full_chunk() -> None:
    bh = [bytes([i]) * 32 for i in range(7)]  # 7 blocks of 4 tokens, chunks of 3 blocks
    assert chunk_hashes(bh, 4, 12, 28) == [bh[2], bh[5]]
    assert chunk_hashes(bh, 4, 12, 23) == [bh[2]]  # the second chunk ends at token 24
    assert chunk_hashes(bh, 4, 12, 24) == [bh[2], bh[5]]
    assert chunk_hashes(bh[:5], 4, 12, 1000) == [bh[2]]  # last block of chunk 2 not hashed
    assert chunk_hashes(bh, 4, 4, 12) == bh[:3]
    assert chunk_hashes([], 4, 12, 100) == []
    with pytest.raises(ValueError):
        chunk_hashes(bh, 4, 10, 28)


def test_chunk_key_format() -> None:
    assert chunk_key("f" * 32, b"\x01\xab") == "pdkv:" + "f" * 32 + ":01ab"


@pytest.mark.parametrize("n,expected", [(0, 0), (1, 0), (256, 0), (257, 256), (512, 256),
                                        (513, 512), (1000, 768)])
def test_max_loadable_tokens(n: int, expected: int) -> None:
    assert max_loadable_tokens(n, 256) == expected
