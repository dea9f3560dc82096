"""The `pdkv bench offline` run: build both systems, time every batch size, assemble the result."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from pdkv.bench.offline_measure import (
    TORCH_DTYPES,
    load_hf,
    measure,
    ratio,
    run_hf,
    run_pdkv,
    throughputs,
)
from pdkv.bench.offline_prompts import build_prompts
from pdkv.bench.offline_report import cpu_description, format_table

_BLOCK_SIZE = 16


def run_offline_bench(
    model: str = "smollm2",
    batch_sizes: Sequence[int] = (1, 8, 32),
    input_len: int = 128,
    output_len: int = 32,
    dtype: str = "float32",
    num_threads: int | None = None,
    seed: int = 0,
    include_hf: bool = True,
    warmup: bool = True,
    repeats: int = 1,
    verbose: bool = True,
) -> dict[str, Any]:
    """Measure prefill and decode throughput of pdkv (and HF transformers) per batch size.

    Args:
        model: pdkv model alias or HF folder (resolved with `pdkv.model.registry.resolve_model`).
        batch_sizes: batch sizes B to measure (requests run together in one batch).
        input_len: prompt length per request, in tokens.
        output_len: generated tokens per request (>= 1; decode throughput needs >= 2).
        dtype: "float32" | "float16" | "bfloat16", for both systems.
        num_threads: torch CPU threads for both systems (None: torch's default / $PDKV_NUM_THREADS);
            the caller's thread count is restored on return.
        seed: varies the prompts and the pdkv engine seed.
        include_hf: also run HF transformers (else only pdkv; ratios and greedy match are None).
        warmup: one untimed small run per system before timing.
        repeats: timed runs per measurement; the shortest time is kept.
        verbose: print the header and table to stdout.

    Returns:
        A JSON-serializable dict: run settings ("model", "model_path", "dtype", "num_threads",
        "torch_version", "transformers_version", "device", "input_len", "output_len", ...),
        "results": one entry per batch size with "pdkv" and "hf" (None without HF) holding
        "prefill_s" / "total_s" / "decode_s" (seconds) and "prefill_tok_s" / "decode_tok_s"
        (tokens per second; decode None when output_len < 2 or the time difference stayed
        non-positive) and "extra_runs" (re-measurements after such noise),
        "prefill_ratio" / "decode_ratio" (pdkv / HF) and "greedy_match_requests"
        (requests whose pdkv greedy tokens equal HF's); "greedy_match" (bool for batch 1, None
        without HF) and "table" (the printed text).

    Raises:
        ValueError: bad lengths or batch sizes, unknown model or dtype.
    """
    prev_threads = torch.get_num_threads()
    try:
        if num_threads is not None and num_threads > 0:
            torch.set_num_threads(num_threads)
        return _bench(
            model, batch_sizes, input_len, output_len, dtype, num_threads, seed, include_hf,
            warmup, repeats, verbose,
        )
    finally:
        torch.set_num_threads(prev_threads)  # leave the caller's process as it was


def _bench(
    model: str,
    batch_sizes: Sequence[int],
    input_len: int,
    output_len: int,
    dtype: str,
    num_threads: int | None,
    seed: int,
    include_hf: bool,
    warmup: bool,
    repeats: int,
    verbose: bool,
) -> dict[str, Any]:
    import transformers

    from pdkv.engine.llm import LLM
    from pdkv.model.registry import resolve_model

    batch_sizes = [int(b) for b in batch_sizes]
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes must be positive integers, got {batch_sizes}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1, got {input_len}, {output_len}")
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
    torch.manual_seed(seed)

    load_before = os.getloadavg()[0]
    max_b = max(batch_sizes)
    bs = _BLOCK_SIZE
    max_model_len = input_len + output_len + bs
    blocks_per_req = -(-(input_len + output_len) // bs) + 1
    num_kv_blocks = max(max_b * blocks_per_req + 16, -(-max_model_len // bs))
    llm = LLM(
        model=model,
        dtype=dtype,
        seed=seed,
        block_size=bs,
        num_kv_blocks=num_kv_blocks,
        max_model_len=max_model_len,
        max_num_seqs=max_b,
        max_num_batched_tokens=max_b * input_len,
        enable_prefix_caching=False,
        num_threads=num_threads,
    )
    device = llm.llm_engine.config.model_config.device
    path = resolve_model(model)
    tokenizer = llm.get_tokenizer()

    hf_model = None
    if include_hf:
        hf_model = load_hf(path, dtype, device, tokenizer.pad_token_id)

    all_prompts = build_prompts(tokenizer, max(max_b, 1), input_len, seed)
    if warmup:
        wb = min(2, max_b)
        warm = all_prompts[:wb]
        run_pdkv(llm, warm, min(output_len, 2), device)
        if hf_model is not None:
            run_hf(hf_model, torch.tensor(warm, device=device), min(output_len, 2), device)

    results = []
    greedy_b1: bool | None = None
    for b in batch_sizes:
        prompts = all_prompts[:b]
        p_pre, p_tot, p_toks, p_extra = measure(
            lambda n, p=prompts: run_pdkv(llm, p, n, device), output_len, repeats
        )
        entry: dict[str, Any] = {
            "batch_size": b,
            "pdkv": {**throughputs(b, input_len, output_len, p_pre, p_tot), "extra_runs": p_extra},
            "hf": None,
            "prefill_ratio": None,
            "decode_ratio": None,
            "greedy_match_requests": None,
        }
        if hf_model is not None:
            ids = torch.tensor(prompts, device=device)
            h_pre, h_tot, h_toks, h_extra = measure(
                lambda n, x=ids: run_hf(hf_model, x, n, device), output_len, repeats
            )
            entry["hf"] = {**throughputs(b, input_len, output_len, h_pre, h_tot), "extra_runs": h_extra}
            entry["prefill_ratio"] = ratio(
                entry["pdkv"]["prefill_tok_s"], entry["hf"]["prefill_tok_s"]
            )
            entry["decode_ratio"] = ratio(entry["pdkv"]["decode_tok_s"], entry["hf"]["decode_tok_s"])
            entry["greedy_match_requests"] = sum(a == h for a, h in zip(p_toks, h_toks, strict=True))
            if b == 1:
                greedy_b1 = p_toks[0] == h_toks[0]
        results.append(entry)

    if hf_model is not None and greedy_b1 is None:
        # Batch 1 was not benchmarked: check greedy agreement on one untimed request.
        one = all_prompts[:1]
        _, p_toks = run_pdkv(llm, one, output_len, device)
        _, h_toks = run_hf(hf_model, torch.tensor(one, device=device), output_len, device)
        greedy_b1 = p_toks[0] == h_toks[0]

    result: dict[str, Any] = {
        "model": model,
        "model_path": path,
        "dtype": dtype,
        "device": device,
        "num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "input_len": input_len,
        "output_len": output_len,
        "batch_sizes": batch_sizes,
        "seed": seed,
        "repeats": repeats,
        "warmup": warmup,
        "include_hf": include_hf,
        "pdkv_engine": {
            "block_size": bs,
            "num_kv_blocks": num_kv_blocks,
            "max_num_seqs": max_b,
            "max_num_batched_tokens": max_b * input_len,
            "max_model_len": max_model_len,
            "enable_prefix_caching": False,
        },
        "results": results,
        "greedy_match": greedy_b1,
        # 1-minute load average of the host before / after: other busy processes compete for
        # the same cores and distort CPU timings (a value near or above the core count is suspect).
        "host_load_avg_1m": [load_before, os.getloadavg()[0]],
        "host_cpu_count": os.cpu_count(),
        "host_cpu": cpu_description(),
    }
    result["table"] = format_table(result)
    if verbose:
        print(result["table"], flush=True)
    return result
