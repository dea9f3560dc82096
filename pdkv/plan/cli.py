"""`pdkv plan`: size KV, handoff and break-even before measuring (torch-free)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pdkv.modelspec import dtypes
from pdkv.modelspec.hf_config import spec_from_hf_config
from pdkv.plan import costs, links
from pdkv.plan.pcp import PcpShape
from pdkv.plan.planner import PlanInputs, make_plan
from pdkv.plan.report import render_json, render_text
from pdkv.plan.resolve import bundled_names, load_config


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The `pdkv plan` options."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model",
        help="alias (smollm2), bundled config ("
        + ", ".join(bundled_names())
        + "), a folder with config.json, or a config.json path",
    )
    src.add_argument("--kv-bytes", type=float, help="KV bytes of one request instead of a model")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (P:D ratio)")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", *dtypes.NAMES),
                   help="KV cache dtype; auto = the config's dtype")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (shards KV heads)")
    p.add_argument(
        "--dcp", type=int, default=1, help="decode-context-parallel size (shards tokens)"
    )
    p.add_argument("--pcp", type=int, default=1,
                   help="prefill-context-parallel size N: PCP's compute and all-gather terms for "
                   "a --prompt-len prefill, and the crossover prompt length (with --prefill-tps)")
    p.add_argument("--pcp-link", default="tcp-loopback", choices=tuple(links.PRESETS),
                   help="link PCP's all-gathers cross (default tcp-loopback: gloo between "
                   "processes on one box)")
    p.add_argument("--pcp-bandwidth", type=float, default=None,
                   help="effective bytes/s one rank's all-gather receives at")
    p.add_argument("--pcp-latency", type=float, default=None,
                   help="seconds per step of a ring all-gather")
    p.add_argument("--pcp-shared-speedup", type=float, default=None,
                   help="the PCP ranks share one box's cores: one rank on all of them is this "
                   "many times faster than on its 1/N share (N: linear in cores); default: each "
                   "rank has its own device")
    p.add_argument("--pcp-overhead", type=float, default=0.0,
                   help="seconds of a prefill that splitting does not shorten (scheduling, "
                   "sampling; `pdkv bench pcp` fits it); 0: all of --prefill-tps is compute")
    p.add_argument("--link", default=None, choices=tuple(links.PRESETS),
                   help="link preset (default tcp-loopback unless --link-bandwidth is given)")
    p.add_argument("--link-bandwidth", type=float, default=None, help="effective bytes/s")
    p.add_argument("--link-latency", type=float, default=None, help="one-way latency, seconds")
    p.add_argument("--sched-overhead", type=float, default=costs.FixedCosts.scheduling,
                   help="scheduling cost per handoff, seconds")
    p.add_argument("--layout-overhead", type=float, default=0.0,
                   help="layout conversion cost per handoff, seconds")
    p.add_argument(
        "--prefill-tps", type=float, default=None, help="measured prefill tok/s of one P"
    )
    p.add_argument("--decode-tps", type=float, default=None,
                   help="measured aggregate decode tok/s of one D at its working batch")
    p.add_argument("--target-ttft", type=float, default=None, help="TTFT target, seconds")
    p.add_argument("--target-tpot", type=float, default=None, help="TPOT target, seconds")
    p.add_argument("--act-dtype", default="auto", choices=("auto", *dtypes.NAMES),
                   help="activation dtype for the attention-FFN estimate (auto: the model's dtype)")
    p.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per KV cache block: P/D moves whole blocks (pdkv's and vLLM's default 16)",
    )
    p.add_argument("--context", type=_lengths, default=(),
                   help="comma-separated context lengths (e.g. 131072,1048576): the state of one "
                   "request per group and in total at each, and its handoff time over --link")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _lengths(text: str) -> tuple[int, ...]:
    """`--context 131072,1048576` as a tuple of ints.

    Raises:
        argparse.ArgumentTypeError: not comma-separated non-negative integers.
    """
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts >= 0, got {text!r}")
    return out


def _link(args: argparse.Namespace) -> links.Link:
    if args.link is None and args.link_bandwidth is not None:
        latency = args.link_latency if args.link_latency is not None else 0.0
        note = f"--link-bandwidth {args.link_bandwidth:g} B/s taken as the effective rate; " + (
            f"--link-latency {latency:g} s" if args.link_latency is not None else
            "latency 0 (no --link-latency)")
        return links.Link("custom", args.link_bandwidth, latency, note)
    return links.link(args.link or "tcp-loopback").with_overrides(args.link_bandwidth,
                                                                   args.link_latency)


def main(args: argparse.Namespace) -> int:
    """Run `pdkv plan`; prints text or JSON.

    Raises:
        ValueError: unknown model/link/dtype, invalid tp/dcp or numbers (cli.main prints it).
    """
    model, source, shape = None, "", None
    if args.model:
        cfg, source = load_config(args.model)
        model = spec_from_hf_config(cfg, args.model)
        if args.pcp > 1:
            shape = PcpShape.from_hf_config(cfg)
    inp = PlanInputs(
        link=_link(args), model=model, model_source=source, kv_bytes=args.kv_bytes,
        prompt_len=args.prompt_len, output_len=args.output_len, kv_dtype=args.kv_dtype,
        tp=args.tp, dcp=args.dcp,
        fixed=costs.FixedCosts(scheduling=args.sched_overhead, layout=args.layout_overhead),
        prefill_tps=args.prefill_tps, decode_tps=args.decode_tps, target_ttft=args.target_ttft,
        target_tpot=args.target_tpot, act_dtype=args.act_dtype, block_size=args.block_size,
        pcp=args.pcp, pcp_shape=shape,
        pcp_link=links.link(args.pcp_link).with_overrides(args.pcp_bandwidth, args.pcp_latency),
        pcp_shared_speedup=args.pcp_shared_speedup, pcp_overhead=args.pcp_overhead,
        contexts=args.context)
    figures = make_plan(inp)
    summary: dict[str, Any] = {
        "model": args.model,
        "config": source,
        "kv_bytes": args.kv_bytes,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "kv_dtype": args.kv_dtype,
        "tp": args.tp,
        "dcp": args.dcp,
        "pcp": args.pcp,
        "block_size": args.block_size,
        "context": ",".join(map(str, args.context)) or None,
        "link": inp.link.name,
        "prefill_tps": args.prefill_tps,
        "decode_tps": args.decode_tps,
        "target_ttft": args.target_ttft,
        "target_tpot": args.target_tpot,
    }
    if args.json:
        sys.stdout.write(render_json(summary, figures))
        return 0
    what = f"model {args.model} ({source})" if model else f"{args.kv_bytes:g} B of KV"
    header = [f"pdkv plan: {what}",
              "  " + ", ".join(f"{k}={v}" for k, v in summary.items()
                               if v is not None and k not in ("model", "config", "kv_bytes"))]
    if model:
        header.append(
            "  groups: " + "; ".join(f"{g.kind} × {g.num_layers} layers" for g in model.groups)
        )
    sys.stdout.write(render_text(header, figures))
    return 0
