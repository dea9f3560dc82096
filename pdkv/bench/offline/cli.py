"""Offline throughput benchmark: pdkv vs HF transformers (and llama.cpp) on the same prompts, dtype
and threads.

All systems run in one process, one after the other for each batch size, so they share the
torch version, the thread count (`torch.set_num_threads`) and the machine state. For a batch of
B requests of `input_len` prompt tokens each:

* prefill throughput (tok/s) = B * input_len / (seconds to run the batch with 1 output token);
* decode throughput (tok/s) = B * (output_len - 1) / (seconds to generate output_len tokens
  minus the prefill seconds above), i.e. tokens generated after the first one per second.

pdkv runs `LLM.generate` with greedy `SamplingParams(max_tokens=..., ignore_eos=True)` and prefix
caching off; HF runs `model.generate(..., do_sample=False)` on the equal-length batch (no
padding) with EOS disabled, so both produce exactly the requested number of tokens and the same
greedy tokens. pdkv's time includes its scheduler and detokenization, HF's its generate loop.
`--peer hf,llama.cpp` adds llama.cpp (llama-cpp-python's C API on an F32 / BF16 GGUF converted
from the same HF folder, `make llama-cpp`; `pdkv/bench/offline/llamacpp.py`): one `llama_decode`
for the batch's prefill and one per decode step, greedy argmax, timed with the same formulas.

Usage::

    from pdkv.bench.offline.cli import run_offline_bench
    result = run_offline_bench(batch_sizes=(1, 8, 32), input_len=128, output_len=32)

or from the CLI (`add_cli_args` / `main`):
`pdkv bench offline --batch-sizes 1,8,32 --input-len 128 --output-len 32 --result-json out.json`
(`--peer hf,llama.cpp` for the three-way table).
"""

# Layout: `offline_prompts` (prompts), `offline_measure` (timing of each system),
# `offline_runner` (the benchmark run), `offline_report` (the tables), `offline_llamacpp` (the
# llama.cpp peer), `llamacpp_gguf` (its GGUF, `make llama-cpp`); this module re-exports
# their public names and holds the CLI (`add_cli_args` / `main`).

from __future__ import annotations

import argparse

from pdkv.bench.offline.measure import TORCH_DTYPES
from pdkv.bench.offline.prompts import build_prompts
from pdkv.bench.offline.report import format_table
from pdkv.bench.offline.runner import PEERS, run_offline_bench
from pdkv.bench.results import write_result_json

__all__ = ["add_cli_args", "build_prompts", "format_table", "main", "run_offline_bench"]


def _parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--batch-sizes must be integers like 1,8,32: {e}") from e
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--batch-sizes must be positive integers, got {text!r}")
    return sizes


def _parse_peers(text: str) -> list[str]:
    peers = [p.strip() for p in text.split(",") if p.strip() and p.strip() != "none"]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise argparse.ArgumentTypeError(f"--peer takes {', '.join(PEERS)} or none, got {bad}")
    return peers


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `pdkv bench offline` flags to `parser` (lengths in tokens)."""
    parser.add_argument("--model", default="smollm2", help="alias (smollm2) or HF folder")
    parser.add_argument(
        "--batch-sizes", type=_parse_batch_sizes, default=[1, 8, 32],
        help="comma-separated batch sizes (requests run together), e.g. 1,8,32",
    )
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    parser.add_argument("--dtype", default="float32", choices=sorted(TORCH_DTYPES))
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads for both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed runs per measurement (best kept)"
    )
    parser.add_argument(
        "--peer", dest="peers", type=_parse_peers, default=["hf"],
        help="systems measured beside pdkv: hf, llama.cpp (comma-separated; none: pdkv only). "
             "llama.cpp adds a 512-token batch-1 prefill, the machine's limits (read bandwidth, "
             "FMA peak, matmul rate) and the workload table with the speed goals; llama.cpp "
             "itself is skipped with a message when not built (`make llama-cpp`)",
    )
    parser.add_argument(
        "--long-prefill-len",
        type=int,
        default=None,
        help=(
            "prompt tokens of the extra batch-1 prefill (default 512 with --peer llama.cpp; "
            "0: off)"
        ),
    )
    parser.add_argument("--no-hf", dest="include_hf", action="store_false",
                        help="skip HF transformers (removes hf from --peer)")
    parser.add_argument(
        "--no-warmup", dest="warmup", action="store_false", help="skip the warmup runs"
    )
    parser.add_argument("--result-json", default=None, help="write the result dict to this file")
    parser.add_argument(
        "--attention-backends",
        default=None,
        help="compare pdkv's decode per --attention-backend instead of pdkv vs HF, e.g. "
        "torch,cpu_paged (ratios against the first; pdkv/bench/offline/backends.py); a name "
        "ending in :no-fused runs without the fused small ops, e.g. cpu_paged,cpu_paged:no-fused",
    )
    parser.add_argument(
        "--prefill-cases", default="1x512,32x128",
        help="with --attention-backends or --cpu-linears: BxL prefill cases (B prompts of L tokens "
             "in one step), comma-separated; '' for none",
    )
    parser.add_argument(
        "--cpu-linears", default=None,
        help="compare pdkv's prefill and decode per --cpu-linear instead, e.g. torch,onednn,auto "
             "(ratios against the first)",
    )
    return parser


def parse_prefill_cases(text: str) -> tuple[tuple[int, int], ...]:
    """"1x512,32x128" -> ((1, 512), (32, 128)). Raises ValueError on another form."""
    cases = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        b, sep, n = part.partition("x")
        if not sep or not b.isdigit() or not n.isdigit():
            raise ValueError(f"--prefill-cases wants BxL items like 32x128, got {part!r}")
        cases.append((int(b), int(n)))
    return tuple(cases)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed `add_cli_args` flags; write --result-json if given.

    Returns:
        Process exit code (0).
    """
    if args.attention_backends or args.cpu_linears:
        from pdkv.bench.offline.backends import run_backend_bench

        knob = "cpu_linear" if args.cpu_linears else "attention_backend"
        values = args.cpu_linears or args.attention_backends
        result = run_backend_bench(
            model=args.model,
            backends=[b.strip() for b in values.split(",") if b.strip()],
            batch_sizes=tuple(args.batch_sizes),
            input_len=args.input_len,
            output_len=args.output_len,
            dtype=args.dtype,
            num_threads=args.num_threads,
            seed=args.seed,
            repeats=args.repeats,
            knob=knob,
            prefill_cases=parse_prefill_cases(args.prefill_cases),
        )
        if args.result_json:
            write_result_json(result, args.result_json)
        return 0
    result = run_offline_bench(
        model=args.model,
        batch_sizes=tuple(args.batch_sizes),
        input_len=args.input_len,
        output_len=args.output_len,
        dtype=args.dtype,
        num_threads=args.num_threads,
        seed=args.seed,
        warmup=args.warmup,
        repeats=args.repeats,
        peers=[p for p in args.peers if args.include_hf or p != "hf"],
        long_prefill_len=args.long_prefill_len,
    )
    if args.result_json:
        write_result_json(result, args.result_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(add_cli_args(argparse.ArgumentParser(description=__doc__)).parse_args()))
