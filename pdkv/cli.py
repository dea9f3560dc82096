"""`pdkv` command line: serve | proxy | up | generate | bench {offline, serve, transfer, chaos,
hosts, soak, pool, handoff, dcp, pcp, hetero, groups, prefill-cap, kvquant, dtype, memory} |
compare | plan | matrix | report."""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

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
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

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
        f"\n{len(outputs)} request{'s' if len(outputs) != 1 else ''}, {total_out} output tokens in "
        f"{wall:.2f} s ({total_out / wall:.1f} tok/s); model load {t_load:.1f} s"
    )
    return 0


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


@dataclass(frozen=True)
class Command:
    """A subcommand whose module is imported only when that subcommand is parsed: `module` (a
    dotted path) provides `add_args(parser)` and `run(args) -> int | None`."""

    name: str
    help: str
    module: str
    add_args: str = "add_cli_args"
    run: str = "main"

    def load(self, parser: argparse.ArgumentParser) -> None:
        """Import the module, add its arguments to `parser`, make its `run` the parser's func."""
        module = importlib.import_module(self.module)
        getattr(module, self.add_args)(parser)
        parser.set_defaults(func=getattr(module, self.run))


# Commands that parse and run without importing torch.
LIGHT_COMMANDS = (
    Command("plan", "cost model: KV bytes, handoff time, recompute vs reload, P:D ratio, PCP "
            "crossover (no torch)",
            "pdkv.plan.cli"),
    Command("matrix",
            "support matrix: run the tagged acceptance tests, write docs/SUPPORT_MATRIX.md",
            "pdkv.matrix.cli"),
    Command("proxy", "P/D proxy (vLLM protocol) over prefill and decode engines",
            "pdkv.router.proxy_cli"),
    Command("up", "start a local colocated or P/D topology (engines + proxy)",
            "pdkv.launch.launcher"),
    Command("report", "re-make the figures of README.md and docs/ (--check: list the stale ones)",
            "pdkv.report.cli"),
)

# `pdkv bench <name>`, one row per subcommand, by family (pdkv/bench/<family>/).
BENCH_COMMANDS = (
    Command("offline", "offline throughput: pdkv vs HF transformers", "pdkv.bench.offline.cli"),
    Command("serve", "online serving benchmark against an OpenAI-compatible server",
            "pdkv.bench.serve.cli"),
    Command("transfer", "KV transfer engines vs raw socket and memcpy (GB/s)",
            "pdkv.bench.transfer.cli"),
    Command("chaos", "1P1D through the proxy under client cancels and a prefill restart",
            "pdkv.bench.chaos.cli"),
    Command("hosts", "TTFT / TPOT of a deployment file on loopback vs shaped links between "
            "network namespaces (one run, one markdown table)", "pdkv.bench.hosts"),
    Command("soak", "hours of mixed load on P/D + pool and colocated behind two proxies: no "
            "5xx, greedy texts equal a reference, blocks, fds and RSS back/flat, plot",
            "pdkv.bench.soak.cli"),
    Command("pool", "KV pool: TTFT of a long prompt cold vs hot per tier, load GB/s",
            "pdkv.bench.pool.cli"),
    Command("handoff", "P→D KV handoff time of one request, measured vs `pdkv plan` (optionally "
            "over a tbf-capped link between two network namespaces)", "pdkv.bench.handoff.cli"),
    Command("dcp", "DCP: KV bytes per rank and decode step time vs dcp 1 at long contexts (tiny "
            "model)", "pdkv.bench.dcp.cli"),
    Command("pcp", "PCP: prefill time vs prompt length on one rank and N ranks, beside `pdkv "
            "plan --pcp N` and its crossover", "pdkv.bench.pcp"),
    Command("hetero", "P/D re-blocking and re-sharding cost (bytes, read ops, time) vs a "
            "same-layout handoff (tiny model)", "pdkv.bench.hetero.cli"),
    Command("groups", "KV bytes per token per state group and the P/D handoff of hybrid models "
            "(tiny-swa, tiny-mla vs their full-attention peer) + real-size figures of Gemma-3, "
            "DeepSeek-V3, Qwen3-Next, Kimi-Linear", "pdkv.bench.groups.cli"),
    Command("prefill-cap", "colocated ITL tail and TTFT against --max-mixed-prefill-tokens, one "
            "server per cap on one workload (cap 0 = the uncapped peer)", "pdkv.bench.prefill_cap"),
    Command("kvquant", "int8 / fp8 KV cache vs the model dtype: first-step logit error, greedy "
            "token agreement, bytes per token", "pdkv.bench.model.kv_quant"),
    Command("dtype", "bfloat16 / float16 model vs float32: first-step logit error, greedy token "
            "agreement, seconds", "pdkv.bench.model.dtype_parity"),
    Command("memory", "RSS of a default pdkv serve after one request, of the pdkv up launcher and "
            "of pdkv proxy, vs the goals (serve <= 1.2 GB, launcher and proxy <= 120 MB)",
            "pdkv.bench.memory"),
)

