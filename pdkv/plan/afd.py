"""Paper estimate of attention–FFN disaggregation traffic (bytes).

Each layer sends the attention output (hidden_size values per token) to the FFN side and gets the
FFN output back: per layer per direction hidden_size · tokens · act_bytes, so 2 · hidden_size ·
tokens · act_bytes per layer both ways. With MoE and experts on different FFN nodes a token is
dispatched to top-k of them: up to top_k times that (upper bound; shared experts and local
experts cut it). Not a feature of pdkv: a size estimate only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ActivationTraffic:
    """Bytes per layer per direction, per layer both ways, and for the whole model both ways."""

    per_layer_direction: int
    per_layer_both: int
    model_both: int
    moe_dispatch_upper: int


def activation_traffic(hidden_size: int, tokens: int, num_layers: int, act_bytes: int = 2,
                       top_k: int = 1) -> ActivationTraffic:
    """Activation bytes attention↔FFN for `tokens` tokens (formula in the module docstring)."""
    one = hidden_size * tokens * act_bytes
    return ActivationTraffic(one, 2 * one, 2 * one * num_layers, one * max(1, top_k))
