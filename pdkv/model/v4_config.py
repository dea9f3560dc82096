"""The DeepSeek-V4 fields of an HF config.json (`DeepseekV4ForCausalLM`, transformers'
`deepseek_v4`), as pdkv's V4 decoder (pdkv/model/deepseek_v4.py) reads them.

Defaults and derivations follow transformers' `DeepseekV4Config.__post_init__`
(configuration_deepseek_v4.py): `layer_types` default to two HCA layers then CSA (odd index) /
HCA alternating; legacy `compress_ratios` (per-layer 0 / 4 / 128) map to those types;
`compress_rates` default to {CSA: 4, HCA: 128}; `mlp_layer_types` default to three `hash_moe`
layers then `moe`; the rotary width is head_dim × partial_rotary_factor (default 64 / 512).

Not built (refused by `v4_fields`): yarn or any rope other than the default on either rope type,
attention / MLP biases, a router scoring function other than sqrtsoftplus / sigmoid / softmax;
(by `check_v4_engine`) TP / DCP / PCP and a quantized KV cache.
The multi-token-prediction layers of a checkpoint (`mtp.*`) are not read (HF drops them too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdkv.modelspec.groups import compressor_state_elems

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
V4_LAYER_TYPES = (SLIDING, CSA, HCA)
V4_MLP_TYPES = ("hash_moe", "moe")
V4_SCORING = ("sqrtsoftplus", "sigmoid", "softmax")
_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class DeepseekV4Fields:
    """What a DeepSeek-V4 layer needs beyond the Llama fields (widths in elements, rates and
    windows in tokens).

    `attn_types[i]` is one of V4_LAYER_TYPES; `compress_rate(i)` is 0 for a sliding-only layer,
    else the tokens per compressed entry of that layer's type. Every layer also attends over a
    sliding window of LlamaArchConfig.sliding_window tokens (shared-KV MQA: one KV head whose
    vector is both key and value).
    """

    attn_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rotary_dim: int
    compress_rope_theta: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float

    def compress_rate(self, layer: int) -> int:
        """Tokens per compressed entry of `layer` (0: sliding window only)."""
        t = self.attn_types[layer]
        return self.csa_rate if t == CSA else self.hca_rate if t == HCA else 0


def _layer_types(cfg: dict[str, Any], n: int, path: str) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        types = [_RATIO_TYPES.get(int(r), f"compress ratio {r}") for r in cfg["compress_ratios"]]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = list(types)[:n]
    if len(types) != n or any(t not in V4_LAYER_TYPES for t in types):
        raise ValueError(f"{path}: layer_types {types} must name {n} layers, each one of "
                         f"{V4_LAYER_TYPES}")
    return tuple(types)


def _rope(cfg: dict[str, Any], path: str) -> None:
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    parts = [rp[k] for k in ("main", "compress") if isinstance(rp.get(k), dict)] or [rp]
    for part in parts:
        kind = part.get("rope_type", part.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{path}: rope {part} is not supported for DeepSeek-V4 yet (default "
                             "rope only; V4-Flash's yarn on the compressed layers is not built)")


def v4_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """LlamaArchConfig fields of a DeepSeek-V4 config.json: one KV head of head_dim (shared-KV
    MQA), every layer a sliding-window layer of `sliding_window` tokens to the KV cache (the
    compressed entries and compressor state are the decoder's), intermediate_size = the experts'
    width, and `v4` (DeepseekV4Fields).

    Raises:
        ValueError: an unknown layer or MLP type, rope other than default, attention or MLP
            biases, an unknown scoring function (each message names the value).
    """
    n = int(cfg["num_hidden_layers"])
    types = _layer_types(cfg, n, path)
    mlp = cfg.get("mlp_layer_types")
    if mlp is None:
        n_hash = int(cfg.get("num_hash_layers", 3))
        mlp = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    mlp = list(mlp)[:n]
    if len(mlp) != n or any(t not in V4_MLP_TYPES for t in mlp):
        raise ValueError(f"{path}: mlp_layer_types {mlp} must name {n} layers, each one of "
                         f"{V4_MLP_TYPES}")
    _rope(cfg, path)
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError(f"{path}: attention / MLP biases are not supported for DeepSeek-V4")
    scoring = str(cfg.get("scoring_func", "sqrtsoftplus"))
    if scoring not in V4_SCORING:
        raise ValueError(f"{path}: scoring_func {scoring!r} is not one of {V4_SCORING}")
    rates = dict(cfg.get("compress_rates") or {})
    head_dim = int(cfg.get("head_dim", 512))
    factor = cfg.get("partial_rotary_factor")
    if factor is None:
        rope_dim = cfg.get("qk_rope_head_dim")
        factor = rope_dim / head_dim if rope_dim else 64 / 512
    window = int(cfg.get("sliding_window", 128))
    v4 = DeepseekV4Fields(
        attn_types=types,
        mlp_types=tuple(mlp),
        csa_rate=int(rates.get(CSA, cfg.get("compress_rate_csa", 4))),
        hca_rate=int(rates.get(HCA, cfg.get("compress_rate_hca", 128))),
        q_lora_rank=int(cfg.get("q_lora_rank", 1024)),
        o_groups=int(cfg.get("o_groups", 8)),
        o_lora_rank=int(cfg.get("o_lora_rank", 1024)),
        rotary_dim=int(head_dim * float(factor)),
        compress_rope_theta=float(cfg.get("compress_rope_theta", 160000.0)),
        index_n_heads=int(cfg.get("index_n_heads", 64)),
        index_head_dim=int(cfg.get("index_head_dim", 128)),
        index_topk=int(cfg.get("index_topk", 512)),
        hc_mult=int(cfg.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(cfg.get("hc_eps", 1e-6)),
        n_routed_experts=int(cfg.get("n_routed_experts", 256)),
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 6)),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 2048)),
        scoring_func=scoring,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
    )
    return dict(
        num_kv_heads=1,
        head_dim=head_dim,
        intermediate_size=v4.moe_intermediate_size,
        layer_types=(SLIDING,) * n,
        sliding_window=window,
        rotary_dim=v4.rotary_dim,
        q_lora_rank=v4.q_lora_rank,
        qkv_bias=False,
        v4=v4,
    )


def check_v4_engine(architecture: str, *, tp: int, dcp: int, pcp: int,
                    kv_cache_dtype: str) -> None:
    """Refuse what a DeepSeek-V4 engine does not have yet (the support matrix lists it).

    Raises:
        ValueError: tp / dcp / pcp above 1 (re-sharding the indexer, TP of the MoE and DCP over
            compressed KV are not built) or a quantized KV cache. (P/D and the KV pool move every
            V4 group; CPU offload and MultiConnector refuse state-slot groups in the connector
            factory.)
    """
    if max(tp, dcp, pcp) > 1:
        raise ValueError(
            f"{architecture}: tensor_parallel_size={tp}, decode_context_parallel_size={dcp}, "
            f"prefill_context_parallel_size={pcp}: DeepSeek-V4 runs on one rank only (TP of the "
            "MoE, re-sharding the indexer and DCP over compressed KV are not built)")
    if kv_cache_dtype != "auto":
        raise ValueError(f"{architecture}: kv_cache_dtype={kv_cache_dtype!r} is not supported "
                         "for DeepSeek-V4 yet: use kv_cache_dtype=auto")


@dataclass(frozen=True)
class V4CacheLayers:
    """Which KV cache "layers" a DeepSeek-V4 model's state occupies. As vLLM registers a
    compressor's and an indexer's cache under their own layer names, each cache of a model layer
    gets its own index: the sliding-window KV of layer i is cache layer i; the others follow, in
    this order, from num_layers on: the compressed KV of every CSA layer, of every HCA layer,
    the indexer keys of every CSA layer, the compressor state of every CSA and HCA layer (model
    layer order). Each kind is one KV cache group (pdkv.worker.kv_cache).

    Attributes:
        csa, hca: model layer indices of the CSA / HCA layers.
        compressed, indexer, state: model layer -> its cache layer (CSA and HCA compressed KV;
            CSA indexer keys; compressor state of both kinds).
    """

    csa: tuple[int, ...]
    hca: tuple[int, ...]
    compressed: dict[int, int]
    indexer: dict[int, int]
    state: dict[int, int]

    @staticmethod
    def of(v4: DeepseekV4Fields) -> V4CacheLayers:
        """The layout of `v4`'s layers."""
        n = len(v4.attn_types)
        csa = tuple(i for i, t in enumerate(v4.attn_types) if t == CSA)
        hca = tuple(i for i, t in enumerate(v4.attn_types) if t == HCA)
        nxt = iter(range(n, 5 * n))
        compressed = {i: next(nxt) for i in (*csa, *hca)}
        indexer = {i: next(nxt) for i in csa}
        state = {i: next(nxt) for i in sorted((*csa, *hca))}
        return V4CacheLayers(csa, hca, compressed, indexer, state)


def layer_state_floats(v4: DeepseekV4Fields, head_dim: int, layer: int) -> int:
    """Float32 values of model layer `layer`'s compressor state: its attention compressor and,
    on a CSA layer, the indexer's; 0 on a sliding-only layer."""
    t = v4.attn_types[layer]
    if t == CSA:
        return (compressor_state_elems(v4.csa_rate, head_dim, True)
                + compressor_state_elems(v4.csa_rate, v4.index_head_dim, True))
    if t == HCA:
        return compressor_state_elems(v4.hca_rate, head_dim, False)
    return 0
