"""Tiny random-weight checkpoints for tensor-parallel, DCP and hybrid-state tests.

`tiny-llama-kv1` and `tiny-llama-kv2` are Llama-architecture HF folders (config.json,
model.safetensors, SmolLM2's tokenizer files) built with transformers' `LlamaConfig` +
`LlamaForCausalLM` from a fixed seed; `tiny-swa` is the same shape as `tiny-llama-kv2` built as a
`Qwen2ForCausalLM` (q/k/v biases) whose `layer_types` interleave sliding-window and full
attention (sliding_window 40 tokens, deliberately not a multiple of the block size 16); `tiny-mla`
is a `DeepseekV3ForCausalLM` of the same hidden size, heads and layers (MLA: latent 48, rope 16,
nope 32, v 32, no q LoRA, dense MLP on every layer, default rope with HF's rope_interleave).
`pdkv.model.registry.resolve_model` builds them on first use under `$PDKV_CACHE/models/<name>`
and reuses them after.

Why these sizes:
- 4 query heads of head_dim 32 (hidden 128): tp 2 gives 2 query heads per rank; the model is
  small enough that tp 2 / dcp 2 run as two processes on a two-core box.
- `tiny-llama-kv1` has 1 KV head: at tp 2 that head is replicated on both ranks, so tp / kv heads
  = 2 >= dcp 2 and vLLM-style DCP 2 (DCP carved out of TP) is allowed.
- `tiny-llama-kv2` has 2 KV heads: tp 2 gives one KV head per rank (no replication), the plain
  tensor-parallel case; DCP on it uses replicated-weight ranks.
- 4 layers, intermediate 256: enough depth that a per-layer sharding bug shows in the output,
  still 6.9M parameters (27 MB of float32 safetensors; 6.3M of them the 49152 x 128 tied
  embedding of SmolLM2's vocabulary).
- max_position_embeddings 8192: the DCP benchmark runs 8k-token contexts; rope_theta 10000.
- initializer_range 0.5 (transformers' default is 0.02): random weights give near-uniform logits,
  and tp / dcp sum in a different order than one rank, so a thin top-1/top-2 margin would flip a
  greedy token. At 0.2 (the matrix's tiny-llama) the margin test fails (smallest margin over its
  10 greedy runs 7e-4); at 0.5 the smallest is 0.0101, 40x the largest |fp32 - fp64| logit
  difference on the same run (2.5e-4, a stand-in for reduction-order rounding).
  tests/model/test_tiny_models.py asserts margin >= 5e-3 and >= 20x that difference at every
  step: `python -m pytest -q tests/model/test_tiny_models.py -k margins`.

`tiny-swa` stands for the families that keep sliding-window KV: Mistral (sliding_window on every
layer), Qwen2 / Qwen3 (`layer_types` or use_sliding_window + max_window_layers), Gemma-2 / Gemma-3
(interleaved local / global layers, 1:1 and 5:1) and gpt-oss (alternating 128-token banded and
full layers). Its 4 layers alternate sliding, full, sliding, full, so both KV cache groups hold
two layers. tests/model/test_swa_engine.py checks that HF really applies the window on it (its
greedy output on a 150-token prompt differs from the same weights with the window disabled).

`tiny-gdn` stands for Qwen3-Next and Qwen3.5 (Gated DeltaNet linear attention, three of every
four layers, plus gated full attention); the KDA layers of Kimi-Linear keep the same kind of state
(a conv window and a per-head recurrent matrix). Here linear and full layers alternate 1:1 so
each group holds two layers; its MoE is dense (mlp_only_layers = every layer). Decoder:
pdkv/model/qwen3_next.py; margins in tests/model/test_tiny_models.py.

`tiny-kda-mla` stands for Kimi-Linear (Kimi Delta Attention linear layers, three of every four,
plus MLA layers without rope): two state kinds in one model, a linear-state group for the KDA
layers and an MLA latent group. Here KDA and MLA alternate 1:1; its MoE is dense
(mlp_layer_types = dense everywhere). Decoder: pdkv/model/kimi_linear.py.

`tiny-mla` stands for DeepSeek-V2/V3/R1 and Kimi-K2 (MLA everywhere) and the MLA layers of
Kimi-Linear; its MoE layers are dense here (first_k_dense_replace = num_hidden_layers), so
pdkv's decoder (pdkv/model/deepseek.py) needs no experts. Its margins are in
tests/model/test_tiny_models.py with the tiny Llamas.

`tiny-v4` stands for DeepSeek-V4-Flash / V4-Pro (`DeepseekV4ForCausalLM`, TinyV4Spec): one
shared K=V head with partial rope and a q LoRA, attention sinks, a grouped low-rank output
projection, mHC residual streams (4) and MoE on every layer (the first hash-routed by token id,
the others top-k with sqrtsoftplus scores and a correction bias). Its layers are sliding window
(24 tokens), CSA (window plus entries compressed 4 to 1, a Lightning Indexer keeping the top 4),
HCA (window plus entries compressed 16 to 1), CSA, so a 100-token prompt already fills the
window, compresses in both kinds of layer and makes the indexer choose (25 entries for 4 places);
4 experts of 64, 2 a token, plus 1 shared. No MTP layer (num_nextn_predict_layers 0). Width,
heads and vocabulary as the tiny Llamas (13.5M parameters, 55 MB of float32; 12.6M of them the
untied embedding and lm_head). transformers' save_pretrained writes the layers under DeepSeek's
own names (`model.layers.N.attn.wq_a.weight`, `.ffn.experts.E.w1.weight`, `.hc_attn_fn`,
`.attn.attn_sink`, `.compressor.ape`, `.ffn.gate.bias`, `.ffn.gate.tid2eid`) but
`model.embed_tokens.weight`, `model.norm.weight`, `model.hc_head.hc_*` and `head.weight`. HF
leaves sinks, position biases, mHC base / scale, router biases and the hash table (tid2eid) at
constants; the builder draws them too. HF's V4 computes norms, rope, mHC and the indexer in
float32 even in a float64 model, so its fp32-vs-fp64 difference understates rounding. The
indexer has 16 heads so that its top-k never ties on the test prompts (with 4 it did, and HF's
output then depended on how the prompt was split; see TinyV4Spec). Margins and HF's chunk
invariance: tests/model/test_tiny_v4.py.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of one tiny random decoder; sizes in elements, lengths in tokens.

    `architecture` is "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3NextForCausalLM" (with the
    linear_* Gated DeltaNet widths) or "DeepseekV3ForCausalLM" (with the MLA widths
    kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim); `layer_types` (Qwen2 only, HF
    names "sliding_attention" / "full_attention") and `sliding_window` (tokens, HF semantics: the
    query at p sees keys p - W < k <= p) make a sliding-window model.
    """

    name: str
    num_key_value_heads: int
    architecture: str = "LlamaForCausalLM"
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    vocab_size: int = 49152  # SmolLM2's tokenizer
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    initializer_range: float = 0.5
    bos_token_id: int = 1
    eos_token_id: int = 2
    seed: int = 0
    # MLA (DeepseekV3ForCausalLM only): latent and per-head widths in elements.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # Gated DeltaNet (Qwen3NextForCausalLM only): linear-attention heads and widths in elements,
    # the causal conv's kernel in tokens; `layer_types` names "linear_attention" / "full_attention".
    linear_num_key_heads: int = 0
    linear_key_head_dim: int = 0
    linear_num_value_heads: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Kimi Delta Attention (KimiLinearForCausalLM only): heads and head width of the KDA layers
    # (q, k and v alike), elements; the MLA widths above apply to its full-attention layers.
    linear_num_heads: int = 0
    linear_head_dim: int = 0

    @property
    def head_dim(self) -> int:
        """Per-head width: hidden_size / num_attention_heads."""
        return self.hidden_size // self.num_attention_heads


