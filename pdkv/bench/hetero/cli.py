"""`pdkv bench hetero`: the cost of re-blocking and re-sharding a P→D handoff against a
same-layout handoff (issue 12, acceptance 4; docs/ARCHITECTURE.md "Three decisions", 3).

In-process engines wired by the P2P connector (`--transfer`, tcp by default), stepped by hand
(`LLM(..., cpu_linear="torch")`): one producer P at tp 1 per block size a case needs and one
consumer D per (block size, tp). Cases (CASES):
  - `same`: P bs 16 → D bs 16, tp 1: the same layout, the baseline;
  - `reblock-d32`: P bs 16 → D bs 32; `reblock-p32`: P bs 32 → D bs 16 (the consumer maps KV
    by absolute token position, pdkv/kv_transfer/reblock.py: one read per contiguous token run
    of one layer's K or V);
  - `reshard-tp2`: P bs 16, tp 1 → D bs 16, tp 2 (two worker processes): each D rank reads only
    its KV heads (pdkv/kv_transfer/reshard.py; on tiny-llama-kv2 one head per rank).
Per case and prompt length, `--repeats` times: reset D's prefix cache (so the pull is whole),
P prefills the prompt (the proxy's prefill leg), D decodes it with greedy sampling pulling the
KV from P (P is stepped too: it serves the reads). Measured from D's scheduler counters (summed
over its ranks): bytes received ("kv_bytes_received") and read operations ("kv_read_ops", the
ReadOps the consumer submitted; the same-layout case merges blocks consecutive on both sides into
one read, so its count depends on the block ids the pools hand out), and the pull's transfer
seconds (claim to "done" ack; at tp 2 the slower rank's). The report (pdkv.bench.hetero.report)
gives ratios against `same` and checks that every case's greedy tokens equal `same`'s; `main`
exits 1 on a mismatch.

The prompts are random token ids (seeded); on a shared CPU box the times are noisy, the read
counts and bytes are exact.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from pdkv.bench.dcp.cli import prompt_ids, sizes
from pdkv.bench.dcp.report import kv_bytes_per_token
from pdkv.bench.hetero.report import (
    BASELINE,
    HeteroResult,
    HeteroRow,
    add_ratios,
    failed_checks,
    format_table,
    median_seconds,
)
from pdkv.bench.pd_legs import NEW_TOKENS, PDEngines, decode, prefill, settle
from pdkv.bench.results import parse_ints, write_result_json

DEFAULT_PROMPT_LENS = (1024, 4096)
DEFAULT_REPEATS = 3


@dataclass(frozen=True)
class Case:
    """One P → D layout pair.

    Attributes:
        name: its name on the command line and in the table.
        p_block_size: P's block size (tokens); P runs at tp 1.
        d_block_size: D's block size (tokens).
        d_tp: D's tensor_parallel_size.
    """

    name: str
    p_block_size: int
    d_block_size: int
    d_tp: int


CASES = {c.name: c for c in (
    Case(BASELINE, 16, 16, 1),
    Case("reblock-d32", 16, 32, 1),
    Case("reblock-p32", 32, 16, 1),
    Case("reshard-tp2", 16, 16, 2),
)}
DEFAULT_CASES = tuple(CASES)


def _constant(values: list[int], what: str, case: str) -> int:
    if len(set(values)) != 1:
        raise RuntimeError(f"{case}: {what} differs between repeats: {values}")
    return values[0]


def run_case(engines: PDEngines, case: Case, prompt: list[int], repeats: int,
             per_token: int) -> HeteroRow:
    """`repeats` whole pulls of `prompt` for `case`: one row (see pdkv.bench.hetero.report).

    Raises:
        RuntimeError: the bytes received differ between repeats, or a pull was not whole.
        TimeoutError: a leg did not finish.
    """
    p = engines.get("kv_producer", case.p_block_size, 1)
    d = engines.get("kv_consumer", case.d_block_size, case.d_tp)
    legs, p_blocks = [], []
    for _ in range(repeats):
        settle(p, d)
        params = prefill(p, prompt)
        groups = params["remote_block_ids"]
        if not isinstance(groups, list) or not isinstance(groups[0], list):
            raise RuntimeError(f"P's kv_transfer_params have no block id groups: {params}")
        p_blocks.append(len(groups[0]))
        legs.append(decode(p, d, prompt, params))
    settle(p, d)
    times = [leg["transfer_s"] for leg in legs]
    ops = [
        leg["read_ops"] for leg in legs
    ]  # depends on how contiguous the blocks are on both sides
    return {
        "case": case.name,
        "p_block_size": case.p_block_size,
        "d_block_size": case.d_block_size,
        "d_tp": case.d_tp,
        "p_tp": 1,
        "prompt_tokens": len(prompt),
        "needed_bytes": len(prompt) * per_token,
        "p_blocks": _constant(p_blocks, "P's blocks", case.name),
        "bytes_received": _constant([leg["bytes"] for leg in legs], "bytes received", case.name),
        "read_ops": statistics.median_low(ops),
        "read_ops_all": ops,
        "transfer_s": median_seconds(times),
        "transfer_s_all": times,
        "outputs": [leg["tokens"] for leg in legs],
    }


def run_hetero_bench(
    cases: Sequence[str] = DEFAULT_CASES,
    prompt_lens: Sequence[int] = DEFAULT_PROMPT_LENS,
    model: str = "tiny-llama-kv2",
    repeats: int = DEFAULT_REPEATS,
    transfer: str = "tcp",
    seed: int = 0,
    num_threads: int | None = None,
    print_table: bool = True,
) -> HeteroResult:
    """Every case of `cases` (names of CASES; `same` is added when missing: it is the baseline)
    at every prompt length, in one run.

    Returns:
        {"rows": [...], "bytes_per_token", "repeats", "transfer", "cpu_count", "model", ...}; each
        row as run_case plus the ratios and check of hetero_report.add_ratios.

    Raises:
        ValueError: an unknown case, repeats < 1, bad prompt lengths.
    """
    from pdkv.cache.specs import DTYPE_BYTES
    from pdkv.model.llama import LlamaArchConfig
    from pdkv.model.registry import resolve_model

    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; choose from {sorted(CASES)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = [BASELINE] + [c for c in dict.fromkeys(cases) if c != BASELINE]
    path = resolve_model(model)
    arch = LlamaArchConfig.from_hf_folder(path)
    max_len, lens = sizes(prompt_lens, NEW_TOKENS, arch.max_position_embeddings)
    engines = PDEngines(path, max_len, transfer, num_threads)
    rows: list[HeteroRow] = []
    try:
        per_token = 0
        for n in lens:
            for name in names:
                case = CASES[name]
                if not per_token:
                    eng = engines.get("kv_producer", case.p_block_size, 1).llm_engine
                    per_token = kv_bytes_per_token(
                        arch.num_layers,
                        arch.num_kv_heads,
                        arch.head_dim,
                        DTYPE_BYTES[eng.config.model_config.dtype],
                    )
                rows.append(
                    run_case(
                        engines, case, prompt_ids(n, arch.vocab_size, seed + n), repeats, per_token
                    )
                )
    finally:
        engines.shutdown()
    add_ratios(rows)
    result: HeteroResult = {
        "rows": rows,
        "baseline": BASELINE,
        "bytes_per_token": per_token,
        "repeats": repeats,
        "transfer": transfer,
        "cpu_count": os.cpu_count(),
        "model": model,
        "prompt_lens": list(prompt_lens),
        "new_tokens": NEW_TOKENS,
        "cases": names,
    }
    if print_table:
        print(format_table(result))
    return result


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """Flags of `pdkv bench hetero`."""
    p.add_argument(
        "--model", default="tiny-llama-kv2", help="model (alias or folder); smollm2 works too"
    )
    p.add_argument(
        "--cases",
        default=",".join(DEFAULT_CASES),
        help=f"comma-separated, of {', '.join(CASES)}; ratios vs {BASELINE} (always run)",
    )
    p.add_argument("--prompt-lens", default=",".join(map(str, DEFAULT_PROMPT_LENS)),
                   help="prompt tokens, comma-separated (capped to the model's max length)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help="pulls per case and length (transfer time: their median)")
    p.add_argument(
        "--transfer", default="tcp", help="P2P transfer engine (kv_connector_extra_config.transfer)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads per engine")
    p.add_argument("--json", default=None, help="write the result (rows) as JSON to this path")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed flags; 0 when every case's output equals the same-layout
    case's, 1 otherwise (the JSON is written either way)."""
    result = run_hetero_bench(
        [c.strip() for c in args.cases.split(",") if c.strip()],
        parse_ints(args.prompt_lens),
        args.model,
        args.repeats,
        args.transfer,
        args.seed,
        args.num_threads,
    )
    if args.json:
        write_result_json(result, args.json)
        print(f"wrote {args.json}")
    bad = failed_checks(result["rows"])
    for line in bad:
        print(f"output check failed: {line}")
    return 1 if bad else 0
