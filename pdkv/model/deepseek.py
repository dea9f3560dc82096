"""DeepSeek-V3-architecture decoder (multi-head latent attention, dense MLPs) over a paged
latent cache.

Numerics follow HF transformers' `DeepseekV3ForCausalLM` (modeling_deepseek_v3.py): RMSNorm in
float32; q = q_proj(x) (or q_b_proj(q_a_layernorm(q_a_proj(x))) with a q LoRA rank) split into
[q_nope, q_pe] per head; kv_a_proj_with_mqa(x) split into the latent (then kv_a_layernorm) and
one shared k_pe; RoPE over qk_rope_head_dim on q_pe and k_pe (with `rope_interleave`, HF's
`apply_rotary_pos_emb_interleave`: pairs (x0, x1), (x2, x3) ... rotated together, output laid
out as [evens, odds], which is rotate-half RoPE on the de-interleaved vector, bit for bit);
attention in pdkv.model.attention_mla; softmax scale (qk_nope + qk_rope) ** -0.5 (default rope,
no yarn mscale). MoE layers are not implemented (the arch config refuses them).

Tensor parallelism (vLLM's split): q / q_b and kv_b rows of this rank's heads, o_proj columns of
them, MLP as the Llama layer; kv_a_proj_with_mqa, kv_a_layernorm (and q_a) replicated, so every
rank computes and caches the whole latent (the MLA cache is replicated, not sharded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdkv.model.arch_config import LlamaArchConfig
from pdkv.model.attention import AttentionMetadata
from pdkv.model.attention_mla import mla_attention
from pdkv.model.llama import (
    LlamaForCausalLM,
    PackedLinear,
    Packer,
    apply_rope,
    linear,
    pack_linear_weight,
    rms_norm,
    rope_cos_sin,
)
from pdkv.parallel.context import ParallelContext


class MLALayer(nn.Module):
    """One DeepSeek-V3 decoder layer with MLA and a dense MLP (weights [out, in], as nn.Linear).

    Raises:
        ValueError: tensor_parallel_size does not divide the heads or the intermediate size.
    """

    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        tp = parallel.tp_size
        if cfg.num_heads % tp or cfg.intermediate_size % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} must divide the model's {cfg.num_heads} heads and "
                f"intermediate_size={cfg.intermediate_size}"
            )
        self.num_heads = cfg.num_heads // tp
        self.nope, self.rope, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.rank = cfg.kv_lora_rank
        self.eps = cfg.rms_norm_eps
        self.scale = (self.nope + self.rope) ** -0.5
        self.interleave = cfg.rope_interleave
        h, i, qk = cfg.hidden_size, cfg.intermediate_size // tp, self.nope + self.rope

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.input_norm, self.post_attn_norm = param(h), param(h)
        qr = cfg.q_lora_rank
        self.q_a = param(qr, h) if qr else None
        self.q_a_norm = param(qr) if qr else None
        self.q_proj = param(self.num_heads * qk, qr or h)  # q_b_proj with a q LoRA rank
        self.kv_a = param(self.rank + self.rope, h)
        self.kv_a_norm = param(self.rank)
        self.kv_b = param(self.num_heads * (self.nope + self.v_dim), self.rank)
        self.o_proj = param(h, self.num_heads * self.v_dim)
        self.gate_up, self.down = param(2 * i, h), param(h, i)
        self.packed: dict[str, PackedLinear] = {"q_proj": None, "kv_a": None, "o_proj": None,
                                                "gate_up": None, "down": None}

    def pack_cpu_weights(self, packer: Packer | None = None) -> bool:
        """Pack the projection weights with `packer` (default oneDNN; kv_b stays plain: attention
        uses it); True when done."""
        for name in self.packed:
            self.packed[name] = (packer or pack_linear_weight)(getattr(self, name))
        return all(p is not None for p in self.packed.values())

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleave:  # HF's interleaved pairs == rotate-half on [evens, odds]
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope(x.contiguous(), cos, sin)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden: [T, hidden] -> [T, hidden]; kv_cache: this layer's [blocks, bs, rank + rope]."""
        t = hidden.shape[0]
        pk = self.packed
        x = rms_norm(hidden, self.input_norm, self.eps)
        if self.q_a is not None and self.q_a_norm is not None:
            q = linear(
                rms_norm(F.linear(x, self.q_a), self.q_a_norm, self.eps), self.q_proj, pk["q_proj"]
            )
        else:
            q = linear(x, self.q_proj, pk["q_proj"])
        q = q.view(t, self.num_heads, self.nope + self.rope)
        ckv = linear(x, self.kv_a, pk["kv_a"])
        latent = rms_norm(ckv[:, : self.rank].contiguous(), self.kv_a_norm, self.eps)
        k_pe = self._rope(ckv[:, None, self.rank :], cos, sin)[:, 0]
        q = torch.cat((q[..., : self.nope], self._rope(q[..., self.nope :], cos, sin)), dim=-1)
        attn = mla_attention(
            q, latent, k_pe, kv_cache, meta, self.kv_b, self.scale, self.nope, self.v_dim
        )
        tp = self.parallel
        hidden = hidden + tp.all_reduce_tp(linear(attn.reshape(t, -1), self.o_proj, pk["o_proj"]))
        x = rms_norm(hidden, self.post_attn_norm, self.eps)
        gate, up = linear(x, self.gate_up, pk["gate_up"]).chunk(2, dim=-1)
        return hidden + tp.all_reduce_tp(linear(F.silu(gate) * up, self.down, pk["down"]))


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """Embedding, MLA decoder layers, final norm and LM head; forward, packing and the KV cache
    group map are LlamaForCausalLM's (one MLA group holding every layer).

    Args:
        cfg: architecture (`cfg.is_mla`).
        dtype, device, parallel: as LlamaForCausalLM.

    Raises:
        ValueError: not an MLA config, or TP does not divide heads / intermediate size.
    """

    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext | None = None) -> None:
        if not cfg.is_mla:
            raise ValueError(f"{cfg.architecture} is not a multi-head latent attention model")
        nn.Module.__init__(self)
        self.cfg = cfg
        self.parallel = parallel or ParallelContext.single()
        self.embed = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(
            MLALayer(cfg, dtype, self.parallel) for _ in range(cfg.num_layers)
        )
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False
            )
        )
        self.head_packed: torch.Tensor | None = None
        self.layer_groups = [0] * cfg.num_layers
        cos, sin = rope_cos_sin(
            cfg.qk_rope_head_dim, cfg.rope_theta, cfg.max_position_embeddings, device
        )
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)

    def load_weights(self, r: Any, put: Callable[[nn.Parameter, torch.Tensor, str], None]) -> None:
        """Read this rank's shard from `r` (pdkv.model.loader's shard reader) with
        `put(param, tensor, name)` (shape-checked copy).

        Raises:
            ValueError: a missing or mis-shaped weight (named).
        """
        tp, rank = self.parallel.tp_size, self.parallel.tp_rank
        layer0 = self.layers[0]
        assert isinstance(layer0, MLALayer)
        heads, qk = layer0.num_heads, layer0.nope + layer0.rope
        q_rows = slice(rank * heads * qk, (rank + 1) * heads * qk)
        kv_w = layer0.nope + layer0.v_dim
        kv_rows = slice(rank * heads * kv_w, (rank + 1) * heads * kv_w)
        o_cols = slice(rank * heads * layer0.v_dim, (rank + 1) * heads * layer0.v_dim)
        inter = self.cfg.intermediate_size // tp
        i_rows = slice(rank * inter, (rank + 1) * inter)
        put(self.embed, r.whole("model.embed_tokens.weight"), "embed_tokens")
        put(self.norm, r.whole("model.norm.weight"), "norm")
        if self.lm_head is not None:
            put(self.lm_head, r.whole("lm_head.weight"), "lm_head")
        else:
            r.skip("lm_head.weight")
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, MLALayer)
            p = f"model.layers.{i}."
            a = p + "self_attn."
            put(layer.input_norm, r.whole(p + "input_layernorm.weight"), p + "input_layernorm")
            put(
                layer.post_attn_norm,
                r.whole(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm",
            )
            if layer.q_a is not None and layer.q_a_norm is not None:
                put(layer.q_a, r.whole(a + "q_a_proj.weight"), a + "q_a_proj")
                put(layer.q_a_norm, r.whole(a + "q_a_layernorm.weight"), a + "q_a_layernorm")
                put(layer.q_proj, r.rows(a + "q_b_proj.weight", q_rows), a + "q_b_proj")
            else:
                put(layer.q_proj, r.rows(a + "q_proj.weight", q_rows), a + "q_proj")
            put(layer.kv_a, r.whole(a + "kv_a_proj_with_mqa.weight"), a + "kv_a_proj_with_mqa")
            put(layer.kv_a_norm, r.whole(a + "kv_a_layernorm.weight"), a + "kv_a_layernorm")
            put(layer.kv_b, r.rows(a + "kv_b_proj.weight", kv_rows), a + "kv_b_proj")
            put(layer.o_proj, r.cols(a + "o_proj.weight", o_cols), a + "o_proj")
            m = p + "mlp."
            put(
                layer.gate_up,
                torch.cat(
                    [r.rows(m + "gate_proj.weight", i_rows), r.rows(m + "up_proj.weight", i_rows)]
                ),
                p + "gate_up",
            )
            put(layer.down, r.cols(m + "down_proj.weight", i_rows), p + "down_proj")
