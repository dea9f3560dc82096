"""`python -m pdkv.bench.model.profile_step`: where one model step's CPU time goes, by kind of op.

Builds the model and a paged KV cache directly (no engine), fills the cache for B requests of
`--context` tokens, then runs a decode step (B = 1 and 32 by default), a prefill step
(`--prefill` tokens, one request) and batched prefill steps (`--prefill-cases 64x128`: 64 prompts
of 128 tokens in one step) under `torch.profiler` and sums each aten / pdkv op's self CPU
time into groups: linear (matmuls), attention (SDPA, the paged decode op, K/V gathers), rmsnorm,
rope, silu*mul, residual adds, kv write (index_put into the slots), fused (pdkv's fused small
ops), other. Shares are of the summed self time of all ops (Python overhead between ops is not
in it); `step ms` is the wall time of one step outside the profiler (best of `--repeats`).

Generic elementwise ops are told apart by their input shapes: `mul` / `add` on 3-D [T, heads, D]
tensors are rope; on 2-D ones `mul` of [T, intermediate] is the SiLU product (silu*mul), `add`
of two [T, hidden] the residual add, and the rest (RMSNorm's composite form: [T, 1] statistics,
the weight product) rmsnorm.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypedDict

import torch

if TYPE_CHECKING:
    from pdkv.model.llama import LlamaForCausalLM

GROUPS: dict[str, tuple[str, ...]] = {
    "linear": (
        "aten::addmm",
        "aten::mm",
        "aten::linear",
        "mkldnn::_linear_pointwise",
        "aten::matmul",
        "pdkv::panel_linear",
    ),
    "attention": (
        "aten::_scaled_dot_product",
        "aten::scaled_dot_product",
        "pdkv::paged_decode",
        "pdkv::paged_prefill",
        "aten::index",
        "aten::masked_fill",
        "aten::softmax",
        "aten::bmm",
    ),
    "rmsnorm": (
        "aten::rms_norm",
        "aten::_fused_rms_norm",
        "aten::rsqrt",
        "aten::pow",
        "aten::mean",
    ),
    "rope": ("aten::flip",),
    "silu*mul": ("aten::silu",),
    "residual add": ("aten::add",),
    "kv write": ("aten::index_put_", "aten::_index_put_impl_", "pdkv::write_kv_"),
    "fused": ("pdkv::fused_",),
}


def _group(name: str, shapes: Sequence[Sequence[int]], hidden: int) -> str:
    """The group of an op given its name, input shapes and the model's hidden size."""
    if name in ("aten::mul", "aten::add", "aten::add_"):
        dims = [list(s) for s in shapes if s]
        if any(len(s) == 3 for s in dims):
            return "rope"
        if name == "aten::mul":
            return "rmsnorm" if any(s[-1] in (1, hidden) for s in dims) else "silu*mul"
        return "residual add" if sum(s[-1] == hidden for s in dims) == 2 else "rmsnorm"
    for g, prefixes in GROUPS.items():
        if name.startswith(prefixes):
            return g
    return "other"


class StepProfile(TypedDict):
    """One profiled step: best wall time (ms), each op group's share of the profiled self CPU
    time and its milliseconds per step."""

    label: str
    step_ms: float
    shares: dict[str, float]
    group_ms: dict[str, float]


def _step_inputs(model: LlamaForCausalLM, batch: int, new: int, context: int, block_size: int,
                 num_blocks: int) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor]]:
    """A closure running one step of `batch` requests with `new` tokens each after `context`
    cached tokens (cache holds random K/V there), and the caches."""
    from pdkv.worker.attn_metadata import build_attention_metadata

    cfg = model.cfg
    kvh, d = model.num_local_kv_heads, cfg.head_dim
    dtype = model.rope_cos.dtype  # the model's activation and KV dtype
    caches = [(torch.randn(2, num_blocks, block_size, kvh, d) * 0.5).to(dtype)
              for _ in range(cfg.num_layers)]
    per = -(-(context + new) // block_size)
    reqs, ids, pos = [], [], []
    for b in range(batch):
        table = list(range(1 + b * per, 1 + (b + 1) * per))
        reqs.append((b * new, new, context, table))
        ids += [(b * 7919 + p) % cfg.vocab_size for p in range(new)]
        pos += list(range(context, context + new))
    meta = build_attention_metadata(reqs, batch * new, block_size, torch.device("cpu"))
    input_ids, positions = torch.tensor(ids), torch.tensor(pos)
    last = torch.arange(new - 1, batch * new, new)

    def step() -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids, positions, caches, meta, last)

    return step, caches


