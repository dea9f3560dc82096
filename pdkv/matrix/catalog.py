"""The support matrix's axes: features (rows of the grid) and models (its columns), in order.

A test joins the matrix with `@pytest.mark.matrix(*features, model="smollm2",
expect="verified")`; the ids used there must be listed here (the pytest plugin refuses others).
`expect="verified"` tests check that the output equals the reference and that blocks return to
baseline; `expect="unsupported"` tests check that pdkv refuses the feature with an error naming
what is missing (recorded with `record_property("matrix_detail", text)`). Pure data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Axis:
    """One feature or model: its id (used in markers and on the command line) and a title."""

    id: str
    title: str


FEATURES: tuple[Axis, ...] = (
    Axis("colocated", "colocated engine, greedy output = HF transformers"),
    Axis("prefix-caching", "prefix caching (a re-sent prompt hits whole blocks)"),
    Axis("chunked-prefill", "chunked prefill (prompt split over steps)"),
    Axis("preemption", "preemption by recompute"),
    Axis("pd-tcp", "P/D, tcp transfer engine"),
    Axis("pd-shm", "P/D, shm transfer engine"),
    Axis("pd-mooncake", "P/D, Mooncake transfer engine"),
    Axis("pool-dram", "KV pool, DRAM tier (cold then hot)"),
    Axis("pool-disk", "KV pool, disk tier (cold then hot)"),
    Axis("pool-redis", "KV pool, redis tier (cold then hot)"),
    Axis("pool-mooncake", "KV pool, Mooncake Store tier (cold then hot)"),
    Axis("offload", "CPU offload (evicted blocks come back from host)"),
    Axis("pd-pool", "P/D + pool (MultiConnector: pool prefix, then P's rest)"),
    Axis("pd-colocated-pool", "PD-colocated + pool (kv_both instances sharing one pool)"),
    Axis("tp", "tensor parallelism (--tensor-parallel-size 2; 3 on SmolLM2)"),
    Axis(
        "dcp",
        "decode context parallelism (--decode-context-parallel-size 2; vLLM mode at tp 2, "
        "replicated weights at tp 1)",
    ),
    Axis(
        "tp-pool",
        "TP 2 with the KV pool: each rank stores and loads its KV heads (dram, disk, redis)",
    ),
    Axis("tp-offload", "TP 2 with CPU offload: each rank's shard to its own host buffer"),
    Axis("tp-pd-pool", "P/D + pool into a TP 2 D (MultiConnector): pool prefix, then P's rest"),
    Axis(
        "dcp-pool",
        "DCP 2 with the KV pool: each rank stores and loads its token shard (dram, disk, redis)",
    ),
    Axis("dcp-offload", "DCP 2 with CPU offload: each rank's shard to its own host buffer"),
    Axis("dcp-pd-pool", "P/D + pool into a DCP 2 D (MultiConnector): pool prefix, then P's rest"),
    Axis("pd-dcp", "P/D into DCP: P tp 1 → D tp 2 + dcp 2, each D rank pulls its shard (tcp)"),
    Axis("pd-reshard", "P/D from P tp 1 to D tp 2, each D rank pulls its KV heads (tcp)"),
    Axis("pd-reblock", "P/D between block sizes 16 and 32, KV mapped by token position (tcp)"),
    Axis(
        "hetero-tp",
        "P/D from a P at tp 2 to D tp 1 and tp 2, each D rank pulls its heads from the P ranks "
        "holding them (tcp)",
    ),
    Axis(
        "quantized-kv",
        "quantized KV cache (--kv-cache-dtype int8 / fp8): P/D, pool and offload = colocated of "
        "the same dtype",
    ),
    Axis(
        "hybrid-sliding-window",
        "hybrid state: sliding-window attention (window-group blocks freed "
        "early, per-window prefix hits)",
    ),
    Axis("hybrid-mla", "hybrid state: MLA latents"),
    Axis("hybrid-linear", "hybrid state: linear attention (conv + recurrent state)"),
    Axis(
        "hybrid-v4",
        "hybrid state: DeepSeek-V4 compressed KV, indexer keys and compressor state (prefix hits "
        "inside and at the edge of compression windows)",
    ),
)

MODELS: tuple[Axis, ...] = (
    Axis("smollm2", "SmolLM2-135M-Instruct (real weights)"),
    Axis("tiny-llama", "random 2-layer Llama, SmolLM2 tokenizer (made by the test)"),
    Axis(
        "tiny-llama-kv1",
        "random 4-layer Llama, 4 query heads, 1 KV head (`--model tiny-llama-kv1`)",
    ),
    Axis(
        "tiny-llama-kv2",
        "random 4-layer Llama, 4 query heads, 2 KV heads (`--model tiny-llama-kv2`)",
    ),
    Axis(
        "tiny-swa", "random 4-layer Qwen2, sliding window 40 on layers 0 and 2 (`--model tiny-swa`)"
    ),
    Axis(
        "tiny-mla",
        "random 4-layer DeepSeek-V3, MLA latent 48 + rope 16, dense MLPs (`--model tiny-mla`)",
    ),
    Axis(
        "tiny-gdn",
        "random 4-layer Qwen3-Next, Gated DeltaNet on layers 0 and 2, full attention on 1 and 3, "
        "dense MLPs (`--model tiny-gdn`)",
    ),
    Axis(
        "tiny-kda-mla",
        "random 4-layer Kimi-Linear, KDA on layers 0 and 2, MLA on 1 and 3, dense MLPs "
        "(`--model tiny-kda-mla`)",
    ),
    Axis(
        "tiny-v4",
        "random 4-layer DeepSeek-V4: sliding window, CSA with the Lightning Indexer, HCA, CSA; "
        "mHC, hash / top-k MoE (`--model tiny-v4`)",
    ),
    Axis(
        "deepseek-v3",
        "DeepSeek-V3 config.json (MLA + MoE), pdkv/plan/configs; its MLA runs on `tiny-mla`",
    ),
    Axis(
        "qwen3-next",
        "Qwen3-Next-80B-A3B config.json (Gated DeltaNet + full attention, MoE); its linear "
        "state runs on `tiny-gdn`",
    ),
    Axis(
        "kimi-linear",
        "Kimi-Linear-48B-A3B config.json (KDA + MLA, MoE); its state runs on `tiny-kda-mla`",
    ),
)

FEATURE_IDS = tuple(a.id for a in FEATURES)
MODEL_IDS = tuple(a.id for a in MODELS)

VERIFIED = "verified"
FAILED = "failed"
NOT_SUPPORTED = "not supported"
SKIPPED = "skipped"
STATUSES = (VERIFIED, FAILED, NOT_SUPPORTED, SKIPPED)

EXPECT_VERIFIED = "verified"
EXPECT_UNSUPPORTED = "unsupported"

DETAIL_PROPERTY = "matrix_detail"
"""`record_property` name under which an `expect="unsupported"` test leaves the error text."""


def cell_order(feature: str, model: str) -> tuple[int, int]:
    """Sort key of a cell in catalog order: features, then models (ids not in the catalog last)."""
    return (FEATURE_IDS.index(feature) if feature in FEATURE_IDS else len(FEATURE_IDS),
            MODEL_IDS.index(model) if model in MODEL_IDS else len(MODEL_IDS))
