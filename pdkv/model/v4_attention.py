"""DeepSeek-V4 attention in torch: sliding-window KV in the paged cache, compressed KV entries
(CSA / HCA compressors), the Lightning Indexer's top-k selection and per-head attention sinks.

Numerics follow transformers' modeling_deepseek_v4.py (DeepseekV4Attention, DeepseekV4CSA/HCA
Compressor, DeepseekV4Indexer; the paper's §2.3):
- Shared-KV MQA: one KV head; its vector (kv_proj, RMSNorm, rope) is both key and value. Every
  layer attends over a sliding window of W tokens (the query at p sees keys p - W < k <= p),
  read from the paged KV cache (the sliding-window group; K and V planes both hold the vector).
- Rope is interleaved (pairs of adjacent channels) on the trailing `rotary_dim` channels; the
  attention output's rope slice is rotated back (-sin) at the query position.
- A compressor turns every `rate` source tokens of a layer's input into one compressed entry:
  per token kv = kv_proj(x), gate = gate_proj(x) + position_bias[token in window]; an entry is
  RMSNorm(sum softmax(gate) * kv) over its window, roped (compress theta) at the position of the
  window's first token. CSA (rate m) projects to 2·d: an entry mixes the previous window's first
  half (its "overlap") with its own window's second half, 2m slots; HCA (rate m') has no overlap.
  Entry w is visible to the query at p when w < (p + 1) // rate.
- CSA's Lightning Indexer runs its own compressor at index_head_dim and scores queries against
  its entries: sum_h w_h · ReLU(q_h · k) / sqrt(c), with w = weights_proj(x) / sqrt(heads); each
  query attends only to its `index_topk` best visible entries. HCA attends to every visible one.
- Attention sinks: one learned logit per head joins the softmax and is dropped after it.

State per request (`V4LayerState`, step 1 of the V4 work: plain tensors held by the model, not
yet KV cache groups): per compressor the pending tokens of the open window (kv and gate rows,
fewer than `rate`), CSA's overlap (the last closed window's first halves: rate rows of kv and
gate) and the entries emitted so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pdkv.model.llama import linear, rms_norm


def rope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, rotary_dim / 2] (float32) of `positions` [n] for `inv_freq` [rotary_dim / 2]."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def inv_freq(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """HF's default rope frequencies: theta^(-2i / rotary_dim), i < rotary_dim / 2 (float32)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device)
                            / rotary_dim))


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rope on the trailing 2·cos.shape[-1] channels of `x` [n, ..., d]: each pair
    (a, b) becomes (a cos - b sin, b cos + a sin); the leading channels are unchanged.
    cos / sin: [n, r / 2]."""
    r = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r,)
    c = cos.repeat_interleave(2, dim=-1).view(shape)
    s = sin.repeat_interleave(2, dim=-1).view(shape)
    rope = x[..., -r:].float()
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    out = (rope * c + rotated * s).to(x.dtype)
    return torch.cat((x[..., :-r], out), dim=-1)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim (HF's DeepseekV4UnweightedRMSNorm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


@dataclass
class CompressorState:
    """One compressor's state for one request.

    Attributes:
        pending_kv, pending_gate: [p, width] rows of the open window (p < rate; gate rows
            include position_bias).
        overlap_kv, overlap_gate: [rate, d] first halves of the last closed window (CSA only;
            None before the first window closes).
        entries: [E, d] compressed entries emitted so far (E = tokens seen // rate).
    """

    pending_kv: torch.Tensor
    pending_gate: torch.Tensor
    entries: torch.Tensor
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None


@dataclass
class V4LayerState:
    """A request's compressor state of one layer: the attention compressor (None on a
    sliding-only layer) and the indexer's (CSA only)."""

    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Compressor(nn.Module):
    """kv_proj / gate_proj [width, hidden], position_bias [rate, width] (float32), kv_norm [d];
    width = 2·d with `overlap` (CSA and its indexer), d without (HCA)."""

    def __init__(self, hidden: int, d: int, rate: int, overlap: bool, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.d, self.rate, self.overlap, self.eps = d, rate, overlap, eps
        width = 2 * d if overlap else d
        self.kv_proj, self.gate_proj = _param(width, hidden, dtype=dtype), _param(
            width, hidden, dtype=dtype)
        self.position_bias = _param(rate, width, dtype=torch.float32)
        self.kv_norm = _param(d, dtype=torch.float32)

    def fresh(self) -> CompressorState:
        """The state of a request that has seen no token."""
        w = self.kv_proj.shape[0]
        dev, dt = self.kv_proj.device, self.kv_proj.dtype
        return CompressorState(torch.empty(0, w, dtype=dt, device=dev),
                               torch.empty(0, w, dtype=torch.float32, device=dev),
                               torch.empty(0, self.d, dtype=dt, device=dev))

    def update(self, x: torch.Tensor, st: CompressorState, inv_freq_c: torch.Tensor) -> None:
        """Feed a request's next tokens x [n, hidden] (its layer input, in order): close every
        window they complete and append its entry to `st.entries`."""
        m, d = self.rate, self.d
        first = st.entries.shape[0] * m  # position of the next window's first token
        kv = torch.cat((st.pending_kv, linear(x, self.kv_proj, None)))
        gate = torch.cat((st.pending_gate, linear(x, self.gate_proj, None).float()))
        usable = (kv.shape[0] // m) * m
        st.pending_kv, st.pending_gate = kv[usable:], gate[usable:]
        if usable == 0:
            return
        nw = usable // m
        ck = kv[:usable].view(nw, m, -1)
        cg = gate[:usable].view(nw, m, -1) + self.position_bias
        if self.overlap:  # slots [previous window's first halves | this window's second halves]
            new_kv = ck.new_zeros(nw, 2 * m, d)
            new_gate = cg.new_full((nw, 2 * m, d), float("-inf"))
            new_kv[:, m:], new_gate[:, m:] = ck[..., d:], cg[..., d:]
            if nw > 1:
                new_kv[1:, :m], new_gate[1:, :m] = ck[:-1, :, :d], cg[:-1, :, :d]
            if st.overlap_kv is not None and st.overlap_gate is not None:
                new_kv[0, :m], new_gate[0, :m] = st.overlap_kv, st.overlap_gate
            st.overlap_kv, st.overlap_gate = ck[-1, :, :d].clone(), cg[-1, :, :d].clone()
            ck, cg = new_kv, new_gate
        pooled = (ck * cg.softmax(dim=1).to(ck.dtype)).sum(dim=1)
        pooled = rms_norm(pooled.float(), self.kv_norm, self.eps).to(ck.dtype)
        pos = torch.arange(nw, device=x.device) * m + first
        cos, sin = rope_angles(pos, inv_freq_c)
        st.entries = torch.cat((st.entries, apply_rope_interleaved(pooled, cos, sin)))


class Indexer(nn.Module):
    """CSA's Lightning Indexer: its compressor (index_head_dim c, overlap), q_b_proj
    [heads·c, q_lora_rank] and weights_proj [heads, hidden]."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, c: int, rate: int, topk: int,
                 eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.c, self.rate, self.topk = heads, c, rate, topk
        self.compressor = Compressor(hidden, c, rate, True, eps, dtype)
        self.q_b_proj = _param(heads * c, q_lora_rank, dtype=dtype)
        self.weights_proj = _param(heads, hidden, dtype=dtype)

    def select(self, x: torch.Tensor, q_res: torch.Tensor, pos: torch.Tensor,
               st: CompressorState, inv_freq_c: torch.Tensor) -> torch.Tensor:
        """After feeding x [n, hidden]: each query's chosen entries as a bool mask [n, E] (its
        `topk` best-scored entries among those visible to it)."""
        self.compressor.update(x, st, inv_freq_c)
        keys = st.entries
        n, e = x.shape[0], keys.shape[0]
        if e == 0:
            return torch.zeros(n, 0, dtype=torch.bool, device=x.device)
        cos, sin = rope_angles(pos, inv_freq_c)
        q = apply_rope_interleaved(linear(q_res, self.q_b_proj, None).view(n, self.heads, self.c),
                                   cos, sin)
        scores = torch.relu(torch.einsum("nhc,ec->nhe", q.float(), keys.float())) * self.c**-0.5
        w = linear(x, self.weights_proj, None).float() * self.heads**-0.5
        index = (scores * w.unsqueeze(-1)).sum(dim=1)  # [n, E]
        visible = torch.arange(e, device=x.device)[None, :] < ((pos + 1) // self.rate)[:, None]
        index = index.masked_fill(~visible, float("-inf"))
        top = index.topk(min(self.topk, e), dim=-1).indices
        chosen = torch.zeros(n, e, dtype=torch.bool, device=x.device)
        chosen.scatter_(1, top, True)
        return chosen & visible


@dataclass(frozen=True)
class V4StepRequest:
    """One request of a step: its flat rows start .. start + n, the tokens already computed
    (`context`), and its sliding-window group block table [blocks] (long)."""

    req_id: str
    start: int
    n: int
    context: int
    block_table: torch.Tensor


@dataclass(frozen=True)
class V4StepMetadata:
    """The V4 decoder's per-request view of a step (built by the model runner beside the
    sliding-window group's AttentionMetadata, whose slots the K/V writes use)."""

    requests: tuple[V4StepRequest, ...] = field(default_factory=tuple)


class V4Attention(nn.Module):
    """One DeepSeek-V4 attention block (module docstring): q LoRA (q_a_proj, weighted q_a_norm,
    q_b_proj, unweighted per-head norm), kv_proj + kv_norm, grouped low-rank output projection
    (o_a_proj per group, o_b_proj), sinks, and the layer's compressor / indexer."""

    def __init__(self, hidden: int, heads: int, d: int, window: int, kind: str, rate: int,
                 v4: object, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        from pdkv.model.v4_config import CSA, HCA, DeepseekV4Fields

        assert isinstance(v4, DeepseekV4Fields)
        self.heads, self.d, self.window, self.eps, self.rate = heads, d, window, eps, rate
        self.o_groups = v4.o_groups
        self.q_a_proj = _param(v4.q_lora_rank, hidden, dtype=dtype)
        self.q_a_norm = _param(v4.q_lora_rank, dtype=torch.float32)
        self.q_b_proj = _param(heads * d, v4.q_lora_rank, dtype=dtype)
        self.kv_proj = _param(d, hidden, dtype=dtype)
        self.kv_norm = _param(d, dtype=torch.float32)
        self.o_a_proj = _param(v4.o_groups * v4.o_lora_rank, heads * d // v4.o_groups,
                               dtype=dtype)
        self.o_b_proj = _param(hidden, v4.o_groups * v4.o_lora_rank, dtype=dtype)
        self.sinks = _param(heads, dtype=torch.float32)
        self.compressor = (Compressor(hidden, d, rate, kind == CSA, eps, dtype)
                           if kind in (CSA, HCA) else None)
        self.indexer = (Indexer(hidden, v4.q_lora_rank, v4.index_n_heads, v4.index_head_dim,
                                rate, v4.index_topk, eps, dtype) if kind == CSA else None)

    def fresh(self) -> V4LayerState:
        """A request's state before its first token."""
        return V4LayerState(
            self.compressor.fresh() if self.compressor is not None else None,
            self.indexer.compressor.fresh() if self.indexer is not None else None)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor,
                freq_c: torch.Tensor, kv_cache: torch.Tensor, slot_blocks: torch.Tensor,
                slot_offsets: torch.Tensor, step: V4StepMetadata,
                states: list[V4LayerState]) -> torch.Tensor:
        """x: [T, hidden] (the normed layer input) -> [T, hidden].

        Args:
            positions: [T] long. freq / freq_c: this layer's rope frequencies (main or
                compress theta) and the compressors' (compress theta).
            kv_cache: this layer's [2, blocks, block_size, 1, d]; the step's vectors are
                written at (slot_blocks, slot_offsets) [T] before any request reads.
            states: per step request (same order), its state of this layer (updated).
        """
        t, h, d = x.shape[0], self.heads, self.d
        cos, sin = rope_angles(positions, freq)
        q_res = rms_norm(linear(x, self.q_a_proj, None).float(), self.q_a_norm, self.eps).to(
            x.dtype)
        q = unweighted_rms_norm(linear(q_res, self.q_b_proj, None).view(t, h, d), self.eps)
        q = apply_rope_interleaved(q, cos, sin)
        kv = rms_norm(linear(x, self.kv_proj, None).float(), self.kv_norm, self.eps).to(x.dtype)
        kv = apply_rope_interleaved(kv, cos, sin)
        kv_cache[0, slot_blocks, slot_offsets, 0] = kv
        kv_cache[1, slot_blocks, slot_offsets, 0] = kv
        block_size = kv_cache.shape[2]
        out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
        for r, st in zip(step.requests, states):
            rows = slice(r.start, r.start + r.n)
            qpos = positions[rows]
            first = max(0, r.context - self.window + 1)
            kpos = torch.arange(first, r.context + r.n, device=x.device)
            keys = kv_cache[0, r.block_table[kpos // block_size], kpos % block_size, 0]
            allowed = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None]
                                                            - self.window)
            if self.compressor is not None and st.compressor is not None:
                self.compressor.update(x[rows], st.compressor, freq_c)
                entries = st.compressor.entries
                e = entries.shape[0]
                if self.indexer is not None and st.indexer is not None:
                    seen = self.indexer.select(x[rows], q_res[rows], qpos, st.indexer, freq_c)
                else:
                    seen = (torch.arange(e, device=x.device)[None, :]
                            < ((qpos + 1) // self.rate)[:, None])
                keys = torch.cat((keys, entries))
                allowed = torch.cat((allowed, seen), dim=1)
            qh = q[rows].transpose(0, 1)  # [H, n, d]
            logits = torch.matmul(qh, keys.t()) * d**-0.5
            logits = logits.masked_fill(~allowed, float("-inf"))
            sink = self.sinks.to(logits.dtype).view(h, 1, 1).expand(h, r.n, 1)
            logits = torch.cat((logits, sink), dim=-1)
            logits = logits - logits.max(dim=-1, keepdim=True).values
            probs = logits.softmax(dim=-1)[..., :-1]
            out[rows] = torch.matmul(probs.to(keys.dtype), keys).transpose(0, 1)
        out = apply_rope_interleaved(out, cos, -sin)
        g = self.o_groups
        grouped = out.reshape(t, g, -1)
        w = self.o_a_proj.view(g, -1, grouped.shape[-1])  # [g, o_lora_rank, heads·d / g]
        low = torch.einsum("tgk,grk->tgr", grouped, w).reshape(t, -1)
        return linear(low, self.o_b_proj, None)
