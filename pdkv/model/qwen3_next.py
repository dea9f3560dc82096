"""Qwen3-Next-architecture decoder: Gated DeltaNet linear-attention layers (state in one slot per
request) interleaved with gated full-attention layers (paged KV cache), dense MLPs.

Numerics follow HF transformers' `Qwen3NextForCausalLM` (modeling_qwen3_next.py):
- RMSNorms scale by (1 + weight) (Qwen3NextRMSNorm): loaded here as 1 + weight, then the Llama norm.
- Full attention: q_proj gives per head [q, gate]; q and k get a per-head RMSNorm (q_norm /
  k_norm); rope rotates the first rotary_dim = head_dim * partial_rotary_factor dims
  (rotate-half); the attention output is multiplied by sigmoid(gate) before o_proj.
- Linear attention (Qwen3NextGatedDeltaNet): in_proj_qkvz / in_proj_ba laid out per key-head group
  ([q, k, v, z] and [b, a]); q, k, v go through a depthwise causal conv (kernel K, SiLU); beta =
  sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule
  (pdkv.model.gated_delta); a gated RMSNorm (weight * norm(o) * silu(z), per value head); out_proj.
MoE layers are not implemented (the arch config refuses them). Tensor parallelism is refused.

A linear layer's state lives in the linear-state group's tensor (pdkv.worker.kv_cache): per slot
and layer `conv_bytes` of conv window [conv_dim, K - 1] in the model dtype, then the recurrent state
[value heads, dk, dv] in float32 (as HF keeps it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdkv.model.arch_config import LINEAR, LlamaArchConfig, attention_groups
from pdkv.model.attention import AttentionMetadata, paged_attention
from pdkv.model.gated_delta import (
    LinearStateMetadata,
    gated_delta_rule,
    recurrent_step,
)
from pdkv.model.llama import LlamaForCausalLM, apply_rope, linear, rms_norm, rope_cos_sin
from pdkv.model.state_slots import StateSlotMixin
from pdkv.parallel.context import ParallelContext


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class _MLPMixin(nn.Module):
    """Norms and the dense SiLU MLP shared by both layer kinds."""

    def _init_mlp(self, cfg: LlamaArchConfig, dtype: torch.dtype) -> None:
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.input_norm, self.post_attn_norm = _param(h, dtype=dtype), _param(h, dtype=dtype)
        self.gate_up, self.down = _param(2 * i, h, dtype=dtype), _param(h, i, dtype=dtype)

    def _mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        x = rms_norm(hidden, self.post_attn_norm, self.eps)
        gate, up = linear(x, self.gate_up, None).chunk(2, dim=-1)
        return hidden + linear(F.silu(gate) * up, self.down, None)

    def pack_cpu_weights(self) -> bool:
        """No oneDNN packing for this architecture (plain F.linear)."""
        return False


class GatedAttentionLayer(_MLPMixin):
    """Qwen3-Next full-attention layer (output gate, q/k norms, partial rope) + dense MLP."""

    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self._init_mlp(cfg, dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim
        q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
        self.q_size, self.kv_size = q, kv
        self.qkv = _param(2 * q + 2 * kv, h, dtype=dtype)  # [q and gate interleaved per head, k, v]
        self.q_norm, self.k_norm = _param(cfg.head_dim, dtype=dtype), _param(cfg.head_dim, dtype=dtype)
        self.o_proj = _param(h, q, dtype=dtype)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """hidden: [T, hidden] -> [T, hidden]; kv_cache: this layer's [2, blocks, bs, kvh, D]."""
        t, d, rd = hidden.shape[0], self.head_dim, self.rotary_dim
        x = rms_norm(hidden, self.input_norm, self.eps)
        qkv = linear(x, self.qkv, None)
        qg = qkv[:, : 2 * self.q_size].view(t, self.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, self.q_size)
        k = qkv[:, 2 * self.q_size : 2 * self.q_size + self.kv_size].view(t, self.num_kv_heads, d)
        v = qkv[:, 2 * self.q_size + self.kv_size :].view(t, self.num_kv_heads, d)
        q = rms_norm(q.reshape(-1, d), self.q_norm, self.eps).view(t, self.num_heads, d)
        k = rms_norm(k.reshape(-1, d), self.k_norm, self.eps).view(t, self.num_kv_heads, d)
        q = torch.cat((apply_rope(q[..., :rd].contiguous(), cos, sin), q[..., rd:]), dim=-1)
        k = torch.cat((apply_rope(k[..., :rd].contiguous(), cos, sin), k[..., rd:]), dim=-1)
        attn = paged_attention(q, k, v.contiguous(), kv_cache, meta, d**-0.5).reshape(t, self.q_size)
        hidden = hidden + linear(attn * torch.sigmoid(gate), self.o_proj, None)
        return self._mlp(hidden)


