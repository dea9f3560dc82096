"""`pdkv bench kvquant`: how far int8 / fp8 KV caches move greedy outputs from the unquantized
(`auto`, the model dtype) cache (issue 12, acceptance 3).

Method: the model is loaded once; for each `--kv-cache-dtype` value a fresh paged KV cache of
that dtype (pdkv.worker.kv_cache) holds N prompts, which are prefilled in one batch and decoded
greedily for M tokens, batched, through the same attention code the engine runs. Per dtype,
against `auto`:
- first step: max |logit difference| over the N prompts' next-token logits (the whole
  vocabulary), and how many prompts pick the same first token;
- greedy agreement: the common prefix of each prompt's M tokens with auto's (tokens after a
  first divergence are conditioned on a different history, so only the prefix is compared),
  summed over prompts / (N × M), and how many prompts agree on all M tokens;
- KV bytes per token per layer (the page formula of pdkv.cache.specs.FullAttentionSpec).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass

import torch

from pdkv.cache.specs import canonical_kv_cache_dtype
from pdkv.model.llama import LlamaForCausalLM
from pdkv.model.loader import load_model
from pdkv.model.registry import resolve_model
from pdkv.worker.attn_metadata import build_attention_metadata
from pdkv.worker.kv_cache import KVCacheSizing, allocate_kv_cache, make_kv_cache_config

PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
    "Explain photosynthesis in one sentence.",
    "List three uses of a paperclip:",
    "The quick brown fox",
)


@dataclass(frozen=True)
class QuantRow:
    """One KV cache dtype against auto (see the module docstring)."""

    kv_cache_dtype: str
    bytes_per_token_layer: float
    max_abs_logit_diff: float
    first_token_same: int
    prefix_agreement: float
    sequences_identical: int
    num_prompts: int
    max_tokens: int
    seconds: float


def greedy_run(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    max_tokens: int,
    kv_cache_dtype: str,
    block_size: int = 16,
) -> tuple[torch.Tensor, list[list[int]], int]:
    """Prefill `prompts` in one batch and decode `max_tokens` greedy tokens each over a fresh KV
    cache of `kv_cache_dtype`. Returns (first-step logits [N, vocab] float32, tokens per prompt,
    bytes of one block of one layer)."""
    arch = model.cfg
    dtype = str(model.embed.dtype).removeprefix("torch.")
    longest = max(len(p) for p in prompts) + max_tokens
    per_req = -(-longest // block_size)
    sizing = KVCacheSizing(block_size=block_size, dtype=dtype, max_model_len=longest,
                           cache_dtype=canonical_kv_cache_dtype(kv_cache_dtype, dtype),
                           num_kv_blocks=per_req * len(prompts))
    kv_config = make_kv_cache_config(arch, sizing)
    _, caches = allocate_kv_cache(kv_config, model.embed.dtype, model.embed.device)
    dev = model.embed.device
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(len(prompts))]
    reqs, start = [], 0
    for p, t in zip(prompts, tables):
        reqs.append((start, len(p), 0, t))
        start += len(p)
    ids = torch.tensor([x for p in prompts for x in p], device=dev)
    pos = torch.tensor([i for p in prompts for i in range(len(p))], device=dev)
    last = torch.tensor([s + n - 1 for s, n, _, _ in reqs], device=dev)
    with torch.inference_mode():
        meta = build_attention_metadata(reqs, len(ids), block_size, dev)
        logits = model(ids, pos, caches, meta, last)
        first = logits.clone()
        out = [[int(t)] for t in logits.argmax(-1)]
        for step in range(1, max_tokens):
            ctx = [len(p) + step - 1 for p in prompts]
            meta = build_attention_metadata(
                [(i, 1, c, t) for i, (c, t) in enumerate(zip(ctx, tables))],
                len(prompts),
                block_size,
                dev,
            )
            ids = torch.tensor([o[-1] for o in out], device=dev)
            logits = model(
                ids,
                torch.tensor(ctx, device=dev),
                caches,
                meta,
                torch.arange(len(prompts), device=dev),
            )
            for o, t in zip(out, logits.argmax(-1)):
                o.append(int(t))
    spec = kv_config.groups[0].spec
    return first, out, spec.page_size_bytes


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def measure(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    max_tokens: int,
    kv_cache_dtypes: tuple[str, ...] = ("int8", "fp8"),
    block_size: int = 16,
) -> list[QuantRow]:
    """auto's row first (its own reference), then one row per quantized dtype."""
    t0 = time.perf_counter()
    ref_logits, ref, ref_page = greedy_run(model, prompts, max_tokens, "auto", block_size)
    rows = [
        QuantRow(
            "auto",
            ref_page / block_size,
            0.0,
            len(prompts),
            1.0,
            len(prompts),
            len(prompts),
            max_tokens,
            time.perf_counter() - t0,
        )
    ]
    for dt in kv_cache_dtypes:
        t0 = time.perf_counter()
        logits, toks, page = greedy_run(model, prompts, max_tokens, dt, block_size)
        rows.append(
            QuantRow(
                kv_cache_dtype=dt,
                bytes_per_token_layer=page / block_size,
                max_abs_logit_diff=float((logits - ref_logits).abs().max()),
                first_token_same=sum(a[0] == b[0] for a, b in zip(toks, ref)),
                prefix_agreement=sum(common_prefix(a, b) for a, b in zip(toks, ref))
                / (len(prompts) * max_tokens),
                sequences_identical=sum(a == b for a, b in zip(toks, ref)),
                num_prompts=len(prompts),
                max_tokens=max_tokens,
                seconds=time.perf_counter() - t0,
            )
        )
    return rows


