"""KV cache sizing and allocation for one worker."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdkv.cache.specs import (
    DTYPE_BYTES,
    SCALE_BYTES,
    CompressedKVSpec,
    CompressorStateSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    LinearStateSpec,
    MLASpec,
    SlidingWindowSpec,
    canonical_kv_cache_dtype,
)
from pdkv.kv_transfer.reshard_state import StateGeometry
from pdkv.model.arch_config import LlamaArchConfig, attention_groups
from pdkv.model.kv_quant import KVCacheLayer, QuantKVCache
from pdkv.model.v4_config import V4CacheLayers, layer_state_floats
from pdkv.parallel.layout import ParallelLayout


def check_sliding_window_parallel(arch: LlamaArchConfig, dcp_size: int) -> None:
    """Refuse decode context parallelism on a sliding-window or MLA model (not supported yet:
    DCP's sharded attention has no window bound, its metadata covers one KV cache group, and it
    attends over K/V heads, not MLA latents).

    Raises:
        ValueError: dcp_size > 1 and some layer slides or the model is MLA.
    """
    if dcp_size > 1 and arch.has_linear_state:
        raise ValueError(
            f"decode_context_parallel_size={dcp_size} is not supported with linear-attention "
            f"(Gated DeltaNet) layers yet ({arch.architecture}: their state is one slot per "
            "request, not blocks of tokens to shard); use decode_context_parallel_size=1"
        )
    if dcp_size > 1 and arch.is_mla:
        raise ValueError(
            f"decode_context_parallel_size={dcp_size} is not supported with multi-head latent "
            f"attention yet ({arch.architecture}: DCP's sharded attention reads K/V heads, not the "
            "latent cache); use decode_context_parallel_size=1 (tensor parallelism works)"
        )
    if dcp_size > 1 and arch.sliding_window is not None:
        raise ValueError(
            f"decode_context_parallel_size={dcp_size} is not supported with sliding-window "
            f"attention yet ({arch.architecture} slides "
            f"{arch.layer_types.count('sliding_attention')} of {arch.num_layers} layers over "
            f"{arch.sliding_window} tokens); use decode_context_parallel_size=1 (tensor "
            "parallelism works)"
        )


def check_pcp_model(arch: LlamaArchConfig, pcp_size: int) -> None:
    """Refuse prefill context parallelism on what it is not built for: sliding-window,
    linear-state (Gated DeltaNet, KDA) and MLA models (its split attends dense K/V heads over one
    full-attention KV cache group).

    Raises:
        ValueError: pcp_size > 1 and the model has one of those layer kinds (named).
    """
    if pcp_size <= 1:
        return
    kinds = [name for name, has in (
        ("linear-attention (recurrent state) layers", arch.has_linear_state),
        ("multi-head latent attention", arch.is_mla),
        ("sliding-window attention", arch.sliding_window is not None)) if has]
    if kinds:
        raise ValueError(
            f"prefill_context_parallel_size={pcp_size} is not built for {' and '.join(kinds)} "
            f"yet ({arch.architecture}); it is built for dense full-attention models only; use "
            "prefill_context_parallel_size=1"
        )


def linear_state_spec(
    arch: LlamaArchConfig, block_size: int, dtype: str, tp_size: int = 1
) -> LinearStateSpec:
    """The Gated DeltaNet state of one layer on one of `tp_size` TP ranks (pdkv/model/
    qwen3_next.py's byte layout): conv window [conv_dim / tp, kernel - 1] in the model dtype (the
    rank's q | k | v channels), recurrent state [value heads / tp, dk, dv] in float32."""
    return LinearStateSpec(
        block_size=block_size,
        conv_shape=(arch.linear_conv_dim // tp_size, arch.linear_conv_kernel_dim - 1),
        recurrent_shape=(
            arch.linear_num_value_heads // tp_size,
            arch.linear_key_head_dim,
            arch.linear_value_head_dim,
        ),
        conv_dtype=dtype,
        recurrent_dtype="float32",
    )


def gdn_state_geometry(arch: LlamaArchConfig, dtype: str) -> StateGeometry:
    """The Gated DeltaNet state slot's geometry over every TP rank (linear_state_spec's layout;
    conv segments q | k | v in channels), for re-sharding it in P/D (pdkv/kv_transfer/
    reshard_state.py)."""
    key = arch.linear_num_key_heads * arch.linear_key_head_dim
    return StateGeometry(
        group=len(attention_groups(arch)),
        num_layers=len(arch.linear_layers),
        conv_segments=(key, key, arch.linear_num_value_heads * arch.linear_value_head_dim),
        conv_row_bytes=(arch.linear_conv_kernel_dim - 1) * DTYPE_BYTES[dtype],
        rec_heads=arch.linear_num_value_heads,
        rec_head_bytes=arch.linear_key_head_dim * arch.linear_value_head_dim * 4,
    )


@dataclass(frozen=True)
class KVCacheSizing:
    """What sizing one engine's KV cache takes, read from its configuration once, at the top
    (LLMEngine): the cache's block size, dtype and budget, the model's dtype and longest
    sequence, the TP/DCP layout. It holds values, not the configuration.

    Attributes:
        block_size: tokens per block of one rank.
        dtype: the model's dtype ("float32", "float16", "bfloat16").
        max_model_len: the longest sequence in tokens; the pool must hold one such request.
        cache_dtype: vLLM's --kv-cache-dtype ("auto": the model's dtype; "int8", "fp8", ...).
        num_kv_blocks: blocks per group; None: kv_cache_memory_bytes // bytes of one block.
        kv_cache_memory_bytes: the budget when num_kv_blocks is None (bytes, per rank).
        layout: the engine's TP/DCP layout (this rank's KV heads; DCP ranks share a request).
    """

    block_size: int
    dtype: str
    max_model_len: int
    cache_dtype: str = "auto"
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    layout: ParallelLayout = field(default_factory=ParallelLayout)


def v4_cache_groups(arch: LlamaArchConfig, block_size: int, dtype: str) -> list[KVCacheGroupSpec]:
    """DeepSeek-V4's groups after its sliding-window group (cache layers: V4CacheLayers): the
    compressed KV of the CSA layers and of the HCA layers, the CSA indexer keys (each a
    CompressedKVSpec of its rate and width, in the model dtype), and one CompressorStateSpec
    group of every compressor layer (float32 slots of the largest layer's state). Kinds a model
    does not have are left out.

    Raises:
        ValueError: a compression rate and block_size that do not divide one another.
    """
    v4 = arch.v4
    assert v4 is not None
    lay = V4CacheLayers.of(v4)
    d, c = arch.head_dim, v4.index_head_dim
    out = []
    for layers, rate, width, cache in ((lay.csa, v4.csa_rate, d, lay.compressed),
                                       (lay.hca, v4.hca_rate, d, lay.compressed),
                                       (lay.csa, v4.csa_rate, c, lay.indexer)):
        if layers:
            out.append(KVCacheGroupSpec(
                layer_indices=tuple(cache[i] for i in layers),
                spec=CompressedKVSpec(block_size=block_size, rate=rate, width=width, dtype=dtype)))
    if lay.state:
        floats = max(layer_state_floats(v4, d, i) for i in lay.state)
        out.append(KVCacheGroupSpec(
            layer_indices=tuple(lay.state.values()),
            spec=CompressorStateSpec(block_size=block_size, conv_shape=(0,),
                                     recurrent_shape=(floats,), recurrent_dtype="float32")))
    return out


def group_kinds(arch: LlamaArchConfig) -> set[str]:
    """The kinds (`KVCacheSpec.kind`) of the KV cache groups `make_kv_cache_config` builds for
    `arch`, without sizing anything (start-up checks before worker processes spawn)."""
    kinds = {"sliding_window" if w is not None else ("mla" if arch.is_mla else "full_attention")
             for w, _ in attention_groups(arch)}
    if arch.v4 is not None:
        kinds |= {"compressed_kv", "compressor_state"}
    return kinds | ({"linear_state"} if arch.has_linear_state else set())


def make_kv_cache_config(arch: LlamaArchConfig, sizing: KVCacheSizing,
                         budget_bytes: int | None = None) -> KVCacheConfig:
    """The KV cache one rank allocates: the one place where an engine sizes it, once for every
    rank (its executor calls this; pdkv.executor).

    One KV cache group per attention kind: FullAttentionSpec for full layers (MLASpec on an
    MLA model), SlidingWindowSpec(window) for sliding ones, in the order of each group's first
    layer (a dense model is one FullAttention group holding every layer); linear-attention layers
    form one LinearStateSpec group after those (so group 0 is always an attention group), one
    slot per request. Every group's pool has num_blocks blocks (per rank): num_kv_blocks, else
    budget // (sum over groups of one block's bytes). A block holds block_size tokens of this
    rank's KV heads (TP shards them); one logical block of block_size × dcp tokens is one
    physical block on each DCP rank (`scheduler_view`).

    Args:
        budget_bytes: the memory budget measured after the weights were loaded (the smallest of
            the ranks', with --gpu-memory-utilization), replacing kv_cache_memory_bytes; None:
            the configured num_kv_blocks or kv_cache_memory_bytes.

    Raises:
        ValueError: the pool cannot hold even one request of max_model_len tokens; DCP with a
            sliding-window model (check_sliding_window_parallel).
    """
    block_size, dtype, max_model_len = sizing.block_size, sizing.dtype, sizing.max_model_len
    dcp_size, tp_size = sizing.layout.dcp_size, sizing.layout.tp_size
    num_kv_heads = sizing.layout.kv_heads_per_rank(arch.num_kv_heads)
    budget = sizing.kv_cache_memory_bytes if budget_bytes is None else budget_bytes
    check_sliding_window_parallel(arch, dcp_size)
    groups = []
    cache_dtype = canonical_kv_cache_dtype(sizing.cache_dtype, dtype)
    full: KVCacheSpec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=arch.head_dim, dtype=dtype,
        cache_dtype=cache_dtype)
    if arch.is_mla:  # the latent is replicated: every rank stores the whole vector
        if cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={cache_dtype!r} is not supported with MLA yet "
                             f"({arch.architecture} keeps latents): use kv_cache_dtype=auto")
        full = MLASpec(block_size=block_size, kv_lora_rank=arch.kv_lora_rank,
                       qk_rope_head_dim=arch.qk_rope_head_dim, dtype=dtype)
    for window, layers in attention_groups(arch):
        spec = full if window is None else SlidingWindowSpec(
            block_size=block_size, num_kv_heads=num_kv_heads, head_size=arch.head_dim,
            dtype=dtype, cache_dtype=cache_dtype, sliding_window=window,
            shared_kv=arch.v4 is not None)  # DeepSeek-V4: K = V, one plane
        groups.append(KVCacheGroupSpec(layer_indices=layers, spec=spec))
    if arch.v4 is not None:  # DeepSeek-V4: compressed entries and compressor state
        groups.extend(v4_cache_groups(arch, block_size, dtype))
    if arch.has_linear_state:  # one state slot per request, after the attention groups
        groups.append(
            KVCacheGroupSpec(
                layer_indices=arch.linear_layers,
                spec=linear_state_spec(arch, block_size, dtype, tp_size),
            )
        )
    block_bytes = sum(g.spec.page_size_bytes * len(g.layer_indices) for g in groups)
    num_blocks = sizing.num_kv_blocks or budget // block_bytes
    needed = -(-max_model_len // (block_size * dcp_size))
    if arch.has_linear_state or arch.v4 is not None:  # a slot per block, and the null block
        needed += 1
    if num_blocks < needed:
        dcp = f" x {dcp_size} DCP ranks" if dcp_size > 1 else ""
        raise ValueError(
            f"KV cache of {num_blocks} blocks x {block_size} tokens{dcp} cannot hold one "
            f"request of max_model_len={max_model_len} tokens ({needed} blocks): raise "
            "num_kv_blocks / kv_cache_memory_bytes or lower max_model_len"
        )
    return KVCacheConfig(num_blocks=num_blocks, groups=tuple(groups))


def scheduler_view(per_rank: KVCacheConfig, dcp_size: int) -> KVCacheConfig:
    """The scheduler's view of a KV cache sized by `make_kv_cache_config`: the same blocks, each
    of block_size × dcp_size tokens (K/V specs)."""
    if dcp_size == 1:
        return per_rank
    groups = tuple(
        KVCacheGroupSpec(layer_indices=g.layer_indices, spec=dataclasses.replace(
            g.spec, block_size=g.spec.block_size * dcp_size))
        if isinstance(g.spec, FullAttentionSpec) else g
        for g in per_rank.groups)
    return KVCacheConfig(num_blocks=per_rank.num_blocks, groups=groups)


def allocate_kv_cache(
    kv_cache_config: KVCacheConfig,
    dtype: torch.dtype,
    device: torch.device,
    buffer_fn: Callable[[int, int], memoryview | None] | None = None,
    prefault: bool = False,
) -> tuple[list[torch.Tensor], list[KVCacheLayer]]:
    """Allocate one cross-layer tensor per group and per-layer views into it.

    A quantized group (spec.cache_dtype int8 / fp8_e4m3) is raw bytes [num_blocks,
    num_layers_in_group, page_size_bytes] and each of its layers a `QuantKVCache` of typed
    views: data [2, num_blocks, block_size, num_kv_heads, head_size] uint8 over the first
    `quant_data_bytes` of each page, scales [2, num_blocks, block_size, num_kv_heads] float32
    over the rest (pdkv/model/kv_quant.py).

    Args:
        buffer_fn: optional (group, nbytes) -> memory to build the group's tensor on (e.g.
            shared memory for the shm transfer engine); None or a None result = torch.empty.
        prefault: on CPU, zero every group tensor here, so all its pages are resident now
            (CacheConfig.prefault). Otherwise the memory is not written here: pages are touched
            (and enter the resident set) only when K/V is first written to them. Slots never
            written hold arbitrary values (NaN included); attention reads only written slots
            (pdkv.model.attention).

    Returns:
        (group tensors, each [num_blocks, num_layers_in_group, 2, block_size, num_kv_heads,
        head_size] (quantized: uint8 [num_blocks, num_layers_in_group, page_size_bytes]);
        per-layer views in model layer order, each [2, num_blocks, block_size, num_kv_heads,
        head_size] or a QuantKVCache). An MLA group: [num_blocks, num_layers_in_group,
        block_size, kv_lora_rank + qk_rope_head_dim], per-layer views [num_blocks, block_size,
        entry]. A linear-state group: uint8 [num_blocks (state slots), num_layers_in_group,
        page_size_bytes], per-layer views [num_blocks, page_size_bytes].

    Raises:
        ValueError: a quantized page whose value bytes are not a multiple of 4 (its float32
            scales would be unaligned; block_size × num_kv_heads × head_size must be even); a
            spec kind without a layout.
    """
    groups: list[torch.Tensor] = []
    num_layers = sum(len(g.layer_indices) for g in kv_cache_config.groups)
    layer_views: list[KVCacheLayer | None] = [None] * num_layers
    for g in kv_cache_config.groups:
        spec = g.spec
        n, layers = kv_cache_config.num_blocks, len(g.layer_indices)
        shape: tuple[int, ...]
        elem = dtype
        if isinstance(
            spec, LinearStateSpec
        ):  # raw bytes: the layer views its conv / recurrent parts
            shape = (n, layers, spec.page_size_bytes)
            elem = torch.uint8
        elif isinstance(spec, MLASpec):
            shape = (n, layers, spec.block_size, spec.entry_size)
        elif isinstance(spec, CompressedKVSpec):
            shape = (n, layers, spec.entries_per_block, spec.width)
        elif isinstance(spec, FullAttentionSpec) and spec.quantized:
            if spec.quant_data_bytes % SCALE_BYTES:
                raise ValueError(
                    f"quantized KV page of {spec.quant_data_bytes} value bytes leaves its "
                    "float32 scales unaligned: block_size x num_kv_heads x head_size must be even"
                )
            shape = (n, layers, spec.page_size_bytes)
            elem = torch.uint8
        elif isinstance(spec, FullAttentionSpec):
            shape = (n, layers, spec.planes, spec.block_size, spec.num_kv_heads, spec.head_size)
        else:
            raise ValueError(f"no KV cache layout for a {spec.kind} group")
        nbytes = kv_cache_config.block_bytes(len(groups)) * n
        buf = (
            buffer_fn(len(groups), nbytes)
            if buffer_fn is not None and device.type == "cpu"
            else None
        )
        if buf is not None:
            t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(elem).view(shape)
        else:
            t = torch.empty(shape, dtype=elem, device=device)
        if prefault and device.type == "cpu":
            t.zero_()
        groups.append(t)
        for j, layer in enumerate(g.layer_indices):
            if isinstance(spec, (MLASpec, LinearStateSpec, CompressedKVSpec)):
                layer_views[layer] = t[:, j]
            elif isinstance(spec, FullAttentionSpec) and spec.quantized:
                page = t[:, j]
                data = page[:, : spec.quant_data_bytes].view(
                    n, 2, spec.block_size, spec.num_kv_heads, spec.head_size
                )
                scales = page[:, spec.quant_data_bytes :].view(torch.float32).view(
                    n, 2, spec.block_size, spec.num_kv_heads)
                layer_views[layer] = QuantKVCache(data.transpose(0, 1), scales.transpose(0, 1),
                                                  spec.cache_dtype, dtype)
            else:
                layer_views[layer] = t[:, j].transpose(0, 1)
    assert all(v is not None for v in layer_views)
    return groups, [v for v in layer_views if v is not None]