class GatedDeltaNetLayer(_MLPMixin, StateSlotMixin):
    """Qwen3-Next linear-attention layer (Gated DeltaNet) + dense MLP; its state is one slot per
    request in the linear-state group (see the module docstring for the byte layout)."""

    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self._init_mlp(cfg, dtype)
        self.dtype = dtype
        self.nk, self.dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.nv, self.dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.conv_dim = cfg.linear_conv_dim
        h, key, value = cfg.hidden_size, self.nk * self.dk, self.nv * self.dv
        self.in_proj = _param(2 * key + 2 * value + 2 * self.nv, h, dtype=dtype)  # [qkvz, ba]
        self.conv = _param(self.conv_dim, self.kernel, dtype=dtype)
        self.dt_bias, self.a_log = _param(self.nv, dtype=dtype), _param(self.nv, dtype=dtype)
        self.norm = _param(self.dv, dtype=dtype)
        self.out_proj = _param(h, value, dtype=dtype)
        self.conv_bytes = self.conv_dim * (self.kernel - 1) * dtype.itemsize
        self.rec_shape = (self.nv, self.dk, self.dv)

    chunk_rule = staticmethod(gated_delta_rule)
    step_rule = staticmethod(recurrent_step)

    def split_qkv(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _qkv(self, c)

    def _split(self, proj: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """HF's fix_query_key_value_ordering: per key-head group [q, k, v, z] and [b, a]."""
        t, r = proj.shape[0], self.nv // self.nk
        qkvz_w = 2 * self.dk + 2 * r * self.dv
        qkvz = proj[:, : self.nk * qkvz_w].view(t, self.nk, qkvz_w)
        ba = proj[:, self.nk * qkvz_w :].view(t, self.nk, 2 * r)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = ba[..., :r].reshape(t, self.nv), ba[..., r:].reshape(t, self.nv)
        return q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), z.reshape(t, self.nv, self.dv), b, a

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, state: torch.Tensor,
                meta: LinearStateMetadata) -> torch.Tensor:
        """hidden: [T, hidden] -> [T, hidden]; state: this layer's [slots, bytes] uint8 (each
        request's state is read from its source slot, or zero when fresh, and the state after each
        of its segments written to that segment's slot)."""
        x = rms_norm(hidden, self.input_norm, self.eps)
        q, k, v, z, b, a = self._split(linear(x, self.in_proj, None))
        mixed = torch.cat((q, k, v), dim=-1)
        beta = b.sigmoid()
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = torch.empty(hidden.shape[0], self.nv, self.dv, dtype=torch.float32, device=hidden.device)
        self.run_state(meta, mixed, g, beta, state, out)
        o = out.to(hidden.dtype).reshape(-1, self.dv)
        normed = rms_norm_gated(o, self.norm, z.reshape(-1, self.dv), self.eps)
        hidden = hidden + linear(normed.reshape(hidden.shape[0], -1), self.out_proj, None)
        return self._mlp(hidden)


