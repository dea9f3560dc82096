"""`pdkv bench groups`: bytes per token per KV cache group and the P→D handoff of models with
state groups (issue 11, acceptance 4), with the real-size figures of the four hybrid families
from their published configs.

Measured part: for each model (default `tiny-swa`, sliding window 40 on two of its four layers,
`tiny-mla`, DeepSeek-V3-style latent attention (48 + 16 floats a token and layer), `tiny-gdn`
(Gated DeltaNet linear state on two layers: one state slot whatever the prompt, plus full
attention), `tiny-kda-mla` (KDA linear state + MLA), and
`tiny-llama-kv2`, the same hidden size, heads and layers with full attention everywhere: the
peer), a P and a D engine
in this process wired by the P2P connector (`--transfer`, tcp by default; pdkv.bench.pd_legs).
For each prompt length, `--repeats` whole pulls (D's prefix cache reset before each): the bytes
D received, which must equal the formula's per-group blocks × block bytes
(pdkv.bench.groups.report.blocks_moved), and the transfer seconds (claim → "done" ack, median).
Ratios are against the peer model at the same prompt length, measured in the same run.

Real-size part (torch-free, no model loaded): per group of Gemma-3-27B, DeepSeek-V3,
Qwen3-Next-80B-A3B and Kimi-Linear-48B-A3B (pdkv/plan/configs/), bytes per token or per request
and bytes held at each prompt length, as `pdkv plan` sizes them (tp 1, the config's dtype).
pdkv runs all four state kinds on its tiny models (dense MLPs: the real families' MoE layers are
not implemented), so those rows come from the cost model only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdkv.bench.dcp.cli import prompt_ids, sizes
from pdkv.bench.groups.report import (
    REAL_MODELS,
    GroupPlan,
    GroupsResult,
    MeasuredRow,
    add_peer_ratios,
    blocks_moved,
    format_measured,
    format_real_size,
    real_size_rows,
)
from pdkv.bench.hetero.report import median_seconds
from pdkv.bench.pd_legs import NEW_TOKENS, PDEngines, decode, prefill, settle
from pdkv.bench.results import parse_ints, write_result_json

if TYPE_CHECKING:
    from pdkv.engine.llm import LLM

DEFAULT_MODELS = ("tiny-swa", "tiny-mla", "tiny-gdn", "tiny-kda-mla", "tiny-llama-kv2")
PEER = "tiny-llama-kv2"
DEFAULT_PROMPT_LENS = (1024, 4096)
BLOCK_SIZE = 16


def _group_plan(llm: LLM, num_tokens: int) -> list[GroupPlan]:
    """Per KV cache group of `llm`'s engine: kind, layers, blocks D pulls for `num_tokens`
    tokens, bytes per block and per token."""
    kv = llm.llm_engine.scheduler.kv_cache_manager.config
    rows: list[GroupPlan] = []
    state_slots = any(group.spec.state_slot for group in kv.groups)
    for g, (group, window) in enumerate(zip(kv.groups, kv.sliding_windows)):
        bs, bb = group.spec.block_size, kv.block_bytes(g)
        linear = group.spec.state_slot  # a block is a state slot: bytes per request
        rows.append(
            {
                "kind": group.spec.kind,
                "layers": len(group.layer_indices),
                "window": window,
                "blocks": blocks_moved(num_tokens, bs, window, per_request=linear,
                                       resume_at_end=state_slots),
                "block_bytes": bb,
                "bytes_per_token": 0 if linear else bb // bs,
            }
        )
    return rows


def run_model(model: str, prompt_lens: Sequence[int], repeats: int, transfer: str, seed: int,
              num_threads: int | None) -> list[MeasuredRow]:
    """Whole pulls of one model at every prompt length: one row per length.

    Raises:
        RuntimeError: the bytes received differ between repeats, or a pull was not whole.
        TimeoutError: a leg did not finish.
    """
    from pdkv.model.arch_config import LlamaArchConfig
    from pdkv.model.registry import resolve_model

    path = resolve_model(model)
    arch = LlamaArchConfig.from_hf_folder(path)
    max_len, lens = sizes(prompt_lens, NEW_TOKENS, arch.max_position_embeddings)
    engines = PDEngines(path, max_len, transfer, num_threads)
    rows: list[MeasuredRow] = []
    try:
        p = engines.get("kv_producer", BLOCK_SIZE, 1)
        d = engines.get("kv_consumer", BLOCK_SIZE, 1)
        for n in lens:
            prompt = prompt_ids(n, arch.vocab_size, seed + n)
            legs = []
            for _ in range(repeats):
                settle(p, d)
                legs.append(decode(p, d, prompt, prefill(p, prompt)))
            settle(p, d)
            received = {leg["bytes"] for leg in legs}
            if len(received) != 1:
                raise RuntimeError(
                    f"{model}, {n} tokens: bytes received differ between repeats: "
                    f"{sorted(received)}"
                )
            groups = _group_plan(d, n)
            rows.append({"model": model, "prompt_tokens": n, "groups": groups,
                         "formula_bytes": sum(g["blocks"] * g["block_bytes"] for g in groups),
                         "bytes_received": received.pop(),
                         "transfer_s": median_seconds([leg["transfer_s"] for leg in legs]),
                         "transfer_s_all": [leg["transfer_s"] for leg in legs]})
    finally:
        engines.shutdown()
    return rows


def run_groups_bench(
    models: Sequence[str] = DEFAULT_MODELS,
    prompt_lens: Sequence[int] = DEFAULT_PROMPT_LENS,
    repeats: int = 3,
    transfer: str = "tcp",
    seed: int = 0,
    num_threads: int | None = None,
    real_models: Sequence[str] = REAL_MODELS,
    print_tables: bool = True,
) -> GroupsResult:
    """The measured rows of every model (ratios against PEER when it ran) and the real-size rows.

    Raises:
        ValueError: repeats < 1, or an unknown real-size model name.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    real = real_size_rows(real_models, prompt_lens)
    rows = [
        r for m in models for r in run_model(m, prompt_lens, repeats, transfer, seed, num_threads)
    ]
    add_peer_ratios(rows, PEER)
    result: GroupsResult = {
        "rows": rows,
        "real_size": real,
        "peer": PEER,
        "repeats": repeats,
        "transfer": transfer,
        "cpu_count": os.cpu_count(),
        "prompt_lens": list(prompt_lens),
        "block_size": BLOCK_SIZE,
    }
    if print_tables:
        print(format_measured(rows))
        print(
            f"\nbytes x / time x: ratio to {PEER} (full attention, same hidden size, heads and "
            "layers; '-' when it did not run) at the same prompt "
            f"length; xfer: median over {repeats} whole pulls (claim -> done ack), transfer "
            f"{transfer!r}.\n"
        )
        print(format_real_size(real, prompt_lens))
        print(
            "\nReal-size rows: `pdkv plan`'s model of the published configs (tp 1, the config's "
            "dtype; a sliding-window group holds at most its window, a linear state one slot per "
            "request)."
        )
    return result


