"""Offline throughput benchmark: pdkv vs HF transformers on the same prompts, dtype and threads.

Both systems run in one process, one after the other for each batch size, so they share the
torch version, the thread count (`torch.set_num_threads`) and the machine state. For a batch of
B requests of `input_len` prompt tokens each:

* prefill throughput (tok/s) = B * input_len / (seconds to run the batch with 1 output token);
* decode throughput (tok/s) = B * (output_len - 1) / (seconds to generate output_len tokens
  minus the prefill seconds above), i.e. tokens generated after the first one per second.

pdkv runs `LLM.generate` with greedy `SamplingParams(max_tokens=..., ignore_eos=True)` and prefix
caching off; HF runs `model.generate(..., do_sample=False)` on the equal-length batch (no
padding) with EOS disabled, so both produce exactly the requested number of tokens and the same
greedy tokens. pdkv's time includes its scheduler and detokenization, HF's its generate loop.

Usage::

    from pdkv.bench.offline import run_offline_bench
    result = run_offline_bench(batch_sizes=(1, 8, 32), input_len=128, output_len=32)

or from the CLI (`add_cli_args` / `main`):
`pdkv bench offline --batch-sizes 1,8,32 --input-len 128 --output-len 32 --result-json out.json`.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_BLOCK_SIZE = 16

# Fixed English text; each prompt is one distinct opening sentence followed by this paragraph
# (repeated as needed), cut to exactly input_len tokens.
_PARAGRAPH = (
    "The river begins high in the mountains, where snow melts each spring and feeds a "
    "hundred small streams. These streams join in a narrow valley and become a fast, cold "
    "current that cuts through the rock. Further down, the valley opens into wide farmland, "
    "and the river slows, bends and spreads into marshes where birds stop on their long "
    "journeys north and south. Towns were built along its banks because the water carried "
    "boats, turned mill wheels and watered the fields. Over the centuries people built "
    "bridges, dams and canals, and the river changed as much as the towns did. Today "
    "scientists measure its flow, its temperature and the life it carries, and they warn that "
    "warmer winters bring less snow and earlier floods. "
)

_SUBJECTS = (
    "a library", "a harbour", "a vineyard", "an orchard", "a lighthouse", "a bakery",
    "a railway", "a museum", "a forest", "a glacier", "a market", "a school",
    "an observatory", "a garden", "a bridge", "a mine",
)


def build_prompts(tokenizer: Any, batch_size: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """Deterministic real-text prompts, all exactly `input_len` tokens long and pairwise different.

    Prompt i starts with its own sentence (request number, seed and subject), so prompts differ
    from their first tokens on and share no prefix-cache block; the fixed paragraph follows.

    Args:
        tokenizer: a transformers tokenizer (the model's).
        batch_size: number of prompts (requests).
        input_len: tokens per prompt.
        seed: varies the opening sentences.

    Returns:
        `batch_size` lists of `input_len` token ids (no special tokens added).
    """
    if input_len < 1:
        raise ValueError(f"input_len must be >= 1, got {input_len}")
    rng = random.Random(seed)
    para_ids = list(tokenizer.encode(_PARAGRAPH, add_special_tokens=False))
    prompts = []
    for i in range(batch_size):
        subject = _SUBJECTS[rng.randrange(len(_SUBJECTS))]
        head = (
            f"Report {i + 1} (series {seed}, code {rng.randrange(10**6):06d}) "
            f"describes {subject} near the river. "
        )
        ids = list(tokenizer.encode(head, add_special_tokens=False))
        while len(ids) < input_len:
            ids.extend(para_ids)
        prompts.append(ids[:input_len])
    return prompts


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _run_pdkv(llm: Any, prompts: list[list[int]], max_tokens: int, device: str) -> tuple[float, list[list[int]]]:
    """Seconds for `llm.generate` of the batch, and each request's output token ids."""
    from pdkv.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    gc.collect()
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    _sync(device)
    dt = time.perf_counter() - t0
    return dt, [list(o.outputs[0].token_ids) for o in outs]


def _run_hf(model: Any, input_ids: torch.Tensor, max_new_tokens: int, device: str) -> tuple[float, list[list[int]]]:
    """Seconds for HF `generate` of the batch, and each request's new token ids."""
    attention_mask = torch.ones_like(input_ids)
    gc.collect()
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
    )
    _sync(device)
    dt = time.perf_counter() - t0
    return dt, out[:, input_ids.shape[1]:].tolist()


