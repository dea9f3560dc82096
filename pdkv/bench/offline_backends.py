"""`pdkv bench offline --attention-backends torch,cpu_paged`: decode throughput of pdkv per
attention backend, in one process and one run.

One engine per backend (same model, dtype, threads, block size, prompts); for each batch size the
backends are measured one after the other (so machine load drifts equally over both), with the
formulas of `pdkv.bench.offline` (decode tok/s = B * (output_len - 1) / (seconds for output_len
tokens - seconds for 1 token)). The table gives each backend's decode tok/s, the ratio of each to
the first backend, and whether the greedy tokens of every backend equal the first's. The host's
1-minute load average before and after is reported: other processes on the cores distort CPU
timings.

A backend name may end in `:no-fused` (e.g. `cpu_paged,cpu_paged:no-fused`): that engine runs
with `--no-fused-ops` (the torch small ops instead of pdkv.model.fused_ops), so fused ops are
compared on and off in one run. Prefill tok/s of each batch (B x input_len prompt tokens in the
first step) are listed under the decode table.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from pdkv.bench.offline_measure import measure, ratio, run_pdkv, throughputs
from pdkv.bench.offline_prompts import build_prompts
from pdkv.bench.offline_report import cpu_description

_BLOCK_SIZE = 16
NO_FUSED = ":no-fused"
"""Suffix of a backend name whose engine runs without the fused small ops."""


def split_backend(name: str) -> tuple[str, bool]:
    """"cpu_paged:no-fused" -> ("cpu_paged", False); "torch" -> ("torch", True) (fused ops on
    when built)."""
    if name.endswith(NO_FUSED):
        return name[: -len(NO_FUSED)], False
    return name, True


def run_backend_bench(
    model: str = "smollm2",
    backends: Sequence[str] = ("torch", "cpu_paged"),
    batch_sizes: Sequence[int] = (1, 32, 64),
    input_len: int = 128,
    output_len: int = 32,
    dtype: str = "float32",
    num_threads: int | None = None,
    seed: int = 0,
    repeats: int = 1,
    verbose: bool = True,
) -> dict[str, Any]:
    """Decode (and prefill) tok/s of pdkv per `--attention-backend` and batch size.

    Args:
        backends: attention backends to compare; ratios are against the first.
        batch_sizes: requests run together (B); lengths in tokens; repeats: best of N timings.
        num_threads: torch CPU threads (None: torch's default); restored on return.

    Returns:
        JSON-serializable dict: settings, "backends_used" (what each engine resolved to: a backend
        that could not load runs torch), "results" per batch size {"batch_size", backend:
        throughputs dict (prefill_s, total_s, decode_s seconds; prefill_tok_s, decode_tok_s),
        "decode_ratio" {backend: tok/s over the first's}, "greedy_equal" {backend: bool}},
        "host_load_avg_1m" [before, after], "table" (the printed text).

    Raises:
        ValueError: no backend, bad lengths or batch sizes.
    """
    from pdkv.engine.llm import LLM

    if not backends or min(batch_sizes, default=0) < 1 or input_len < 1 or output_len < 2:
        raise ValueError("need backends, batch sizes >= 1, input_len >= 1 and output_len >= 2")
    prev_threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        load_before = os.getloadavg()[0]
        max_b, bs = max(batch_sizes), _BLOCK_SIZE
        max_len = input_len + output_len + bs
        blocks = max_b * (-(-(input_len + output_len) // bs) + 1) + 16
        engines = {
            name: LLM(model=model, dtype=dtype, seed=seed, block_size=bs, num_kv_blocks=blocks,
                      max_model_len=max_len, max_num_seqs=max_b, max_num_batched_tokens=max_b * input_len,
                      enable_prefix_caching=False, num_threads=num_threads,
                      attention_backend=split_backend(name)[0], fused_ops=split_backend(name)[1])
            for name in backends
        }
        first = engines[backends[0]]
        device = first.llm_engine.config.model_config.device
        prompts = build_prompts(first.get_tokenizer(), max_b, input_len, seed)
        for llm in engines.values():  # warm-up, untimed
            run_pdkv(llm, prompts[:2], 2, device)
        results = []
        for b in batch_sizes:
            entry: dict[str, Any] = {"batch_size": b, "decode_ratio": {}, "greedy_equal": {}}
            toks: dict[str, list[list[int]]] = {}
            for name, llm in engines.items():
                pre, tot, toks[name], extra = measure(
                    lambda n, llm=llm, p=prompts[:b]: run_pdkv(llm, p, n, device), output_len, repeats)
                entry[name] = {**throughputs(b, input_len, output_len, pre, tot), "extra_runs": extra}
            for name in backends:
                entry["decode_ratio"][name] = ratio(entry[name]["decode_tok_s"],
                                                    entry[backends[0]]["decode_tok_s"])
                entry["greedy_equal"][name] = toks[name] == toks[backends[0]]
            results.append(entry)
        result: dict[str, Any] = {
            "model": model, "dtype": dtype, "num_threads": torch.get_num_threads(),
            "input_len": input_len, "output_len": output_len, "backends": list(backends),
            "backends_used": {n: e.llm_engine.runner.attention_backend
                              + (" + fused ops" if e.llm_engine.runner.fused_ops else "")
                              for n, e in engines.items()},
            "results": results, "host_load_avg_1m": [load_before, os.getloadavg()[0]],
            "host_cpu_count": os.cpu_count(), "host_cpu": cpu_description(),
        }
        result["table"] = format_backend_table(result)
        if verbose:
            print(result["table"], flush=True)
        return result
    finally:
        torch.set_num_threads(prev_threads)


def format_backend_table(result: dict[str, Any]) -> str:
    """The run as text: one row per batch size, decode tok/s per backend and ratios."""
    names = result["backends"]
    used = result["backends_used"]
    lines = [
        f"pdkv decode by attention backend: {result['model']} {result['dtype']}, "
        f"{result['num_threads']} threads, {result['input_len']} prompt + {result['output_len']} "
        f"output tokens; {result['host_cpu']}",
        "backends: " + ", ".join(f"{n} (ran {used[n]})" for n in names),
        "| batch | " + " | ".join(f"{n} decode tok/s" for n in names)
        + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " | greedy equal |",
        "|---" * (1 + 2 * len(names) - 1 + 1) + "|",
    ]
    for e in result["results"]:
        tok = [e[n]["decode_tok_s"] for n in names]
        rat = [e["decode_ratio"][n] for n in names[1:]]
        lines.append(
            f"| {e['batch_size']} | " + " | ".join("-" if t is None else f"{t:.1f}" for t in tok)
            + " | " + " | ".join("-" if r is None else f"{r:.2f}x" for r in rat)
            + f" | {'yes' if all(e['greedy_equal'].values()) else 'NO'} |"
        )
    pre = [(e["batch_size"], [e[n].get("prefill_tok_s") for n in names]) for e in result["results"]]
    if any(t is not None for _, toks in pre for t in toks):
        lines.append("prefill tok/s (batch x input_len prompt tokens): " + "; ".join(
            f"B={b}: " + ", ".join(f"{n} {'-' if t is None else f'{t:.0f}'}" for n, t in zip(names, toks))
            for b, toks in pre))
    lo, hi = result["host_load_avg_1m"]
    lines.append(f"host load average (1 min) before / after: {lo:.2f} / {hi:.2f} on {result['host_cpu_count']} CPUs")
    return "\n".join(lines)