TinyLlamaSpec = TinyModelSpec  # the name before sliding-window models


@dataclass(frozen=True)
class TinyV4Spec:
    """Shape of the tiny random DeepSeek-V4 (`DeepseekV4ForCausalLM`); sizes in elements, lengths
    and windows in tokens, HF `DeepseekV4Config` names.

    One shared K=V head of `head_dim` (rope on its last `head_dim * partial_rotary_factor`
    dims); q through a LoRA of `q_lora_rank`; grouped output projection (`o_groups` groups, each
    to `o_lora_rank`); a sink logit per head. `layer_types` picks each layer's attention:
    "sliding_attention" (the window only), "compressed_sparse_attention" (CSA: the window plus
    entries compressed `csa_compress_rate` tokens to one, of which the Lightning Indexer's
    `index_n_heads` x `index_head_dim` scorer keeps the top `index_topk` per query) or
    "heavily_compressed_attention" (HCA: the window plus every entry compressed
    `hca_compress_rate` to one). Every layer is MoE: `n_routed_experts` experts of
    `moe_intermediate_size`, `num_experts_per_tok` per token, plus `n_shared_experts`;
    "hash_moe" layers route by a fixed token-id table (tid2eid), "moe" layers by a top-k router
    with a score-correction bias. `hc_mult` residual streams (mHC, Sinkhorn `hc_sinkhorn_iters`).
    """

    name: str
    initializer_range: float
    seed: int
    architecture: str = "DeepseekV4ForCausalLM"
    vocab_size: int = 49152  # SmolLM2's tokenizer
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 32
    q_lora_rank: int = 64
    partial_rotary_factor: float = 0.5
    layer_types: tuple[str, ...] = (
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
        "compressed_sparse_attention",
    )
    csa_compress_rate: int = 4
    hca_compress_rate: int = 16
    sliding_window: int = 24
    mlp_layer_types: tuple[str, ...] = ("hash_moe", "moe", "moe", "moe")
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 64
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    o_groups: int = 2
    o_lora_rank: int = 32
    # Issue 33 asked for 4 indexer heads of width 16. With 4 heads 1/16 of the indexer's scores
    # are exactly 0 (the ReLU zeroes every head), and zeros tied at the top-k boundary on every
    # build tried (32 seeds / ranges, 2-10 ties on the test prompts); torch.topk breaks such ties
    # by the row's length, so HF's own greedy output changed with how the tokens were split into
    # forwards. 16 heads make exact zeros ~1e-5 rare (no tie in any of 29 builds tried). Width 32
    # so rope (16 dims, the main rope's width) covers only its last half, as in V4 (64 of 128),
    # not the whole head.
    index_n_heads: int = 16
    index_head_dim: int = 32
    index_topk: int = 4
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    max_position_embeddings: int = 8192
    bos_token_id: int = 1
    eos_token_id: int = 2