def _best(fn: Any, repeats: int) -> tuple[float, list[list[int]]]:
    """Run `fn` `repeats` times; the shortest time and the last outputs."""
    best = math.inf
    toks: list[list[int]] = []
    for _ in range(max(1, repeats)):
        dt, toks = fn()
        best = min(best, dt)
    return best, toks


def _measure(run: Any, output_len: int, repeats: int, max_extra: int = 3) -> tuple[float, float | None, list[list[int]], int]:
    """Best-of-`repeats` seconds for 1 and for `output_len` tokens, and the output tokens.

    `run(max_tokens)` returns (seconds, token ids per request). When the longer run does not
    take longer than the 1-token run (timing noise, e.g. other processes on the cores), both are
    measured again, at most `max_extra` times, keeping the best of each.

    Returns:
        (prefill seconds, total seconds or None when output_len < 2, tokens, extra pairs run).
    """
    pre, toks = _best(lambda: run(1), repeats)
    if output_len < 2:
        return pre, None, toks, 0
    tot, toks = _best(lambda: run(output_len), repeats)
    extra = 0
    while tot <= pre and extra < max_extra:
        extra += 1
        pre = min(pre, run(1)[0])
        dt, toks = run(output_len)
        tot = min(tot, dt)
    return pre, tot, toks, extra