def _qkv(layer: GatedDeltaNetLayer, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv output [T, conv_dim] -> q, k [T, Hk, dk] and v [T, Hv, dv]."""
    key = layer.nk * layer.dk
    t = c.shape[0]
    return (c[:, :key].reshape(t, layer.nk, layer.dk), c[:, key : 2 * key].reshape(t, layer.nk, layer.dk),
            c[:, 2 * key :].reshape(t, layer.nv, layer.dv))


def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3NextRMSNormGated: weight * norm(x) * silu(gate), normalised and gated in float32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """Embedding, Qwen3-Next layers, final norm and LM head; forward is LlamaForCausalLM's.

    Layer i reads metadata `layer_groups[i]`: the attention groups first (pdkv.worker.kv_cache
    order), then the linear-state group last; kv_caches[i] of a linear layer is its [slots, bytes]
    state view.

    Raises:
        ValueError: no linear layers in `cfg`; tensor / decode context parallelism (not built).
    """

    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext | None = None) -> None:
        if not cfg.has_linear_state:
            raise ValueError(f"{cfg.architecture} has no linear-attention layers")
        if parallel is not None and parallel.layout.world_size > 1:
            raise ValueError(
                f"{cfg.architecture}: tensor / decode context parallelism is not supported with "
                "linear-attention (Gated DeltaNet) layers yet; use tensor_parallel_size=1 and "
                "decode_context_parallel_size=1")
        nn.Module.__init__(self)
        self.parallel = parallel or ParallelContext.single()
        self.cfg = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            GatedDeltaNetLayer(cfg, dtype) if t == LINEAR else GatedAttentionLayer(cfg, dtype)
            for t in cfg.layer_types)
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.head_packed: torch.Tensor | None = None
        groups = attention_groups(cfg)
        self.layer_groups = [len(groups)] * cfg.num_layers  # linear layers: the last group
        for g, (_, layers) in enumerate(groups):
            for i in layers:
                self.layer_groups[i] = g
        cos, sin = rope_cos_sin(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, device)
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)

    def pack_cpu_weights(self) -> bool:
        """No oneDNN packing for this architecture."""
        return False

    def load_weights(self, r: Any, put: Callable[[nn.Parameter, torch.Tensor, str], None]) -> None:
        """Read the weights from `r` (pdkv.model.loader's shard reader) with `put(param, tensor,
        name)`; (1 + w) norms are stored as 1 + w.

        Raises:
            ValueError: a missing or mis-shaped weight (named).
        """
        def plus1(name: str) -> torch.Tensor:
            return r.whole(name).float() + 1.0

        put(self.embed, r.whole("model.embed_tokens.weight"), "embed_tokens")
        put(self.norm, plus1("model.norm.weight"), "norm")
        if self.lm_head is not None:
            put(self.lm_head, r.whole("lm_head.weight"), "lm_head")
        else:
            r.skip("lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            put(layer.input_norm, plus1(p + "input_layernorm.weight"), p + "input_layernorm")
            put(layer.post_attn_norm, plus1(p + "post_attention_layernorm.weight"), p + "post_attention_layernorm")
            m = p + "mlp."
            put(layer.gate_up, torch.cat([r.whole(m + "gate_proj.weight"), r.whole(m + "up_proj.weight")]),
                p + "gate_up")
            put(layer.down, r.whole(m + "down_proj.weight"), m + "down_proj")
            if isinstance(layer, GatedDeltaNetLayer):
                a = p + "linear_attn."
                put(layer.in_proj, torch.cat([r.whole(a + "in_proj_qkvz.weight"), r.whole(a + "in_proj_ba.weight")]),
                    a + "in_proj")
                put(layer.conv, r.whole(a + "conv1d.weight")[:, 0], a + "conv1d")
                put(layer.dt_bias, r.whole(a + "dt_bias"), a + "dt_bias")
                put(layer.a_log, r.whole(a + "A_log"), a + "A_log")
                put(layer.norm, r.whole(a + "norm.weight"), a + "norm")
                put(layer.out_proj, r.whole(a + "out_proj.weight"), a + "out_proj")
            else:
                assert isinstance(layer, GatedAttentionLayer)
                a = p + "self_attn."
                put(layer.qkv, torch.cat([r.whole(a + f"{n}_proj.weight") for n in "qkv"]), a + "qkv")
                put(layer.q_norm, plus1(a + "q_norm.weight"), a + "q_norm")
                put(layer.k_norm, plus1(a + "k_norm.weight"), a + "k_norm")
                put(layer.o_proj, r.whole(a + "o_proj.weight"), a + "o_proj")