def profile_cases(model: LlamaForCausalLM, cases: Sequence[tuple[str, int, int, int]],
                  block_size: int = 16, repeats: int = 3) -> list[StepProfile]:
    """Profile each (label, batch, new tokens, context tokens) step.

    Returns:
        per case {"label", "step_ms" (best wall time, milliseconds), "shares" {group: fraction
        of the profiled self CPU time}, "group_ms" {group: milliseconds per step}}.
    """
    out: list[StepProfile] = []
    for label, batch, new, context in cases:
        num_blocks = 2 + batch * (-(-(context + new) // block_size))
        step, _ = _step_inputs(model, batch, new, context, block_size, num_blocks)
        step()  # warm-up
        best = float("inf")
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - t0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    record_shapes=True) as prof:
            step()
        sums: dict[str, float] = defaultdict(float)
        for ev in prof.key_averages(group_by_input_shape=True):
            sums[_group(ev.key, ev.input_shapes or (), model.cfg.hidden_size)] += (
                ev.self_cpu_time_total
            )  # microseconds
        total = sum(sums.values()) or 1.0
        out.append({
            "label": label, "step_ms": best * 1e3,
            "shares": {g: sums[g] / total for g in (*GROUPS, "other")},
            "group_ms": {g: sums[g] / 1e3 for g in (*GROUPS, "other")},
        })
    return out


def format_profile(rows: list[StepProfile], title: str) -> str:
    """Markdown table: one row per case, the share of each group in percent."""
    groups = [*GROUPS, "other"]
    lines = [
        title,
        "| step | step ms | " + " | ".join(groups) + " |",
        "|---" * (len(groups) + 2) + "|",
    ]
    for r in rows:
        lines.append(f"| {r['label']} | {r['step_ms']:.1f} | "
                     + " | ".join(f"{100 * r['shares'][g]:.1f} %" for g in groups) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m pdkv.bench.model.profile_step`."""
    from pdkv.model.cpu_linear import CPU_LINEARS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the model's weights, activations and KV cache (as the engine's --dtype)")
    p.add_argument("--num-threads", "--threads", dest="num_threads", type=int, default=2,
                   help="torch threads (as every pdkv bench's --num-threads)")
    p.add_argument("--decode-batches", default="1,32", help="comma-separated decode batch sizes")
    p.add_argument("--context", type=int, default=150, help="cached tokens per decoding request")
    p.add_argument("--prefill", type=int, default=512, help="prefill tokens (0: none)")
    p.add_argument("--prefill-cases", default="",
                   help="BxL prefill steps of B prompts of L tokens each, e.g. 64x128 "
                        "(comma-separated)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attention-backend", default="auto", help="auto, torch or cpu_paged")
    p.add_argument(
        "--no-fused-ops", action="store_true", help="the torch small ops (reference path)"
    )
    p.add_argument("--no-decode-layer-op", action="store_true",
                   help="decode steps run the Python layer (pdkv/model/decode_layer.py)")
    p.add_argument("--cpu-linear", default="panel", choices=CPU_LINEARS,
                   help="the matmuls, as the engine's --cpu-linear (default: the engine's default)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Print the profile table of decode and prefill steps."""
    from pdkv.bench.offline.cli import parse_prefill_cases
    from pdkv.bench.offline.report import cpu_description
    from pdkv.model.cpu_linear import setup_cpu_linear
    from pdkv.model.decode_layer import set_decode_layer_op
    from pdkv.model.fused_ops import set_fused_ops
    from pdkv.model.loader import load_model
    from pdkv.model.paged_prefill import install_attention_backend
    from pdkv.model.registry import resolve_model

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.num_threads)
    model = load_model(resolve_model(args.model), args.dtype, "cpu")
    linear = setup_cpu_linear(model, args.cpu_linear, args.dtype, "cpu").describe()
    backend = install_attention_backend(model, args.attention_backend, "cpu", "auto", 1, False)
    fused = set_fused_ops(model, not args.no_fused_ops)
    layer_ops = set_decode_layer_op(model, fused and not args.no_decode_layer_op, backend)
    cases = [
        (f"decode B={b}", b, 1, args.context) for b in map(int, args.decode_batches.split(",")) if b
    ]
    if args.prefill:
        cases.append((f"prefill {args.prefill}", 1, args.prefill, 0))
    cases += [(f"prefill {b} x {n}", b, n, 0) for b, n in parse_prefill_cases(args.prefill_cases)]
    load_before = os.getloadavg()[0]
    rows = profile_cases(model, cases, repeats=args.repeats)
    print(
        format_profile(
            rows,
            f"{args.model} {args.dtype}, {args.num_threads} "
            f"thread{'s' if args.num_threads != 1 else ''}, linear {linear}, attention {backend}, "
            f"fused ops {'on' if fused else 'off'}, decode layer op "
            f"{'on' if layer_ops else 'off'}, context {args.context}; cpu "
            f"{cpu_description()}, load average {load_before:.2f} / {os.getloadavg()[0]:.2f} "
            "before / after",
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
