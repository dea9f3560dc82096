"""`pdkv bench offline --attention-backends torch,cpu_paged` (or `--cpu-linears torch,onednn,auto`):
prefill and decode throughput of pdkv per attention backend (or per CPU matmul mode), in one
process and one run.

One engine per backend (same model, dtype, threads, block size, prompts); for each batch size the
backends are measured one after the other (so machine load drifts equally over both), with the
formulas of `pdkv.bench.offline.cli` (decode tok/s = B * (output_len - 1) / (seconds of an
output_len run after its first tokens), pdkv.bench.offline.measure). The table gives each
backend's decode tok/s, the ratio of each to the first backend, and whether the greedy tokens
of every backend equal the first's. A second table gives prefill tok/s per prefill case (B
requests of L prompt tokens each, all prefilled in one step: `--prefill-cases 1x512,32x128`;
prefill tok/s = B * L / seconds of a generate of one output
token), best of `repeats`, with the same ratios. The host's
1-minute load average before and after is reported: other processes on the cores distort CPU
timings.

A backend name may end in `:no-fused` (e.g. `cpu_paged,cpu_paged:no-fused`): that engine runs
with `--no-fused-ops` (the torch small ops instead of pdkv.model.fused_ops), so fused ops are
compared on and off in one run. Prefill tok/s of each batch (B x input_len prompt tokens in the
first step) are listed under the decode table.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pdkv.bench.offline.measure import measure, ratio, run_pdkv, throughputs
from pdkv.bench.offline.prompts import build_prompts
from pdkv.bench.offline.report import cpu_description

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pdkv.engine.llm import LLM

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
    prefill_cases: Sequence[tuple[int, int]] = ((1, 512), (32, 128)),
    knob: str = "attention_backend",
) -> dict[str, Any]:
    """Decode (and prefill) tok/s of pdkv per `--attention-backend` (or per `knob`) and batch size.

    Args:
        backends: values of `knob` to compare; ratios are against the first.
        knob: the LLM keyword varied: "attention_backend" or "cpu_linear".
        batch_sizes: requests run together (B); lengths in tokens; repeats: best of N timings.
        num_threads: torch CPU threads (None: torch's default); restored on return.
        prefill_cases: (B, L) pairs: B prompts of L tokens prefilled in one step, timed alone.

    Returns:
        JSON-serializable dict: settings, "backends_used" (what each engine resolved to: a backend
        that could not load runs torch), "results" per batch size {"batch_size", backend:
        throughputs dict (prefill_s, total_s, decode_s seconds; prefill_tok_s, decode_tok_s),
        "decode_ratio" {backend: tok/s over the first's}, "greedy_equal" {backend: bool}},
        "prefill" per case {"batch_size", "input_len", backend: {"prefill_s", "prefill_tok_s"},
        "prefill_ratio", "greedy_equal"},
        "host_load_avg_1m" [before, after], "table" (the printed text).

    Raises:
        ValueError: no backend, bad lengths or batch sizes.
    """
    from pdkv.engine.llm import LLM

    if not backends or min(batch_sizes, default=0) < 1 or input_len < 1 or output_len < 2:
        raise ValueError("need backends, batch sizes >= 1, input_len >= 1 and output_len >= 2")
    if any(b < 1 or n < 1 for b, n in prefill_cases):
        raise ValueError(f"prefill cases need B >= 1 and L >= 1, got {list(prefill_cases)}")
    if knob not in ("attention_backend", "cpu_linear"):
        raise ValueError(f"knob must be attention_backend or cpu_linear, got {knob!r}")
    prev_threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        load_before = os.getloadavg()[0]
        bs = _BLOCK_SIZE
        shapes = [(b, input_len + output_len) for b in batch_sizes] + [
            (b, n + 1) for b, n in prefill_cases
        ]
        max_b = max(b for b, _ in shapes)
        max_len = max(n for _, n in shapes) + bs
        blocks = max(b * (-(-n // bs) + 1) for b, n in shapes) + 16
        step_tokens = max([max(batch_sizes) * input_len] + [b * n for b, n in prefill_cases])
        engines = {
            name: LLM(
                model=model,
                dtype=dtype,
                seed=seed,
                block_size=bs,
                num_kv_blocks=blocks,
                max_model_len=max_len,
                max_num_seqs=max_b,
                max_num_batched_tokens=step_tokens,
                enable_prefix_caching=False,
                num_threads=num_threads,
                **_engine_knobs(knob, name),
            )
            for name in backends
        }
        first = engines[backends[0]]
        device = first.llm_engine.config.model_config.device
        prompts = build_prompts(first.get_tokenizer(), max_b, input_len, seed)
        for llm in engines.values():  # warm-up, untimed
            run_pdkv(llm, prompts[:2], 2, device)
        results = []
        for b in batch_sizes:
            entry: dict[str, Any] = {
                "batch_size": b,
                "decode_ratio": {},
                "prefill_ratio": {},
                "greedy_equal": {},
            }
            toks: dict[str, list[list[int]]] = {}
            for name, llm in engines.items():
                pre, tot, toks[name], extra = measure(
                    functools.partial(run_pdkv, llm, prompts[:b], device=device), output_len,
                    repeats)
                entry[name] = {
                    **throughputs(b, input_len, output_len, pre, tot),
                    "extra_runs": extra,
                }
            for name in backends:
                entry["decode_ratio"][name] = ratio(entry[name]["decode_tok_s"],
                                                    entry[backends[0]]["decode_tok_s"])
                entry["prefill_ratio"][name] = ratio(entry[name]["prefill_tok_s"],
                                                     entry[backends[0]]["prefill_tok_s"])
                entry["greedy_equal"][name] = toks[name] == toks[backends[0]]
            results.append(entry)
        prefill = [_prefill_case(engines, first.get_tokenizer(), b, n, seed, repeats, device)
                   for b, n in prefill_cases]
        result: dict[str, Any] = {
            "model": model,
            "dtype": dtype,
            "num_threads": torch.get_num_threads(),
            "input_len": input_len,
            "output_len": output_len,
            "backends": list(backends),
            "knob": knob,
            "backends_used": {n: _resolved(e, knob) for n, e in engines.items()},
            "results": results,
            "prefill": prefill,
            "host_load_avg_1m": [load_before, os.getloadavg()[0]],
            "host_cpu_count": os.cpu_count(),
            "host_cpu": cpu_description(),
        }
        result["table"] = format_backend_table(result)
        if verbose:
            print(result["table"], flush=True)
        return result
    finally:
        torch.set_num_threads(prev_threads)


def _prefill_case(engines: dict[str, LLM], tokenizer: PreTrainedTokenizerBase, b: int, n: int,
                  seed: int, repeats: int,
                  device: str) -> dict[str, Any]:
    """Prefill tok/s of every engine for B prompts of n tokens (one output token, best of repeats);
    ratios against the first engine."""
    prompts = build_prompts(tokenizer, b, n, seed)
    entry: dict[str, Any] = {
        "batch_size": b,
        "input_len": n,
        "prefill_ratio": {},
        "greedy_equal": {},
    }
    toks: dict[str, list[list[int]]] = {}
    for name, llm in engines.items():
        best = float("inf")
        for _ in range(max(1, repeats)):
            dt, toks[name], _ = run_pdkv(llm, prompts, 1, device)
            best = min(best, dt)
        entry[name] = {"prefill_s": best, "prefill_tok_s": b * n / best}
    names = list(engines)
    for name in names:
        entry["prefill_ratio"][name] = ratio(
            entry[name]["prefill_tok_s"], entry[names[0]]["prefill_tok_s"]
        )
        entry["greedy_equal"][name] = toks[name] == toks[names[0]]
    return entry


def _engine_knobs(knob: str, name: str) -> dict[str, str | bool]:
    """The LLM keywords of one compared engine: `cpu_linear=name`, or the attention backend of
    `name` and whether it runs the fused ops (a `:no-fused` suffix turns them off)."""
    if knob == "cpu_linear":
        return {"cpu_linear": name}
    backend, fused = split_backend(name)
    return {"attention_backend": backend, "fused_ops": fused}


def _resolved(llm: Any, knob: str) -> str:
    """What the engine's `knob` resolved to (cpu_linear auto: its table; the attention backend
    and whether fused ops run)."""
    runner = llm.llm_engine.runner
    if knob == "cpu_linear":
        setup = getattr(runner, "cpu_linear", None)
        return setup.describe() if setup is not None else "?"
    return str(runner.attention_backend) + (" + fused ops" if runner.fused_ops else "")


def format_backend_table(result: dict[str, Any]) -> str:
    """The run as text: one row per batch size, prefill and decode tok/s per backend and ratios."""
    names = result["backends"]
    used = result["backends_used"]
    by_linear = result.get("knob") == "cpu_linear"  # prefill and decode rows; else decode only
    what = "CPU matmul (--cpu-linear)" if by_linear else "attention backend (decode tok/s)"
    lines = [
        f"pdkv by {what}: {result['model']} {result['dtype']}, "
        f"{result['num_threads']} thread{'s' if result['num_threads'] != 1 else ''}, "
        f"{result['input_len']} prompt + {result['output_len']} "
        f"output tokens; {result['host_cpu']}",
        "backends: " + ", ".join(f"{n} (ran {used[n]})" for n in names),
        "| batch | "
        + ("phase | " if by_linear else "")
        + " | ".join(f"{n} tok/s" for n in names)
        + " | "
        + " | ".join(f"{n} / {names[0]}" for n in names[1:])
        + " | greedy equal |",
        "|---" * (1 + by_linear + 2 * len(names) - 1 + 1) + "|",
    ]
    for e in result["results"]:
        for phase in ("prefill", "decode") if by_linear else ("decode",):
            tok = [e[n][f"{phase}_tok_s"] for n in names]
            rat = [e[f"{phase}_ratio"][n] for n in names[1:]]
            lines.append(
                f"| {e['batch_size']} | " + (f"{phase} | " if by_linear else "")
                + " | ".join("-" if t is None else f"{t:.1f}" for t in tok)
                + " | " + " | ".join("-" if r is None else f"{r:.2f}x" for r in rat)
                + f" | {'yes' if all(e['greedy_equal'].values()) else 'NO'} |"
            )
    if result.get("prefill"):
        lines += [
            "| prefill B x L | " + " | ".join(f"{n} prefill tok/s" for n in names)
            + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " | greedy equal |",
            "|---" * (1 + 2 * len(names) - 1 + 1) + "|",
        ]
        for e in result["prefill"]:
            rat = [e["prefill_ratio"][n] for n in names[1:]]
            lines.append(
                f"| {e['batch_size']} x {e['input_len']} | "
                + " | ".join(f"{e[n]['prefill_tok_s']:.1f}" for n in names)
                + " | " + " | ".join("-" if r is None else f"{r:.2f}x" for r in rat)
                + f" | {'yes' if all(e['greedy_equal'].values()) else 'NO'} |"
            )
    lo, hi = result["host_load_avg_1m"]
    lines.append(
        f"host load average (1 min) before / after: {lo:.2f} / {hi:.2f} on "
        f"{result['host_cpu_count']} CPUs"
    )
    return "\n".join(lines)
