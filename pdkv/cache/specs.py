"""KV cache specs and groups (torch-free).

A model declares per layer what state it keeps; layers with an equal spec form a KV cache group
and the manager allocates blocks per group (vLLM's `KVCacheSpec` / `KVCacheGroupSpec`,
vllm/v1/kv_cache_interface.py). Dense models need only `FullAttentionSpec`; sliding-window layers
(Mistral, Qwen2 `layer_types`, Gemma-2/3) get `SlidingWindowSpec`; DeepSeek-V2/V3 latent
attention gets `MLASpec`; linear-attention layers (Gated DeltaNet) get `LinearStateSpec`, one
state slot per request; DeepSeek-V4 adds `CompressedKVSpec` (one entry per `rate` tokens) and
`CompressorStateSpec` (a linear-state-like slot). Block tables, hashes,
kv_transfer_params and pool keys are keyed by group.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")
"""Values of `--kv-cache-dtype` (vLLM's flag): auto = the model dtype; int8 (symmetric) and fp8
(= fp8_e4m3, torch.float8_e4m3fn) store 1 byte per value plus a float32 scale per (token, head)
for K and for V (pdkv/model/kv_quant.py)."""

QUANTIZED_KV_CACHE_DTYPES = ("int8", "fp8_e4m3")
"""Canonical quantized KV cache dtypes (`canonical_kv_cache_dtype`)."""

SCALE_BYTES = 4
"""Bytes of one quantization scale (float32)."""


def canonical_kv_cache_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """"auto" (kept in the model dtype: "auto" or the model dtype itself), "int8" or "fp8_e4m3"
    ("fp8" is vLLM's alias of e4m3).

    Raises:
        ValueError: not one of KV_CACHE_DTYPES nor the model dtype (names the accepted values).
    """
    if kv_cache_dtype in ("auto", dtype):
        return "auto"
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} (or the model dtype "
                         f"{dtype!r}), got {kv_cache_dtype!r}")
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


@dataclass(frozen=True)
class KVCacheSpec:
    """Base spec: state kept per block of `block_size` tokens."""

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer."""
        raise NotImplementedError

    @property
    def kind(self) -> str:
        """Short name used in fingerprints and logs."""
        raise NotImplementedError

    @property
    def state_slot(self) -> bool:
        """Whether a block of this group is a per-request state slot (linear-attention state,
        DeepSeek-V4 compressor state): it holds the state at one position, not tokens, so a
        connector moves the slot of the position it resumes at, not every block."""
        return False


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """K and V of every token, for causal attention over the whole context.

    One block of one layer is K and V, each [block_size, num_kv_heads, head_size] of `dtype`:
    page_size_bytes = 2 * block_size * num_kv_heads * head_size * dtype_bytes.

    With a quantized `cache_dtype` ("int8" or "fp8_e4m3"; "auto" = stored in `dtype`) the page
    is the 1-byte values followed by a float32 scale per (token, head) for K and for V:
    page_size_bytes = 2 * block_size * num_kv_heads * head_size + 2 * block_size * num_kv_heads * 4
    (`quant_data_bytes` + the scales; pdkv/model/kv_quant.py).

    With `shared_kv` (DeepSeek-V4's shared-KV MQA: the key is the value) a page holds one plane,
    not two: page_size_bytes = block_size * num_kv_heads * head_size * dtype_bytes (not with a
    quantized cache).
    """

    num_kv_heads: int = 1
    head_size: int = 1
    dtype: str = "float32"
    cache_dtype: str = "auto"
    shared_kv: bool = False

    @property
    def planes(self) -> int:
        """Vectors stored per token and head: 2 (K and V), 1 with shared_kv."""
        return 1 if self.shared_kv else 2

    @property
    def quantized(self) -> bool:
        """Whether the cache stores quantized values with scales."""
        return self.cache_dtype != "auto"

    @property
    def quant_data_bytes(self) -> int:
        """Bytes of a quantized page's values (K then V, 1 byte each); the scales follow."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size

    @property
    def page_size_bytes(self) -> int:
        if self.quantized:
            return self.quant_data_bytes + 2 * self.block_size * self.num_kv_heads * SCALE_BYTES
        return (self.planes * self.block_size * self.num_kv_heads * self.head_size
                * DTYPE_BYTES[self.dtype])

    @property
    def kind(self) -> str:
        return "full_attention"


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """K and V of the last `sliding_window` tokens (the query's own included).

    HF semantics (transformers' `sliding_window_overlay`): the query at position p sees keys at
    positions k with p - sliding_window < k <= p. Pages are those of full attention; the manager
    frees a request's blocks once every token in them has left the window of all later queries,
    and a prefix-cache hit needs only the blocks of the window before the hit's end.
    """

    sliding_window: int = 1

    @property
    def kind(self) -> str:
        return "sliding_window"


@dataclass(frozen=True)
class MLASpec(KVCacheSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): one vector per token, no heads.

    What vLLM's MLA backends store: the kv_a_layernorm'ed latent c_kv (`kv_lora_rank` wide)
    followed by the rope'd shared key k_pe (`qk_rope_head_dim` wide). Every query head
    up-projects the same latent, so with tensor parallelism each rank keeps the whole vector
    (replicated, as vLLM). One block of one layer is [block_size, kv_lora_rank + qk_rope_head_dim]
    of `dtype`: page_size_bytes = block_size * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes.
    """

    kv_lora_rank: int = 1
    qk_rope_head_dim: int = 0
    dtype: str = "float32"

    @property
    def entry_size(self) -> int:
        """Elements cached per token and layer: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.entry_size * DTYPE_BYTES[self.dtype]

    @property
    def kind(self) -> str:
        return "mla"


@dataclass(frozen=True)
class LinearStateSpec(KVCacheSpec):
    """Linear-attention state (Gated DeltaNet: Qwen3-Next, Qwen3.5; the KDA layers of
    Kimi-Linear): per request and layer a conv window and a recurrent state whose size does not
    depend on the request's length, so a request holds exactly one "block" of this group (a state
    slot), whatever its length (vLLM's `MambaSpec` / `MambaManager`). `block_size` is the common
    block size of the other groups and plays no part in the size.

    One slot of one layer is the conv window `conv_shape` of `conv_dtype` followed by the
    recurrent state `recurrent_shape` of `recurrent_dtype` (float32, as HF and vLLM keep it):
    page_size_bytes = prod(conv_shape) * conv bytes + prod(recurrent_shape) * recurrent bytes.
    Gated DeltaNet: conv_shape = (2 * key heads * dk + value heads * dv, kernel - 1),
    recurrent_shape = (value heads, dk, dv).
    """

    conv_shape: tuple[int, ...] = ()
    recurrent_shape: tuple[int, ...] = ()
    conv_dtype: str = "float32"
    recurrent_dtype: str = "float32"

    @property
    def conv_bytes(self) -> int:
        """Bytes of one layer's conv window."""
        return _prod(self.conv_shape) * DTYPE_BYTES[self.conv_dtype]

    @property
    def page_size_bytes(self) -> int:
        return self.conv_bytes + _prod(self.recurrent_shape) * DTYPE_BYTES[self.recurrent_dtype]

    @property
    def state_slot(self) -> bool:
        return True

    @property
    def kind(self) -> str:
        return "linear_state"


@dataclass(frozen=True)
class CompressedKVSpec(KVCacheSpec):
    """DeepSeek-V4 compressed entries of one layer (CSA / HCA compressed KV, or CSA's indexer
    keys): one `width`-wide vector per `rate` tokens (pdkv/model/v4_attention.py).

    A block covers `block_size` tokens, like every group's, and holds the entries of the windows
    that end in it: entry w (tokens w·rate .. (w + 1)·rate - 1) lives in the block of its last
    token, at offset w mod entries_per_block. With rate dividing block_size a block holds
    block_size / rate entries; with block_size dividing rate, one entry in every (rate /
    block_size)-th block (the others hold none). A prefix hit of whole blocks thus holds exactly
    the entries of the windows it contains: the full-attention manager's rule.
    page_size_bytes = entries_per_block · width · dtype bytes.

    Raises (at construction):
        ValueError: neither of rate and block_size divides the other.
    """

    rate: int = 1
    width: int = 1
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.block_size % self.rate and self.rate % self.block_size:
            raise ValueError(
                f"a compression rate of {self.rate} tokens and a block size of {self.block_size} "
                "tokens must divide one another (an entry's window would straddle blocks): "
                "choose --block-size accordingly")

    @property
    def entries_per_block(self) -> int:
        """Entry slots of one block: block_size // rate, at least 1."""
        return max(1, self.block_size // self.rate)

    def entry_slot(self, entry: int) -> tuple[int, int]:
        """(block index in the request's table, offset in the block) of entry `entry`."""
        last = (entry + 1) * self.rate - 1
        return last // self.block_size, entry % self.entries_per_block

    @property
    def page_size_bytes(self) -> int:
        return self.entries_per_block * self.width * DTYPE_BYTES[self.dtype]

    @property
    def kind(self) -> str:
        return "compressed_kv"


@dataclass(frozen=True)
class CompressorStateSpec(LinearStateSpec):
    """DeepSeek-V4 compressor state of one layer: the pending tokens of the open window and
    CSA's overlap, for the attention compressor and (CSA) the indexer's, as float32 in a fixed
    slot per request (`recurrent_shape` = (floats,)), kept like linear state: one slot per
    request, or with prefix caching a checkpoint per block (its state at the block's end).
    Layout: pdkv/model/v4_attention.py `Compressor.state_floats`."""

    @property
    def kind(self) -> str:
        return "compressor_state"


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def window_first_block(resume_token: int, block_size: int, window: int | None) -> int:
    """First block a group keeps for a request that resumes at token `resume_token` (0 without
    a window): a sliding-window group keeps the window of the block boundary
    B = resume_token // block_size * block_size at or before it, tokens B - W + 1 on (what the
    resumed query reads, and what a later prefix hit of B tokens needs). Used where a connector
    moves a window group (P/D pulls, `pdkv bench groups`); `KVCacheManager.cache_loaded_blocks`
    keeps the same blocks."""
    if window is None:
        return 0
    boundary = resume_token // block_size * block_size
    return max(0, boundary - window + 1) // block_size


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers (by index) that share one spec and one block table per request."""

    layer_indices: tuple[int, ...]
    spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """What the worker allocates: `num_blocks` blocks per group.

    Each group's cache is one tensor [num_blocks, num_layers_in_group, 2, block_size,
    num_kv_heads, head_size] ("cross-layer" layout; an MLA group: [num_blocks,
    num_layers_in_group, block_size, kv_lora_rank + qk_rope_head_dim]; a linear-state group:
    uint8 [num_blocks, num_layers_in_group, page_size_bytes], each block one request's state
    slot), so a block is one contiguous run of `block_bytes(group)` bytes: what P/D transfer and
    the pool move.
    """

    num_blocks: int
    groups: tuple[KVCacheGroupSpec, ...]

    def block_bytes(self, group_id: int = 0) -> int:
        """Bytes of one block across all layers of a group."""
        g = self.groups[group_id]
        return g.spec.page_size_bytes * len(g.layer_indices)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Per group: its sliding window in tokens, or None (no window)."""
        return tuple(g.spec.sliding_window if isinstance(g.spec, SlidingWindowSpec) else None
                     for g in self.groups)

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole KV cache."""
        return sum(self.block_bytes(i) for i in range(len(self.groups))) * self.num_blocks
