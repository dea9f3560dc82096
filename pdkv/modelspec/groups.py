"""State groups of a model and their size: bytes per token (attention KV) or per request
(linear-attention state), for one rank given the TP size (torch-free).

Sharding rules (vLLM's, ../shared/reference/ANCHORS.md §3):
- GQA/MHA: KV heads are split over TP ranks; when tp > kv_heads each rank keeps one head
  (a head is replicated tp / kv_heads times).
- MLA: one latent vector per token and layer, shared by all heads, so every TP rank keeps
  the whole latent (replicated tp times); DCP is what divides it (by tokens).
- Linear state: split over TP by heads, one slot per request, never by tokens.
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


@dataclass(frozen=True)
class LinearState:
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

    def token_bytes(self, dt: ElementType, tp: int = 1) -> int:
        return 0

    def tokens_held(self, num_tokens: int) -> int:
        return 0

    def block_tokens_held(self, num_tokens: int, block_size: int) -> int:
        return 0

    def request_bytes(self, dt: ElementType, tp: int = 1) -> int:
        """Bytes per request on one rank: layers · (conv + recurrent) · elem / min(tp, heads)."""
        total = self.num_layers * (self.conv_elems + self.recurrent_elems) * dt.bytes
        return total // min(tp, self.shard_heads)

    def formula(self, dt: ElementType, tp: int = 1) -> str:
        div = min(tp, self.shard_heads)
        shard = "" if div == 1 else f" / {div} (tp)"
        return f"{self.num_layers} layers·({self.detail})·{dt.bytes} B{shard}, per request"


StateGroup = FullAttention | MLA | LinearState