TINY_MODELS: dict[str, TinyModelSpec | TinyV4Spec] = {
    "tiny-llama-kv1": TinyModelSpec(name="tiny-llama-kv1", num_key_value_heads=1),
    "tiny-llama-kv2": TinyModelSpec(name="tiny-llama-kv2", num_key_value_heads=2),
    "tiny-swa": TinyModelSpec(
        name="tiny-swa", num_key_value_heads=2, architecture="Qwen2ForCausalLM",
        layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
        sliding_window=40,
        # Seed 6: smallest greedy margin 0.029, 70x the fp32-vs-fp64 logit difference on the
        # test prompts (seed 0 gave 0.0097, only 20x).
        seed=6,
    ),
    # DeepSeek-V3-style MLA, dense MLP on every layer (first_k_dense_replace = 4: no MoE), no q
    # LoRA, default rope (no yarn), HF's rope_interleave. Cached per token and layer: the 48-wide
    # latent plus the 16-wide rope'd key, 64 floats (tiny-llama-kv2 caches 2 x 2 x 32 = 128).
    "tiny-mla": TinyModelSpec(
        name="tiny-mla", num_key_value_heads=4, architecture="DeepseekV3ForCausalLM",
        kv_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        # Seed 3: smallest greedy margin 0.10, 330x the fp32-vs-fp64 logit difference on 15-,
        # 40- and 100-token prompts (seed 0: 0.022, 59x; seed 2: 0.0036, 18x).
        seed=3,
    ),
    # Qwen3-Next-style hybrid: Gated DeltaNet linear attention and gated full attention
    # alternate (linear, full, linear, full); dense MLP on every layer (mlp_only_layers = all, no
    # MoE). Linear layers: 2 key heads x 32 (q and k), 4 value heads x 32, conv kernel 4; their
    # state per layer and request is the conv window (3 x 256 floats) plus the recurrent state
    # (4 x 32 x 32 floats), whatever the length. Full layers: 4 q heads, 2 KV heads of 32 with
    # an output gate, q/k norms and rope on 8 of 32 dims (partial_rotary_factor 0.25).
    "tiny-gdn": TinyModelSpec(
        name="tiny-gdn", num_key_value_heads=2, architecture="Qwen3NextForCausalLM",
        layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
        linear_num_key_heads=2, linear_key_head_dim=32, linear_num_value_heads=4,
        linear_value_head_dim=32, linear_conv_kernel_dim=4,
        # Seed 4: smallest greedy margin 0.036, 72x the fp32-vs-fp64 logit difference on the
        # margin test's prompts (seed 0: 0.033, 60x; seed 3: 0.013, 51x; seed 5: 0.0007, 1x).
        seed=4,
    ),
    # Kimi-Linear-style hybrid: KDA linear attention and MLA alternate (kda, mla, kda, mla);
    # dense MLP on every layer (mlp_layer_types = dense, no MoE). KDA layers: 2 heads x 32 for
    # q, k and v, short conv kernel 4; their state per layer and request is the conv window
    # (3 x 64 channels x 3 floats) plus the recurrent state (2 x 32 x 32 floats). MLA layers: 4
    # heads, latent 48 + 16-wide shared key (NoPE: Kimi-Linear's MLA applies no rope), nope 32,
    # v 32.
    "tiny-kda-mla": TinyModelSpec(
        name="tiny-kda-mla", num_key_value_heads=4, architecture="KimiLinearForCausalLM",
        layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
        kv_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        linear_num_heads=2, linear_head_dim=32, linear_conv_kernel_dim=4,
        # Seed 12: smallest greedy margin 0.061, >= 21x the fp32-vs-fp64 logit difference on the
        # margin test's prompts (seed 0: 0.002, 1x; seed 4: 0.037 but 12x; seed 6: 0.032, 20.5x).
        # Hidden states grow to ~1e3 here, so fp32 rounding is larger than in the other tiny models.
        seed=12,
    ),
    # DeepSeek-V4-style: sliding, CSA, HCA, CSA layers, all MoE (layer 0 hash-routed), mHC
    # residual streams; no MTP layer. See TinyV4Spec and the module docstring.
    "tiny-v4": TinyV4Spec(
        name="tiny-v4",
        # initializer_range 0.5, seed 6: smallest greedy margin 0.0997 on the 14-, 40- and
        # 101-token prompts of tests/model/test_tiny_v4.py, 2159x the |fp32 - fp64| logit
        # difference there (4.7e-5). 0.02 (HF's default, logits of std 0.23) gave 8e-4..4e-3 on
        # seeds 0, 1, 2, 6 and 0.1 7e-4..6e-3, below 5e-3; 0.2 / 0.5 pass on most seeds (0.2
        # seed 0: 0.025, 1280x; 0.5 seed 3: 0.029, 678x).
        initializer_range=0.5, seed=6,
    ),
}

