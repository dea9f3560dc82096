"""Llama-architecture decoder (Llama, SmolLM2, Qwen2-style qkv bias) over a paged KV cache.

Numerics follow HF transformers' `LlamaForCausalLM` (RMSNorm in float32, rotate-half RoPE,
residual order), with q/k/v and gate/up projections fused into one matmul each and logits
computed only for the positions that are sampled.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pdkv.model import fused_ops
from pdkv.model.arch_config import (
    SUPPORTED_ARCHITECTURES,
    LlamaArchConfig,
    attention_groups,
    hybrid_state_kinds,
)
from pdkv.model.attention import AttentionMetadata, paged_attention
from pdkv.model.layer_hooks import LayerHooks
from pdkv.model.linear_backend import LinearDispatch
from pdkv.model.panel_linear import PanelWeight
from pdkv.parallel.context import ParallelContext

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaArchConfig", "LlamaForCausalLM", "hybrid_state_kinds"]

# (q [T, H, D], k [T, KVH, D], v [T, KVH, D], kv_cache, meta, scale) -> [T, H, D]; the layer's
# one attention call (paged_attention today; a DCP variant plugs in here).
AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]


def rope_cos_sin(
    head_dim: int, theta: float, max_positions: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables as HF computes them: inv_freq = theta^(-2i/d), angles = pos * inv_freq,
    duplicated to the full head dim.

    Returns:
        (cos, signed_sin), each [max_positions, head_dim] float32; signed_sin has its first
        half negated so that rotate_half(x) * sin == swap_halves(x) * signed_sin exactly.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    pos = torch.arange(max_positions, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    half = head_dim // 2
    return emb.cos(), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF's `x * cos + rotate_half(x) * sin`, bit for bit).

    x: [T, heads, D]; cos / signed_sin: [T, 1, D] (see rope_cos_sin).
    """
    t, h, d = x.shape
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)
    return x * cos + swapped * signed_sin


