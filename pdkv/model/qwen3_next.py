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
MoE layers are not implemented (the arch config refuses them).

Tensor parallelism (vLLM's Qwen3-Next split): full attention as Llama (q/gate rows of the rank's
heads, k / v rows of its KV heads, o_proj row-parallel); the dense MLP column- / row-parallel;
a linear layer holds the key-head groups [r·Hk/tp, (r+1)·Hk/tp) of rank r and their value heads:
in_proj_qkvz / in_proj_ba rows of those groups (column-parallel; HF lays them out per key-head
group), conv1d channels split per segment q | k | v (each on its own), dt_bias / A_log of its
value heads, out_proj columns of its value heads (row-parallel); the row-parallel outputs are
summed over the TP group. tp must divide the linear key heads (as vLLM requires).

A linear layer's state lives in the linear-state group's tensor (pdkv.worker.kv_cache): per slot
and layer `conv_bytes` of conv window [conv_dim, K - 1] in the model dtype, then the recurrent state
[value heads, dk, dv] in float32 (as HF keeps it); at tp > 1 the rank's share of each: conv
channels [q part | k part | v part], recurrent state of its value heads.
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
from pdkv.model.llama import LlamaForCausalLM, Packer, apply_rope, linear, rms_norm, rope_cos_sin
from pdkv.model.state_slots import StateSlotMixin
from pdkv.parallel.context import ParallelContext
from pdkv.parallel.layout import ParallelLayout


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class _MLPMixin(nn.Module):
    """Norms and the dense SiLU MLP shared by both layer kinds."""

    parallel: ParallelContext

    def _init_mlp(
        self, cfg: LlamaArchConfig, dtype: torch.dtype, parallel: ParallelContext | None = None
    ) -> None:
        """The rank's slice of the intermediate size (gate_up column-, down row-parallel)."""
        self.parallel = parallel or ParallelContext.single()
        h, i = cfg.hidden_size, cfg.intermediate_size // self.parallel.tp_size
        self.eps = cfg.rms_norm_eps
        self.input_norm, self.post_attn_norm = _param(h, dtype=dtype), _param(h, dtype=dtype)
        self.gate_up, self.down = _param(2 * i, h, dtype=dtype), _param(h, i, dtype=dtype)

    def _mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        x = rms_norm(hidden, self.post_attn_norm, self.eps)
        gate, up = linear(x, self.gate_up, None).chunk(2, dim=-1)
        return hidden + self.parallel.all_reduce_tp(linear(F.silu(gate) * up, self.down, None))

    def pack_cpu_weights(self, packer: Packer | None = None) -> bool:
        """No packed weights for this architecture (plain F.linear)."""
        return False


