"""Kimi-Linear-architecture decoder: Kimi Delta Attention linear layers (state in one slot per
request) interleaved with MLA layers (paged latent cache), dense MLPs.

Numerics follow HF transformers' `KimiLinearForCausalLM` (modeling_kimi_linear.py):
- RMSNorms are the Llama ones (weight * norm(x), no 1 + w).
- KDA layer: q, k, v projections (each heads x head_dim), one depthwise causal conv (SiLU) over
  their concatenation [q | k | v] (so one conv window holds the three short convs' states),
  q and k l2-normalised per head; per-channel decay g = -exp(A_log[head]) * softplus(f_b(f_a(x))
  + dt_bias) (softplus taken as the identity above 20, as HF); beta = sigmoid(b_proj(x)); the
  rule in pdkv.model.kimi_delta; output RMSNorm per head gated by sigmoid(g_b(g_a(x))), o_proj.
- MLA layer: DeepSeek-V3's (pdkv.model.deepseek.MLALayer) with no rope: Kimi-Linear's MLA is
  NoPE, its qk_rope_head_dim part of the key is the shared latent key as projected.

State layout of a KDA layer's slot (uint8 bytes, `KDALayer.state_views`): the conv window
[3 x heads x head_dim, K - 1] in the model dtype, then the recurrent state [heads, dk, dv]
float32 (pdkv.worker.kv_cache.linear_state_spec with key heads = value heads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pdkv.model.arch_config import LINEAR, LlamaArchConfig, attention_groups
from pdkv.model.deepseek import MLALayer
from pdkv.model.gated_delta import LinearStateMetadata
from pdkv.model.kimi_delta import kda_rule, kda_step
from pdkv.model.llama import LlamaForCausalLM, Packer, linear, rms_norm, rope_cos_sin
from pdkv.model.qwen3_next import _MLPMixin, _param
from pdkv.model.state_slots import StateSlotMixin
from pdkv.parallel.context import ParallelContext


class KimiMLALayer(MLALayer):
    """MLALayer without rope (Kimi-Linear's MLA layers are NoPE)."""

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x


class KDALayer(_MLPMixin, StateSlotMixin):
    """Kimi Delta Attention layer + dense MLP; its state is one slot per request in the
    linear-state group (see the module docstring for the byte layout)."""

    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self._init_mlp(cfg, dtype)
        self.dtype = dtype
        self.heads, self.d = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        h, width = cfg.hidden_size, self.heads * self.d
        self.conv_dim = 3 * width
        self.qkv = _param(3 * width, h, dtype=dtype)
        self.conv = _param(self.conv_dim, self.kernel, dtype=dtype)
        self.f_a, self.f_b = _param(self.d, h, dtype=dtype), _param(width, self.d, dtype=dtype)
        self.dt_bias, self.a_log = _param(width, dtype=dtype), _param(self.heads, dtype=dtype)
        self.b_proj = _param(self.heads, h, dtype=dtype)
        self.g_a, self.g_b = _param(self.d, h, dtype=dtype), _param(width, self.d, dtype=dtype)
        self.o_norm = _param(self.d, dtype=dtype)
        self.o_proj = _param(h, width, dtype=dtype)
        self.conv_bytes = self.conv_dim * (self.kernel - 1) * dtype.itemsize
        self.rec_shape = (self.heads, self.d, self.d)

    chunk_rule = staticmethod(kda_rule)
    step_rule = staticmethod(kda_step)

    def split_qkv(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(x.reshape(c.shape[0], self.heads, self.d) for x in c.chunk(3, dim=-1))  # type: ignore[return-value]

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        state: torch.Tensor,
        meta: LinearStateMetadata,
    ) -> torch.Tensor:
        """hidden: [T, hidden] -> [T, hidden]; state: this layer's [slots, bytes] uint8 (each
        request's state read from its source slot, or zero when fresh; the state after each of
        its segments written to that segment's slot)."""
        t = hidden.shape[0]
        x = rms_norm(hidden, self.input_norm, self.eps)
        mixed = linear(x, self.qkv, None)
        raw = linear(linear(x, self.f_a, None), self.f_b, None).float() + self.dt_bias.float()
        soft = torch.where(raw > 20.0, raw, torch.log(1.0 + torch.exp(raw)))
        g = (-self.a_log.float().exp()[:, None] * soft.view(t, self.heads, self.d))
        beta = linear(x, self.b_proj, None).sigmoid()
        out = torch.empty(t, self.heads, self.d, dtype=torch.float32, device=hidden.device)
        self.run_state(meta, mixed, g, beta, state, out)
        gate = linear(linear(x, self.g_a, None), self.g_b, None).view(t, self.heads, self.d)
        o = out.to(hidden.dtype).float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.float()
        o = (o * torch.sigmoid(gate.float())).to(hidden.dtype)
        hidden = hidden + linear(o.reshape(t, -1), self.o_proj, None)
        return self._mlp(hidden)


class KimiLinearForCausalLM(LlamaForCausalLM):
    """Embedding, KDA and MLA layers, final norm and LM head; forward is LlamaForCausalLM's.

    Layer i reads metadata `layer_groups[i]`: the MLA group first, the linear-state group last
    (pdkv.worker.kv_cache order); kv_caches[i] of a KDA layer is its [slots, bytes] state view.

    Raises:
        ValueError: no KDA layers or no MLA in `cfg`; tensor / decode context parallelism (not
            built).
    """

    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext | None = None) -> None:
        if not (cfg.has_linear_state and cfg.is_mla):
            raise ValueError(f"{cfg.architecture} is not a KDA + MLA model")
        if parallel is not None and parallel.layout.world_size > 1:
            raise ValueError(
                f"{cfg.architecture}: tensor / decode context parallelism is not supported with "
                "linear-attention (Kimi Delta Attention) layers yet; use tensor_parallel_size=1 "
                "and decode_context_parallel_size=1"
            )
        nn.Module.__init__(self)
        self.parallel = parallel or ParallelContext.single()
        self.cfg = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            KDALayer(cfg, dtype) if t == LINEAR else KimiMLALayer(cfg, dtype, self.parallel)
            for t in cfg.layer_types)
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        )
        self.head_packed: torch.Tensor | None = None
        groups = attention_groups(cfg)
        self.layer_groups = [len(groups)] * cfg.num_layers  # KDA layers: the last group
        for g, (_, layers) in enumerate(groups):
            for i in layers:
                self.layer_groups[i] = g
        # No rope is applied; LlamaForCausalLM.forward indexes these tables (kept tiny: 2 dims).
        cos, sin = rope_cos_sin(2, 10000.0, cfg.max_position_embeddings, device)
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)

    def pack_cpu_weights(self, packer: Packer | None = None) -> bool:
        """No packed weights for this architecture."""
        return False

    def load_weights(self, r: Any, put: Callable[[nn.Parameter, torch.Tensor, str], None]) -> None:
        """Read the weights from `r` (pdkv.model.loader's shard reader) with `put(param, tensor,
        name)`. Names are the checkpoint's (what transformers saves and moonshotai publishes):
        `block_sparse_moe.*_proj` for a dense MLP, `self_attn.{q,k,v}_conv1d` (HF's one conv1d
        over [q | k | v] is their concatenation), `self_attn.A_log` / `dt_bias` / `f_a_proj` /
        `f_b_proj` (HF's forget_gate).

        Raises:
            ValueError: a missing or mis-shaped weight (named).
        """
        put(self.embed, r.whole("model.embed_tokens.weight"), "embed_tokens")
        put(self.norm, r.whole("model.norm.weight"), "norm")
        if self.lm_head is not None:
            put(self.lm_head, r.whole("lm_head.weight"), "lm_head")
        else:
            r.skip("lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            put(layer.input_norm, r.whole(p + "input_layernorm.weight"), p + "input_layernorm")
            put(
                layer.post_attn_norm,
                r.whole(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm",
            )
            m = p + "block_sparse_moe."  # the checkpoint's name for a dense layer's MLP as well
            put(
                layer.gate_up,
                torch.cat([r.whole(m + "gate_proj.weight"), r.whole(m + "up_proj.weight")]),
                p + "gate_up",
            )
            put(layer.down, r.whole(m + "down_proj.weight"), m + "down_proj")
            if isinstance(layer, KDALayer):
                put(
                    layer.qkv,
                    torch.cat([r.whole(a + f"{n}_proj.weight") for n in "qkv"]),
                    a + "qkv",
                )
                put(
                    layer.conv,
                    torch.cat([r.whole(a + f"{n}_conv1d.weight")[:, 0] for n in "qkv"]),
                    a + "conv1d",
                )
                for name, param in (
                    ("f_a_proj", layer.f_a),
                    ("f_b_proj", layer.f_b),
                    ("b_proj", layer.b_proj),
                    ("g_a_proj", layer.g_a),
                    ("g_b_proj", layer.g_b),
                    ("o_norm", layer.o_norm),
                    ("o_proj", layer.o_proj),
                ):
                    put(param, r.whole(a + name + ".weight"), a + name)
                put(layer.dt_bias, r.whole(a + "dt_bias").reshape(-1), a + "dt_bias")
                put(layer.a_log, r.whole(a + "A_log").reshape(-1), a + "A_log")
            else:
                assert isinstance(layer, KimiMLALayer)
                if layer.q_a is not None and layer.q_a_norm is not None:
                    put(layer.q_a, r.whole(a + "q_a_proj.weight"), a + "q_a_proj")
                    put(layer.q_a_norm, r.whole(a + "q_a_layernorm.weight"), a + "q_a_layernorm")
                    put(layer.q_proj, r.whole(a + "q_b_proj.weight"), a + "q_b_proj")
                else:
                    put(layer.q_proj, r.whole(a + "q_proj.weight"), a + "q_proj")
                put(layer.kv_a, r.whole(a + "kv_a_proj_with_mqa.weight"), a + "kv_a_proj_with_mqa")
                put(layer.kv_a_norm, r.whole(a + "kv_a_layernorm.weight"), a + "kv_a_layernorm")
                put(layer.kv_b, r.whole(a + "kv_b_proj.weight"), a + "kv_b_proj")
                put(layer.o_proj, r.whole(a + "o_proj.weight"), a + "o_proj")