def format_rows(rows: list[QuantRow]) -> str:
    """A fixed-width table of the rows."""
    head = (
        f"{'kv_cache_dtype':<14} {'B/token/layer':>13} {'max|dlogit| step1':>17} "
        f"{'step1 same':>10} {'prefix agree':>12} {'identical':>9} {'seconds':>8}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.kv_cache_dtype:<14} {r.bytes_per_token_layer:>13.0f} "
            f"{r.max_abs_logit_diff:>17.4f} "
            f"{r.first_token_same:>5}/{r.num_prompts:<4} {r.prefix_agreement:>12.3f} "
            f"{r.sequences_identical:>4}/{r.num_prompts:<4} {r.seconds:>8.1f}"
        )
    return "\n".join(lines)


def add_greedy_run_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by the greedy-agreement benchmarks (`pdkv bench kvquant`, `pdkv bench dtype`):
    model, prompts, tokens per prompt, threads, JSON output."""
    p.add_argument("--model", default="smollm2", help="registry name or model folder")
    p.add_argument(
        "--num-prompts", type=int, default=len(PROMPTS), help=f"prompts (at most {len(PROMPTS)})"
    )
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument(
        "--num-threads", type=int, default=0, help="torch CPU threads (0: torch's default)"
    )
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_greedy_run_args(p)
    p.add_argument(
        "--kv-cache-dtypes", default="int8,fp8", help="quantized dtypes to compare with auto"
    )
    p.add_argument("--block-size", type=int, default=16)


def main(args: argparse.Namespace) -> int:
    """Print the table (and write --json); 0."""
    from pdkv.bench.results import write_result_json
    from pdkv.tokenizer import Tokenizer

    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    path = resolve_model(args.model)
    model = load_model(path, "float32", "cpu")
    model.pack_cpu_weights()
    tok = Tokenizer(path)
    prompts = [tok.encode(t) for t in PROMPTS[: args.num_prompts]]
    dtypes = tuple(d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip())
    rows = measure(model, prompts, args.max_tokens, dtypes, args.block_size)
    print(f"{args.model}: {len(prompts)} prompts x {args.max_tokens} greedy tokens, float32 model, "
          f"block_size {args.block_size}; references: kv_cache_dtype=auto")
    print(format_rows(rows))
    if args.json:
        result: dict[str, object] = {"model": args.model, "rows": [asdict(r) for r in rows]}
        write_result_json(result, args.json)
        print(f"wrote {args.json}")
    return 0
