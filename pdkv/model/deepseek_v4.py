"""DeepSeek-V4-architecture decoder (`DeepseekV4ForCausalLM`): compressed sparse / heavily
compressed attention (pdkv/model/v4_attention.py), manifold-constrained hyper-connections (mHC)
and a mixture of experts on every layer.

Numerics follow transformers' modeling_deepseek_v4.py (the paper's §2):
- mHC (DeepseekV4HyperConnection): the residual is `hc_mult` streams [T, hc, hidden]. Before a
  block, the streams (flattened, unweighted-RMS-normed, float32) are projected to pre (hc), post
  (hc) and comb (hc × hc) weights: pre = sigmoid(·) + eps collapses the streams into the block
  input, post = 2·sigmoid(·) spreads the block output, comb = softmax(·) + eps projected onto
  doubly-stochastic matrices by `hc_sinkhorn_iters` Sinkhorn-Knopp iterations mixes the streams:
  streams' = post ⊗ out + combᵀ · streams. The head (DeepseekV4HyperHead) collapses them once
  more before the final norm.
- MoE (DeepseekV4SparseMoeBlock), computed densely (every expert on every token, weighted by
  the routing; exact at this size): router scores = score_fn(x · Wᵀ) (sqrtsoftplus =
  sqrt(softplus)); `moe` layers pick the top-k of scores + e_score_correction_bias, `hash_moe`
  layers take tid2eid[token id]; weights = the picked scores normalised to sum 1, times
  routed_scaling_factor. Experts and the one shared expert are SwiGLU with gate clamped to
  <= swiglu_limit and up to ±swiglu_limit.
- RMSNorm weights are float32 and normalise in float32 (HF keeps them so).

Checkpoint names are DeepSeek's own (what transformers' save_pretrained writes and V4
checkpoints ship): layers.i.attn.{wq_a, q_norm, wq_b, wkv, norm, wo_a, wo_b, attn_sink,
compressor.{wkv, wgate, ape, norm}, indexer.{wq_b, weights_proj, compressor.*}},
layers.i.ffn.{gate.weight, gate.bias | gate.tid2eid, experts.e.{w1, w2, w3}, shared_experts.*},
layers.i.{attn_norm, ffn_norm, hc_attn_*, hc_ffn_*}, hc_head.*, norm, embed_tokens, head.

State: every kind is a KV cache group (pdkv/model/v4_attention.py; groups built by
pdkv.worker.kv_cache.v4_cache_groups): the sliding window, the compressed entries per rate, the
indexer keys, and the compressor state as linear-state-like slots, so prefix caching restores a
request at a block boundary (inside a compression window or at its edge), and P/D and the KV
pool move every group (D resumes after P's token, from the state slot of the prompt's end). The
multi-token-prediction layer is not built; TP / DCP / PCP, CPU offload and MultiConnector are
refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdkv.model.arch_config import LlamaArchConfig
from pdkv.model.layer_hooks import LayerHooks
from pdkv.model.llama import LlamaForCausalLM, linear, rms_norm
from pdkv.model.v4_attention import (
    V4Attention,
    V4LayerCaches,
    V4StepMetadata,
    frozen_param,
    inv_freq,
    unweighted_rms_norm,
)
from pdkv.model.v4_config import SLIDING, DeepseekV4Fields, V4CacheLayers
from pdkv.parallel.context import ParallelContext


class HyperConnection(nn.Module):
    """mHC weights of one block: fn [(2 + hc)·hc, hc·hidden], base [(2 + hc)·hc], scale [3]
    (float32)."""

    def __init__(self, hc: int, hidden: int, iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc, self.iters, self.eps, self.norm_eps = hc, iters, eps, norm_eps
        n = (2 + hc) * hc
        self.fn = frozen_param(n, hc * hidden, dtype=torch.float32)
        self.base = frozen_param(n, dtype=torch.float32)
        self.scale = frozen_param(3, dtype=torch.float32)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, hidden] -> (post [T, hc], comb [T, hc, hc], collapsed [T, hidden])."""
        hc, t = self.hc, streams.shape[0]
        flat = unweighted_rms_norm(streams.reshape(t, self.fn.shape[1]).float(), self.norm_eps)
        mix = F.linear(flat, self.fn)
        pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(t, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1)
        comb = comb + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def _mix(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor,
         comb: torch.Tensor) -> torch.Tensor:
    """post ⊗ out + combᵀ · streams: [T, hc, hidden]."""
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dt).transpose(-1, -2), streams)


