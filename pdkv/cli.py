"""`pdkv` command line: serve | proxy | up | generate | bench {offline, serve, transfer, chaos, pool, handoff, dcp, hetero, groups, prefill-cap, kvquant, dtype, memory} | compare | plan | matrix."""

from __future__ import annotations

import argparse
import re
import sys
import time

from pdkv.cli_parser import PdkvArgumentParser

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "Give three tips for learning a new language.",
]


def _cmd_generate(args: argparse.Namespace) -> int:
    import logging

    from pdkv import LLM, SamplingParams
    from pdkv.engine.arg_utils import EngineArgs

    # As `pdkv serve`: the engine's start-up lines (the --cpu-linear auto table, fallbacks) show.
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        prompts = DEMO_PROMPTS
        args.chat = True
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    engine_args = EngineArgs.from_cli_args(args)
    t0 = time.perf_counter()
    llm = LLM(**vars(engine_args))
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    total_out = 0
    for prompt, out in zip(prompts, outputs):
        comp = out.outputs[0]
        m = out.metrics
        total_out += len(comp.token_ids)
        print(f"\n=== {out.request_id}: {prompt}")
        print(comp.text)
        ttft = m.ttft if m else None
        tpot = m.tpot if m else None
        e2e = m.e2el if m else None
        print(
            f"--- prompt {len(out.prompt_token_ids)} tok (cached {out.num_cached_tokens}), "
            f"output {len(comp.token_ids)} tok, finish={comp.finish_reason}, "
            f"TTFT {_ms(ttft)}, TPOT {_ms(tpot)}, E2EL {_ms(e2e)}"
        )
    print(
        f"\n{len(outputs)} request{'s' if len(outputs) != 1 else ''}, {total_out} output tokens in {wall:.2f} s "
        f"({total_out / wall:.1f} tok/s); model load {t_load:.1f} s"
    )
    return 0


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


