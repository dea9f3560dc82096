"""The parts every recipe's command line shares: its timeout and log flags, the run wrapper (stop
on SIGTERM / Ctrl-C, a recipe error as exit 1) and the printed pipe table."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from pdkv.report import markdown
from pdkv.report.recipes.procs import Deadlines, RecipeError

EXIT_FAILED = 1  # a request failed, a server was never ready, a bench run failed


def add_common_args(parser: argparse.ArgumentParser, name: str) -> None:
    """Flags of every recipe: --log-dir (default pdkv-logs/recipes/NAME), --ready-timeout,
    --bench-timeout (s)."""
    parser.add_argument("--log-dir", default=os.path.join("pdkv-logs", "recipes", name),
                        help="server and benchmark logs and result JSONs, one folder per run")
    parser.add_argument("--ready-timeout", type=float, default=Deadlines.ready_s,
                        help="s to wait for a server to become ready")
    parser.add_argument("--bench-timeout", type=float, default=Deadlines.bench_s,
                        help="s one `pdkv bench serve` run may take")


def add_workload_args(parser: argparse.ArgumentParser, *, num_prompts: int, input_len: int,
                      output_len: int, request_rate: float, max_concurrency: int,
                      input_help: str = "prompt tokens") -> None:
    """The `pdkv bench serve` workload flags two recipes share (--model, --port, --num-prompts,
    --input-len, --output-len, --request-rate, --max-concurrency, --seed), with the guide's
    defaults of each recipe."""
    parser.add_argument("--model", default="smollm2", help="alias or HF folder")
    parser.add_argument("--port", type=int, default=0, help="the server's port (0: a free one)")
    parser.add_argument("--num-prompts", type=int, default=num_prompts, help="requests per run")
    parser.add_argument("--input-len", type=int, default=input_len, help=input_help)
    parser.add_argument("--output-len", type=int, default=output_len,
                        help="output tokens per request")
    parser.add_argument("--request-rate", type=float, default=request_rate,
                        help="Poisson arrivals, req/s")
    parser.add_argument("--max-concurrency", type=int, default=max_concurrency,
                        help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")


def workload_bench_args(args: argparse.Namespace) -> list[str]:
    """The `pdkv bench serve` flags of the workload flags `add_workload_args` parsed."""
    return ["--model", args.model, "--num-prompts", str(args.num_prompts),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--request-rate", str(args.request_rate),
            "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed)]


def deadlines(args: argparse.Namespace) -> Deadlines:
    """The Deadlines of the parsed common flags."""
    return Deadlines(ready_s=args.ready_timeout, bench_s=args.bench_timeout)


def engine_args(args: Sequence[str]) -> list[str]:
    """The engine flags given after `--` (argparse.REMAINDER keeps the `--` itself)."""
    return [a for a in args if a != "--"]


def main(module: str, doc: str | None,
         add_cli_args: Callable[[argparse.ArgumentParser], argparse.ArgumentParser],
         run_recipe: Callable[[argparse.Namespace], int], argv: Sequence[str] | None) -> int:
    """A recipe's command line: parse `argv` with the recipe's flags (prog `python -m MODULE`,
    the first paragraph of its docstring `doc` as description), then `run` its body; returns the
    exit status."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}",
                                     description=doc.split("\n\n")[0] if doc else None)
    args = add_cli_args(parser).parse_args(argv)
    return run(lambda: run_recipe(args))


def run(body: Callable[[], int]) -> int:
    """Run a recipe's `body` with SIGTERM and SIGINT raising KeyboardInterrupt (so its `finally`
    stops what it started); a RecipeError is printed and returns EXIT_FAILED, an interrupt 130."""
    from pdkv.launch.topology import stop_on_signals

    stop_on_signals()
    try:
        return body()
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130


def print_table(columns: list[str], rows: list[list[str]]) -> None:
    """Print a markdown pipe table (`default_convert` reads it back), flushed."""
    print("\n".join(markdown.render_table(columns, rows)), flush=True)


def num(value: float | None, fmt: str = ".2f") -> str:
    """A result value formatted with `fmt` ("-" when it is None)."""
    return "-" if value is None else format(float(value), fmt)


def joined(*values: float | None, sep: str = " / ") -> str:
    """Values formatted by `num`, joined: "7693.36 / 8824.80 / 10979.24"."""
    return sep.join(num(v) for v in values)
