"""Pool keys: namespace fingerprint, chunk hashes and chunk keys (torch-free, pure functions).

A pool entry holds the KV of one chunk of `chunk_size` tokens (a multiple of the block size). Its
key is `pdkv:<fingerprint>:<chunk hash>`:

- the chunk hash is the engine's block hash of the chunk's last block
  (`pdkv.block_hashing.hash_request_tokens`: a reproducible sha256 chain over every token before
  it, with cache_salt folded into the first block), so it is equal across processes, restarts and
  machines;
- the fingerprint covers everything else that changes the bytes of the KV: weights digest, KV
  dtype and quantization, block size, memory layout, the KV cache groups (kind, layers, heads,
  head size), chunk size, and the tp / dcp rank and size of the worker that holds the shard.

Only full chunks are stored, and the last prompt token is never loaded (the engine must compute
it to sample), so a full hit on an n-token prompt is `max_loadable_tokens(n, C)` tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from pdkv.cache.kv_layout import KVLayout
from pdkv.cache.specs import KVCacheConfig, KVCacheGroupSpec

FORMAT_TAG = "pdkv.pool.v1"
"""Format tag hashed into every fingerprint; bump it when the value format changes."""

_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class PoolNamespace:
    """Everything besides the token prefix that changes a chunk's KV bytes.

    Attributes:
        model_digest: digest of the weights (`pdkv.model.loader.model_digest`).
        dtype: KV cache dtype ("float32", "bfloat16", ...).
        block_size: tokens per block.
        kv_layout: the worker's KV memory layout name.
        groups: one description per KV cache group, in group order, e.g.
            "full_attention:layers=0-29:kv_heads=3:head_size=64:dtype=float32".
        chunk_size: tokens per pool chunk (a positive multiple of block_size).
        tp_rank, tp_size: tensor-parallel rank and size of the shard.
        dcp_rank, dcp_size: decode-context-parallel rank and size of the shard.
        kv_quant: KV quantization scheme ("" for none).

    Raises:
        ValueError: chunk_size is not a positive multiple of block_size, or a rank is not in
            [0, size).
    """

    model_digest: str
    dtype: str
    block_size: int
    kv_layout: str
    groups: tuple[str, ...]
    chunk_size: int
    tp_rank: int = 0
    tp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    kv_quant: str = ""

    def __post_init__(self) -> None:
        check_chunk_size(self.block_size, self.chunk_size)
        for rank, size, what in ((self.tp_rank, self.tp_size, "tp"),
                                 (self.dcp_rank, self.dcp_size, "dcp")):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{what}_rank={rank} is not in [0, {what}_size={size})")

    @property
    def fingerprint(self) -> str:
        """First 32 hex chars (128 bits) of sha256 over msgpack([FORMAT_TAG, sorted (name, value)
        pairs of every field]). Any field change gives a different fingerprint."""
        # Names are unique, so sorting never compares values; tuples encode as msgpack arrays.
        pairs = sorted((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        payload = _encoder.encode([FORMAT_TAG, pairs])
        return hashlib.sha256(payload).hexdigest()[:32]

    @classmethod
    def from_layout(
        cls,
        layout: KVLayout,
        kv_cache_config: KVCacheConfig,
        chunk_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        dcp_rank: int = 0,
        dcp_size: int = 1,
    ) -> PoolNamespace:
        """Namespace of an engine from its KV layout (model_digest, dtype, block_size,
        kv_layout, kv_quant) and its KV cache config (layers, heads and head size enter through
        the group descriptions).

        Raises:
            ValueError: chunk_size is not a positive multiple of the block size, or the
                layout's block size differs from a group's.
        """
        block_size = layout.block_size
        for g in kv_cache_config.groups:
            if g.spec.block_size != block_size:
                raise ValueError(
                    f"group block_size {g.spec.block_size} != layout block_size {block_size}"
                )
        return cls(
            model_digest=layout.model_digest,
            dtype=layout.dtype,
            block_size=block_size,
            kv_layout=layout.kv_layout,
            groups=tuple(describe_group(g) for g in kv_cache_config.groups),
            chunk_size=chunk_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            dcp_rank=dcp_rank,
            dcp_size=dcp_size,
            kv_quant=layout.kv_quant or "",
        )


def describe_group(group: KVCacheGroupSpec) -> str:
    """Canonical text of a KV cache group: kind, layer indices and every spec field
    (e.g. "full_attention:layers=0-29:block_size=16:dtype=float32:head_size=64:num_kv_heads=3";
    a quantized KV cache adds e.g. "cache_dtype=int8", an unquantized one's text omits
    cache_dtype=auto, so namespaces from before quantized KV keep their fingerprints; likewise
    "shared_kv=True" only for DeepSeek-V4's one-plane window)."""
    spec = group.spec
    fields = sorted((f.name, getattr(spec, f.name)) for f in dataclasses.fields(spec)
                    if not (f.name == "cache_dtype" and getattr(spec, f.name) == "auto")
                    and not (f.name == "shared_kv" and not getattr(spec, f.name)))
    parts = [spec.kind, "layers=" + _ranges(group.layer_indices)]
    parts += [f"{name}={value}" for name, value in fields]
    return ":".join(parts)


def _ranges(indices: Sequence[int]) -> str:
    """"0-29" for a contiguous ascending run, else the indices joined by commas."""
    if indices and list(indices) == list(range(indices[0], indices[0] + len(indices))):
        return f"{indices[0]}-{indices[-1]}"
    return ",".join(str(i) for i in indices)


def check_chunk_size(block_size: int, chunk_size: int) -> None:
    """Raises ValueError unless block_size > 0 and chunk_size is a positive multiple of it."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if chunk_size <= 0 or chunk_size % block_size:
        raise ValueError(
            f"chunk_size must be a positive multiple of block_size={block_size}, got {chunk_size}"
        )


def chunk_hashes(
    block_hashes: Sequence[bytes], block_size: int, chunk_size: int, max_tokens: int
) -> list[bytes]:
    """Hash of every full chunk within the first `max_tokens` tokens.

    Chunk i (tokens [i*C, (i+1)*C)) is hashed by its last block:
    `block_hashes[(i+1)*(C//block_size) - 1]`, taken while (i+1)*C <= max_tokens and that block
    hash exists. The chain behind a block hash covers every earlier token and the cache_salt.

    Raises:
        ValueError: chunk_size is not a positive multiple of block_size.
    """
    check_chunk_size(block_size, chunk_size)
    per_chunk = chunk_size // block_size
    out: list[bytes] = []
    i = 0
    while (i + 1) * chunk_size <= max_tokens and (i + 1) * per_chunk <= len(block_hashes):
        out.append(block_hashes[(i + 1) * per_chunk - 1])
        i += 1
    return out


def chunk_key(fingerprint: str, chunk_hash: bytes) -> str:
    """The pool key of a chunk: f"pdkv:{fingerprint}:{chunk_hash.hex()}"."""
    return f"pdkv:{fingerprint}:{chunk_hash.hex()}"


def max_loadable_tokens(num_prompt_tokens: int, chunk_size: int) -> int:
    """Most prompt tokens the pool can supply: ((n-1)//C)*C (full chunks only, and never the last
    prompt token, which the engine computes to sample); 0 for an empty prompt."""
    if num_prompt_tokens <= 0:
        return 0
    return ((num_prompt_tokens - 1) // chunk_size) * chunk_size
