"""State groups of a model and their size: bytes per token (attention KV) or per request
(linear-attention state), for one rank given the TP size (torch-free).

Sharding rules (vLLM's, ../shared/reference/ANCHORS.md §3):
- GQA/MHA: KV heads are split over TP ranks; when tp > kv_heads each rank keeps one head
  (a head is replicated tp / kv_heads times).
- MLA: one latent vector per token and layer, shared by all heads, so every TP rank keeps
  the whole latent (replicated tp times); DCP is what divides it (by tokens).
- Linear state: split over TP by heads, one slot per request, never by tokens.
- DeepSeek-V4 (shared-KV MQA, one KV head): HF's tp plan keeps attention, its compressors and
  the indexer replicated on every TP rank, so every V4 group below is replicated tp times.

`token_bytes` is the bytes of one held entry and `tokens_held(n)` the entries held for n tokens;
an entry is one token except in the compressed groups (`entry_tokens` tokens per entry), so
`per_token_bytes` (token_bytes / entry_tokens) is what one prompt token costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdkv.modelspec.dtypes import ElementType


def heads_per_rank(num_heads: int, tp: int) -> int:
    """KV heads one TP rank holds: num_heads / tp, or 1 (replicated) when tp > num_heads.

    Raises:
        ValueError: tp < 1, or neither of num_heads and tp divides the other.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if tp >= num_heads:
        if tp % num_heads:
            raise ValueError(f"tp={tp} is not a multiple of {num_heads} KV heads")
        return 1
    if num_heads % tp:
        raise ValueError(f"{num_heads} KV heads do not split over tp={tp}")
    return num_heads // tp