# Tokenizer files copied from the SmolLM2 folder (those that exist there).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_llama(spec: TinyModelSpec | TinyV4Spec, out_dir: str, tokenizer_dir: str) -> None:
    """Write the HF folder of `spec` into `out_dir` (which must exist): config.json,
    generation_config.json, model.safetensors (float32) and the tokenizer files of `tokenizer_dir`.

    Deterministic: the weights depend only on `spec` (seeded with `spec.seed` in a forked RNG, so
    the caller's torch RNG state is untouched).

    Raises:
        FileNotFoundError: `tokenizer_dir` has no tokenizer.json.
    """
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        raise FileNotFoundError(f"no tokenizer.json in {tokenizer_dir}")
    model = _build_v4(spec) if isinstance(spec, TinyV4Spec) else _build_hf(spec)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src):
            shutil.copy(src, out_dir)


def _build_hf(spec: TinyModelSpec) -> Any:
    """The random-weight HF model of `spec` (seeded with `spec.seed` in a forked RNG)."""
    import torch
    import transformers

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=True,
        initializer_range=spec.initializer_range,
        bos_token_id=spec.bos_token_id,
        eos_token_id=spec.eos_token_id,
    )
    if spec.architecture == "DeepseekV3ForCausalLM":
        del common["num_key_value_heads"]
        cfg = transformers.DeepseekV3Config(
            **common, num_key_value_heads=spec.num_attention_heads, q_lora_rank=None,
            kv_lora_rank=spec.kv_lora_rank, qk_rope_head_dim=spec.qk_rope_head_dim,
            qk_nope_head_dim=spec.qk_nope_head_dim, v_head_dim=spec.v_head_dim,
            first_k_dense_replace=spec.num_hidden_layers, n_routed_experts=1, rope_interleave=True,
        )
    elif spec.architecture == "Qwen3NextForCausalLM":
        cfg = transformers.Qwen3NextConfig(
            **common,
            head_dim=spec.head_dim,
            layer_types=list(spec.layer_types or ()),
            linear_num_key_heads=spec.linear_num_key_heads,
            linear_key_head_dim=spec.linear_key_head_dim,
            linear_num_value_heads=spec.linear_num_value_heads,
            linear_value_head_dim=spec.linear_value_head_dim,
            linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
            mlp_only_layers=list(range(spec.num_hidden_layers)),
            num_experts=0,
        )
    elif spec.architecture == "KimiLinearForCausalLM":
        del common["max_position_embeddings"], common["rope_theta"]
        common["tie_word_embeddings"] = False  # HF's KimiLinearForCausalLM never ties lm_head
        cfg = transformers.KimiLinearConfig(
            **common,
            model_max_length=spec.max_position_embeddings,
            pad_token_id=None,
            q_lora_rank=None,
            kv_lora_rank=spec.kv_lora_rank,
            qk_rope_head_dim=spec.qk_rope_head_dim,
            qk_nope_head_dim=spec.qk_nope_head_dim,
            v_head_dim=spec.v_head_dim,
            layer_types=list(spec.layer_types or ()),
            mlp_layer_types=["dense"] * spec.num_hidden_layers,
            linear_num_heads=spec.linear_num_heads,
            linear_head_dim=spec.linear_head_dim,
            linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
        )
    elif spec.architecture == "Qwen2ForCausalLM":
        cfg = transformers.Qwen2Config(
            **common, layer_types=list(spec.layer_types) if spec.layer_types else None,
            sliding_window=spec.sliding_window, use_sliding_window=spec.sliding_window is not None,
            max_window_layers=0,
        )
    else:
        cfg = transformers.LlamaConfig(**common, head_dim=spec.head_dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = getattr(transformers, spec.architecture)(cfg).eval()
    return model


def v4_config(spec: TinyV4Spec) -> Any:
    """The `transformers.DeepseekV4Config` of `spec` (default rope on both the main and the
    compressed branches, no yarn; no MTP layer; lm_head not tied)."""
    import transformers

    return transformers.DeepseekV4Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        q_lora_rank=spec.q_lora_rank,
        partial_rotary_factor=spec.partial_rotary_factor,
        layer_types=list(spec.layer_types),
        compress_rates={"compressed_sparse_attention": spec.csa_compress_rate,
                        "heavily_compressed_attention": spec.hca_compress_rate},
        sliding_window=spec.sliding_window,
        mlp_layer_types=list(spec.mlp_layer_types),
        n_routed_experts=spec.n_routed_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        n_shared_experts=spec.n_shared_experts,
        moe_intermediate_size=spec.moe_intermediate_size,
        scoring_func=spec.scoring_func,
        routed_scaling_factor=spec.routed_scaling_factor,
        swiglu_limit=spec.swiglu_limit,
        hc_mult=spec.hc_mult,
        hc_sinkhorn_iters=spec.hc_sinkhorn_iters,
        o_groups=spec.o_groups,
        o_lora_rank=spec.o_lora_rank,
        index_n_heads=spec.index_n_heads,
        index_head_dim=spec.index_head_dim,
        index_topk=spec.index_topk,
        rope_theta=spec.rope_theta,
        compress_rope_theta=spec.compress_rope_theta,
        max_position_embeddings=spec.max_position_embeddings,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
        initializer_range=spec.initializer_range,
        bos_token_id=spec.bos_token_id,
        eos_token_id=spec.eos_token_id,
    )


