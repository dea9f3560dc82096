"""`pdkv bench pcp`: prefill time of one prompt on one rank vs N prefill-context-parallel ranks,
against prompt length, beside what `pdkv plan --pcp N` predicts (issue 32).

Per model (`--model`, comma-separated), three in-process engines run one request at a time
(`LLM(..., cpu_linear="torch", block_size=16)`, no prefix cache, no chunked prefill: a prompt's
prefill is one step):
- `N=1`: one rank with T torch threads (T: `--num-threads`, else torch's default);
- `N=1 share`: one rank with T // N threads, at the longest prompt only: the speed a PCP rank has
  when the N ranks share the T cores. S, its compute time over N=1's (t0 taken off both, see
  below), is the plan's `--pcp-shared-speedup` (S = N: the cores scale linearly and the split
  cannot gain);
- `N=N`: `prefill_context_parallel_size=N` (N worker processes, T // N threads each).

Per prompt length and repeat: random prompt ids (seeded by length, the same for every engine); the
prefill time is the engine-level TTFT: `engine.step()` from adding the request until its first
token; `comm` is the time inside those steps' PCP all-gathers (`StepTimings.pcp_comm`, the
largest over the ranks): it includes a rank's wait for the slower one at each all-gather, so it
exceeds the transfer alone when the ranks are unbalanced or descheduled on shared cores. The
request then decodes `--new-tokens` greedy tokens; N's tokens must equal N=1's (exit
status 1 otherwise). One warm-up request per engine is not timed.

Plan columns (pdkv.plan.pcp): one cost model per LLM, fitted to N=1 alone: t = t0 + FLOPs_1(L) / F
by least squares over the N=1 medians (t0: the per-prefill time a split does not shorten), the
ranks computing at F / S with S = (N=1 share − t0) / (N=1 − t0) at the longest prompt, the
all-gathers over `--pcp-bandwidth` / `--pcp-latency` (default the tcp-loopback preset: gloo
between processes of one box). From these it predicts N=1 and N at every length and the
crossover (`pdkv plan --pcp N --prefill-tps ... --pcp-overhead t0 --pcp-shared-speedup S` gives
the same). The measured crossover is the shortest measured length from which N was faster at
every longer measured length (none: not within the range).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pdkv.bench.header import host_facts, machine_lines
from pdkv.bench.results import parse_ints, write_result_json
from pdkv.plan import links
from pdkv.plan.pcp import (
    PcpModel,
    PcpShape,
    calibrate_flops,
    fit_single_rank,
    split_threshold,
)

if TYPE_CHECKING:
    from pdkv.engine.llm import LLM

DEFAULT_MODELS = ("tiny-llama-kv2", "smollm2")
DEFAULT_LENS = (128, 256, 512, 1024, 2048)
DEFAULT_REPEATS = 3
DEFAULT_NEW_TOKENS = 4
BLOCK_TOKENS = 16
VOCAB_LOW = 1000  # clear of special tokens
STEP_DEADLINE_S = 600.0  # one request, prefill and decode
MS = 1e3


def prompt_ids(length: int, vocab_size: int, seed: int) -> list[int]:
    """`length` token ids drawn uniformly from [1000, vocab_size), seeded by `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, vocab_size) for _ in range(length)]


def _one_request(llm: LLM, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """(prefill seconds until the first token, PCP all-gather seconds in those steps, the greedy
    tokens) of one request run alone."""
    from pdkv import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    req, text = engine.make_request({"prompt_token_ids": prompt}, params)
    deadline = time.monotonic() + STEP_DEADLINE_S
    engine.add_request(req, text)
    try:
        comm = 0.0
        t0 = time.perf_counter()
        while req.num_output_tokens < 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill of {len(prompt)} tokens not done in "
                                   f"{STEP_DEADLINE_S:g} s")
            engine.step()
            comm += engine.runner.timings.pcp_comm
        ttft = time.perf_counter() - t0
        while not req.is_finished:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{new_tokens} tokens not done in {STEP_DEADLINE_S:g} s")
            engine.step()
        return ttft, comm, list(req.output_token_ids)
    finally:
        if not req.is_finished:
            engine.abort_request([req.request_id])


def _engine(path: str, max_len: int, pcp: int, num_threads: int) -> LLM:
    from pdkv import LLM

    kw: dict[str, int] = {"prefill_context_parallel_size": pcp} if pcp > 1 else {}
    return LLM(path, cpu_linear="torch", block_size=BLOCK_TOKENS, enable_prefix_caching=False,
               enable_chunked_prefill=False, max_num_batched_tokens=max_len,
               max_model_len=max_len, num_kv_blocks=-(-max_len // BLOCK_TOKENS) + 2,
               num_threads=num_threads, **kw)


Samples = dict[int, dict[str, list[Any]]]
"""Per prompt length: {"ttft_s": [...], "comm_s": [...], "tokens": [[...], ...]}; key 0 holds
{"dtype": [the model dtype the engine ran in]}."""


def measure(path: str, prompts: dict[int, list[int]], repeats: int, new_tokens: int, pcp: int,
            num_threads: int, max_len: int) -> Samples:
    """Per prompt length (see Samples) over `repeats` runs on one engine of `pcp` ranks and
    `num_threads` torch threads in all (after one untimed warm-up request)."""
    import torch

    before = torch.get_num_threads()
    llm = _engine(path, max_len, pcp, num_threads)
    try:
        first = prompts[min(prompts)]
        _one_request(llm, first, 1)  # warm-up
        out: Samples = {}
        for n, prompt in prompts.items():
            got: dict[str, list[Any]] = {"ttft_s": [], "comm_s": [], "tokens": []}
            for _ in range(repeats):
                ttft, comm, tokens = _one_request(llm, prompt, new_tokens)
                got["ttft_s"].append(ttft)
                got["comm_s"].append(comm)
                got["tokens"].append(tokens)
            out[n] = got
        out[0] = {"dtype": [llm.llm_engine.config.model_config.dtype]}
        return out
    finally:
        llm.llm_engine.shutdown()
        torch.set_num_threads(before)  # LLM(num_threads=...) sets this process's threads


def measured_crossover(lens: Sequence[int], ratios: Sequence[float]) -> int | None:
    """Shortest length of `lens` (ascending) from which every ratio (N ranks / one) is below 1;
    None when the longest is not."""
    cross = None
    for n, r in zip(reversed(lens), reversed(ratios)):
        if r >= 1:
            break
        cross = n
    return cross


def run_model(model: str, lens: Sequence[int], repeats: int, new_tokens: int, pcp: int,
              seed: int, threads: int, link: links.Link,
              say: Callable[[str], object]) -> dict[str, Any]:
    """N=1, N=1 share and N=pcp on one model (module docstring); its rows and crossovers."""
    from pdkv.cache.specs import DTYPE_BYTES
    from pdkv.model.registry import resolve_model

    path = resolve_model(model)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    shape = PcpShape.from_hf_config(cfg)
    lens = sorted(set(lens))
    max_len = max(lens) + new_tokens + 2
    vocab = int(cfg["vocab_size"])
    prompts = {n: prompt_ids(n, vocab, seed + n) for n in lens}
    share_threads = max(1, threads // pcp)
    say(f"[{model}] N=1, {threads} threads ...")
    one = measure(path, prompts, repeats, new_tokens, 1, threads, max_len)
    say(f"[{model}] N=1 share, {share_threads} threads, {max(lens)} tokens ...")
    share = measure(path, {max(lens): prompts[max(lens)]}, repeats, new_tokens, 1,
                    share_threads, max_len)
    say(f"[{model}] N={pcp}, {share_threads} threads per rank ...")
    many = measure(path, prompts, repeats, new_tokens, pcp, threads, max_len)
    dtype = one[0]["dtype"][0]
    elem = DTYPE_BYTES[dtype]

    def med(s: Samples, n: int, key: str) -> float:
        return float(statistics.median(s[n][key]))

    longest = max(lens)
    try:
        t0, flops = fit_single_rank(shape, [(n, med(one, n, "ttft_s")) for n in lens])
    except ValueError as e:  # N=1 times not growing with L (noise): all of it is compute
        say(f"[{model}] {e}: t0 = 0, F from {longest} tokens")
        t0, flops = 0.0, calibrate_flops(shape, longest, med(one, longest, "ttft_s"))
    t_share, t_one = med(share, longest, "ttft_s"), med(one, longest, "ttft_s")
    s_shared = (t_share - t0) / (t_one - t0) if min(t_share, t_one) > t0 else t_share / t_one
    plan = PcpModel(shape, pcp, flops, link.bandwidth, link.latency, elem, elem, s_shared, t0)
    rows = []
    for n in lens:
        t1, tn = med(one, n, "ttft_s"), med(many, n, "ttft_s")
        c = plan.cost(n)
        rows.append({
            "model": model, "prompt_len": n, "split": n >= split_threshold(pcp),
            "n1_ms": t1 * MS, "n_ms": tn * MS, "ratio": tn / t1,
            "comm_ms": med(many, n, "comm_s") * MS,
            "plan_n1_ms": c.single_s * MS, "plan_n_ms": c.pcp_s * MS,
            "plan_comm_ms": c.comm_s * MS, "plan_ratio": c.pcp_s / c.single_s,
            "tokens_equal": all(t == one[n]["tokens"][0] for t in many[n]["tokens"]),
            "n1_ttft_s": one[n]["ttft_s"], "n_ttft_s": many[n]["ttft_s"],
            "n_comm_s": many[n]["comm_s"], "tokens": one[n]["tokens"][0],
        })
    plan_cross = plan.crossover()
    return {
        "model": model, "dtype": dtype, "shape": vars(shape), "threads": threads,
        "share_threads": share_threads, "share_ttft_s": share[longest]["ttft_s"],
        "shared_speedup": s_shared, "flops_per_s": flops, "overhead_s": t0, "rows": rows,
        "measured_crossover": measured_crossover(lens, [r["ratio"] for r in rows]),
        "plan_crossover": plan_cross,
    }


def format_table(models: Sequence[dict[str, Any]], pcp: int) -> str:
    """One markdown table, a row per (model, prompt length), then each model's crossovers."""
    n = f"N={pcp}"
    lines = [f"| model | prompt | N=1 ms | {n} ms | {n}/N=1 | comm ms | plan N=1 ms | "
             f"plan {n} ms | plan comm ms | plan {n}/N=1 | tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in models:
        for r in m["rows"]:
            split = "" if r["split"] else " (not split)"
            lines.append(
                f"| {r['model']} | {r['prompt_len']}{split} | {r['n1_ms']:.1f} | "
                f"{r['n_ms']:.1f} | {r['ratio']:.2f} | {r['comm_ms']:.1f} | "
                f"{r['plan_n1_ms']:.1f} | {r['plan_n_ms']:.1f} | {r['plan_comm_ms']:.1f} | "
                f"{r['plan_ratio']:.2f} | "
                + ("equal" if r["tokens_equal"] else "DIFFER") + " |")
    lines.append("")
    for m in models:
        def tok(x: int | None, what: str) -> str:
            return f"{x} tokens" if x is not None else what
        lines.append(
            f"{m['model']}: crossover measured "
            f"{tok(m['measured_crossover'], 'none in the measured lengths')}, plan "
            f"{tok(m['plan_crossover'], 'never')} (fitted to N=1: t0 = "
            f"{m['overhead_s'] * MS:.1f} ms, F = {m['flops_per_s']:.3g} FLOP/s; shared speed-up "
            f"S = {m['shared_speedup']:.2f}: N=1 compute on {m['share_threads']} thread(s) / on "
            f"{m['threads']})")
    lines.append(
        f"prefill ms: median engine-level TTFT of one request alone; comm: time inside its PCP "
        f"all-gathers (the largest over the ranks), which includes a rank's wait for the slower "
        f"one (the plan's comm is the transfer alone). plan: pdkv.plan.pcp, t0 + FLOPs / F "
        f"fitted to the N=1 column, ranks at F / S. "
        f"On one box the {pcp} ranks share the cores N=1 had: with S = {pcp} (cores scale "
        "linearly) the split cannot gain, and the all-gathers are pure loss.")
    return "\n".join(lines)


def run_pcp_bench(models: Sequence[str] = DEFAULT_MODELS, lens: Sequence[int] = DEFAULT_LENS,
                  repeats: int = DEFAULT_REPEATS, new_tokens: int = DEFAULT_NEW_TOKENS,
                  pcp: int = 2, seed: int = 0, num_threads: int | None = None,
                  bandwidth: float | None = None, latency: float | None = None,
                  print_fn: Callable[[str], object] = print) -> dict[str, Any]:
    """Every model at every length (module docstring); prints the header and table.

    Returns:
        {"header": [...], "models": [run_model results], "table", "settings", "publishable",
        "all_tokens_equal"}.

    Raises:
        ValueError: pcp < 2, no lengths, a length < 1, repeats or new_tokens < 1.
    """
    import torch

    if pcp < 2:
        raise ValueError(f"--pcp must be >= 2 (it is compared with one rank), got {pcp}")
    if not lens or min(lens) < 1 or repeats < 1 or new_tokens < 1:
        raise ValueError("need prompt lengths >= 1, repeats >= 1 and new tokens >= 1")
    link = links.link("tcp-loopback").with_overrides(bandwidth, latency)
    threads = num_threads or torch.get_num_threads()
    load_before = os.getloadavg()
    host = host_facts()
    results = [run_model(m, lens, repeats, new_tokens, pcp, seed, threads, link, print_fn)
               for m in models]
    load_after = os.getloadavg()
    lines, quiet = machine_lines(host, load_before, load_after)
    header = [
        "command: pdkv " + shlex.join(sys.argv[1:]) if sys.argv[1:3] == ["bench", "pcp"] else
        f"pdkv bench pcp: models {','.join(models)}",
        f"prompt lengths {','.join(map(str, sorted(set(lens))))}, {repeats} repeat(s), "
        f"{new_tokens} greedy tokens checked; N=1 on {threads} torch threads, each of the {pcp} "
        f"ranks on {max(1, threads // pcp)}; plan link {link.name}: {link.bandwidth:.3g} B/s, "
        f"{link.latency:g} s per all-gather step",
        *lines,
    ]
    table = format_table(results, pcp)
    print_fn("\n" + "\n".join(header) + "\n\n" + table)
    return {
        "benchmark": "pcp (issue 32)", "header": header, "models": results, "table": table,
        "settings": {"lens": sorted(set(lens)), "repeats": repeats, "new_tokens": new_tokens,
                     "pcp": pcp, "seed": seed, "threads": threads,
                     "link": {"name": link.name, "bandwidth": link.bandwidth,
                              "latency": link.latency}},
        "machine": {**host, "load_average_before": list(load_before),
                    "load_average_after": list(load_after)},
        "publishable": quiet,
        "all_tokens_equal": all(r["tokens_equal"] for m in results for r in m["rows"]),
    }


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """Flags of `pdkv bench pcp`."""
    p.add_argument("--model", default=",".join(DEFAULT_MODELS),
                   help="models, comma-separated (aliases or folders)")
    p.add_argument("--prompt-lens", default=",".join(map(str, DEFAULT_LENS)),
                   help="prompt tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help="timed requests per length and engine (the median is shown)")
    p.add_argument("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS,
                   help="greedy tokens per request, compared between N=1 and N")
    p.add_argument("--pcp", type=int, default=2, help="prefill-context-parallel size N")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of N=1 (N's ranks get an equal share); default torch's")
    p.add_argument("--pcp-bandwidth", type=float, default=None,
                   help="the plan's all-gather bytes/s (default: the tcp-loopback preset)")
    p.add_argument("--pcp-latency", type=float, default=None,
                   help="the plan's seconds per all-gather step (default: the preset's)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result here")


def main(args: argparse.Namespace) -> int:
    """`pdkv bench pcp`: 0 when every N-rank run gave N=1's tokens, else 1."""
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    result = run_pcp_bench(models, parse_ints(args.prompt_lens), args.repeats, args.new_tokens,
                           args.pcp, args.seed, args.num_threads, args.pcp_bandwidth,
                           args.pcp_latency)
    if args.json:
        write_result_json(result, args.json)
        print(f"result written to {args.json}")
    return 0 if result["all_tokens_equal"] else 1