class LlamaLayer(nn.Module):
    """One decoder layer with fused projections (weights [out, in], as nn.Linear).

    With tensor parallelism the layer holds this rank's shard (Megatron / vLLM split): qkv and
    gate_up are column-parallel (its q heads, its KV heads, its slice of the intermediate size),
    o_proj and down are row-parallel, their partial outputs summed over the TP group before the
    residual add.
    """

    def __init__(
        self,
        cfg: LlamaArchConfig,
        dtype: torch.dtype,
        parallel: ParallelContext | None = None,
        attention: AttentionFn = paged_attention,
    ) -> None:
        super().__init__()
        self.parallel = parallel or ParallelContext.single()
        self.attention = attention
        tp = self.parallel.tp_size
        self.parallel.layout.check_heads(cfg.num_heads, cfg.num_kv_heads)
        if cfg.intermediate_size % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} must divide the model's "
                f"intermediate_size={cfg.intermediate_size}"
            )
        self.num_heads = cfg.num_heads // tp
        self.num_kv_heads = self.parallel.layout.kv_heads_per_rank(cfg.num_kv_heads)
        self.head_dim = cfg.head_dim
        q_size = self.num_heads * cfg.head_dim
        kv_size = self.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.eps = cfg.rms_norm_eps
        h, i = cfg.hidden_size, cfg.intermediate_size // tp
        self.input_norm = nn.Parameter(torch.empty(h, dtype=dtype), requires_grad=False)
        self.post_attn_norm = nn.Parameter(torch.empty(h, dtype=dtype), requires_grad=False)
        self.qkv = nn.Parameter(
            torch.empty(q_size + 2 * kv_size, h, dtype=dtype), requires_grad=False
        )
        self.qkv_bias = (
            nn.Parameter(torch.empty(q_size + 2 * kv_size, dtype=dtype), requires_grad=False)
            if cfg.qkv_bias
            else None
        )
        self.o_proj = nn.Parameter(torch.empty(h, q_size, dtype=dtype), requires_grad=False)
        self.gate_up = nn.Parameter(torch.empty(2 * i, h, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(h, i, dtype=dtype), requires_grad=False)
        # oneDNN-packed weights (pack_cpu_weights), which then replace the plain ones; a
        # LinearDispatch (--cpu-linear auto) over the plain ones; None = plain F.linear.
        self.packed: dict[str, PackedLinear] = {
            "qkv": None,
            "o_proj": None,
            "gate_up": None,
            "down": None,
        }
        # C++ fused small ops (pdkv.model.fused_ops.set_fused_ops); False = the torch ops.
        self.fused_ops = False
        # The whole layer of a decode step as one C++ op (pdkv.model.decode_layer.DecodeLayerOp,
        # set by set_decode_layer_op): (hidden, cos, sin, kv_cache, meta) -> hidden; None = the
        # Python below.
        self.decode_op: Callable[..., torch.Tensor] | None = None

    def pack_cpu_weights(self, packer: Packer | None = None) -> bool:
        """Pack the four projection weights with `packer` (default pack_linear_weight: oneDNN),
        keeping one copy of each: a packed weight's plain parameter becomes a meta tensor (shape
        and dtype, no memory). True when all four are packed."""
        packer = packer or pack_linear_weight
        for name in self.packed:
            packed = packer(getattr(self, name))
            if packed is None:
                return False
            self.packed[name] = packed
            setattr(self, name, _without_data(getattr(self, name)))
        return True

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden: [T, hidden] -> [T, hidden]; kv_cache: this layer's [2, blocks, bs, kvh, D].

        With fused ops on (pdkv.model.fused_ops) the residual stream `hidden` is updated in place
        and returned."""
        op = self.decode_op
        if (op is not None and meta.all_decode and meta.dcp is None and meta.pcp is None
                and type(kv_cache) is torch.Tensor and kv_cache.stride(3) == self.head_dim):
            return op(hidden, cos, sin, kv_cache, meta)
        t = hidden.shape[0]
        fused = self.fused_ops
        x = (
            fused_ops.rms_norm(hidden, self.input_norm, self.eps)
            if fused
            else rms_norm(hidden, self.input_norm, self.eps)
        )
        pk = self.packed
        qkv = linear(x, self.qkv, pk["qkv"], self.qkv_bias)
        # q and k heads are rotated together (one pass of elementwise ops).
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, -1)
        qk = fused_ops.rope_(qk, cos, sin) if fused else apply_rope(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        attn = self.attention(q, k, v, kv_cache, meta, self.head_dim**-0.5)
        tp = self.parallel
        o = tp.all_reduce_tp(linear(attn.reshape(t, self.q_size), self.o_proj, pk["o_proj"]))
        if fused:
            x = fused_ops.add_rms_norm_(hidden, o, self.post_attn_norm, self.eps)
            act = fused_ops.silu_mul(linear(x, self.gate_up, pk["gate_up"]))
            return hidden.add_(tp.all_reduce_tp(linear(act, self.down, pk["down"])))
        hidden = hidden + o
        x = rms_norm(hidden, self.post_attn_norm, self.eps)
        gate, up = linear(x, self.gate_up, pk["gate_up"]).chunk(2, dim=-1)
        return hidden + tp.all_reduce_tp(linear(F.silu(gate) * up, self.down, pk["down"]))


# What a projection runs with besides its plain weight: a oneDNN-packed weight, pdkv's panel
# weight (pdkv.model.panel_linear), a per-shape dispatch (pdkv.model.linear_backend), or nothing
# (F.linear).
PackedLinear = torch.Tensor | PanelWeight | LinearDispatch | None
Packer = Callable[[torch.Tensor], PackedLinear]
"""Makes a weight's packed form ([out, in] -> PackedLinear; None: cannot pack it here)."""


def linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedLinear,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias. x: [T, in]; weight: [out, in]. With `packed` a oneDNN-reordered copy
    of weight (see pack_linear_weight) the CPU oneDNN kernel runs instead of the BLAS one; with a
    PanelWeight pdkv's panel kernel on it; with a LinearDispatch the kernel its table names for T
    rows runs on the plain weight."""
    if packed is None:
        return F.linear(x, weight, bias)
    if isinstance(packed, torch.Tensor):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return packed(x, weight, bias)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-reordered copy of a CPU weight [out, in] (float32; bfloat16 where oneDNN has a
    bf16 kernel, see pdkv.model.cpu_features), or None when unavailable."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
    except RuntimeError:  # this oneDNN build has no kernel for the dtype on this CPU
        return None


def _without_data(param: torch.Tensor) -> nn.Parameter:
    """A stand-in for a weight whose only copy is now packed: same shape and dtype on the meta
    device (no memory; reading its values raises)."""
    return nn.Parameter(
        torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) * weight, normalised in float32.

    x: [T, hidden]. In float32 the fused kernel equals HF's composite form bit for bit
    (checked by tests/model/test_llama_ops.py); other dtypes use HF's form.
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied or not).

    Args:
        cfg: architecture.
        dtype: parameter and activation dtype.
        device: where tensors live.
        parallel: this rank's TP / DCP context (None: one process). Layers hold the rank's shard;
            embedding, norms and LM head are replicated, so every rank returns the full logits.

    Raises:
        ValueError: the layout does not fit the model's heads or intermediate size (the message
            names the values; see ParallelLayout.check_heads).
    """

    # The file map the embedding is read from, when the loader maps it (pdkv.model.loader): a
    # class-level default, so subclasses whose __init__ skips this one's (DeepSeek-V3, Qwen3-Next,
    # Kimi-Linear) have it too (pack_cpu_weights reads it).
    embed_file_map: mmap.mmap | None = None

    def __init__(
        self,
        cfg: LlamaArchConfig,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.parallel = parallel or ParallelContext.single()
        self.embed = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(
            LlamaLayer(cfg, dtype, self.parallel) for _ in range(cfg.num_layers)
        )
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False
            )
        )
        self.head_packed: PackedLinear = None
        # KV cache group of each layer (pdkv.worker.kv_cache makes one group per entry).
        self.layer_groups = [0] * cfg.num_layers
        for g, (_, layers) in enumerate(attention_groups(cfg)):
            for i in layers:
                self.layer_groups[i] = g
        cos, sin = rope_cos_sin(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, device)
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)  # signed, see above

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank stores per layer (size its KV cache for these)."""
        return self.parallel.layout.kv_heads_per_rank(self.cfg.num_kv_heads)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | Sequence[AttentionMetadata],
        logits_indices: torch.Tensor,
        layer_hooks: LayerHooks | None = None,
    ) -> torch.Tensor:
        """Run the step.

        Args:
            input_ids: [T] long, the step's tokens (several requests, flattened).
            positions: [T] long, their positions within their requests.
            kv_caches: per layer [2, num_blocks, block_size, num_local_kv_heads, head_dim].
            meta: paged-attention metadata: one per KV cache group (layer i reads
                meta[layer_groups[i]]: its group's block tables and sliding window), or one for
                every layer (a dense model's single group).
            logits_indices: [S] long, flat indices whose next-token logits are needed (in a step
                split by PCP, input_ids / positions are this rank's tokens only and the rows
                come from every rank: meta.pcp, pdkv.model.pcp_attention).
            layer_hooks: the KV connector's per-layer hooks (pdkv/model/layer_hooks.py), or
                None: `wait_for_layer_load(i)` before layer i, `save_kv_layer(i)` after it
                wrote its KV (every layer kind: attention, MLA, linear state). Never set in a
                CUDA-graph capture (graphs are off while a connector is set).

        Returns:
            [S, vocab_size] float32 logits.
        """
        hidden = self.embed[input_ids]
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        metas = [meta] if isinstance(meta, AttentionMetadata) else meta
        for i, (layer, kv_cache, g) in enumerate(zip(self.layers, kv_caches, self.layer_groups)):
            if layer_hooks is not None:
                layer_hooks.wait_for_layer_load(i)
            hidden = layer.forward(hidden, cos, sin, kv_cache, metas[g if len(metas) > 1 else 0])
            if layer_hooks is not None:
                layer_hooks.save_kv_layer(i)
        pcp = getattr(metas[0], "pcp", None)  # split by PCP: sampled rows on several ranks
        if pcp is None:
            hidden = hidden[logits_indices]
        else:
            from pdkv.model.pcp_attention import gather_logit_rows

            hidden = gather_logit_rows(hidden, pcp)
        hidden = rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)
        head = self.embed if self.lm_head is None else self.lm_head
        return linear(hidden, head, self.head_packed).float()

    def pack_cpu_weights(self, packer: Packer | None = None) -> bool:
        """Pack every projection and the LM head with `packer` (default pack_linear_weight:
        oneDNN's packed-weight linear; pdkv.model.panel_linear.pack_panel_weight: the panel
        kernel). Results differ from BLAS only in the last bits (greedy parity with HF is
        tested). Returns True when all are packed.

        Each packed weight replaces its plain copy (one copy of each weight). A tied LM head
        also needs the plain table for the embedding lookup: read from a map of the weights
        file (the loader's embed_file_map), whose pages packing read are dropped again here, it
        holds only the rows looked up since (reclaimable page cache, not a second copy); without
        a map the table is held twice (vocab_size x hidden_size x dtype bytes more)."""
        if self.head_packed is not None and not isinstance(self.head_packed, LinearDispatch):
            # packed before: the plain weights are gone
            return all(p is not None for layer in self.layers for p in layer.packed.values())
        packer = packer or pack_linear_weight
        if self.lm_head is None:
            self.head_packed = packer(self.embed)
            if self.head_packed is not None and self.embed_file_map is not None:
                self.embed_file_map.madvise(
                    mmap.MADV_DONTNEED
                )  # unmodified private pages: reloaded on use
        else:
            self.head_packed = packer(self.lm_head)
            if self.head_packed is not None:
                self.lm_head = _without_data(self.lm_head)
        return self.head_packed is not None and all(
            layer.pack_cpu_weights(packer) for layer in self.layers
        )

    def linear_weights(self) -> list[torch.Tensor]:
        """One layer's projection weights ([out, in], in forward order): the shapes a step's
        matmuls have (the first layer holding a `packed` table of plain weights; [] if none)."""
        for layer in self.layers:
            slots = getattr(layer, "packed", None)
            if isinstance(slots, dict) and slots:
                weights = [getattr(layer, name) for name in slots]
                if not any(w.is_meta for w in weights):
                    return weights
        return []

    def use_linear_dispatch(self, dispatch: LinearDispatch) -> int:
        """Run every plain projection (layers' `packed` slots left None, and the LM head) through
        `dispatch` (--cpu-linear auto; one weight copy: the plain one). Returns how many."""
        n = 0
        for layer in self.layers:
            slots = getattr(layer, "packed", None)
            if not isinstance(slots, dict):
                continue
            for name, cur in slots.items():
                if cur is None and not getattr(layer, name).is_meta:
                    slots[name] = dispatch
                    n += 1
        if self.head_packed is None:
            self.head_packed = dispatch
            n += 1
        return n
