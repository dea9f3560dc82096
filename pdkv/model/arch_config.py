"""The parts of an HF config.json the Llama-architecture decoder uses, sliding windows included.

Sliding-window layers, per family (HF semantics: the query at position p sees keys k with
p - sliding_window < k <= p, transformers' `sliding_window_overlay`):
- Mistral (`MistralForCausalLM`): `sliding_window` (when not null) on every layer.
- Qwen2 (`Qwen2ForCausalLM`): only with `use_sliding_window` true (default false; Qwen2Config then
  sets sliding_window to None), on the layers `layer_types` marks "sliding_attention", or, without
  `layer_types`, on layers i >= `max_window_layers` (default 28), as Qwen2Config.__post_init__.
- Llama: never.
Gemma-2/3 (interleaved local/global) and gpt-oss (alternating banded/full) use the same per-layer
form; their architectures are not implemented here.

Multi-head latent attention (`DeepseekV3ForCausalLM`, decoder in pdkv/model/deepseek.py): every
layer is MLA with a dense MLP (a q LoRA rank is supported; MoE layers, yarn rope and attention
biases are refused). The KV cache stores one latent + rope'd key vector per token, so
`num_kv_heads` is 1 (the vector is replicated across TP ranks, as vLLM) and `head_dim` is its
width, kv_lora_rank + qk_rope_head_dim.

Gated DeltaNet linear attention (`Qwen3NextForCausalLM`, decoder in pdkv/model/qwen3_next.py):
`layer_types` "linear_attention" / "full_attention" (or every `full_attention_interval`-th layer
full), the `linear_*` widths and partial rope on the full layers; dense MLPs only (MoE refused).
Linear layers form one linear-state KV cache group after the attention groups.

Kimi-Linear (`KimiLinearForCausalLM`, decoder in pdkv/model/kimi_linear.py): Kimi Delta
Attention layers ("linear_attention") and MLA layers ("full_attention", no rope) from
`layer_types` (or the checkpoint's 1-based `linear_attn_config` kda_layers / full_attn_layers);
the MLA fields as DeepSeek-V3's, the KDA heads as linear_num_key_heads = linear_num_value_heads
(q, k and v alike) of one width; dense MLPs only (`mlp_layer_types` all "dense"). Two state
kinds: an MLA group and the linear-state group.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from pdkv.model.v4_config import DeepseekV4Fields, v4_fields
from pdkv.modelspec.hf_config import spec_from_hf_config

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "DeepseekV3ForCausalLM",
    "Qwen3NextForCausalLM",
    "KimiLinearForCausalLM",
    "DeepseekV4ForCausalLM",
)
V4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)
KIMI_ARCHITECTURES = ("KimiLinearForCausalLM",)
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
LINEAR_ARCHITECTURES = ("Qwen3NextForCausalLM",)
FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"


@dataclass(frozen=True)
class LlamaArchConfig:
    """The parts of an HF config.json this model uses.

    `layer_types[i]` is "full_attention" or "sliding_attention"; sliding layers attend over the
    last `sliding_window` tokens (None when no layer slides).

    Raises (from `from_hf_folder`):
        ValueError: unsupported architecture, rope scaling or state kind (MLA, linear state).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    bos_token_id: int | None
    eos_token_id: int | None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # MLA (DeepseekV3ForCausalLM): widths in elements; kv_lora_rank 0 = not MLA.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # Gated DeltaNet (Qwen3NextForCausalLM, decoder in pdkv/model/qwen3_next.py): linear heads
    # and widths in elements, conv kernel in tokens; layer_types marks "linear_attention".
    # rotary_dim: dims of each full-attention head that rope rotates (0 = all of head_dim).
    linear_num_key_heads: int = 0
    linear_key_head_dim: int = 0
    linear_num_value_heads: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    rotary_dim: int = 0
    # DeepSeek-V4 (decoder in pdkv/model/deepseek_v4.py): compressed attention, mHC, MoE.
    v4: DeepseekV4Fields | None = None

    @property
    def has_linear_state(self) -> bool:
        """True for a hybrid model with linear-attention (recurrent state) layers."""
        return LINEAR in self.layer_types

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the linear-attention layers (their state is one group, one slot per
        request)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the causal conv (q, k and v): 2 * key heads * dk + value heads * dv."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def is_mla(self) -> bool:
        """True for a multi-head latent attention model (every attention layer MLA; Kimi-Linear
        also has linear-attention layers)."""
        return self.kv_lora_rank > 0

    def layer_window(self, layer: int) -> int | None:
        """Sliding window (tokens) of `layer`, None for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    @staticmethod
    def from_hf_folder(path: str) -> LlamaArchConfig:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        arch = (cfg.get("architectures") or ["?"])[0]
        hybrid = [] if arch in V4_ARCHITECTURES else hybrid_state_kinds(cfg)
        allowed = (("sliding_window", "mla") if arch in MLA_ARCHITECTURES else
                   ("linear_state",) if arch in LINEAR_ARCHITECTURES else
                   ("mla", "linear_state") if arch in KIMI_ARCHITECTURES else ("sliding_window",))
        if any(kind not in allowed for kind in hybrid):
            raise ValueError(
                f"{arch} in {path} keeps {' + '.join(hybrid)} state: hybrid state groups (linear "
                "attention, MLA outside DeepseekV3ForCausalLM) are not supported yet (issue 11); "
                f"supported: full-attention, sliding-window and MLA {SUPPORTED_ARCHITECTURES}"
            )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} in {path}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        mla = mla_fields(cfg, path) if arch in MLA_ARCHITECTURES else {}
        if arch in LINEAR_ARCHITECTURES:
            mla = linear_fields(cfg, path)
        if arch in KIMI_ARCHITECTURES:
            mla = kimi_fields(cfg, path)
        if arch in V4_ARCHITECTURES:
            mla = v4_fields(cfg, path)
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) != "default":
            raise ValueError(f"rope_scaling {rope_scaling} is not supported yet")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0]
        rope_params = cfg.get("rope_parameters") or {}
        window, layer_types = sliding_layers(cfg, arch)
        fields: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=(cfg["intermediate_size"] if arch not in V4_ARCHITECTURES
                               else cfg.get("moe_intermediate_size", 2048)),
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rope_theta=float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            layer_types=layer_types,
            sliding_window=window,
        )
        fields.update(mla)
        return LlamaArchConfig(**fields)


def mla_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """The MLA fields of a DeepseekV3 config.json, with num_kv_heads = 1 and head_dim =
    kv_lora_rank + qk_rope_head_dim (what one token of one layer caches).

    Raises:
        ValueError: some layer is MoE (first_k_dense_replace < num_hidden_layers with routed
            experts): only dense MLPs are implemented; rope other than default (yarn); attention
            biases.
    """
    n = int(cfg["num_hidden_layers"])
    dense = int(cfg.get("first_k_dense_replace") or 0)
    if cfg.get("n_routed_experts") and dense < n:
        raise ValueError(
            f"{path}: layers {dense}..{n - 1} are mixture-of-experts "
            f"(first_k_dense_replace={dense}, n_routed_experts={cfg['n_routed_experts']}); only "
            "dense MLPs are implemented (set first_k_dense_replace to num_hidden_layers)"
        )
    rope_params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope_params.get("rope_type", rope_params.get("type", "default")) != "default":
        raise ValueError(
            f"{path}: rope {rope_params} is not supported for MLA yet (default rope only)"
        )
    if cfg.get("attention_bias"):
        raise ValueError(f"{path}: attention_bias is not supported for MLA")
    rank, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    return dict(
        num_kv_heads=1, head_dim=rank + rope, kv_lora_rank=rank, qk_rope_head_dim=rope,
        q_lora_rank=cfg.get("q_lora_rank"), qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]), rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


def linear_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """The fields of a Qwen3-Next config.json: Gated DeltaNet widths, its `layer_types`
    ("linear_attention" / "full_attention", or every `full_attention_interval`-th layer full) and
    the rotary dims of the gated full-attention layers (head_dim * partial_rotary_factor).

    Raises:
        ValueError: some layer is mixture-of-experts (only dense MLPs are implemented); an
            unknown layer type; rope other than default.
    """
    n = int(cfg["num_hidden_layers"])
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    moe = [i for i in range(n) if i not in dense and cfg.get("num_experts") and (i + 1) % step == 0]
    if moe:
        which = f"{moe[0]}..{moe[-1]}" if moe == list(range(moe[0], moe[-1] + 1)) else str(moe)
        raise ValueError(
            f"{path}: layers {which} are mixture-of-experts (num_experts={cfg['num_experts']}); "
            "only dense MLPs are implemented (set mlp_only_layers to every layer)"
        )
    types = cfg.get("layer_types")
    if types is None:
        k = int(cfg.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % k == 0 else LINEAR for i in range(n)]
    if len(types) != n or any(t not in (FULL, LINEAR) for t in types):
        raise ValueError(
            f"{path}: layer_types {types} must name {n} layers, each {FULL!r} or {LINEAR!r}"
        )
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(
            f"{path}: rope {rope} is not supported for Qwen3-Next yet (default rope only)"
        )
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    return dict(
        layer_types=tuple(types),
        linear_num_key_heads=int(cfg["linear_num_key_heads"]),
        linear_key_head_dim=int(cfg["linear_key_head_dim"]),
        linear_num_value_heads=int(cfg["linear_num_value_heads"]),
        linear_value_head_dim=int(cfg["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        rotary_dim=int(head_dim * factor),
        qkv_bias=bool(cfg.get("attention_bias", False)),
    )


def kimi_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """The fields of a Kimi-Linear config.json: the MLA fields (as `mla_fields`, no rope on the
    shared key), the KDA heads (q, k and v each `linear_num_heads` x `linear_head_dim`, conv
    kernel `linear_conv_kernel_dim`; or the checkpoint's `linear_attn_config`), `layer_types`
    and the context length (`model_max_length`, HF's name for max_position_embeddings here);
    the LM head is never tied (HF's model keeps lm_head whatever `tie_word_embeddings` says).

    Raises:
        ValueError: some layer is mixture-of-experts (only dense MLPs are implemented); layer
            types that are not KDA / MLA; attention biases.
    """
    n = int(cfg["num_hidden_layers"])
    lac = cfg.get("linear_attn_config") or {}
    types = cfg.get("layer_types")
    if types is None and "kda_layers" in lac and "full_attn_layers" in lac:
        types = [LINEAR if i + 1 in lac["kda_layers"] else FULL for i in range(n)]
    if types is None:
        types = [FULL if i and i % 4 == 0 else LINEAR for i in range(n)]
    if len(types) != n or any(t not in (FULL, LINEAR) for t in types):
        raise ValueError(
            f"{path}: layer_types {types} must name {n} layers, each {FULL!r} or {LINEAR!r}"
        )
    mlp = cfg.get("mlp_layer_types")
    if mlp is None:
        dense = int(cfg.get("first_k_dense_replace", 1))
        mlp = ["dense" if i < dense else "sparse" for i in range(n)]
    moe = [i for i, t in enumerate(mlp) if t != "dense"]
    if moe:
        which = f"{moe[0]}..{moe[-1]}" if moe == list(range(moe[0], moe[-1] + 1)) else str(moe)
        raise ValueError(
            f"{path}: layers {which} are mixture-of-experts; only dense MLPs are implemented "
            "(set mlp_layer_types to 'dense' for every layer)"
        )
    if cfg.get("attention_bias"):
        raise ValueError(f"{path}: attention_bias is not supported for MLA")
    heads = int(lac.get("num_heads", cfg.get("linear_num_heads", 32)))
    width = int(lac.get("head_dim", cfg.get("linear_head_dim", 128)))
    kernel = int(lac.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4)))
    rank, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    return dict(
        num_kv_heads=1,
        head_dim=rank + rope,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
        q_lora_rank=cfg.get("q_lora_rank"),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        layer_types=tuple(types),
        linear_num_key_heads=heads,
        linear_key_head_dim=width,
        linear_num_value_heads=heads,
        linear_value_head_dim=width,
        linear_conv_kernel_dim=kernel,
        max_position_embeddings=int(
            cfg.get("model_max_length", cfg.get("max_position_embeddings", 4096))
        ),
        # HF's KimiLinearForCausalLM has its own lm_head whatever the flag says
        tie_word_embeddings=False,
    )


def attention_groups(cfg: LlamaArchConfig) -> list[tuple[int | None, tuple[int, ...]]]:
    """Attention layers grouped by window: (window in tokens or None for full attention, layer
    indices), groups in the order of their first layer. A dense model is one group of every
    layer; the KV cache keeps one group per entry (pdkv.worker.kv_cache). Linear-attention layers
    are not attention groups (`LlamaArchConfig.linear_layers`: one linear-state group after
    these)."""
    groups: dict[int | None, list[int]] = {}
    for i in range(cfg.num_layers):
        if cfg.layer_types and cfg.layer_types[i] == LINEAR:
            continue
        groups.setdefault(cfg.layer_window(i), []).append(i)
    return [(w, tuple(layers)) for w, layers in groups.items()]


def sliding_layers(cfg: dict[str, Any], arch: str) -> tuple[int | None, tuple[str, ...]]:
    """(sliding window in tokens or None, per-layer type) as transformers applies them for
    `arch` (rules in the module docstring).

    Raises:
        ValueError: `layer_types` has the wrong length or an unknown type.
    """
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    if arch == "MistralForCausalLM":
        return (int(window), (SLIDING,) * n) if window else (None, (FULL,) * n)
    if arch != "Qwen2ForCausalLM" or not window or not cfg.get("use_sliding_window", False):
        return None, (FULL,) * n
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", 28))
        types = [SLIDING if i >= first else FULL for i in range(n)]
    if len(types) != n or any(t not in (FULL, SLIDING) for t in types):
        raise ValueError(f"layer_types {types} must name {n} layers, each {FULL!r} or {SLIDING!r}")
    if SLIDING not in types:
        return None, tuple(types)
    return int(window), tuple(types)


def hybrid_state_kinds(cfg: dict[str, object]) -> list[str]:
    """The non-full-attention state kinds an HF config.json declares ("sliding_window", "mla",
    "linear_state"), read by the cost model's parser (`pdkv.modelspec.hf_config`); [] for a dense
    model or a config that parser cannot read."""
    try:
        spec = spec_from_hf_config(dict(cfg))
    except (ValueError, KeyError, TypeError):
        return []
    return [g.kind for g in spec.groups if g.kind != "full_attention"]
