"""The `pdkv bench offline` run: build pdkv and its peers, time every batch size, assemble the
result.

Peers: "hf" (HF transformers, `offline_measure.run_hf`) and "llama.cpp" (llama-cpp-python's C API,
`offline_llamacpp.LlamaCppPeer`). Each system runs the same token ids, one after the other, with
the same thread count and the timing formulas of `pdkv.bench.offline.cli`. With llama.cpp, a batch-1
prefill of `long_prefill_len` tokens (default 512) is timed on every system too, and the result
gets the workload table with the machine's limits measured in the same process (read bandwidth,
FMA peak, matmul rate: `pdkv.bench.offline.limits`) and the speed goals
(`pdkv.bench.offline.workloads`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pdkv.bench.offline.measure import (
    TORCH_DTYPES,
    Timed,
    load_hf,
    measure,
    ratio,
    run_hf,
    run_pdkv,
    throughputs,
)
from pdkv.bench.offline.prompts import build_prompts
from pdkv.bench.offline.report import cpu_description, format_table, format_workload_table
from pdkv.bench.offline.workloads import (
    decode_context,
    evaluate_goals,
    goals_for,
    workload_rows,
)

if TYPE_CHECKING:
    from pdkv.bench.offline.llamacpp import LlamaCppPeer

_BLOCK_SIZE = 16
PEERS = ("hf", "llama.cpp")
DEFAULT_LONG_PREFILL_LEN = 512

# (seconds, tokens per request) for a batch of token-id prompts and a max token count.
RunFn = Callable[[list[list[int]], int], Timed]


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
    peers: Sequence[str] | None = None,
    long_prefill_len: int | None = None,
) -> dict[str, Any]:
    """Measure prefill and decode throughput of pdkv and its peers per batch size.

    Args:
        model: pdkv model alias or HF folder (resolved with `pdkv.model.registry.resolve_model`).
        batch_sizes: batch sizes B to measure (requests run together in one batch).
        input_len: prompt length per request, in tokens.
        output_len: generated tokens per request (>= 1; decode throughput needs >= 2).
        dtype: "float32" | "float16" | "bfloat16", for every system (llama.cpp: f32/bf16 GGUF).
        num_threads: CPU threads for every system (None: torch's default / $PDKV_NUM_THREADS);
            the caller's thread count is restored on return.
        seed: varies the prompts and the pdkv engine seed.
        include_hf: used when `peers` is None: peers ("hf",) if True else ().
        warmup: one untimed small run per system before timing.
        repeats: timed runs per measurement; the shortest time is kept.
        verbose: print the header and tables (and a peer's skip message) to stdout.
        peers: systems to compare with pdkv, from PEERS. llama.cpp is skipped with a message
            ("llamacpp_skipped") when its binding or GGUF is missing (`make llama-cpp`).
        long_prefill_len: prompt tokens of the extra batch-1 prefill (None: 512 when llama.cpp
            runs, else not measured; 0: not measured).

    Returns:
        A JSON-serializable dict: run settings ("model", "model_path", "dtype", "num_threads",
        "torch_version", "transformers_version", "device", "input_len", "output_len", "peers",
        ...), "results": one entry per batch size with "pdkv", "hf" and "llamacpp" (None when not
        run) holding "prefill_s" / "total_s" / "decode_s" (seconds) and "prefill_tok_s" /
        "decode_tok_s" (tokens per second; decode None when output_len < 2 or the time
        difference stayed non-positive) and "extra_runs" (re-measurements after such noise),
        "prefill_ratio" / "decode_ratio" (pdkv / HF), "llamacpp_prefill_ratio" /
        "llamacpp_decode_ratio" (pdkv / llama.cpp), "greedy_match_requests" (requests whose pdkv
        greedy tokens equal HF's), "llamacpp_greedy_match_requests" (pdkv vs llama.cpp) and
        "greedy_match_requests_all" (equal on every system run); "long_prefill" (None or the
        same per-system figures for one prompt of long_prefill_len tokens), "greedy_match" (bool
        for batch 1 vs HF, None without HF), "workloads" (the workload rows, when llama.cpp was
        asked for, even if it was skipped), "limits" (`limits.limits_dict`, same condition),
        "goals" (`workloads.evaluate_goals`), "llamacpp_skipped" (the skip message or None) and
        "table" (the printed text).

    Raises:
        ValueError: bad lengths, batch sizes or peers, unknown model or dtype.
    """
    if peers is None:
        peers = ("hf",) if include_hf else ()
    peers = list(dict.fromkeys(peers))
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peers {unknown}; choose from {list(PEERS)}")
    if long_prefill_len is None:
        long_prefill_len = DEFAULT_LONG_PREFILL_LEN if "llama.cpp" in peers else 0
    prev_threads = torch.get_num_threads()
    try:
        if num_threads is not None and num_threads > 0:
            torch.set_num_threads(num_threads)
        return _bench(
            model, batch_sizes, input_len, output_len, dtype, num_threads, seed, peers,
            long_prefill_len, warmup, repeats, verbose,
        )
    finally:
        torch.set_num_threads(prev_threads)  # leave the caller's process as it was


def _open_llamacpp(model: str, dtype: str, output_len: int,
                   verbose: bool) -> tuple[LlamaCppPeer | None, str | None]:
    """(the llama.cpp peer or None, the skip message or None)."""
    from pdkv.bench.offline.llamacpp import load_peer, unavailable_reason

    reason = unavailable_reason(model, dtype)
    if reason is not None:
        if verbose:
            print(reason, flush=True)
        return None, reason
    return load_peer(model, dtype, torch.get_num_threads(), output_len), None


def _compare(entry: dict[str, Any], b: int, toks: dict[str, list[list[int]]]) -> None:
    """Ratios and greedy-token agreement of pdkv vs each peer measured in `entry`."""
    for name, key in (("hf", ""), ("llamacpp", "llamacpp_")):
        if entry.get(name) is None:
            continue
        for kind in ("prefill", "decode"):
            entry[f"{key}{kind}_ratio"] = ratio(
                entry["pdkv"][f"{kind}_tok_s"], entry[name][f"{kind}_tok_s"]
            )
        entry[f"{key}greedy_match_requests"] = sum(
            a == o for a, o in zip(toks["pdkv"], toks[name], strict=True)
        )
    # requests equal on every system; None with pdkv alone (nothing was compared)
    entry["greedy_match_requests_all"] = sum(
        all(toks[s][i] == toks["pdkv"][i] for s in toks) for i in range(b)
    ) if len(toks) > 1 else None


def _bench(
    model: str,
    batch_sizes: Sequence[int],
    input_len: int,
    output_len: int,
    dtype: str,
    num_threads: int | None,
    seed: int,
    peers: list[str],
    long_prefill_len: int,
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
    if long_prefill_len < 0:
        raise ValueError(f"long_prefill_len must be >= 0, got {long_prefill_len}")
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
    torch.manual_seed(seed)

    load_before = os.getloadavg()[0]
    max_b = max(batch_sizes)
    bs = _BLOCK_SIZE
    longest = max(input_len, long_prefill_len)
    max_model_len = longest + output_len + bs
    blocks_per_req = -(-(input_len + output_len) // bs) + 1
    num_kv_blocks = max(max_b * blocks_per_req + 16, -(-max_model_len // bs) + 1)
    max_batched = max(max_b * input_len, long_prefill_len)
    llm = LLM(
        model=model,
        dtype=dtype,
        seed=seed,
        block_size=bs,
        num_kv_blocks=num_kv_blocks,
        max_model_len=max_model_len,
        max_num_seqs=max_b,
        max_num_batched_tokens=max_batched,
        enable_prefix_caching=False,
        num_threads=num_threads,
    )
    device = llm.llm_engine.config.model_config.device
    path = resolve_model(model)
    tokenizer = llm.get_tokenizer()

    systems: dict[str, RunFn] = {"pdkv": lambda p, n: run_pdkv(llm, p, n, device)}
    if "hf" in peers:
        hf_model = load_hf(path, dtype, device, tokenizer.pad_token_id)
        systems["hf"] = lambda p, n: run_hf(hf_model, torch.tensor(p, device=device), n, device)
    llamacpp, skipped = None, None
    if "llama.cpp" in peers:
        llamacpp, skipped = _open_llamacpp(model, dtype, output_len, verbose)
        if llamacpp is not None:
            systems["llamacpp"] = llamacpp.run
    cost = limits = None
    if "llama.cpp" in peers:
        from pdkv.bench.offline.limits import measure_limits, model_cost

        cost = model_cost(path, dtype)
        limits = measure_limits(cost.weight_bytes)
    try:
        all_prompts = build_prompts(tokenizer, max(max_b, 1), input_len, seed)
        if warmup:
            warm = all_prompts[:min(2, max_b)]
            for run in systems.values():
                run(warm, min(output_len, 2))

        long_prefill = None
        if long_prefill_len and len(systems) > 1:
            long_prompt = build_prompts(tokenizer, 1, long_prefill_len, seed + 1)
            long_prefill = {"input_len": long_prefill_len, "batch_size": 1}
            long_toks = {}
            for name, run in systems.items():
                pre, _, toks, _ = measure(functools.partial(run, long_prompt), 1, repeats)
                long_prefill[name] = throughputs(1, long_prefill_len, 1, pre, None)
                long_toks[name] = toks
            _compare(long_prefill, 1, long_toks)

        results = []
        for b in batch_sizes:
            prompts = all_prompts[:b]
            entry: dict[str, Any] = {"batch_size": b, "hf": None, "llamacpp": None}
            toks = {}
            for name, run in systems.items():
                pre, tot, toks[name], extra = measure(
                    functools.partial(run, prompts), output_len, repeats
                )
                entry[name] = {
                    **throughputs(b, input_len, output_len, pre, tot),
                    "extra_runs": extra,
                }
            for key in ("prefill_ratio", "decode_ratio", "greedy_match_requests",
                        "llamacpp_prefill_ratio", "llamacpp_decode_ratio",
                        "llamacpp_greedy_match_requests", "greedy_match_requests_all"):
                entry[key] = None
            _compare(entry, b, toks)
            results.append(entry)

        greedy_b1 = None
        if "hf" in systems:
            one = [e for e in results if e["batch_size"] == 1]
            if one:
                greedy_b1 = one[0]["greedy_match_requests"] == 1
            else:  # batch 1 was not benchmarked: check greedy agreement on one untimed request
                p_toks = systems["pdkv"](all_prompts[:1], output_len)[1]
                h_toks = systems["hf"](all_prompts[:1], output_len)[1]
                greedy_b1 = p_toks[0] == h_toks[0]
    finally:
        if llamacpp is not None:
            llamacpp.close()

    from pdkv.bench.offline.llamacpp import binding_version

    result: dict[str, Any] = {
        "model": model,
        "model_path": path,
        "dtype": dtype,
        "device": device,
        "num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "llama_cpp_python_version": binding_version() if llamacpp is not None else None,
        "input_len": input_len,
        "output_len": output_len,
        "batch_sizes": batch_sizes,
        "seed": seed,
        "repeats": repeats,
        "warmup": warmup,
        "include_hf": "hf" in systems,
        "peers": peers,
        "llamacpp_skipped": skipped,
        "pdkv_engine": {
            "block_size": bs,
            "num_kv_blocks": num_kv_blocks,
            "max_num_seqs": max_b,
            "max_num_batched_tokens": max_batched,
            "max_model_len": max_model_len,
            "enable_prefix_caching": False,
        },
        "results": results,
        "long_prefill": long_prefill,
        "greedy_match": greedy_b1,
        # 1-minute load average of the host before / after: other busy processes compete for
        # the same cores and distort CPU timings (a value near or above the core count is suspect).
        "host_load_avg_1m": [load_before, os.getloadavg()[0]],
        "host_cpu_count": os.cpu_count(),
        "host_cpu": cpu_description(),
    }
    result["workloads"] = result["limits"] = result["goals"] = None
    if cost is not None and limits is not None:
        from pdkv.bench.offline.limits import limits_dict

        context = decode_context(result)
        result["workloads"] = workload_rows(result, cost, limits)
        result["limits"] = limits_dict(cost, limits, context)
        result["goals"] = evaluate_goals(result["workloads"], cost, limits,
                                         goals_for(result["dtype"]), context=context)
    result["table"] = format_table(result)
    if result["workloads"] is not None:
        result["table"] += "\n\n" + format_workload_table(result)
    if verbose:
        print(result["table"], flush=True)
    return result