def failed_checks(result: GroupsResult) -> list[str]:
    """Rows whose measured bytes differ from the per-group formula."""
    return [
        f"{r['model']} at {r['prompt_tokens']} tokens: received {r['bytes_received']} B, formula "
        f"{r['formula_bytes']} B"
        for r in result["rows"]
        if r["bytes_received"] != r["formula_bytes"]
    ]


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """Flags of `pdkv bench groups`."""
    p.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help=f"comma-separated models (aliases or folders); ratios vs {PEER} when it runs",
    )
    p.add_argument("--prompt-lens", default=",".join(map(str, DEFAULT_PROMPT_LENS)),
                   help="prompt tokens, comma-separated (capped to the model's max length)")
    p.add_argument(
        "--repeats", type=int, default=3, help="whole pulls per model and length (time: median)"
    )
    p.add_argument(
        "--transfer", default="tcp", help="P2P transfer engine (kv_connector_extra_config.transfer)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads per engine")
    p.add_argument("--real-models", default=",".join(REAL_MODELS),
                   help="bundled configs for the real-size table (pdkv plan --model names)")
    p.add_argument("--json", default=None, help="write the result as JSON to this path")


def main(args: argparse.Namespace) -> int:
    """Run from parsed flags; 1 when a model's measured bytes differ from the formula."""
    lens = parse_ints(args.prompt_lens)
    result = run_groups_bench(
        [m.strip() for m in args.models.split(",") if m.strip()],
        lens,
        args.repeats,
        args.transfer,
        args.seed,
        args.num_threads,
        [m.strip() for m in args.real_models.split(",") if m.strip()],
    )
    if args.json:
        write_result_json(result, args.json)
        print(f"wrote {args.json}")
    bad = failed_checks(result)
    for line in bad:
        print(f"bytes check failed: {line}")
    return 1 if bad else 0