class MoE(nn.Module):
    """Router (gate [E, hidden]; e_score_correction_bias [E] or tid2eid [vocab, k]), experts
    gate_up [E, 2·I, hidden] / down [E, hidden, I], one shared expert."""

    def __init__(self, hidden: int, v4: DeepseekV4Fields, hashed: bool, vocab: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        e, i, k = v4.n_routed_experts, v4.moe_intermediate_size, v4.num_experts_per_tok
        self.hashed, self.k, self.v4 = hashed, k, v4
        self.gate = frozen_param(e, hidden, dtype=dtype)
        self.bias = frozen_param(e, dtype=torch.float32) if not hashed else None
        self.register_buffer("tid2eid", torch.zeros(vocab if hashed else 0, k, dtype=torch.long))
        self.gate_up = frozen_param(e, 2 * i, hidden, dtype=dtype)
        self.down = frozen_param(e, hidden, i, dtype=dtype)
        self.shared_gate_up = frozen_param(2 * i, hidden, dtype=dtype)
        self.shared_down = frozen_param(hidden, i, dtype=dtype)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        lim = self.v4.swiglu_limit
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=lim)) * up.clamp(min=-lim, max=lim)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (normed), input_ids [T] -> [T, hidden]."""
        logits = linear(x, self.gate, None)
        fn = self.v4.scoring_func
        scores = (F.softplus(logits).sqrt() if fn == "sqrtsoftplus" else
                  torch.sigmoid(logits) if fn == "sigmoid" else logits.softmax(dim=-1))
        if self.hashed:
            idx = self.tid2eid[input_ids]
        else:
            assert self.bias is not None
            idx = torch.topk(scores + self.bias, self.k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.v4.routed_scaling_factor
        # dense: each token's weight per expert (0 for experts it did not pick)
        dense = torch.zeros_like(scores).scatter_add_(1, idx, w)
        out = torch.zeros_like(x)
        for e in range(self.gate_up.shape[0]):
            y = linear(self._swiglu(linear(x, self.gate_up[e], None)), self.down[e], None)
            out = out + y * dense[:, e : e + 1].to(y.dtype)
        shared = linear(self._swiglu(linear(x, self.shared_gate_up, None)), self.shared_down,
                        None)
        return out + shared


class V4Layer(nn.Module):
    """One decoder block: mHC around attention and around the MoE, norms (float32)."""

    def __init__(self, cfg: LlamaArchConfig, i: int, dtype: torch.dtype) -> None:
        super().__init__()
        v4 = cfg.v4
        assert v4 is not None and cfg.sliding_window is not None
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.eps = eps
        self.kind = v4.attn_types[i]
        self.input_norm = frozen_param(h, dtype=torch.float32)
        self.post_attn_norm = frozen_param(h, dtype=torch.float32)
        self.attn_hc = HyperConnection(v4.hc_mult, h, v4.hc_sinkhorn_iters, v4.hc_eps, eps)
        self.ffn_hc = HyperConnection(v4.hc_mult, h, v4.hc_sinkhorn_iters, v4.hc_eps, eps)
        self.attn = V4Attention(h, cfg.num_heads, cfg.head_dim, cfg.sliding_window, self.kind,
                                v4.compress_rate(i), v4, eps, dtype)
        self.mlp = MoE(h, v4, v4.mlp_types[i] == "hash_moe", cfg.vocab_size, dtype)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                freqs: tuple[torch.Tensor, torch.Tensor], caches: V4LayerCaches,
                meta: Any, step: V4StepMetadata) -> torch.Tensor:
        """streams [T, hc, hidden] -> [T, hc, hidden]."""
        main, compress = freqs
        post, comb, x = self.attn_hc(streams)
        x = rms_norm(x.float(), self.input_norm, self.eps).to(x.dtype)
        out = self.attn(x, positions, main if self.kind == SLIDING else compress, compress,
                        caches, meta.slot_block_ids, meta.slot_offsets, step)
        streams = _mix(streams, out, post, comb)
        post, comb, x = self.ffn_hc(streams)
        x = rms_norm(x.float(), self.post_attn_norm, self.eps).to(x.dtype)
        return _mix(streams, self.mlp(x, input_ids), post, comb)


class DeepseekV4ForCausalLM(LlamaForCausalLM):
    """Embedding, V4 layers, mHC head, final norm and LM head.

    forward takes meta = [the sliding-window group's AttentionMetadata, ..., V4StepMetadata]
    and every cache layer's view (module docstring).

    Raises:
        ValueError: not a V4 config; a parallel layout other than one rank.
    """

    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, device: torch.device,
                 parallel: ParallelContext | None = None) -> None:
        if cfg.v4 is None:
            raise ValueError(f"{cfg.architecture} is not a DeepSeek-V4 config")
        nn.Module.__init__(self)
        self.parallel = parallel or ParallelContext.single()
        lay = self.parallel.layout
        if lay.world_size > 1:
            raise ValueError(
                f"{cfg.architecture}: tensor / decode / prefill context parallelism "
                f"(tp={lay.tp_size}, dcp={lay.dcp_size}) is not supported for DeepSeek-V4 yet "
                "(re-sharding the indexer, TP of the MoE and DCP over compressed KV are not "
                "built): run it on one rank")
        self.cfg = cfg
        v4 = cfg.v4
        h = cfg.hidden_size
        self.embed = frozen_param(cfg.vocab_size, h, dtype=dtype)
        self.embed_file_map = None
        self.layers = nn.ModuleList(V4Layer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.hc_fn = frozen_param(v4.hc_mult, v4.hc_mult * h, dtype=torch.float32)
        self.hc_base = frozen_param(v4.hc_mult, dtype=torch.float32)
        self.hc_scale = frozen_param(1, dtype=torch.float32)
        self.norm = frozen_param(h, dtype=torch.float32)
        self.lm_head = frozen_param(cfg.vocab_size, h, dtype=dtype)
        self.head_packed = None
        self.layer_groups = [0] * cfg.num_layers  # one sliding-window group of every layer
        self.register_buffer("freq_main", inv_freq(v4.rotary_dim, cfg.rope_theta, device),
                             persistent=False)
        self.register_buffer("freq_compress",
                             inv_freq(v4.rotary_dim, v4.compress_rope_theta, device),
                             persistent=False)
        self.cache_layers = V4CacheLayers.of(v4)

    @property
    def num_local_kv_heads(self) -> int:
        """One KV head (shared-KV MQA)."""
        return 1

    def layer_caches(self, kv_caches: Sequence[Any]) -> list[V4LayerCaches]:
        """Each layer's views among `kv_caches` (one per cache layer, V4CacheLayers order)."""
        lay, out = self.cache_layers, []
        for i in range(self.cfg.num_layers):
            c, x, st = lay.compressed.get(i), lay.indexer.get(i), lay.state.get(i)
            out.append(V4LayerCaches(
                kv_caches[i], i,
                kv_caches[c] if c is not None else None, -1 if c is None else c,
                kv_caches[x] if x is not None else None, -1 if x is None else x,
                kv_caches[st].view(torch.float32) if st is not None else None,
                -1 if st is None else st))
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: Any,
        logits_indices: torch.Tensor,
        layer_hooks: LayerHooks | None = None,
    ) -> torch.Tensor:
        """Run the step: input_ids / positions [T] long; kv_caches per cache layer
        (V4CacheLayers: the sliding-window layers [1, blocks, block_size, 1, head_dim], then the
        compressed entries, indexer keys and state slots); meta = the sliding-window group's
        AttentionMetadata first and V4StepMetadata last; returns [S, vocab] float32 logits of
        `logits_indices` [S]."""
        attn_meta, step = meta[0], meta[-1]
        assert isinstance(step, V4StepMetadata)
        caches = self.layer_caches(kv_caches)
        hc = self.cfg.v4.hc_mult if self.cfg.v4 is not None else 1
        x = self.embed[input_ids]
        streams = x.unsqueeze(1).expand(-1, hc, -1).contiguous()
        freqs = (self.freq_main, self.freq_compress)
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            if layer_hooks is not None:
                layer_hooks.wait_for_layer_load(i)
            streams = layer(streams, input_ids, positions, freqs, cache, attn_meta, step)
            if layer_hooks is not None:
                layer_hooks.save_kv_layer(i)
        streams = streams[logits_indices]
        t = streams.shape[0]
        flat = unweighted_rms_norm(streams.reshape(t, self.hc_fn.shape[1]).float(),
                                   self.cfg.rms_norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base)
        pre = pre + (self.cfg.v4.hc_eps if self.cfg.v4 is not None else 0.0)
        hidden = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        hidden = rms_norm(hidden.float(), self.norm, self.cfg.rms_norm_eps).to(streams.dtype)
        return linear(hidden, self.lm_head, None).float()

    def pack_cpu_weights(self, packer: Any = None) -> bool:
        """No packed weights for this architecture (plain F.linear)."""
        return False

    def linear_weights(self) -> list[torch.Tensor]:
        """None for --cpu-linear auto's table (the projections run on plain F.linear)."""
        return []

    def load_weights(self, r: Any, put: Callable[[nn.Parameter, torch.Tensor, str], None]) -> None:
        """Read the weights from `r` (pdkv.model.loader's shard reader) under the checkpoint's
        names (module docstring); experts' w1 (gate) and w3 (up) are stacked into gate_up.

        Raises:
            ValueError: a missing or mis-shaped weight (named).
        """
        put(self.embed, r.whole("model.embed_tokens.weight"), "embed_tokens")
        put(self.lm_head, r.whole("head.weight"), "head")
        put(self.norm, r.whole("model.norm.weight"), "norm")
        for name in ("hc_fn", "hc_base", "hc_scale"):
            put(getattr(self, name), r.whole(f"model.hc_head.{name}"), f"hc_head.{name}")
        for i, layer in enumerate(self.layers):
            _load_layer(layer, r, put, f"model.layers.{i}.")