def _build_v4(spec: TinyV4Spec) -> Any:
    """The random-weight `DeepseekV4ForCausalLM` of `spec`, seeded with `spec.seed` in a forked RNG.

    HF's `_init_weights` leaves some V4 tensors at constants (attention sinks 0, compressor and
    indexer position_bias 0, mHC base 0 / scale 1, e_score_correction_bias 0, tid2eid 0: every
    token to expert 0); the same RNG then overwrites them so every path is exercised: sinks ~
    N(0, 1), position_bias ~ N(0, 0.5), mHC fn ~ N(0, 1 / sqrt(hc_mult * hidden)) (mixes of
    unit scale whatever the initializer_range), base ~ N(0, 0.5), scale ~ 1 + N(0, 0.1),
    e_score_correction_bias ~ N(0, 0.1), and each token's tid2eid row num_experts_per_tok
    distinct experts drawn at random.
    """
    import torch
    import transformers
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    cfg = v4_config(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = transformers.DeepseekV4ForCausalLM(cfg).eval()
        fn_std = (spec.hc_mult * spec.hidden_size) ** -0.5
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, v4.DeepseekV4Attention):
                    module.sinks.normal_(0.0, 1.0)
                elif isinstance(module, (v4.DeepseekV4HCACompressor, v4.DeepseekV4CSACompressor,
                                         v4.DeepseekV4Indexer)):
                    module.position_bias.normal_(0.0, 0.5)
                elif isinstance(module, v4.DeepseekV4HyperConnection):
                    module.fn.normal_(0.0, fn_std)
                    module.base.normal_(0.0, 0.5)
                    module.scale.normal_(1.0, 0.1)
                elif isinstance(module, v4.DeepseekV4HyperHead):
                    module.hc_fn.normal_(0.0, fn_std)
                    module.hc_base.normal_(0.0, 0.5)
                    module.hc_scale.normal_(1.0, 0.1)
                elif isinstance(module, v4.DeepseekV4TopKRouter):
                    module.e_score_correction_bias.normal_(0.0, 0.1)
                elif isinstance(module, v4.DeepseekV4HashRouter):
                    rows = torch.rand(spec.vocab_size, spec.n_routed_experts).argsort(dim=-1)
                    module.tid2eid.copy_(rows[:, :spec.num_experts_per_tok])
    return model
