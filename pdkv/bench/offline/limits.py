"""The machine's limits beside `pdkv bench offline`'s systems: memory read bandwidth, fp32 FMA
peak, and the roofline they put on a model's decode and prefill.

Both are measured in the benchmark's own process with its thread count, right before the
systems run, so a ratio such as "pdkv reaches 81 % of the read limit" compares figures of one
run on one machine state:

* read bandwidth (bytes / second): the best of `repeats` timed `torch.sum` passes over one float32
  buffer the size of the model's weights (a streaming read, vectorized and split over the
  threads by ATen's reduction; nothing is written back but one scalar). The buffer is placed as
  the engine places its packed weights (pdkv.model.hugepages: 2 MiB pages where transparent huge
  pages allow), so the limit is the best read this machine gives the weights;
* FMA peak (FLOP / second): the best of `repeats` timed runs of pdkv's `fma_peak` op
  (`csrc/fma_peak.cpp`: twelve independent vector FMA chains per thread, operands in registers,
  the ISA the extension was built for), the rate no compute-bound float32 kernel can pass here;
  where the CPU has AVX512-BF16, also the bfloat16 dot-product peak (`bf16_dot_peak`: the same
  with VDPBF16PS, 64 FLOP per instruction), the compute ceiling of a bfloat16 run;
* matmul rate (FLOP / second): the best of `repeats` timed `torch.mm` products of two n × n
  float32 matrices (2 n^3 FLOP each; ATen's BLAS), what a tuned library reaches. It stands in for
  the FMA peak where pdkv's extension is not built.

The roofline (Williams, Waterman and Patterson, "Roofline: an insightful visual performance model
for multicore architectures", CACM 2009): one decode step of B sequences with C cached tokens each
reads the weights once (`weight_bytes`) and each sequence's K and V (C x `kv_bytes_per_token`),
and computes 2 x `matmul_params` + C x `attn_flop_per_ctx_token` FLOP per sequence, so it takes
at least max(bytes / bandwidth, FLOP / FMA peak) seconds, and B tokens per step give the limit in
tokens / second. At 64 sequences of SmolLM2 with 150 cached tokens the float32 KV read (440 MB)
is close to the weights' (538 MB), so it is counted. A prefill of B prompts of L tokens is compute
bound at the FMA peak: each token costs 2 x `matmul_params` FLOP plus attention over L / 2
earlier tokens on average (causal). Softmax, norms and the KV write are left out, so the limit
is an upper bound a little above the true one.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pdkv.model.hugepages import HugePageArena

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelCost:
    """What one token costs a decoder-only model, from its safetensors headers.

    Attributes:
        weight_bytes: bytes of weights one decode step reads, in the benchmark's dtype (every
            tensor except an untied input embedding, of which a step reads only B rows; a tied
            embedding is read once, as the LM head).
        matmul_params: parameters of the 2-D weights a token is multiplied with (projections, MLP
            and LM head; norms, biases and an untied embedding table left out): 2 x this is the
            FLOP per token outside attention.
        dtype: the dtype weight_bytes is counted in.
        kv_bytes_per_token: bytes of K and V one cached token holds over all layers, in `dtype`
            (2 x layers x KV heads x head dim x dtype bytes; 0 when config.json lacks the sizes).
        attn_flop_per_ctx_token: attention FLOP per new token per cached token it attends to
            (q.k and p.v: 4 x layers x query heads x head dim).
    """

    weight_bytes: int
    matmul_params: int
    dtype: str
    kv_bytes_per_token: int = 0
    attn_flop_per_ctx_token: int = 0


@dataclass(frozen=True)
class MachineLimits:
    """Read bandwidth, FMA peak and matmul rate measured in this process (`measure_limits`).

    Attributes:
        read_bytes_per_s: best streaming read rate over `read_buffer_bytes` (bytes / second).
        read_buffer_bytes: size of the buffer read (bytes; the model's weight bytes).
        matmul_flop_per_s: best fp32 `torch.mm` rate (FLOP / second) of `matmul_n`^3 products.
        matmul_n: side of the square matrices.
        threads: torch intra-op threads used for all of them.
        fma_flop_per_s: best register-only fp32 FMA rate (FLOP / second, pdkv's `fma_peak` op),
            None where pdkv's extension is not loaded.
        read_huge_pages: the read buffer was advised for 2 MiB pages (HugePageArena.advised).
        bf16_dot_flop_per_s: best register-only bfloat16 dot-product rate (FLOP / second,
            pdkv's `bf16_dot_peak` op: VDPBF16PS), None where the CPU has no AVX512-BF16 or the
            extension is not loaded.
    """

    read_bytes_per_s: float
    read_buffer_bytes: int
    matmul_flop_per_s: float
    matmul_n: int
    threads: int
    fma_flop_per_s: float | None = None
    read_huge_pages: bool = False
    bf16_dot_flop_per_s: float | None = None

    @property
    def peak_flop_per_s(self) -> float:
        """The float32 compute ceiling: the FMA peak, else the matmul rate."""
        return self.fma_flop_per_s if self.fma_flop_per_s is not None else self.matmul_flop_per_s

    def compute_peak(self, dtype: str) -> float:
        """The roofline's compute ceiling for a run of `dtype` (FLOP / second): the bfloat16
        dot-product peak for "bfloat16" where measured (the panel kernel's VDPBF16PS does twice
        a float32 FMA's work), else `peak_flop_per_s`."""
        if dtype == "bfloat16" and self.bf16_dot_flop_per_s is not None:
            return self.bf16_dot_flop_per_s
        return self.peak_flop_per_s


def model_cost(model_path: str, dtype: str) -> ModelCost:
    """Weight bytes per decode step and matmul parameters per token of the model in `model_path`.

    Reads only the safetensors headers (`*.safetensors` in the folder) and `config.json`'s
    `tie_word_embeddings` (default False, as transformers).

    Raises:
        ValueError: an unknown dtype, or no safetensors file in the folder.
    """
    from safetensors import safe_open

    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors file in {model_path}")
    cfg: dict[str, Any] = {}
    cfg_path = os.path.join(model_path, "config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
    tied = bool(cfg.get("tie_word_embeddings", False))
    layers, heads = cfg.get("num_hidden_layers", 0), cfg.get("num_attention_heads", 0)
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size", 0) // heads if heads else 0)
    total = matmul = 0
    for name in files:
        with safe_open(os.path.join(model_path, name), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                shape = st.get_slice(key).get_shape()
                numel = 1
                for d in shape:
                    numel *= int(d)
                is_embed = key.endswith("embed_tokens.weight")
                if is_embed and not tied:
                    continue  # a decode step gathers B rows of it
                total += numel
                if len(shape) == 2:
                    matmul += numel
    return ModelCost(
        weight_bytes=total * _DTYPE_BYTES[dtype],
        matmul_params=matmul,
        dtype=dtype,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * _DTYPE_BYTES[dtype],
        attn_flop_per_ctx_token=4 * layers * heads * head_dim,
    )


def best_seconds(fn: Any, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn` (seconds; no warm-up call: make it first)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _best_op_rate(op_name: str, repeats: int, iters: int) -> float | None:
    """Best FLOP / second of `repeats` runs of the peak op `torch.ops.pdkv.<op_name>(iters)`
    (which returns [flop, checksum]), after one run of iters / 10 that brings the threads and
    clocks up; None when pdkv's extension is not loaded or was built without that op."""
    from pdkv.model.paged_decode_build import load

    if load() is not None or not hasattr(torch.ops.pdkv, op_name):
        return None
    op = getattr(torch.ops.pdkv, op_name)
    op(max(1, iters // 10))
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        flop = float(op(iters)[0])
        best = max(best, flop / (time.perf_counter() - t0))
    return best


def measure_fma_peak(repeats: int = 5, iters: int = 20_000_000) -> float | None:
    """Best fp32 FMA rate (FLOP / second) of `repeats` runs of pdkv's `fma_peak` op with torch's
    threads, `iters` rounds of 12 vector FMAs per thread each; None when pdkv's extension is not
    loaded (`make setup` builds it; PDKV_CPU_OPS=0 turns it off)."""
    return _best_op_rate("fma_peak", repeats, iters)


def measure_bf16_dot_peak(repeats: int = 5, iters: int = 10_000_000) -> float | None:
    """Best bfloat16 dot-product rate (FLOP / second) of `repeats` runs of pdkv's `bf16_dot_peak`
    op with torch's threads (`iters` rounds of 12 VDPBF16PS per thread each); None where the
    extension is not loaded or was built for a CPU without AVX512-BF16."""
    return _best_op_rate("bf16_dot_peak", repeats, iters)


def measure_limits(read_bytes: int, repeats: int = 5, matmul_n: int = 3072) -> MachineLimits:
    """Measure read bandwidth over `read_bytes`, the fp32 FMA peak and the matmul rate, with
    torch's threads.

    Args:
        read_bytes: bytes of the float32 buffer read (the model's weight bytes); >= 4.
        repeats: timed passes of each; the fastest is kept (after one untimed pass).
        matmul_n: side of the n x n float32 matrices multiplied (>= 64).

    Returns:
        The measured `MachineLimits`.

    Raises:
        ValueError: read_bytes < 4, repeats < 1 or matmul_n < 64.
    """
    if read_bytes < 4 or repeats < 1 or matmul_n < 64:
        raise ValueError(f"bad limits sizes: read_bytes={read_bytes}, repeats={repeats}, "
                         f"matmul_n={matmul_n}")
    arena = HugePageArena()
    buf = arena.empty((read_bytes // 4,), torch.float32).fill_(1.0)
    buf.sum()
    read_s = best_seconds(buf.sum, repeats)
    nbytes = buf.numel() * 4
    arena_advised = arena.advised
    del buf, arena
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(matmul_n, matmul_n, generator=gen)
    b = torch.randn(matmul_n, matmul_n, generator=gen)
    torch.mm(a, b)
    mm_s = best_seconds(lambda: torch.mm(a, b), repeats)
    return MachineLimits(
        read_bytes_per_s=nbytes / read_s,
        read_buffer_bytes=nbytes,
        matmul_flop_per_s=2.0 * matmul_n**3 / mm_s,
        matmul_n=matmul_n,
        threads=torch.get_num_threads(),
        fma_flop_per_s=measure_fma_peak(repeats),
        read_huge_pages=arena_advised,
        bf16_dot_flop_per_s=measure_bf16_dot_peak(repeats),
    )


def token_flop(cost: ModelCost, context: float) -> float:
    """FLOP of one new token attending to `context` tokens (matmuls + attention)."""
    return 2.0 * cost.matmul_params + context * cost.attn_flop_per_ctx_token


def decode_limit_tok_s(cost: ModelCost, limits: MachineLimits, batch_size: int,
                       context: float = 0.0) -> float:
    """Roofline decode throughput (tokens / second, all sequences) at `batch_size` sequences of
    `context` cached tokens each (on average over the decode)."""
    step_s = max(
        (cost.weight_bytes + batch_size * context * cost.kv_bytes_per_token)
        / limits.read_bytes_per_s,
        batch_size * token_flop(cost, context) / limits.compute_peak(cost.dtype),
    )
    return batch_size / step_s


def prefill_limit_tok_s(cost: ModelCost, limits: MachineLimits, prompt_len: int = 0) -> float:
    """Roofline prefill throughput (prompt tokens / second) of prompts of `prompt_len` tokens:
    compute bound at the compute peak of the run's dtype (`MachineLimits.compute_peak`), each
    token attending to prompt_len / 2 tokens on average."""
    return limits.compute_peak(cost.dtype) / token_flop(cost, prompt_len / 2)


def flop_share(cost: ModelCost, limits: MachineLimits, tok_s: float | None,
               context: float = 0.0) -> float | None:
    """Fraction of the compute peak of the run's dtype (`MachineLimits.compute_peak`) that `tok_s`
    tokens / second of `context`-token attention use (None: no figure)."""
    if tok_s is None:
        return None
    return tok_s * token_flop(cost, context) / limits.compute_peak(cost.dtype)


def limits_dict(cost: ModelCost, limits: MachineLimits, context: float = 0.0) -> dict[str, Any]:
    """JSON form of the limits, with the batch-1 decode limit at `context` cached tokens and the
    matmul-only prefill limit (tokens / second)."""
    return {
        **asdict(limits),
        **{f"model_{k}": v for k, v in asdict(cost).items()},
        "peak_flop_per_s": limits.peak_flop_per_s,
        "compute_peak_flop_per_s": limits.compute_peak(cost.dtype),
        "decode_context": context,
        "decode_limit_tok_s_batch1": decode_limit_tok_s(cost, limits, 1, context),
        "prefill_limit_tok_s": prefill_limit_tok_s(cost, limits),
    }


def format_limits(lim: dict[str, Any]) -> str:
    """The limit rows printed above the workload table (from `limits_dict`)."""
    gb = lim["read_bytes_per_s"] / 1e9
    mb = lim["read_buffer_bytes"] / 1e6
    gf = lim["matmul_flop_per_s"] / 1e9
    fma = lim.get("fma_flop_per_s")
    peak = (f"limit: fp32 FMA peak {fma / 1e9:.1f} GFLOP/s (register-only vector FMAs, "
            f"pdkv's fma_peak op)" if fma else
            "limit: fp32 FMA peak not measured (pdkv's extension not loaded): the matmul rate "
            "stands in for it")
    bf16 = lim.get("bf16_dot_flop_per_s")
    if bf16 and lim.get("model_dtype") == "bfloat16":
        peak += (f"\nlimit: bf16 dot-product peak {bf16 / 1e9:.1f} GFLOP/s (register-only "
                 "VDPBF16PS, pdkv's bf16_dot_peak op): this bfloat16 run's compute ceiling")
    return "\n".join([
        peak,
        f"limit: memory read {gb:.1f} GB/s (torch.sum over {mb:.0f} MB, the "
        f"{lim['model_dtype']} weights, on "
        f"{'2 MiB' if lim.get('read_huge_pages') else '4 KiB'} pages; "
        f"{lim['threads']} threads) -> batch-1 decode <= "
        f"{lim['decode_limit_tok_s_batch1']:.1f} tok/s",
        f"       fp32 matmul {gf:.1f} GFLOP/s (torch.mm {lim['matmul_n']}^3); "
        f"{lim['model_matmul_params'] / 1e6:.1f} M matmul params x 2 FLOP/token: prefill and "
        f"large-batch decode <= {lim['prefill_limit_tok_s']:.1f} tok/s before attention",
        f"roofline per row: max(bytes / read rate, FLOP / FMA peak), with K/V reads of "
        f"{lim['model_kv_bytes_per_token'] / 1e3:.1f} kB per cached token and "
        f"{lim['model_attn_flop_per_ctx_token'] / 1e3:.1f} kFLOP per attended token "
        f"(decode at {lim['decode_context']:.0f} cached tokens, causal prefill)",
    ])