COMPARE_COMMAND = Command(
    "compare", "one workload on colocated, P/D, P/D + pool, ...: cold and hot, one report",
    "pdkv.bench.compare.cli",
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, except for flags that take no value (`--no-hf`, stored as
    False when given): their default says nothing a user can act on ("(default: True)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
            return action.help
        if action.help and re.search(r"\bdefaults?\b", action.help, re.IGNORECASE):
            return action.help  # the help says its default itself: no second "(default: ...)"
        return super()._get_help_string(action)


class LazySubParsers(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Subparsers of which the `Command`s get their arguments (and import their module) only
    when their name is parsed: `pdkv serve` imports no benchmark, `pdkv bench --help` lists them
    all from their help text alone."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending: dict[str, Command] = {}

    def add_command(self, command: Command) -> argparse.ArgumentParser:
        """A subparser for `command`, filled in when it is chosen."""
        self.pending[command.name] = command
        parser: argparse.ArgumentParser = self.add_parser(command.name, help=command.help,
                                                          formatter_class=HelpFormatter)
        return parser

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        command = self.pending.pop(values[0], None) if values else None
        if command is not None:
            command.load(self._name_parser_map[command.name])
        super().__call__(parser, namespace, values, option_string)


def build_light_parser(name: str) -> argparse.ArgumentParser:
    """A parser with only the torch-free subcommand `name` (`plan`, `matrix`, `proxy`, `up`,
    `report`): those run without importing torch (matrix runs its checks in a pytest subprocess;
    `up` starts its engines as `pdkv serve` processes; report runs each figure's command as one)."""
    parser = PdkvArgumentParser(prog="pdkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, action=LazySubParsers)
    sub.add_command(next(c for c in LIGHT_COMMANDS if c.name == name))
    return parser


def build_parser() -> argparse.ArgumentParser:
    from pdkv.engine.arg_utils import EngineArgs

    fmt = HelpFormatter
    parser = PdkvArgumentParser(prog="pdkv", description=__doc__, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True, action=LazySubParsers)

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
    gen.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="logging level of the engine's messages",
    )
    gen.set_defaults(func=_cmd_generate)

    from pdkv.serve import api_server

    serve = sub.add_parser(
        "serve", help="OpenAI-compatible server with Prometheus metrics", formatter_class=fmt
    )
    api_server.add_cli_args(serve)
    serve.set_defaults(func=api_server.main)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, action=LazySubParsers)
    for command in BENCH_COMMANDS:
        bench_sub.add_command(command)
    sub.add_command(COMPARE_COMMAND)
    for command in LIGHT_COMMANDS:
        sub.add_command(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    light = argv[0] if argv and argv[0] in {c.name for c in LIGHT_COMMANDS} else None
    parser = build_light_parser(light) if light else build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