@dataclass(frozen=True)
class FullAttention:
    """Per-head K and V for every token (Llama, Qwen2, SmolLM2, GLM-4.5, Qwen3-Next full layers)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kind: str = "full_attention"
    entry_tokens = 1  # tokens per held entry (class constant, not a field)

    def token_bytes(self, dt: ElementType, tp: int = 1) -> int:
        """Bytes per token on one rank: 2 (K,V) · layers · heads/rank · (head_dim · elem +
        scale)."""
        h = heads_per_rank(self.num_kv_heads, tp)
        return 2 * self.num_layers * h * (self.head_dim * dt.bytes + dt.scale_bytes)

    def formula(self, dt: ElementType, tp: int = 1) -> str:
        h = heads_per_rank(self.num_kv_heads, tp)
        scale = f" + {dt.scale_bytes} B scale" if dt.scale_bytes else ""
        shard = "" if tp == 1 else f" (tp={tp}: {h} of {self.num_kv_heads} heads per rank)"
        return (
            f"2·{self.num_layers} layers·{h} kv heads·({self.head_dim}·{dt.bytes} B{scale}){shard}"
        )

    def tokens_held(self, num_tokens: int) -> int:
        return num_tokens

    def block_tokens_held(self, num_tokens: int, block_size: int) -> int:
        """Token slots of the whole blocks holding the prompt's KV (what P/D moves: blocks)."""
        return -(-num_tokens // block_size) * block_size

    def request_bytes(self, dt: ElementType, tp: int = 1) -> int:
        return 0


@dataclass(frozen=True)
class SlidingWindow(FullAttention):
    """Full attention bounded to the last `window` tokens (Mistral, Gemma local layers)."""

    window: int = 0
    kind: str = "sliding_window"

    def tokens_held(self, num_tokens: int) -> int:
        return min(num_tokens, self.window)

    def block_tokens_held(self, num_tokens: int, block_size: int) -> int:
        """Token slots of the blocks P/D moves for a prompt of `num_tokens`: D resumes at the last
        prompt token and keeps the window of that token's block boundary B, blocks
        (B − window + 1) // block_size .. (n − 1) // block_size
        (pdkv.cache.specs.window_first_block)."""
        if num_tokens == 0:
            return 0
        last = (num_tokens - 1) // block_size
        first = max(0, last * block_size - self.window + 1) // block_size
        return (last - first + 1) * block_size

    def formula(self, dt: ElementType, tp: int = 1) -> str:
        return super().formula(dt, tp) + f", at most the last {self.window} tokens"


@dataclass(frozen=True)
class MLA:
    """DeepSeek-V3 multi-head latent attention: one (kv_lora_rank + rope) vector per token and
    layer, no per-head K/V; replicated on every TP rank."""

    num_layers: int
    kv_lora_rank: int
    rope_dim: int
    kind: str = "mla"
    entry_tokens = 1

    def token_bytes(self, dt: ElementType, tp: int = 1) -> int:
        """Bytes per token on one rank: layers · ((kv_lora_rank + rope_dim) · elem + scale)."""
        heads_per_rank(1, tp)
        return self.num_layers * ((self.kv_lora_rank + self.rope_dim) * dt.bytes + dt.scale_bytes)

    def formula(self, dt: ElementType, tp: int = 1) -> str:
        scale = f" + {dt.scale_bytes} B scale" if dt.scale_bytes else ""
        rep = "" if tp == 1 else f" (replicated on each of tp={tp} ranks)"
        return (f"({self.kv_lora_rank}+{self.rope_dim})·{dt.bytes} B{scale}·"
                f"{self.num_layers} layers{rep}")

    def tokens_held(self, num_tokens: int) -> int:
        return num_tokens

    def block_tokens_held(self, num_tokens: int, block_size: int) -> int:
        """Token slots of the whole blocks holding the prompt's latents."""
        return -(-num_tokens // block_size) * block_size

    def request_bytes(self, dt: ElementType, tp: int = 1) -> int:
        return 0


class _PerRequestState:
    """What a per-request state group (a fixed slot whatever the length) says of tokens: it
    holds none, so 0 bytes per token and no token blocks; its bytes are `request_bytes`."""

    def token_bytes(self, dt: ElementType, tp: int = 1) -> int:
        return 0

    def tokens_held(self, num_tokens: int) -> int:
        return 0

    def block_tokens_held(self, num_tokens: int, block_size: int) -> int:
        return 0


@dataclass(frozen=True)
class LinearState(_PerRequestState):
    """Conv + recurrent state of linear-attention layers (Gated DeltaNet, KDA): a fixed size per
    request, independent of the prompt length.

    Attributes:
        conv_elems / recurrent_elems: elements per layer for the whole model (all heads).
        shard_heads: heads the state splits over under TP (at most this many ranks share it).
        variant: "gated_delta_net" or "kda" (for the printed formula).
        detail: the shape arithmetic, printed beside the number.
    """

    num_layers: int
    conv_elems: int
    recurrent_elems: int
    shard_heads: int
    variant: str
    detail: str
    kind: str = "linear_state"
    entry_tokens = 1

    def request_bytes(self, dt: ElementType, tp: int = 1) -> int:
        """Bytes per request on one rank: layers · (conv + recurrent) · elem / min(tp, heads)."""
        total = self.num_layers * (self.conv_elems + self.recurrent_elems) * dt.bytes
        return total // min(tp, self.shard_heads)

    def formula(self, dt: ElementType, tp: int = 1) -> str:
        div = min(tp, self.shard_heads)
        shard = "" if div == 1 else f" / {div} (tp)"
        return f"{self.num_layers} layers·({self.detail})·{dt.bytes} B{shard}, per request"


def _replicated_vector_bytes(num_layers: int, width: int, dt: ElementType, tp: int) -> int:
    """Bytes of one vector per layer that every TP rank keeps whole (DeepSeek-V4's single KV
    head: window vectors, compressed entries, indexer keys): layers · (width · elem + scale).

    Raises:
        ValueError: tp < 1.
    """
    heads_per_rank(1, tp)
    return num_layers * (width * dt.bytes + dt.scale_bytes)


def _replicated_vector_formula(num_layers: int, width: int, dt: ElementType) -> str:
    scale = f" + {dt.scale_bytes} B scale" if dt.scale_bytes else ""
    return f"{num_layers} layers·({width}·{dt.bytes} B{scale})"


def _replicated_note(tp: int) -> str:
    return "" if tp == 1 else f" (replicated on each of tp={tp} ranks)"


@dataclass(frozen=True)
class SharedKVWindow(SlidingWindow):
    """DeepSeek-V4's sliding-window branch, present in every layer: shared-KV MQA (K = V, one KV
    head), so ONE head_dim vector per token and layer, for the last `window` tokens
    (transformers' DeepseekV4HCACache.update keeps `keys` and `values` as one tensor). HF keeps
    window − 1 tokens between steps (the next token makes `window`); a slot of `window` is
    counted. Replicated on every TP rank. Build it with num_kv_heads=1.

    Raises:
        ValueError: num_kv_heads != 1.
    """

    kind: str = "v4_window_kv"

    def __post_init__(self) -> None:
        if self.num_kv_heads != 1:
            raise ValueError(f"DeepSeek-V4 has one shared KV head, got {self.num_kv_heads}")

    def token_bytes(self, dt: ElementType, tp: int = 1) -> int:
        """Bytes per token on one rank: layers · (head_dim · elem + scale), any tp."""
        return _replicated_vector_bytes(self.num_layers, self.head_dim, dt, tp)

    def formula(self, dt: ElementType, tp: int = 1) -> str:
        return (f"{_replicated_vector_formula(self.num_layers, self.head_dim, dt)}, K = V: one "
                f"vector, at most the last {self.window} tokens{_replicated_note(tp)}")


@dataclass(frozen=True)
class CompressedKV:
    """DeepSeek-V4 compressed KV of the CSA or HCA layers: one head_dim entry per `rate` tokens
    and layer (transformers' compressors close a window of `rate` tokens into one entry:
    `compressed_kv["compressor"]`, paper §2.3.1 / §2.3.2), so n tokens hold n // rate entries.
    Replicated on every TP rank.

    Attributes:
        layer_type: "compressed_sparse_attention" or "heavily_compressed_attention".
        rate: tokens per entry (compress_rates[layer_type]: m = 4 for CSA, m' = 128 for HCA).
    """

    num_layers: int
    head_dim: int
    rate: int
    layer_type: str
    kind: str = "compressed_kv"

    @property
    def entry_tokens(self) -> int:
        return self.rate

    def token_bytes(self, dt: ElementType, tp: int = 1) -> int:
        """Bytes of one entry (one per `rate` tokens) on one rank: layers · (head_dim · elem +
        scale), any tp."""
        return _replicated_vector_bytes(self.num_layers, self.head_dim, dt, tp)

    def formula(self, dt: ElementType, tp: int = 1) -> str:
        return (f"{_replicated_vector_formula(self.num_layers, self.head_dim, dt)} per entry, "
                f"one entry per {self.rate} tokens (n // {self.rate}){_replicated_note(tp)}")

    def tokens_held(self, num_tokens: int) -> int:
        """Entries held for `num_tokens` tokens: the closed windows, num_tokens // rate."""
        return num_tokens // self.rate

    def block_tokens_held(self, num_tokens: int, block_size: int) -> int:
        """Entry slots of the whole blocks holding the prompt's entries, as pdkv pages them
        (pdkv.cache.specs.CompressedKVSpec): a block covers `block_size` tokens and holds the
        entries of the windows ending in it, max(1, block_size // rate) slots."""
        return -(-num_tokens // block_size) * max(1, block_size // self.rate)

    def request_bytes(self, dt: ElementType, tp: int = 1) -> int:
        return 0


@dataclass(frozen=True)
class IndexerKeys(CompressedKV):
    """The Lightning Indexer's compressed keys of the CSA layers: one index_head_dim entry per
    `rate` tokens and layer (transformers' `compressed_kv["indexer"]`, paper §2.3.1 eqs. 13–17),
    in the KV dtype. Replicated on every TP rank."""

    kind: str = "indexer_keys"


def compressor_state_elems(rate: int, head_dim: int, overlap: bool) -> int:
    """float32 values of one compressor's state slot (one layer, one request): the pending
    tokens of the open window, kv and gate each `rate` × width (width 2·head_dim with the CSA
    overlap, else head_dim; at most rate − 1 rows are held), then with `overlap` the last closed
    window's first halves, kv and gate each rate × head_dim. pdkv's V4 decoder lays its state
    slots out so (pdkv/model/v4_attention.py)."""
    width = 2 * head_dim if overlap else head_dim
    return 2 * rate * width + (2 * rate * head_dim if overlap else 0)


@dataclass(frozen=True)
class CompressorState(_PerRequestState):
    """DeepSeek-V4 compressor (or indexer) state of one layer type: a fixed-size slot per
    request and layer, independent of the prompt length, like the linear state.

    Per layer, in float32 elements (transformers' DeepseekV4HCACache / DeepseekV4CSACache):
    - pending tokens of the open window (`buffer_kv` / `buffer_gate`): at most rate − 1 tokens;
      the slot holds `rate` (an upper bound), each token with a kv_proj and a gate_proj output
      of `width` = 2·head_dim (CSA and its indexer: the Ca and Cb series) or head_dim (HCA):
      rate · 2 · width;
    - with `overlap` (CSA and its indexer), the last closed window's Ca halves
      (`overlap_kv` / `overlap_gate`): rate · head_dim for kv and the same for gate:
      2 · rate · head_dim.
    Sized in float32 (4 B) whatever the KV dtype: the compressor/indexer projections are in
    `_keep_in_fp32_modules` and `position_bias` is fp32 (note: HF's non-strict fp32 list only
    upcasts under fp16, so a bf16 HF model buffers some of these in bf16; fp32 is the upper
    bound). Replicated on every TP rank.

    Attributes:
        head_dim: width of one compressed entry (head_dim, or index_head_dim for the indexer).
        rate: tokens per window.
        overlap: CSA's overlapping windows (two series, Ca carried over); False for HCA.
        what: "CSA compressor", "CSA indexer" or "HCA compressor" (printed).
    """

    num_layers: int
    head_dim: int
    rate: int
    overlap: bool
    what: str
    kind: str = "compressor_state"
    elem_bytes: int = 4
    entry_tokens = 1

    def layer_elems(self) -> int:
        """float32 elements per layer: pending rate·2·width (+ overlap 2·rate·head_dim)."""
        return compressor_state_elems(self.rate, self.head_dim, self.overlap)

    def request_bytes(self, dt: ElementType, tp: int = 1) -> int:
        """Bytes per request on one rank: layers · layer_elems · 4 B (fp32; `dt` not used),
        any tp."""
        heads_per_rank(1, tp)
        return self.num_layers * self.layer_elems() * self.elem_bytes

    def formula(self, dt: ElementType, tp: int = 1) -> str:
        d, m = self.head_dim, self.rate
        parts = (f"pending {m}·2·(2·{d}) + overlap 2·{m}·{d}" if self.overlap
                 else f"pending {m}·2·{d}")
        rep = "" if tp == 1 else f" (replicated on each of tp={tp} ranks)"
        return (f"{self.num_layers} layers·({parts})·{self.elem_bytes} B (fp32), per request: "
                f"a slot of {m} pending tokens (at most {m - 1} held){rep}")


StateGroup = FullAttention | MLA | LinearState | CompressedKV | CompressorState


def per_token_bytes(g: StateGroup, dt: ElementType, tp: int = 1) -> int | float:
    """Bytes one prompt token adds to group `g` on one rank: token_bytes / entry_tokens (an int
    when exact; a compressed group's entry is shared by `entry_tokens` tokens)."""
    b = g.token_bytes(dt, tp)
    return b // g.entry_tokens if b % g.entry_tokens == 0 else b / g.entry_tokens
