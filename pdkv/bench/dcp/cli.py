"""`pdkv bench dcp`: KV bytes per rank and decode step time of decode context parallelism (DCP)
against its dcp 1 baseline, at long contexts on a tiny model (issue 10, acceptance 7).

Each configuration is one in-process engine (`LLM(..., cpu_linear="torch", block_size=16)`, no
prefix cache, KV pool sized for the longest context): `dcp1` (one process), `dcp2` (tp 1, weights
replicated, two worker processes), and optionally vLLM-mode `tp2` / `tp2-dcp2` on
tiny-llama-kv1 (`--vllm-model`). Per context length one request of that many random prompt tokens
runs its prefill, then `--decode-steps` decode steps; measured per decode step: the wall time of
`engine.step()`, and from the runner's `timings` rank 0's forward seconds and the DCP all-gather +
merge seconds in it. After the last decode step the KV the request holds is read off the scheduler
(blocks × physical block bytes per rank) beside the figure computed from the model config and the
DCP placement (pdkv.bench.dcp.report); then the request is aborted.

On a CPU box with few cores the worker processes of dcp 2 compete for the same cores, every step
crosses a pipe, and dcp 1 runs the single-rank SDPA attention while DCP runs the reference
(out, lse) path (pdkv/model/attention_lse.py), so the decode time is not a speed-up measurement:
the KV bytes per rank are the point.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdkv.bench.dcp.report import (
    DcpResult,
    DcpRow,
    Measured,
    add_ratios,
    format_table,
    kv_bytes_per_token,
    kv_tokens_per_rank,
    step_stats,
)
from pdkv.bench.results import parse_ints, write_result_json
from pdkv.parallel.layout import ParallelLayout

if TYPE_CHECKING:
    from pdkv.engine.llm import LLM

BLOCK_TOKENS = 16
DEFAULT_CONTEXT_LENS = (1024, 4096, 8192)
DEFAULT_DECODE_STEPS = 32
QUICK_CONTEXT_LENS = (128, 256)
QUICK_DECODE_STEPS = 4
VOCAB_LOW = 1000  # clear of special tokens
STEP_DEADLINE_S = 600.0  # one request's prefill, or one decode step


@dataclass(frozen=True)
class BenchConfig:
    """One engine configuration.

    Attributes:
        name: its name on the command line and in the table.
        tp: tensor_parallel_size.
        dcp: decode_context_parallel_size.
        vllm_model: runs on --vllm-model (tiny-llama-kv1: vLLM mode needs tp / KV heads ≥ dcp)
            instead of --model.
        baseline: the config its ratios are taken against ("" for none).
    """

    name: str
    tp: int
    dcp: int
    vllm_model: bool = False
    baseline: str = ""


CONFIGS: dict[str, BenchConfig] = {c.name: c for c in (
    BenchConfig("dcp1", tp=1, dcp=1),
    BenchConfig("dcp2", tp=1, dcp=2, baseline="dcp1"),
    BenchConfig("tp2", tp=2, dcp=1, vllm_model=True),
    BenchConfig("tp2-dcp2", tp=2, dcp=2, vllm_model=True, baseline="tp2"),
)}
DEFAULT_CONFIGS = ("dcp1", "dcp2")


def note(configs: Sequence[BenchConfig]) -> str:
    """The caveat printed with the table: cores vs worker processes."""
    procs = max(ParallelLayout(c.tp, c.dcp, dcp_replicated=c.tp == 1).world_size for c in configs)
    return (
        f"Note: this machine has {os.cpu_count()} CPU cores; the {procs} worker processes of the "
        "largest config compete for them (and with any other load), so decode time at dcp 2 here "
        "is not a speed-up measurement: the KV bytes per rank are the point."
    )


def prompt_ids(length: int, vocab_size: int, seed: int) -> list[int]:
    """`length` token ids drawn uniformly from [1000, vocab_size)."""
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, vocab_size) for _ in range(length)]


def sizes(
    context_lens: Sequence[int], decode_steps: int, model_max_len: int
) -> tuple[int, list[int]]:
    """(max_model_len, prompt lengths): max_model_len fits the longest context plus the decode
    tokens, capped at the model's max_position_embeddings; a prompt that would not fit then is
    shortened to max_model_len − decode_steps − 2 tokens.

    Raises:
        ValueError: a context length below 1 or no room for the decode steps.
    """
    if not context_lens or min(context_lens) < 1:
        raise ValueError(f"context lengths must be >= 1 token, got {list(context_lens)}")
    max_len = min(model_max_len, max(context_lens) + decode_steps + 2)
    room = max_len - decode_steps - 2
    if room < 1:
        raise ValueError(
            f"max_model_len={max_len} leaves no prompt room for {decode_steps} decode steps"
        )
    return max_len, [min(n, room) for n in context_lens]


def _measure(llm: LLM, cfg: BenchConfig, prompt: list[int], decode_steps: int,
             per_token: int, interleave: int) -> Measured:
    """Prefill one request, time `decode_steps` decode steps, read its KV blocks, abort it."""
    from pdkv import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 2, ignore_eos=True)
    req, text = engine.make_request({"prompt_token_ids": prompt}, params)
    engine.add_request(req, text)
    try:
        deadline = time.monotonic() + STEP_DEADLINE_S
        t0 = time.perf_counter()
        while req.num_output_tokens < 1:  # prefill (chunked) until the first token
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{cfg.name}: prefill of {len(prompt)} tokens not done in {STEP_DEADLINE_S:g} s"
                )
            engine.step()
        prefill_s = time.perf_counter() - t0
        step_s, forward_s, comm_s = [], [], []
        for _ in range(decode_steps):
            t0 = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t0)
            if engine.last_num_scheduled_tokens != 1:
                raise RuntimeError(
                    f"{cfg.name}: a decode step scheduled {engine.last_num_scheduled_tokens} tokens"
                )
            forward_s.append(engine.runner.timings.forward)
            comm_s.append(engine.runner.timings.dcp_comm)
        kv_config = engine.runner.kv_cache_config
        blocks = len(engine.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0])
        tokens = req.num_computed_tokens
    finally:
        engine.abort_request([req.request_id])
    block_bytes_per_rank = (
        kv_config.block_bytes(0) // cfg.dcp
    )  # logical block = dcp physical blocks
    tokens_per_rank = kv_tokens_per_rank(tokens, interleave, cfg.dcp)
    return {
        "prompt_tokens": len(prompt),
        "context_tokens": tokens,
        "kv_tokens_per_rank": tokens_per_rank,
        "kv_bytes_per_token_per_rank": per_token,
        "kv_bytes_per_rank": tokens_per_rank * per_token,
        "blocks": blocks,
        "block_bytes_per_rank": block_bytes_per_rank,
        "kv_measured_bytes_per_rank": blocks * block_bytes_per_rank,
        "pool_bytes_per_rank": kv_config.total_bytes // cfg.dcp,
        "prefill_s": prefill_s,
        "decode_steps": decode_steps,
        **step_stats(step_s, forward_s, comm_s),
        "step_s": step_s,
        "forward_s": forward_s,
        "dcp_comm_s": comm_s,
    }


def run_config(cfg: BenchConfig, model: str, context_lens: Sequence[int], decode_steps: int,
               interleave: int = 1, seed: int = 0,
               num_threads: int | None = None) -> list[DcpRow]:
    """One engine of `cfg` on `model` (alias or folder); a row per context length (see module
    docstring for the fields' meaning; bytes, tokens, ms, shares in [0, 1]).

    Raises:
        ValueError: a layout the model's heads do not allow, bad context lengths.
        TimeoutError / RuntimeError: a step that did not finish or was not a one-token decode.
    """
    from pdkv import LLM
    from pdkv.cache.specs import DTYPE_BYTES
    from pdkv.model.llama import LlamaArchConfig
    from pdkv.model.registry import resolve_model

    path = resolve_model(model)
    arch = LlamaArchConfig.from_hf_folder(path)
    max_len, prompt_lens = sizes(context_lens, decode_steps, arch.max_position_embeddings)
    kw: dict[str, int] = {}
    if cfg.tp > 1 or cfg.dcp > 1:
        kw.update(tensor_parallel_size=cfg.tp, decode_context_parallel_size=cfg.dcp,
                  cp_kv_cache_interleave_size=interleave)
    llm = LLM(path, cpu_linear="torch", block_size=BLOCK_TOKENS, enable_prefix_caching=False,
              max_model_len=max_len, num_kv_blocks=-(-max_len // (BLOCK_TOKENS * cfg.dcp)) + 2,
              num_threads=num_threads, **kw)
    try:
        engine = llm.llm_engine
        layout = engine.config.parallel_config.layout()
        per_token = kv_bytes_per_token(arch.num_layers, layout.kv_heads_per_rank(arch.num_kv_heads),
                                       arch.head_dim, DTYPE_BYTES[engine.config.model_config.dtype])
        rows: list[DcpRow] = []
        for ctx, n in zip(context_lens, prompt_lens):
            prompt = prompt_ids(n, engine.vocab_size, seed + ctx)
            row = _measure(
                llm, cfg, prompt, decode_steps, per_token, interleave if cfg.dcp > 1 else 1
            )
            rows.append(DcpRow(config=cfg.name, baseline=cfg.baseline, model=model, tp=cfg.tp,
                               dcp=cfg.dcp, interleave=interleave, context_len=ctx,
                               **row))  # type: ignore[typeddict-item]  # ratios: add_ratios
        return rows
    finally:
        llm.llm_engine.shutdown()


def run_dcp_bench(
    configs: Sequence[str] = DEFAULT_CONFIGS,
    context_lens: Sequence[int] = DEFAULT_CONTEXT_LENS,
    decode_steps: int = DEFAULT_DECODE_STEPS,
    model: str = "tiny-llama-kv2",
    vllm_model: str = "tiny-llama-kv1",
    interleave: int = 1,
    seed: int = 0,
    num_threads: int | None = None,
    print_table: bool = True,
) -> DcpResult:
    """Every config of `configs` (names of CONFIGS) at every context length, in one run.

    Returns:
        {"rows": [...], "baselines": {config: baseline}, "note", "cpu_count", ...}; each row has the
        fields of run_config plus kv_ratio, kv_measured_ratio and step_ratio against its baseline.

    Raises:
        ValueError: an unknown config name or decode_steps < 1.
    """
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown config(s) {unknown}; choose from {sorted(CONFIGS)}")
    if decode_steps < 1:
        raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
    chosen = [CONFIGS[c] for c in configs]
    rows: list[DcpRow] = []
    for cfg in chosen:
        rows += run_config(cfg, vllm_model if cfg.vllm_model else model, context_lens, decode_steps,
                           interleave, seed, num_threads)
    add_ratios(rows)
    result: DcpResult = {
        "rows": rows,
        "baselines": {c.name: c.baseline for c in chosen},
        "note": note(chosen),
        "cpu_count": os.cpu_count(),
        "context_lens": list(context_lens),
        "decode_steps": decode_steps,
        "model": model,
        "vllm_model": vllm_model,
        "block_size": BLOCK_TOKENS,
        "interleave": interleave,
    }
    if print_table:
        print(format_table(result))
    return result


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """Flags of `pdkv bench dcp`."""
    p.add_argument(
        "--model", default="tiny-llama-kv2", help="model of dcp1 / dcp2 (alias or folder)"
    )
    p.add_argument(
        "--vllm-model",
        default="tiny-llama-kv1",
        help="model of tp2 / tp2-dcp2 (vLLM mode needs tp / KV heads to be a multiple of dcp)",
    )
    p.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"comma-separated, of {', '.join(CONFIGS)}; ratios vs dcp1 (tp2-dcp2 vs tp2)",
    )
    p.add_argument(
        "--context-lens",
        default=",".join(map(str, DEFAULT_CONTEXT_LENS)),
        help="prompt tokens per request, comma-separated (capped to the model's max length)",
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=DEFAULT_DECODE_STEPS,
        help="timed decode steps per context",
    )
    p.add_argument(
        "--cp-kv-cache-interleave-size", type=int, default=1, help="DCP interleave I (tokens)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    p.add_argument(
        "--num-threads", type=int, default=None, help="torch CPU threads (split among workers)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=(
            f"contexts {','.join(map(str, QUICK_CONTEXT_LENS))}, {QUICK_DECODE_STEPS} decode "
            "steps"
        ),
    )
    p.add_argument("--json", default=None, help="write the result (rows) as JSON to this path")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed flags; 0 on success."""
    contexts = list(QUICK_CONTEXT_LENS) if args.quick else parse_ints(args.context_lens)
    steps = QUICK_DECODE_STEPS if args.quick else args.decode_steps
    result = run_dcp_bench(
        [c.strip() for c in args.configs.split(",") if c.strip()],
        contexts,
        steps,
        args.model,
        args.vllm_model,
        args.cp_kv_cache_interleave_size,
        args.seed,
        args.num_threads,
    )
    if args.json:
        write_result_json(result, args.json)
        print(f"wrote {args.json}")
    return 0
