"""DeepSeek-V4 attention in torch: sliding-window KV in the paged cache, compressed KV entries
(CSA / HCA compressors), the Lightning Indexer's top-k selection and per-head attention sinks.

Numerics follow transformers' modeling_deepseek_v4.py (DeepseekV4Attention, DeepseekV4CSA/HCA
Compressor, DeepseekV4Indexer; the paper's §2.3):
- Shared-KV MQA: one KV head; its vector (kv_proj, RMSNorm, rope) is both key and value. Every
  layer attends over a sliding window of W tokens (the query at p sees keys p - W < k <= p),
  read from the paged KV cache (the sliding-window group, one plane: `shared_kv`).
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

State, all in KV cache groups (pdkv.worker.kv_cache.v4_cache_groups; cache layers
pdkv.model.v4_config.V4CacheLayers):
- the window's vectors: the sliding-window group (K = V: one plane, `FullAttentionSpec.shared_kv`);
- the compressed entries and the indexer keys: CompressedKVSpec groups, entry w in the block of
  its window's last token (`CompressedKVSpec.entry_slot`), written once when its window closes;
- the compressor state: a CompressorStateSpec slot per request (with prefix caching, one per
  block holding the state at the block's end), float32: per compressor (the attention's, then
  the indexer's) the pending rows of the open window, kv then gate, `rate` × width each, then
  (CSA) the overlap, kv then gate, `rate` × d each. After p tokens a compressor holds p mod rate
  pending rows, has emitted p // rate entries and (CSA) has an overlap once p >= rate: a slot is
  the state at exactly one position, so a prefix hit restores it with the entries of its blocks.
Requests run one by one (torch); a request's tokens are fed to the compressors segment by segment
(split where its state slot changes) and each segment's end state is written to its slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdkv.model.llama import linear, rms_norm
from pdkv.model.v4_config import CSA, HCA, DeepseekV4Fields
from pdkv.modelspec.groups import compressor_state_elems


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
    """One compressor's state for one request at some position.

    Attributes:
        pending_kv, pending_gate: [p, width] rows of the open window (p < rate; gate rows
            without position_bias), float32.
        count: entries emitted so far (tokens seen // rate).
        overlap_kv, overlap_gate: [rate, d] first halves of the last closed window (gate rows
            with position_bias; CSA only; None before the first window closes).
    """

    pending_kv: torch.Tensor
    pending_gate: torch.Tensor
    count: int
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None


def frozen_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised inference-only parameter of `shape` (filled by the loader)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Compressor(nn.Module):
    """kv_proj / gate_proj [width, hidden], position_bias [rate, width] (float32), kv_norm [d];
    width = 2·d with `overlap` (CSA and its indexer), d without (HCA)."""

    def __init__(self, hidden: int, d: int, rate: int, overlap: bool, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.d, self.rate, self.overlap, self.eps = d, rate, overlap, eps
        self.width = 2 * d if overlap else d
        self.kv_proj = frozen_param(self.width, hidden, dtype=dtype)
        self.gate_proj = frozen_param(self.width, hidden, dtype=dtype)
        self.position_bias = frozen_param(rate, self.width, dtype=torch.float32)
        self.kv_norm = frozen_param(d, dtype=torch.float32)

    @property
    def state_floats(self) -> int:
        """Float32 values of this compressor's part of a state slot (module docstring)."""
        return compressor_state_elems(self.rate, self.d, self.overlap)

    def load(self, slot: torch.Tensor | None, position: int) -> CompressorState:
        """The state after `position` tokens from `slot` [state_floats] float32 (None or
        position 0: nothing seen)."""
        m, w, d = self.rate, self.width, self.d
        dev = self.kv_proj.device
        if slot is None or position == 0:
            empty = torch.empty(0, w, dtype=torch.float32, device=dev)
            return CompressorState(empty, empty.clone(), 0)
        p = position % m
        kv, gate = slot[: m * w].view(m, w), slot[m * w : 2 * m * w].view(m, w)
        st = CompressorState(kv[:p].clone(), gate[:p].clone(), position // m)
        if self.overlap and st.count > 0:
            o = slot[2 * m * w :]
            st.overlap_kv = o[: m * d].view(m, d).clone()
            st.overlap_gate = o[m * d : 2 * m * d].view(m, d).clone()
        return st

    def save(self, st: CompressorState, slot: torch.Tensor) -> None:
        """Write `st` into `slot` [state_floats] float32 (rows past the pending ones are left
        as they are: never read)."""
        m, w, d = self.rate, self.width, self.d
        p = st.pending_kv.shape[0]
        slot[: p * w] = st.pending_kv.reshape(-1)
        slot[m * w : m * w + p * w] = st.pending_gate.reshape(-1)
        if self.overlap and st.overlap_kv is not None and st.overlap_gate is not None:
            slot[2 * m * w : 2 * m * w + m * d] = st.overlap_kv.reshape(-1)
            slot[2 * m * w + m * d : 2 * m * w + 2 * m * d] = st.overlap_gate.reshape(-1)

    def update(self, x: torch.Tensor, st: CompressorState,
               inv_freq_c: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Feed a request's next tokens x [n, hidden] (its layer input, in order): close every
        window they complete. Returns (index of the first new entry, new entries [k, d] in x's
        dtype); `st` moves past x."""
        m, d = self.rate, self.d
        first = st.count
        kv = torch.cat((st.pending_kv, linear(x, self.kv_proj, None).float()))
        gate = torch.cat((st.pending_gate, linear(x, self.gate_proj, None).float()))
        usable = (kv.shape[0] // m) * m
        st.pending_kv, st.pending_gate = kv[usable:], gate[usable:]
        if usable == 0:
            return first, torch.empty(0, d, dtype=x.dtype, device=x.device)
        nw = usable // m
        ck = kv[:usable].view(nw, m, -1).to(x.dtype)
        cg = gate[:usable].view(nw, m, -1) + self.position_bias
        if self.overlap:  # slots [previous window's first halves | this window's second halves]
            new_kv = ck.new_zeros(nw, 2 * m, d)
            new_gate = cg.new_full((nw, 2 * m, d), float("-inf"))
            new_kv[:, m:], new_gate[:, m:] = ck[..., d:], cg[..., d:]
            if nw > 1:
                new_kv[1:, :m], new_gate[1:, :m] = ck[:-1, :, :d], cg[:-1, :, :d]
            if st.overlap_kv is not None and st.overlap_gate is not None:
                new_kv[0, :m], new_gate[0, :m] = st.overlap_kv.to(ck.dtype), st.overlap_gate
            st.overlap_kv, st.overlap_gate = ck[-1, :, :d].float().clone(), cg[-1, :, :d].clone()
            ck, cg = new_kv, new_gate
        pooled = (ck * cg.softmax(dim=1).to(ck.dtype)).sum(dim=1)
        pooled = rms_norm(pooled.float(), self.kv_norm, self.eps).to(x.dtype)
        pos = torch.arange(nw, device=x.device) * m + first * m
        cos, sin = rope_angles(pos, inv_freq_c)
        st.count += nw
        return first, apply_rope_interleaved(pooled, cos, sin)


def write_entries(cache: torch.Tensor, table: torch.Tensor, rate: int, block_size: int,
                  first: int, entries: torch.Tensor) -> None:
    """Store entries first .. first + k - 1 ([k, width]) in a CompressedKVSpec layer view
    `cache` [blocks, entries_per_block, width] through the request's block `table` [blocks]:
    entry w in the block of token (w + 1)·rate - 1, at offset w mod entries_per_block."""
    if entries.shape[0] == 0:
        return
    w = torch.arange(first, first + entries.shape[0], device=entries.device)
    blocks = table[((w + 1) * rate - 1) // block_size]
    cache[blocks, w % cache.shape[1]] = entries.to(cache.dtype)


def read_entries(cache: torch.Tensor, table: torch.Tensor, rate: int, block_size: int,
                 count: int) -> torch.Tensor:
    """Entries 0 .. count - 1 of a request ([count, width]) from `cache` (see write_entries)."""
    w = torch.arange(count, device=table.device)
    return cache[table[((w + 1) * rate - 1) // block_size], w % cache.shape[1]]


class Indexer(nn.Module):
    """CSA's Lightning Indexer: its compressor (index_head_dim c, overlap), q_b_proj
    [heads·c, q_lora_rank] and weights_proj [heads, hidden]."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, c: int, rate: int, topk: int,
                 eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.c, self.rate, self.topk = heads, c, rate, topk
        self.compressor = Compressor(hidden, c, rate, True, eps, dtype)
        self.q_b_proj = frozen_param(heads * c, q_lora_rank, dtype=dtype)
        self.weights_proj = frozen_param(heads, hidden, dtype=dtype)

    def select(self, x: torch.Tensor, q_res: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor,
               inv_freq_c: torch.Tensor) -> torch.Tensor:
        """Each query's chosen entries as a bool mask [n, E]: its `topk` best-scored entries
        among those visible to it; keys: the request's indexer keys [E, c]."""
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
    (`context`), its block table [blocks] (long) per cache layer (`tables`, pdkv.model.
    v4_config.V4CacheLayers indices), and its compressor-state source slot (-1: fresh) and
    segments ((tokens, destination slot), pdkv.worker.attn_metadata.build_linear_state_metadata).
    """

    start: int
    n: int
    context: int
    tables: dict[int, torch.Tensor]
    src: int = -1
    segments: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class V4StepMetadata:
    """The V4 decoder's per-request view of a step (built by the model runner beside the
    sliding-window group's AttentionMetadata, whose slots the K/V writes use)."""

    requests: tuple[V4StepRequest, ...] = ()


@dataclass(frozen=True)
class V4LayerCaches:
    """One model layer's cache views: the sliding-window layer [1, blocks, block_size, 1, d]
    and its cache layer index, then (None on a sliding-only layer) the compressed entries
    [blocks, per block, d], the indexer keys [blocks, per block, c] (CSA) and the state slots
    [slots, floats] float32, each with its cache layer index (the key of the request tables)."""

    window: torch.Tensor
    window_id: int
    compressed: torch.Tensor | None = None
    compressed_id: int = -1
    indexer: torch.Tensor | None = None
    indexer_id: int = -1
    state: torch.Tensor | None = None
    state_id: int = -1


class V4Attention(nn.Module):
    """One DeepSeek-V4 attention block (module docstring): q LoRA (q_a_proj, weighted q_a_norm,
    q_b_proj, unweighted per-head norm), kv_proj + kv_norm, grouped low-rank output projection
    (o_a_proj per group, o_b_proj), sinks, and the layer's compressor / indexer."""

    def __init__(self, hidden: int, heads: int, d: int, window: int, kind: str, rate: int,
                 v4: DeepseekV4Fields, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.d, self.window, self.eps, self.rate = heads, d, window, eps, rate
        self.o_groups = v4.o_groups
        self.q_a_proj = frozen_param(v4.q_lora_rank, hidden, dtype=dtype)
        self.q_a_norm = frozen_param(v4.q_lora_rank, dtype=torch.float32)
        self.q_b_proj = frozen_param(heads * d, v4.q_lora_rank, dtype=dtype)
        self.kv_proj = frozen_param(d, hidden, dtype=dtype)
        self.kv_norm = frozen_param(d, dtype=torch.float32)
        self.o_a_proj = frozen_param(v4.o_groups * v4.o_lora_rank, heads * d // v4.o_groups,
                               dtype=dtype)
        self.o_b_proj = frozen_param(hidden, v4.o_groups * v4.o_lora_rank, dtype=dtype)
        self.sinks = frozen_param(heads, dtype=torch.float32)
        self.compressor = (Compressor(hidden, d, rate, kind == CSA, eps, dtype)
                           if kind in (CSA, HCA) else None)
        self.indexer = (Indexer(hidden, v4.q_lora_rank, v4.index_n_heads, v4.index_head_dim,
                                rate, v4.index_topk, eps, dtype) if kind == CSA else None)

    def _compress(self, x: torch.Tensor, r: V4StepRequest, caches: V4LayerCaches,
                  freq_c: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run request `r`'s rows x [n, hidden] through the compressor (and indexer) segment by
        segment, writing entries and each segment's end state; returns all of its entries
        [E, d] and indexer keys [E, c] ([0, c] without an indexer)."""
        comp, idx = self.compressor, self.indexer
        assert comp is not None and caches.compressed is not None and caches.state is not None
        slots = caches.state
        src = slots[r.src] if r.src >= 0 else None
        split = comp.state_floats
        st = comp.load(src, r.context)
        sti = (idx.compressor.load(src[split:] if src is not None else None, r.context)
               if idx is not None else None)
        ctab = r.tables[caches.compressed_id]
        itab = r.tables[caches.indexer_id] if idx is not None else None
        lo = 0
        for length, dst in r.segments:
            rows = x[lo : lo + length]
            first, new = comp.update(rows, st, freq_c)
            write_entries(caches.compressed, ctab, self.rate, block_size, first, new)
            comp.save(st, slots[dst])
            if idx is not None and sti is not None and caches.indexer is not None:
                assert itab is not None
                first, new = idx.compressor.update(rows, sti, freq_c)
                write_entries(caches.indexer, itab, self.rate, block_size, first, new)
                idx.compressor.save(sti, slots[dst][split:])
            lo += length
        count = (r.context + r.n) // self.rate
        entries = read_entries(caches.compressed, ctab, self.rate, block_size, count)
        keys = (read_entries(caches.indexer, itab, self.rate, block_size, count)
                if caches.indexer is not None and itab is not None
                else entries.new_zeros(0, 0))
        return entries, keys

    def forward(self, x: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor,
                freq_c: torch.Tensor, caches: V4LayerCaches, slot_blocks: torch.Tensor,
                slot_offsets: torch.Tensor, step: V4StepMetadata) -> torch.Tensor:
        """x: [T, hidden] (the normed layer input) -> [T, hidden].

        Args:
            positions: [T] long. freq / freq_c: this layer's rope frequencies (main or
                compress theta) and the compressors' (compress theta).
            caches: this layer's cache views; the step's window vectors are written at
                (slot_blocks, slot_offsets) [T] before any request reads.
            step: the requests, in flat-batch order.
        """
        t, h, d = x.shape[0], self.heads, self.d
        cos, sin = rope_angles(positions, freq)
        q_res = rms_norm(linear(x, self.q_a_proj, None).float(), self.q_a_norm, self.eps).to(
            x.dtype)
        q = unweighted_rms_norm(linear(q_res, self.q_b_proj, None).view(t, h, d), self.eps)
        q = apply_rope_interleaved(q, cos, sin)
        kv = rms_norm(linear(x, self.kv_proj, None).float(), self.kv_norm, self.eps).to(x.dtype)
        kv = apply_rope_interleaved(kv, cos, sin)
        win = caches.window
        win[0, slot_blocks, slot_offsets, 0] = kv  # one plane: the key is the value
        block_size = win.shape[2]
        out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
        for r in step.requests:
            rows = slice(r.start, r.start + r.n)
            qpos = positions[rows]
            first = max(0, r.context - self.window + 1)
            kpos = torch.arange(first, r.context + r.n, device=x.device)
            table = r.tables[caches.window_id]
            keys = win[0, table[kpos // block_size], kpos % block_size, 0]
            allowed = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None]
                                                            - self.window)
            if self.compressor is not None:
                entries, ikeys = self._compress(x[rows], r, caches, freq_c, block_size)
                if self.indexer is not None:
                    seen = self.indexer.select(x[rows], q_res[rows], qpos, ikeys, freq_c)
                else:
                    seen = (torch.arange(entries.shape[0], device=x.device)[None, :]
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