def _load_layer(layer: V4Layer, r: Any, put: Callable[[nn.Parameter, torch.Tensor, str], None],
                p: str) -> None:
    """One layer's weights (checkpoint names under prefix `p`)."""
    def load(param: nn.Parameter, name: str) -> None:
        put(param, r.whole(p + name), p + name)

    load(layer.input_norm, "attn_norm.weight")
    load(layer.post_attn_norm, "ffn_norm.weight")
    for hc, tag in ((layer.attn_hc, "attn"), (layer.ffn_hc, "ffn")):
        for part in ("fn", "base", "scale"):
            load(getattr(hc, part), f"hc_{tag}_{part}")
    a = layer.attn
    for param, name in ((a.q_a_proj, "wq_a"), (a.q_a_norm, "q_norm"), (a.q_b_proj, "wq_b"),
                        (a.kv_proj, "wkv"), (a.kv_norm, "norm"), (a.o_a_proj, "wo_a"),
                        (a.o_b_proj, "wo_b")):
        load(param, f"attn.{name}.weight")
    load(a.sinks, "attn.attn_sink")
    comps = [(a.compressor, "attn.compressor.")]
    if a.indexer is not None:
        comps.append((a.indexer.compressor, "attn.indexer.compressor."))
        load(a.indexer.q_b_proj, "attn.indexer.wq_b.weight")
        load(a.indexer.weights_proj, "attn.indexer.weights_proj.weight")
    for comp, q in comps:
        if comp is None:
            continue
        load(comp.kv_proj, q + "wkv.weight")
        load(comp.gate_proj, q + "wgate.weight")
        load(comp.position_bias, q + "ape")
        load(comp.kv_norm, q + "norm.weight")
    m = layer.mlp
    load(m.gate, "ffn.gate.weight")
    if m.bias is not None:
        load(m.bias, "ffn.gate.bias")
    else:
        t2e = r.whole(p + "ffn.gate.tid2eid").long()
        if tuple(t2e.shape) != tuple(m.tid2eid.shape):
            raise ValueError(f"weight {p}ffn.gate.tid2eid: expected shape "
                             f"{tuple(m.tid2eid.shape)}, got {tuple(t2e.shape)}")
        m.tid2eid.copy_(t2e)
    experts = m.gate_up.shape[0]
    put(m.gate_up, torch.stack([
        torch.cat([r.whole(f"{p}ffn.experts.{e}.w1.weight"),
                   r.whole(f"{p}ffn.experts.{e}.w3.weight")]) for e in range(experts)]),
        p + "ffn.experts.w1|w3")
    put(m.down, torch.stack([r.whole(f"{p}ffn.experts.{e}.w2.weight") for e in range(experts)]),
        p + "ffn.experts.w2")
    put(m.shared_gate_up, torch.cat([r.whole(p + "ffn.shared_experts.w1.weight"),
                                     r.whole(p + "ffn.shared_experts.w3.weight")]),
        p + "ffn.shared_experts.w1|w3")
    load(m.shared_down, "ffn.shared_experts.w2.weight")