# Commands that parse and run without importing torch: name -> (module, help).
_LIGHT_COMMANDS = {
    "plan": ("pdkv.plan.cli", "cost model: KV bytes, handoff time, recompute vs reload, P:D ratio (no torch)"),
    "matrix": ("pdkv.matrix.cli", "support matrix: run the tagged acceptance tests, write docs/SUPPORT_MATRIX.md"),
    "proxy": ("pdkv.router.proxy_cli", "P/D proxy (vLLM protocol) over prefill and decode engines"),
    "up": ("pdkv.router.launcher", "start a local colocated or P/D topology (engines + proxy)"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, except for flags that take no value (`--no-hf`, stored as
    False when given): their default says nothing a user can act on ("(default: True)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
            return action.help
        if action.help and re.search(r"\bdefaults?\b", action.help, re.IGNORECASE):
            return action.help  # the help says its default itself: no second "(default: ...)"
        return super()._get_help_string(action)


def _add_light(sub: argparse._SubParsersAction, name: str) -> None:  # type: ignore[type-arg]
    """Add the torch-free subcommand `name`: its module's `add_cli_args` and `main`."""
    import importlib

    module_name, help_text = _LIGHT_COMMANDS[name]
    module = importlib.import_module(module_name)
    p = sub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
    module.add_cli_args(p)
    p.set_defaults(func=module.main)


def build_light_parser(name: str) -> argparse.ArgumentParser:
    """A parser with only the torch-free subcommand `name` (`plan`, `matrix`, `proxy`, `up`):
    those run without importing torch (matrix runs its checks in a pytest subprocess; `up` starts
    its engines as `pdkv serve` processes)."""
    parser = PdkvArgumentParser(prog="pdkv", description=__doc__)
    _add_light(parser.add_subparsers(dest="command", required=True), name)
    return parser


def build_parser() -> argparse.ArgumentParser:
    from pdkv.engine.arg_utils import EngineArgs

    fmt = HelpFormatter
    parser = PdkvArgumentParser(prog="pdkv", description=__doc__, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="generate completions offline and print timings",
        description="Generate completions offline and print per-request timings. Without "
        "--prompt/--prompts-file, four built-in chat prompts are used.",
        formatter_class=fmt,
    )
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", help="one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    gen.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of random sampling")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    gen.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                     help="logging level of the engine's messages")
    gen.set_defaults(func=_cmd_generate)

    from pdkv.serve import api_server

    serve = sub.add_parser(
        "serve", help="OpenAI-compatible server with Prometheus metrics", formatter_class=fmt
    )
    api_server.add_cli_args(serve)
    serve.set_defaults(func=api_server.main)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    offline = bench_sub.add_parser(
        "offline", help="offline throughput: pdkv vs HF transformers", formatter_class=fmt
    )
    from pdkv.bench import offline as offline_bench

    offline_bench.add_cli_args(offline)
    offline.set_defaults(func=offline_bench.main)
    from pdkv.bench import serve as serve_bench

    serve_p = bench_sub.add_parser(
        "serve",
        help="online serving benchmark against an OpenAI-compatible server",
        formatter_class=fmt,
    )
    serve_bench.add_cli_args(serve_p)
    serve_p.set_defaults(func=serve_bench.main)
    from pdkv.bench import transfer as transfer_bench

    transfer_p = bench_sub.add_parser(
        "transfer", help="KV transfer engines vs raw socket and memcpy (GB/s)", formatter_class=fmt
    )
    transfer_bench.add_cli_args(transfer_p)
    transfer_p.set_defaults(func=transfer_bench.main)
    from pdkv.bench import chaos as chaos_bench

    chaos_p = bench_sub.add_parser(
        "chaos", help="1P1D through the proxy under client cancels and a prefill restart", formatter_class=fmt
    )
    chaos_bench.add_cli_args(chaos_p)
    chaos_p.set_defaults(func=chaos_bench.main)
    from pdkv.bench import pool as pool_bench

    pool_p = bench_sub.add_parser(
        "pool", help="KV pool: TTFT of a long prompt cold vs hot per tier, load GB/s", formatter_class=fmt
    )
    pool_bench.add_cli_args(pool_p)
    pool_p.set_defaults(func=pool_bench.main)
    from pdkv.bench import handoff as handoff_bench

    handoff_p = bench_sub.add_parser(
        "handoff", help="P→D KV handoff time of one request, measured vs `pdkv plan` (optionally over "
        "a tbf-capped link between two network namespaces)", formatter_class=fmt
    )
    handoff_bench.add_cli_args(handoff_p)
    handoff_p.set_defaults(func=handoff_bench.main)
    from pdkv.bench import dcp as dcp_bench

    dcp_p = bench_sub.add_parser(
        "dcp", help="DCP: KV bytes per rank and decode step time vs dcp 1 at long contexts (tiny model)",
        formatter_class=fmt,
    )
    dcp_bench.add_cli_args(dcp_p)
    dcp_p.set_defaults(func=dcp_bench.main)
    from pdkv.bench import hetero as hetero_bench

    hetero_p = bench_sub.add_parser(
        "hetero", help="P/D re-blocking and re-sharding cost (bytes, read ops, time) vs a same-layout "
        "handoff (tiny model)", formatter_class=fmt,
    )
    hetero_bench.add_cli_args(hetero_p)
    hetero_p.set_defaults(func=hetero_bench.main)
    from pdkv.bench import groups as groups_bench

    groups_p = bench_sub.add_parser(
        "groups", help="KV bytes per token per state group and the P/D handoff of hybrid models (tiny-swa, "
        "tiny-mla vs their full-attention peer) + real-size figures of Gemma-3, DeepSeek-V3, Qwen3-Next, Kimi-Linear",
        formatter_class=fmt,
    )
    groups_bench.add_cli_args(groups_p)
    groups_p.set_defaults(func=groups_bench.main)
    from pdkv.bench import prefill_cap as prefill_cap_bench

    cap_p = bench_sub.add_parser(
        "prefill-cap", help="colocated ITL tail and TTFT against --max-mixed-prefill-tokens, one server per "
        "cap on one workload (cap 0 = the uncapped peer)", formatter_class=fmt,
    )
    prefill_cap_bench.add_cli_args(cap_p)
    cap_p.set_defaults(func=prefill_cap_bench.main)
    from pdkv.bench import kv_quant as kv_quant_bench

    kv_quant_p = bench_sub.add_parser(
        "kvquant", help="int8 / fp8 KV cache vs the model dtype: first-step logit error, greedy token "
        "agreement, bytes per token", formatter_class=fmt,
    )
    kv_quant_bench.add_cli_args(kv_quant_p)
    kv_quant_p.set_defaults(func=kv_quant_bench.main)
    from pdkv.bench import dtype_parity as dtype_bench

    dtype_p = bench_sub.add_parser(
        "dtype", help="bfloat16 / float16 model vs float32: first-step logit error, greedy token agreement, "
        "seconds", formatter_class=fmt,
    )
    dtype_bench.add_cli_args(dtype_p)
    dtype_p.set_defaults(func=dtype_bench.main)

    from pdkv.bench import memory as memory_bench

    memory_p = bench_sub.add_parser(
        "memory", help="RSS of a default pdkv serve after one request, of the pdkv up launcher and of pdkv proxy, "
        "vs the goals (serve <= 1.2 GB, launcher and proxy <= 120 MB)", formatter_class=fmt,
    )
    memory_bench.add_cli_args(memory_p)
    memory_p.set_defaults(func=memory_bench.main)

    from pdkv.bench import compare

    compare_p = sub.add_parser(
        "compare", help="one workload on colocated, P/D, P/D + pool, ...: cold and hot, one report",
        formatter_class=fmt,
    )
    compare.add_cli_args(compare_p)
    compare_p.set_defaults(func=compare.main)
    for name in _LIGHT_COMMANDS:
        _add_light(sub, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    light = argv[0] if argv and argv[0] in _LIGHT_COMMANDS else None
    parser = build_light_parser(light) if light else build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
