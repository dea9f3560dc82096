"""A model's state groups read from an HF config.json dict (torch-free).

Recognised layouts: dense GQA/MHA (Llama, Qwen2, SmolLM2, GLM-4.5), sliding window (Mistral,
`layer_types` with "sliding_attention", Gemma's `sliding_window_pattern`), MLA (`kv_lora_rank`,
DeepSeek-V3), and hybrid linear attention: Qwen3-Next (`layer_types` / `full_attention_interval`
+ `linear_*` Gated DeltaNet dims) and Kimi-Linear (`linear_attn_config` with 1-based
`kda_layers` / `full_attn_layers`, MLA on the full layers).

Linear-state shapes follow vLLM's mamba state-shape helpers: Gated DeltaNet conv state
(conv_kernel − 1) × (2·k_heads·k_dim + v_heads·v_dim), recurrent v_heads × k_dim × v_dim; KDA conv
state for q, k and v: 3 × heads·head_dim × (kernel − 1), recurrent heads × head_dim × head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdkv.modelspec.groups import MLA, FullAttention, LinearState, SlidingWindow, StateGroup

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"


@dataclass(frozen=True)
class ModelSpec:
    """What the cost model needs to know about a model.

    Attributes:
        name: where it came from (alias, fixture or path).
        num_layers: decoder layers (the unit of layer-wise publishing).
        hidden_size: residual width (activation traffic).
        dtype: the config's weight dtype name ("bfloat16", "float32"...), default for KV/state.
        groups: one entry per state kind present.
        experts_per_token: MoE top-k (1 for dense), for the attention-FFN estimate.
    """

    name: str
    num_layers: int
    hidden_size: int
    dtype: str
    groups: tuple[StateGroup, ...]
    experts_per_token: int = 1

    @property
    def num_kv_heads(self) -> int:
        """Smallest KV head count of the attention groups (1 for MLA); 0 without attention."""
        heads = [1 if isinstance(g, MLA) else g.num_kv_heads for g in self.groups
                 if not isinstance(g, LinearState)]
        return min(heads) if heads else 0


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    inner = cfg.get("text_config")
    return {**cfg, **inner} if isinstance(inner, dict) else cfg


def _layer_types(c: dict[str, Any], n: int) -> list[str]:
    lac = c.get("linear_attn_config")
    if isinstance(lac, dict) and lac.get("kda_layers") is not None:
        full = {int(i) - 1 for i in lac.get("full_attn_layers") or []}
        return [FULL if i in full else LINEAR for i in range(n)]
    types = c.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        out = []
        for t in types:
            if t in ("linear_attention", "mamba", "linear"):
                out.append(LINEAR)
            elif t in ("sliding_attention", "sliding_window", "local"):
                out.append(SLIDING)
            else:
                out.append(FULL)
        return out
    if c.get("full_attention_interval") and c.get("linear_num_value_heads"):
        k = int(c["full_attention_interval"])
        return [FULL if (i + 1) % k == 0 else LINEAR for i in range(n)]
    window = c.get("sliding_window")
    pattern = c.get("sliding_window_pattern")
    if window and pattern:
        return [FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(n)]
    if (
        window
        and c.get("use_sliding_window", True)
        and window < c.get("max_position_embeddings", 1 << 62)
    ):
        return [SLIDING] * n
    return [FULL] * n


def _require(c: dict[str, Any], key: str) -> int:
    if c.get(key) is None:
        raise ValueError(f"config.json has no {key!r}")
    return int(c[key])


def _linear_group(c: dict[str, Any], layers: int) -> LinearState:
    lac = c.get("linear_attn_config")
    if isinstance(lac, dict):  # Kimi Delta Attention
        h, d = int(lac["num_heads"]), int(lac["head_dim"])
        k = int(lac.get("short_conv_kernel_size", 4))
        return LinearState(
            layers, conv_elems=3 * h * d * (k - 1), recurrent_elems=h * d * d, shard_heads=h,
            variant="kda",
            detail=f"conv 3·{h}·{d}·({k}−1) + recurrent {h}·{d}·{d}")
    nk, nv = _require(c, "linear_num_key_heads"), _require(c, "linear_num_value_heads")
    dk, dv = _require(c, "linear_key_head_dim"), _require(c, "linear_value_head_dim")
    k = int(c.get("linear_conv_kernel_dim", 4))
    return LinearState(
        layers, conv_elems=(2 * nk * dk + nv * dv) * (k - 1), recurrent_elems=nv * dk * dv,
        shard_heads=nk, variant="gated_delta_net",
        detail=f"conv (2·{nk}·{dk}+{nv}·{dv})·({k}−1) + recurrent {nv}·{dk}·{dv}")


def spec_from_hf_config(cfg: dict[str, Any], name: str = "model") -> ModelSpec:
    """Build a ModelSpec from a parsed HF config.json (nested `text_config` is honoured).

    Raises:
        ValueError: a field the detected layout needs is missing.
    """
    c = _text_config(cfg)
    n = _require(c, "num_hidden_layers")
    hidden = _require(c, "hidden_size")
    types = _layer_types(c, n)
    groups: list[StateGroup] = []
    n_full, n_slide, n_lin = types.count(FULL), types.count(SLIDING), types.count(LINEAR)
    heads = _require(c, "num_attention_heads")
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    if n_full:
        if c.get("kv_lora_rank"):
            groups.append(MLA(n_full, int(c["kv_lora_rank"]), _require(c, "qk_rope_head_dim")))
        else:
            groups.append(FullAttention(n_full, kv_heads, head_dim))
    if n_slide:
        groups.append(
            SlidingWindow(n_slide, kv_heads, head_dim, window=_require(c, "sliding_window"))
        )
    if n_lin:
        groups.append(_linear_group(c, n_lin))
    dtype = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
    topk = int(c.get("num_experts_per_tok") or c.get("num_experts_per_token") or 1)
    return ModelSpec(name, n, hidden, dtype, tuple(groups), topk)