class GatedAttentionLayer(_MLPMixin):
    """Qwen3-Next full-attention layer (output gate, q/k norms, partial rope) + dense MLP."""

    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        self._init_mlp(cfg, dtype, parallel)
        self.num_heads = cfg.num_heads // parallel.tp_size
        self.num_kv_heads = parallel.layout.kv_heads_per_rank(cfg.num_kv_heads)
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim
        q, kv, h = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim, cfg.hidden_size
        self.q_size, self.kv_size = q, kv
        self.qkv = _param(2 * q + 2 * kv, h, dtype=dtype)  # [q and gate interleaved per head, k, v]
        self.q_norm, self.k_norm = (
            _param(cfg.head_dim, dtype=dtype),
            _param(cfg.head_dim, dtype=dtype),
        )
        self.o_proj = _param(h, q, dtype=dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
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
        attn = paged_attention(q, k, v.contiguous(), kv_cache, meta, d**-0.5).reshape(
            t, self.q_size
        )
        hidden = hidden + self.parallel.all_reduce_tp(
            linear(attn * torch.sigmoid(gate), self.o_proj, None)
        )
        return self._mlp(hidden)


class GatedDeltaNetLayer(_MLPMixin, StateSlotMixin):
    """Qwen3-Next linear-attention layer (Gated DeltaNet) + dense MLP; its state is one slot per
    request in the linear-state group (see the module docstring for the byte layout)."""

    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        self._init_mlp(cfg, dtype, parallel)
        self.dtype = dtype
        tp = parallel.tp_size
        # This rank's key-head groups and their value heads (module docstring).
        self.nk, self.dk = cfg.linear_num_key_heads // tp, cfg.linear_key_head_dim
        self.nv, self.dv = cfg.linear_num_value_heads // tp, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.conv_dim = 2 * self.nk * self.dk + self.nv * self.dv
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
        return (
            q.reshape(t, -1),
            k.reshape(t, -1),
            v.reshape(t, -1),
            z.reshape(t, self.nv, self.dv),
            b,
            a,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        state: torch.Tensor,
        meta: LinearStateMetadata,
    ) -> torch.Tensor:
        """hidden: [T, hidden] -> [T, hidden]; state: this layer's [slots, bytes] uint8 (each
        request's state is read from its source slot, or zero when fresh, and the state after each
        of its segments written to that segment's slot)."""
        x = rms_norm(hidden, self.input_norm, self.eps)
        q, k, v, z, b, a = self._split(linear(x, self.in_proj, None))
        mixed = torch.cat((q, k, v), dim=-1)
        beta = b.sigmoid()
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = torch.empty(
            hidden.shape[0], self.nv, self.dv, dtype=torch.float32, device=hidden.device
        )
        self.run_state(meta, mixed, g, beta, state, out)
        o = out.to(hidden.dtype).reshape(-1, self.dv)
        normed = rms_norm_gated(o, self.norm, z.reshape(-1, self.dv), self.eps)
        hidden = hidden + self.parallel.all_reduce_tp(
            linear(normed.reshape(hidden.shape[0], -1), self.out_proj, None)
        )
        return self._mlp(hidden)


def _qkv(
    layer: GatedDeltaNetLayer, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv output [T, conv_dim] -> q, k [T, Hk, dk] and v [T, Hv, dv]."""
    key = layer.nk * layer.dk
    t = c.shape[0]
    return (
        c[:, :key].reshape(t, layer.nk, layer.dk),
        c[:, key : 2 * key].reshape(t, layer.nk, layer.dk),
        c[:, 2 * key :].reshape(t, layer.nv, layer.dv),
    )


def rms_norm_gated(
    x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float
) -> torch.Tensor:
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
        ValueError: no linear layers in `cfg`; a parallel layout the model cannot split
            (`check_parallel`).
    """

    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext | None = None) -> None:
        if not cfg.has_linear_state:
            raise ValueError(f"{cfg.architecture} has no linear-attention layers")
        nn.Module.__init__(self)
        self.parallel = parallel or ParallelContext.single()
        check_parallel(cfg, self.parallel.layout)
        self.cfg = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            GatedDeltaNetLayer(cfg, dtype, self.parallel) if t == LINEAR
            else GatedAttentionLayer(cfg, dtype, self.parallel)
            for t in cfg.layer_types)
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        )
        self.head_packed: torch.Tensor | None = None
        groups = attention_groups(cfg)
        self.layer_groups = [len(groups)] * cfg.num_layers  # linear layers: the last group
        for g, (_, layers) in enumerate(groups):
            for i in layers:
                self.layer_groups[i] = g
        cos, sin = rope_cos_sin(
            cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, device
        )
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)

    def pack_cpu_weights(self, packer: Packer | None = None) -> bool:
        """No packed weights for this architecture."""
        return False

    def load_weights(self, r: Any, put: Callable[[nn.Parameter, torch.Tensor, str], None]) -> None:
        """Read this rank's shard of the weights from `r` (pdkv.model.loader's shard reader) with
        `put(param, tensor, name)`; (1 + w) norms are stored as 1 + w. Sharding: module docstring.

        Raises:
            ValueError: a missing or mis-shaped weight (named).
        """
        def plus1(name: str) -> torch.Tensor:
            return r.whole(name).float() + 1.0

        cfg, ctx = self.cfg, self.parallel
        tp, rank = ctx.tp_size, ctx.tp_rank
        put(self.embed, r.whole("model.embed_tokens.weight"), "embed_tokens")
        put(self.norm, plus1("model.norm.weight"), "norm")
        if self.lm_head is not None:
            put(self.lm_head, r.whole("lm_head.weight"), "lm_head")
        else:
            r.skip("lm_head.weight")
        inter = cfg.intermediate_size // tp
        i_rows = slice(rank * inter, (rank + 1) * inter)
        heads, d = cfg.num_heads // tp, cfg.head_dim
        kv_heads = ctx.layout.kv_heads_per_rank(cfg.num_kv_heads)
        kv0 = ctx.layout.kv_head_start(ctx.rank, cfg.num_kv_heads)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            put(layer.input_norm, plus1(p + "input_layernorm.weight"), p + "input_layernorm")
            put(
                layer.post_attn_norm,
                plus1(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm",
            )
            m = p + "mlp."
            put(
                layer.gate_up,
                torch.cat(
                    [r.rows(m + "gate_proj.weight", i_rows), r.rows(m + "up_proj.weight", i_rows)]
                ),
                p + "gate_up",
            )
            put(layer.down, r.cols(m + "down_proj.weight", i_rows), m + "down_proj")
            if isinstance(layer, GatedDeltaNetLayer):
                _load_linear(layer, r, put, p + "linear_attn.", rank)
            else:
                assert isinstance(layer, GatedAttentionLayer)
                a = p + "self_attn."
                kv_rows = slice(kv0 * d, (kv0 + kv_heads) * d)
                qkv = [
                    r.rows(
                        a + "q_proj.weight", slice(rank * heads * 2 * d, (rank + 1) * heads * 2 * d)
                    ),
                    r.rows(a + "k_proj.weight", kv_rows),
                    r.rows(a + "v_proj.weight", kv_rows),
                ]
                put(layer.qkv, torch.cat(qkv), a + "qkv")
                put(layer.q_norm, plus1(a + "q_norm.weight"), a + "q_norm")
                put(layer.k_norm, plus1(a + "k_norm.weight"), a + "k_norm")
                put(
                    layer.o_proj,
                    r.cols(a + "o_proj.weight", slice(rank * heads * d, (rank + 1) * heads * d)),
                    a + "o_proj",
                )


def _load_linear(
    layer: GatedDeltaNetLayer,
    r: Any,
    put: Callable[[nn.Parameter, torch.Tensor, str], None],
    a: str,
    rank: int,
) -> None:
    """TP rank `rank`'s shard of one Gated DeltaNet layer (`a`: its "linear_attn." prefix): its
    key-head groups' rows of in_proj_qkvz / in_proj_ba, its q | k | v conv channels, its value
    heads' dt_bias, A_log and out_proj columns."""
    nk, dk, nv, dv = layer.nk, layer.dk, layer.nv, layer.dv  # local counts
    qkvz_w, ba_w = 2 * dk + 2 * (nv // nk) * dv, 2 * (nv // nk)
    g0, v0 = rank * nk, rank * nv  # first key-head group, first value head
    qkvz = r.rows(a + "in_proj_qkvz.weight", slice(g0 * qkvz_w, (g0 + nk) * qkvz_w))
    ba = r.rows(a + "in_proj_ba.weight", slice(g0 * ba_w, (g0 + nk) * ba_w))
    put(layer.in_proj, torch.cat([qkvz, ba]), a + "in_proj")
    conv = r.whole(a + "conv1d.weight")[:, 0]  # [q | k | v] channels of every rank
    key = nk * dk * layer.parallel.tp_size  # q channels of every rank
    parts = (conv[g0 * dk : (g0 + nk) * dk], conv[key + g0 * dk : key + (g0 + nk) * dk],
             conv[2 * key + v0 * dv : 2 * key + (v0 + nv) * dv])
    put(layer.conv, torch.cat(parts), a + "conv1d")
    put(layer.dt_bias, r.rows(a + "dt_bias", slice(v0, v0 + nv)), a + "dt_bias")
    put(layer.a_log, r.rows(a + "A_log", slice(v0, v0 + nv)), a + "A_log")
    put(layer.norm, r.whole(a + "norm.weight"), a + "norm")
    put(
        layer.out_proj,
        r.cols(a + "out_proj.weight", slice(v0 * dv, (v0 + nv) * dv)),
        a + "out_proj",
    )


def check_parallel(cfg: LlamaArchConfig, layout: ParallelLayout) -> None:
    """Whether a Qwen3-Next model splits over `layout`.

    Raises:
        ValueError: decode context parallelism (not built with linear-attention state: it is one
            slot per request, not blocks of tokens to shard); tp not dividing the linear key heads
            (vLLM's rule), the attention heads (ParallelLayout.check_heads) or the intermediate
            size. Each message names the values.
    """
    if layout.dcp_size > 1:
        raise ValueError(
            f"{cfg.architecture}: decode_context_parallel_size={layout.dcp_size} is not supported "
            "with linear-attention (Gated DeltaNet) layers yet (their state is one slot per "
            "request, not blocks of tokens to shard); use decode_context_parallel_size=1"
        )
    tp = layout.tp_size
    if cfg.linear_num_key_heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the model's {cfg.linear_num_key_heads} "
            f"linear-attention key heads ({cfg.architecture}: each rank holds whole key-head "
            "groups, as in vLLM)"
        )
    layout.check_heads(cfg.num_heads, cfg.num_kv_heads)
    if cfg.intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the model's "
            f"intermediate_size={cfg.intermediate_size}"
        )
