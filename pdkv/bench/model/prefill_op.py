"""`python -m pdkv.bench.model.prefill_op`: the paged prefill attention op alone
(`torch.ops.pdkv.paged_prefill`, pdkv/model/paged_prefill.py), one run of new tokens after some
cached ones, on random K/V laid out in blocks as the engine's cache is.

Prints per case the median wall time of a call over `--repeats` calls (after a warm-up) and the
attention FLOP rate it implies: a causal run of T new tokens after C cached ones attends to
T·C + T(T+1)/2 keys per query head, each costing 4·D FLOP (Q·K and P·V, a multiply and an add
each). Softmax and the block gathers are not counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def attention_flop(new: int, cached: int, heads: int, head_size: int) -> float:
    """FLOP of one causal prefill run: heads x attended keys x 4 x head_size."""
    keys = new * cached + new * (new + 1) // 2
    return 4.0 * heads * keys * head_size


def time_case(new: int, cached: int, heads: int, kv_heads: int, head_size: int, block_size: int,
              repeats: int, seed: int = 0) -> float:
    """Median seconds of one `paged_prefill` call over `repeats` calls (5 warm-up calls first).

    Raises:
        RuntimeError: the extension is not loaded (pdkv.model.paged_decode_build.load).
    """
    g = torch.Generator().manual_seed(seed)
    blocks = -(-(cached + new) // block_size)
    kv = torch.randn(2, blocks + 1, block_size, kv_heads, head_size, generator=g)
    q = torch.randn(new, heads, head_size, generator=g)
    tables = torch.arange(1, blocks + 1).view(1, blocks)
    cu, ctx, out = torch.tensor([0, new]), torch.tensor([cached]), torch.empty_like(q)

    def call() -> None:
        torch.ops.pdkv.paged_prefill(q, kv, cu, ctx, tables, head_size**-0.5, 0, out)

    for _ in range(5):
        call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Print the table; 1 when pdkv's C++ ops cannot load here."""
    from pdkv.bench.offline.report import cpu_description
    from pdkv.model.paged_decode_build import load

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--new-tokens", type=int, default=512, help="prompt tokens of the run")
    p.add_argument("--cached", default="0,3584", help="comma-separated cached tokens per case")
    p.add_argument("--num-heads", type=int, default=9, help="query heads (SmolLM2: 9)")
    p.add_argument("--num-kv-heads", type=int, default=3, help="KV heads (SmolLM2: 3)")
    p.add_argument("--head-size", type=int, default=64, help="head dim")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--repeats", type=int, default=60, help="timed calls per case")
    p.add_argument("--num-threads", "--threads", dest="num_threads", type=int, default=2,
                   help="torch threads")
    args = p.parse_args(argv)
    why = load()
    if why is not None:
        print(f"pdkv's C++ ops are not available: {why}")
        return 1
    torch.set_num_threads(args.num_threads)
    load_before = os.getloadavg()[0]
    rows = []
    for cached in map(int, args.cached.split(",")):
        s = time_case(args.new_tokens, cached, args.num_heads, args.num_kv_heads, args.head_size,
                      args.block_size, args.repeats)
        flop = attention_flop(args.new_tokens, cached, args.num_heads, args.head_size)
        rows.append(f"| {args.new_tokens} | {cached} | {s * 1e3:.2f} | {flop / s / 1e9:.1f} |")
    print(f"paged_prefill, {args.num_heads} query / {args.num_kv_heads} KV heads of "
          f"{args.head_size}, block {args.block_size}, {args.num_threads} threads, median of "
          f"{args.repeats}; cpu {cpu_description()}, load average {load_before:.2f} / "
          f"{os.getloadavg()[0]:.2f} before / after")
    print("| new tokens | cached tokens | ms per call | attention GFLOP/s |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
