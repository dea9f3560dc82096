"""`pdkv bench dtype`: how far a lower-precision model dtype (bfloat16, float16) moves greedy
outputs from float32, and how long the same greedy run takes in each.

Method (the kvquant bench's, pdkv/bench/model/kv_quant.py, with the model dtype varied instead of
the KV cache's): the model is loaded in float32 and in the dtype under test, each with the
`--cpu-linear` mode given (default panel, the engine's; auto times its table on that dtype); N
prompts are prefilled in one batch and decoded greedily for M tokens over a KV cache of the model
dtype. Reported against float32: first-step max |logit difference| (whole vocabulary), prompts with
the same first token, greedy common-prefix agreement (summed prefix / (N x M)), prompts identical in
all M tokens, and each run's seconds. The CPU's bf16 flags are printed (pdkv/model/cpu_features.py).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass

import torch

from pdkv.bench.model.kv_quant import PROMPTS, add_greedy_run_args, common_prefix, greedy_run
from pdkv.model.cpu_features import read_cpu_features
from pdkv.model.cpu_linear import setup_cpu_linear
from pdkv.model.llama import LlamaForCausalLM
from pdkv.model.loader import load_model
from pdkv.model.registry import resolve_model


@dataclass(frozen=True)
class DtypeRow:
    """One model dtype against float32 (see the module docstring); seconds are wall time."""

    dtype: str
    cpu_linear: str
    max_abs_logit_diff: float
    first_token_same: int
    prefix_agreement: float
    sequences_identical: int
    num_prompts: int
    max_tokens: int
    seconds: float


def load_with_linear(
    path: str, dtype: str, cpu_linear: str = "auto"
) -> tuple[LlamaForCausalLM, str]:
    """A CPU model in `dtype` with `cpu_linear` applied; returns (model, what the mode resolved
    to)."""
    model = load_model(path, dtype, "cpu")
    return model, setup_cpu_linear(model, cpu_linear, dtype, "cpu").describe()


def compare_dtypes(models: dict[str, tuple[LlamaForCausalLM, str]], prompts: list[list[int]],
                   max_tokens: int) -> list[DtypeRow]:
    """One row per model; the first entry of `models` ({dtype: (model, cpu_linear)}) is the
    reference (its row has zero error)."""
    rows: list[DtypeRow] = []
    ref_logits: torch.Tensor | None = None
    ref: list[list[int]] = []
    for dtype, (model, linear) in models.items():
        t0 = time.perf_counter()
        logits, toks, _ = greedy_run(model, prompts, max_tokens, "auto")
        secs = time.perf_counter() - t0
        if ref_logits is None:
            ref_logits, ref = logits, toks
        rows.append(
            DtypeRow(
                dtype=dtype,
                cpu_linear=linear,
                max_abs_logit_diff=float((logits - ref_logits).abs().max()),
                first_token_same=sum(a[0] == b[0] for a, b in zip(toks, ref)),
                prefix_agreement=sum(common_prefix(a, b) for a, b in zip(toks, ref))
                / (len(prompts) * max_tokens),
                sequences_identical=sum(a == b for a, b in zip(toks, ref)),
                num_prompts=len(prompts),
                max_tokens=max_tokens,
                seconds=secs,
            )
        )
    return rows


def format_rows(rows: list[DtypeRow]) -> str:
    """A fixed-width table of the rows."""
    lines = [f"{'dtype':<9} {'max|dlogit| step1':>17} {'step1 same':>10} {'prefix agree':>12} "
             f"{'identical':>9} {'seconds':>8}  cpu-linear"]
    for r in rows:
        lines.append(
            f"{r.dtype:<9} {r.max_abs_logit_diff:>17.4f} "
            f"{r.first_token_same:>5}/{r.num_prompts:<4} "
            f"{r.prefix_agreement:>12.3f} {r.sequences_identical:>4}/{r.num_prompts:<4} "
            f"{r.seconds:>8.1f}  {r.cpu_linear}"
        )
    return "\n".join(lines)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """`pdkv bench dtype` flags (tokens; threads)."""
    add_greedy_run_args(p)
    p.add_argument(
        "--dtypes", default="bfloat16", help="dtypes to compare with float32, e.g. bfloat16,float16"
    )
    p.add_argument("--cpu-linear", default="panel", choices=["panel", "onednn", "auto", "torch"],
                   help="matmuls of both models, as the engine's --cpu-linear")


def main(args: argparse.Namespace) -> int:
    """Print the table (and write --json); 0."""
    from pdkv.bench.results import write_result_json
    from pdkv.tokenizer import Tokenizer

    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    path = resolve_model(args.model)
    prompts = [Tokenizer(path).encode(t) for t in PROMPTS[: args.num_prompts]]
    dtypes = ["float32"] + [
        d.strip() for d in args.dtypes.split(",") if d.strip() and d.strip() != "float32"
    ]
    models = {d: load_with_linear(path, d, args.cpu_linear) for d in dtypes}
    rows = compare_dtypes(models, prompts, args.max_tokens)
    print(
        f"{args.model}: {len(prompts)} prompts x {args.max_tokens} greedy tokens, reference "
        "float32, "
        f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''}; CPU bf16 "
        f"flags: {read_cpu_features().describe()}"
    )
    print(format_rows(rows))
    if args.json:
        result: dict[str, object] = {"model": args.model, "rows": [asdict(r) for r in rows]}
        write_result_json(result, args.json)
        print(f"wrote {args.json}")
    return 0