def _throughputs(b: int, input_len: int, output_len: int, prefill_s: float, total_s: float | None) -> dict[str, Any]:
    decode_s = None if total_s is None else total_s - prefill_s
    decode_tok_s = None
    if decode_s is not None and decode_s > 0 and output_len > 1:
        decode_tok_s = b * (output_len - 1) / decode_s
    return {
        "prefill_s": prefill_s,
        "total_s": total_s,
        "decode_s": decode_s,
        "prefill_tok_s": b * input_len / prefill_s,
        "decode_tok_s": decode_tok_s,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _load_hf(path: str, dtype: str, device: str, pad_token_id: int | None) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=_TORCH_DTYPES[dtype]).to(device)
    model.eval()
    gc_ = model.generation_config
    # No EOS: generate exactly max_new_tokens with plain argmax, like pdkv's ignore_eos=True.
    # (min_new_tokens would otherwise mask EOS, which ignore_eos does not.)
    gc_.eos_token_id = None
    gc_.pad_token_id = pad_token_id if pad_token_id is not None else 0
    for name in ("temperature", "top_p", "top_k"):
        if hasattr(gc_, name):
            setattr(gc_, name, None)
    return model


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
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_TORCH_DTYPES)}, got {dtype!r}")
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
        hf_model = _load_hf(path, dtype, device, tokenizer.pad_token_id)

    all_prompts = build_prompts(tokenizer, max(max_b, 1), input_len, seed)
    if warmup:
        wb = min(2, max_b)
        warm = all_prompts[:wb]
        _run_pdkv(llm, warm, min(output_len, 2), device)
        if hf_model is not None:
            _run_hf(hf_model, torch.tensor(warm, device=device), min(output_len, 2), device)

    results = []
    greedy_b1: bool | None = None
    for b in batch_sizes:
        prompts = all_prompts[:b]
        p_pre, p_tot, p_toks, p_extra = _measure(
            lambda n, p=prompts: _run_pdkv(llm, p, n, device), output_len, repeats
        )
        entry: dict[str, Any] = {
            "batch_size": b,
            "pdkv": {**_throughputs(b, input_len, output_len, p_pre, p_tot), "extra_runs": p_extra},
            "hf": None,
            "prefill_ratio": None,
            "decode_ratio": None,
            "greedy_match_requests": None,
        }
        if hf_model is not None:
            ids = torch.tensor(prompts, device=device)
            h_pre, h_tot, h_toks, h_extra = _measure(
                lambda n, x=ids: _run_hf(hf_model, x, n, device), output_len, repeats
            )
            entry["hf"] = {**_throughputs(b, input_len, output_len, h_pre, h_tot), "extra_runs": h_extra}
            entry["prefill_ratio"] = _ratio(
                entry["pdkv"]["prefill_tok_s"], entry["hf"]["prefill_tok_s"]
            )
            entry["decode_ratio"] = _ratio(entry["pdkv"]["decode_tok_s"], entry["hf"]["decode_tok_s"])
            entry["greedy_match_requests"] = sum(a == h for a, h in zip(p_toks, h_toks, strict=True))
            if b == 1:
                greedy_b1 = p_toks[0] == h_toks[0]
        results.append(entry)

    if hf_model is not None and greedy_b1 is None:
        # Batch 1 was not benchmarked: check greedy agreement on one untimed request.
        one = all_prompts[:1]
        _, p_toks = _run_pdkv(llm, one, output_len, device)
        _, h_toks = _run_hf(hf_model, torch.tensor(one, device=device), output_len, device)
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
        "host_cpu": _cpu_description(),
    }
    result["table"] = format_table(result)
    if verbose:
        print(result["table"], flush=True)
    return result


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _cpu_description() -> str:
    """CPU model and its widest vector extensions, from /proc/cpuinfo ("unknown" elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown"
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    ext = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(ext) or 'no avx2'})"


def format_table(result: dict[str, Any]) -> str:
    """Plain-text report of a `run_offline_bench` result (throughputs in tokens per second)."""
    lines = [
        f"pdkv offline benchmark  model={result['model']}  dtype={result['dtype']}  "
        f"device={result['device']}  threads={result['num_threads']}",
        f"input_len={result['input_len']} tok  output_len={result['output_len']} tok  "
        f"torch={result['torch_version']}  transformers={result['transformers_version']}  "
        f"repeats={result['repeats']} (best)",
        f"cpu: {result.get('host_cpu', 'unknown')}",
        "prefill tok/s = B*input_len / t(max_tokens=1);  "
        "decode tok/s = B*(output_len-1) / (t(output_len) - t(max_tokens=1))",
        "",
    ]
    cols = ["batch", "pdkv prefill tok/s", "HF prefill tok/s", "ratio",
            "pdkv decode tok/s", "HF decode tok/s", "ratio"]
    rows = []
    for e in result["results"]:
        hf = e["hf"] or {}
        rows.append([
            str(e["batch_size"]),
            _fmt(e["pdkv"]["prefill_tok_s"], ".1f"),
            _fmt(hf.get("prefill_tok_s"), ".1f"),
            _fmt(e["prefill_ratio"], ".2f"),
            _fmt(e["pdkv"]["decode_tok_s"], ".1f"),
            _fmt(hf.get("decode_tok_s"), ".1f"),
            _fmt(e["decode_ratio"], ".2f"),
        ])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines.append(" | ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    lines.append("-+-".join("-" * w for w in widths))
    for r in rows:
        lines.append(" | ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
    lines.append("")
    load = result.get("host_load_avg_1m")
    if load:
        lines.append(
            f"host load avg (1 min) before/after: {load[0]:.2f}/{load[1]:.2f} "
            f"on {result.get('host_cpu_count')} cpus"
        )
    gm = result["greedy_match"]
    lines.append(
        "greedy match (batch 1, pdkv vs HF token ids): "
        + ("n/a (no HF)" if gm is None else ("yes" if gm else "no"))
    )
    return "\n".join(lines)


def _parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--batch-sizes must be integers like 1,8,32: {e}") from e
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--batch-sizes must be positive integers, got {text!r}")
    return sizes


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `pdkv bench offline` flags to `parser` (lengths in tokens)."""
    parser.add_argument("--model", default="smollm2", help="alias (smollm2) or HF folder")
    parser.add_argument(
        "--batch-sizes", type=_parse_batch_sizes, default=[1, 8, 32],
        help="comma-separated batch sizes (requests run together), e.g. 1,8,32",
    )
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    parser.add_argument("--dtype", default="float32", choices=sorted(_TORCH_DTYPES))
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads for both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per measurement (best kept)")
    parser.add_argument("--no-hf", dest="include_hf", action="store_false", help="skip HF transformers")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warmup runs")
    parser.add_argument("--result-json", default=None, help="write the result dict to this file")
    return parser


def main(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed `add_cli_args` flags; write --result-json if given.

    Returns:
        Process exit code (0).
    """
    result = run_offline_bench(
        model=args.model,
        batch_sizes=tuple(args.batch_sizes),
        input_len=args.input_len,
        output_len=args.output_len,
        dtype=args.dtype,
        num_threads=args.num_threads,
        seed=args.seed,
        include_hf=args.include_hf,
        warmup=args.warmup,
        repeats=args.repeats,
    )
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(add_cli_args(argparse.ArgumentParser(description=__doc__)).parse_args()))
