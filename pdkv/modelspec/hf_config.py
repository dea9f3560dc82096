"""A model's state groups read from an HF config.json dict (torch-free).

Recognised layouts: dense GQA/MHA (Llama, Qwen2, SmolLM2, GLM-4.5), sliding window (Mistral,
`layer_types` with "sliding_attention", Gemma's `sliding_window_pattern`), MLA (`kv_lora_rank`,
DeepSeek-V3), and hybrid linear attention: Qwen3-Next (`layer_types` / `full_attention_interval`
+ `linear_*` Gated DeltaNet dims) and Kimi-Linear (`linear_attn_config` with 1-based
`kda_layers` / `full_attn_layers`, MLA on the full layers), and DeepSeek-V4 (`model_type`
"deepseek_v4": a K = V sliding window in every layer, compressed KV on the CSA / HCA layers, the
CSA indexer's keys and the compressors' fixed per-request state; `deepseek_v4_groups`).

Linear-state shapes follow vLLM's mamba state-shape helpers: Gated DeltaNet conv state
(conv_kernel − 1) × (2·k_heads·k_dim + v_heads·v_dim), recurrent v_heads × k_dim × v_dim; KDA conv
state for q, k and v: 3 × heads·head_dim × (kernel − 1), recurrent heads × head_dim × head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdkv.modelspec.groups import (
    MLA,
    CompressedKV,
    CompressorState,
    FullAttention,
    IndexerKeys,
    LinearState,
    SharedKVWindow,
    SlidingWindow,
    StateGroup,
)

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
#: transformers' DeepseekV4Config defaults (default_compress_rates, sliding_window, index_head_dim).
V4_COMPRESS_RATES = {CSA: 4, HCA: 128}
V4_SLIDING_WINDOW = 128
V4_INDEX_HEAD_DIM = 128


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
        """Smallest KV head count of the attention groups (1 for MLA and DeepSeek-V4's
        compressed KV); 0 without attention."""
        heads = [g.num_kv_heads if isinstance(g, FullAttention) else 1 for g in self.groups
                 if isinstance(g, (FullAttention, MLA, CompressedKV))]
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


def is_deepseek_v4(c: dict[str, Any]) -> bool:
    """True for a DeepSeek-V4 config (model_type deepseek_v4 or DeepseekV4ForCausalLM)."""
    return c.get("model_type") == "deepseek_v4" or "DeepseekV4ForCausalLM" in (
        c.get("architectures") or [])


def v4_compress_rates(c: dict[str, Any]) -> dict[str, int]:
    """compress_rates with transformers' defaults ({CSA: 4, HCA: 128}) and its legacy scalar
    keys compress_rate_csa / compress_rate_hca folded in (DeepseekV4Config.__post_init__).

    Raises:
        ValueError: a rate < 1.
    """
    rates = {**V4_COMPRESS_RATES, **{k: int(v) for k, v in (c.get("compress_rates") or {}).items()}}
    for key, t in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if c.get(key) is not None:
            rates[t] = int(c[key])
    for t in (CSA, HCA):
        if rates[t] < 1:
            raise ValueError(f"compress_rates[{t!r}] must be >= 1, got {rates[t]}")
    return rates


def v4_layer_types(c: dict[str, Any], n: int) -> list[str]:
    """DeepSeek-V4 per-layer attention types as DeepseekV4Config.__post_init__ derives them:
    explicit `layer_types` > legacy per-layer `compress_ratios` (0 sliding, the CSA rate CSA,
    the HCA rate HCA; 0/4/128 by default) > 2 × HCA then HCA / CSA alternating (CSA at odd
    interleave index i, i.e. layers 3, 5, 7, ...); truncated to n layers.

    Raises:
        ValueError: fewer than n types, an unknown type, or a ratio matching no rate.
    """
    types = c.get("layer_types")
    if types is None and c.get("compress_ratios") is not None:
        rates = v4_compress_rates(c)
        by_ratio = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
        bad = [r for r in c["compress_ratios"] if int(r) not in by_ratio]
        if bad:
            raise ValueError(f"compress_ratios {bad}: expected 0 or one of compress_rates "
                             f"{rates[CSA]} (CSA), {rates[HCA]} (HCA)")
        types = [by_ratio[int(r)] for r in c["compress_ratios"]]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = list(types)[:n]
    if len(types) != n:
        raise ValueError(f"layer_types names {len(types)} layers, num_hidden_layers is {n}")
    bad = sorted({t for t in types if t not in (SLIDING, CSA, HCA)})
    if bad:
        raise ValueError(f"DeepSeek-V4 layer_types {bad}: expected {SLIDING!r}, {CSA!r} or {HCA!r}")
    return types


def deepseek_v4_groups(c: dict[str, Any], n: int) -> tuple[StateGroup, ...]:
    """DeepSeek-V4's state groups (transformers' DeepseekV4HCACache / DeepseekV4CSACache):
    the K = V window in all n layers; per CSA layer compressed KV (head_dim per m tokens), the
    indexer's keys (index_head_dim per m tokens) and both compressors' fixed state (with
    overlap); per HCA layer compressed KV (head_dim per m' tokens) and its compressor's state
    (no overlap, no indexer); sliding_attention layers only the window. Groups of a layer type
    the config lacks are left out.

    Raises:
        ValueError: head_dim missing, or bad layer types / rates (v4_layer_types).
    """
    types = v4_layer_types(c, n)
    rates = v4_compress_rates(c)
    d = _require(c, "head_dim")
    di = int(c.get("index_head_dim") or V4_INDEX_HEAD_DIM)
    window = int(c.get("sliding_window") or V4_SLIDING_WINDOW)
    n_csa, n_hca = types.count(CSA), types.count(HCA)
    m, mh = rates[CSA], rates[HCA]
    groups: list[StateGroup] = [SharedKVWindow(n, 1, d, window=window)]
    if n_csa:
        groups += [
            CompressedKV(n_csa, d, m, CSA, kind="csa_compressed_kv"),
            IndexerKeys(n_csa, di, m, CSA, kind="csa_indexer_keys"),
        ]
    if n_hca:
        groups.append(CompressedKV(n_hca, d, mh, HCA, kind="hca_compressed_kv"))
    if n_csa:
        groups += [
            CompressorState(n_csa, d, m, True, "CSA compressor", kind="csa_compressor_state"),
            CompressorState(n_csa, di, m, True, "CSA indexer", kind="csa_indexer_state"),
        ]
    if n_hca:
        groups.append(
            CompressorState(n_hca, d, mh, False, "HCA compressor", kind="hca_compressor_state"))
    return tuple(groups)


def spec_from_hf_config(cfg: dict[str, Any], name: str = "model") -> ModelSpec:
    """Build a ModelSpec from a parsed HF config.json (nested `text_config` is honoured).

    Raises:
        ValueError: a field the detected layout needs is missing.
    """
    c = _text_config(cfg)
    n = _require(c, "num_hidden_layers")
    hidden = _require(c, "hidden_size")
    dtype = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
    topk = int(c.get("num_experts_per_tok") or c.get("num_experts_per_token") or 1)
    if is_deepseek_v4(c):
        return ModelSpec(name, n, hidden, dtype, deepseek_v4_groups(c, n), topk)
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
    return ModelSpec(name, n, hidden, dtype, tuple(groups), topk)
