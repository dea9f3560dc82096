"""`--cpu-linear panel`: float32 projections on weights packed in panels of 16 output rows, run by
pdkv's own kernel (`csrc/panel_linear.cpp`): AVX2 + FMA, or 16-wide AVX-512 where the CPU has it
(`torch.ops.pdkv.panel_linear_isa()` names the one built).

Layout: a weight W [N, K] becomes panels [ceil(N / 16), K, 16] with panels[p, k, j] = W[16 p + j, k]
(rows past N zero), which replaces the plain weight (one copy; 16-row padding only). For each k
the 16 weights of a panel are one 64-byte line, so a decode step streams the weights once in
order, and the kernel's 6 x 16 register block (BLIS's AVX2 shape) reuses each loaded line for up
to 6 rows of x, with K in one chunk (chunks of at most 4,096 when longer) so each output is
stored once.

Why: at decode sizes a linear layer is bound by reading its weights. On this project's 2-core AVX2
EPYC, over SmolLM2-135M's 30 layers of projections (`python -m pdkv.model.panel_linear`, both
timed in one run, quiet box), the panel kernel took 0.62x the time of oneDNN's packed weights (the
previous default, `--cpu-linear onednn`) at 1 row, 0.71x at 8, 0.76x at 32, 0.78x at 64 and 0.92x
at 512 (prefill): docs/SPEED.md "Panel linear kernel". Rerun it on another CPU.

Numerics: each output is one sequential float32 sum over k (FMA), computed by one thread in a
fixed order, so a row's result does not depend on the other rows in the batch (unlike BLAS /
oneDNN, whose blocking changes with the row count); it differs from F.linear in the last bits
(tests/model/test_panel_linear.py bounds it; greedy parity with HF: tests/engine/test_hf_parity.py).

bfloat16 weights are packed as bfloat16 (half the bytes streamed per step, prefetched 48 rows
ahead) and widened to float32 in registers (a 16-bit shift, exact; from 18 rows of x a chunk is
widened once into a float32 buffer instead), with float32 FMA and x / y in float32 (a bfloat16
x is widened by the op, y rounded to bfloat16 once at the end): the approach of
llama.cpp's AVX2 bf16 dot products, so bf16 decodes faster than float32 on CPUs without native
bf16 instead of running torch's emulated bf16 GEMM. Where the CPU has AVX512-BF16, a bfloat16 x
on bfloat16 panels runs VDPBF16PS instead (pairs of k per float32 lane, the panel's rows
interleaved in registers): the same float32 sums but for the order of each pair's two additions,
still independent of the batch, within float32's summation bound (tests/model/test_panel_linear.py).

Available for float32 and bfloat16 on CPU when pdkv's extension is built (`make setup`) and the CPU
has AVX2 and FMA; otherwise `pack_panel_weight` returns None and the caller keeps oneDNN
(pdkv/model/cpu_linear.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdkv.model.hugepages import HugePageArena

NR = 16
"""Output rows per panel (two AVX2 vectors of float32, one AVX-512 vector)."""
PANEL_DTYPES = (torch.float32, torch.bfloat16)
"""Weight dtypes the kernel reads (bfloat16 is widened to float32 in registers)."""


def pack_panels(weight: torch.Tensor, arena: HugePageArena | None = None) -> torch.Tensor:
    """weight [N, K] -> panels [ceil(N / 16), K, 16] of its dtype, contiguous, rows past N zero;
    allocated from `arena` (2 MiB pages, pdkv.model.hugepages) when given."""
    n, k = weight.shape
    p = -(-n // NR)
    if arena is None and n % NR == 0:  # one copy, no padded temporary (a freed temporary can
        return weight.view(p, NR, k).transpose(1, 2).contiguous()  # stay in the RSS)
    if arena is None:
        panels = weight.new_zeros(p, k, NR)
    else:
        panels = arena.empty((p, k, NR), weight.dtype)
        if n % NR:
            panels[-1].zero_()
    full = n // NR
    if full:
        panels[:full].copy_(weight[: full * NR].view(full, NR, k).transpose(1, 2))
    if n % NR:
        panels[-1, :, : n - full * NR].copy_(weight[full * NR :].T)
    return panels


def unpack_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of pack_panels: panels [P, K, 16] -> weight [out_features, K]."""
    p, k, nr = panels.shape
    return panels.transpose(1, 2).reshape(p * nr, k)[:out_features]


def panel_linear_unavailable(weight: torch.Tensor, allow_build: bool = False) -> str | None:
    """Why the panel kernel cannot run `weight` (None: it can): off CPU, not float32, pdkv's
    extension not loadable, or built without the op (a CPU without AVX2 / FMA)."""
    from pdkv.model.paged_decode_build import load

    if weight.device.type != "cpu":
        return f"device {weight.device.type}"
    if weight.dtype not in PANEL_DTYPES:
        return f"dtype {weight.dtype} (float32 and bfloat16 only)"
    why = load(allow_build=allow_build)
    if why is not None:
        return why
    if not hasattr(torch.ops.pdkv, "panel_linear"):
        return "the extension has no panel_linear (built for a CPU without AVX2 and FMA)"
    return None


@dataclass(frozen=True)
class PanelWeight:
    """A projection's only copy of its weight, packed (see the module docstring); called like
    the other `PackedLinear` kinds in pdkv.model.llama.linear.

    Attributes:
        panels: [ceil(out_features / 16), in_features, 16], float32 or bfloat16.
        out_features: N of the original [N, K] weight.
    """

    panels: torch.Tensor
    out_features: int

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] -> [T, out_features] in x's dtype (+ bias [out_features]); `weight` (the plain
        parameter, now shape-only) is ignored. The kernel sums in float32: a bfloat16 x is
        widened by the op and the float32 sums rounded to bfloat16 once at the end (as torch's
        bf16 matmul accumulates in float32)."""
        if x.dtype in (torch.float32, torch.bfloat16):  # the op widens and rounds bfloat16
            return torch.ops.pdkv.panel_linear(x, self.panels, self.out_features, bias)
        y = torch.ops.pdkv.panel_linear(x.float(), self.panels, self.out_features,
                                        None if bias is None else bias.float())
        return y.to(x.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held (the plain weight's plus the 16-row padding)."""
        return self.panels.numel() * self.panels.element_size()


def pack_panel_weight(weight: torch.Tensor,
                      arena: HugePageArena | None = None) -> PanelWeight | None:
    """weight [N, K] packed for the panel kernel (into `arena` when given), or None where it
    cannot run (see panel_linear_unavailable; the caller falls back)."""
    if panel_linear_unavailable(weight) is not None:
        return None
    return PanelWeight(pack_panels(weight.detach(), arena), int(weight.shape[0]))


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of `repeats` timed calls after one untimed call (wall clock, seconds)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    """`python -m pdkv.model.panel_linear`: time the panel kernel against oneDNN's packed weights
    on one set of a model's projection shapes repeated over its layers, at several row counts,
    in one run (best of a few calls each; wall clock, --num-threads threads)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument(
        "--shapes",
        default="1152x576,576x576,3072x576,576x1536",
        help="comma-separated NxK projection shapes of one layer (default: SmolLM2-135M)",
    )
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rows", default="1,8,32,64,512", help="comma-separated row counts")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    weights = [torch.randn(n, k) for (n, k) in shapes for _ in range(args.layers)]
    why = panel_linear_unavailable(weights[0], allow_build=True)
    if why is not None:
        print(f"panel kernel unavailable: {why}")
        return 1
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
    panels = [PanelWeight(pack_panels(w), w.shape[0]) for w in weights]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(
        f"{len(weights)} projections ({args.layers} layers of {args.shapes}), "
        f"{args.num_threads} thread{'s' if args.num_threads != 1 else ''}"
    )
    print(
        f"{'rows':>5} {'onednn ms':>10} {'panel ms':>9} "
        f"{'panel/onednn time':>18} {'panel GFLOP/s':>14}"
    )
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for (_, k) in shapes}
            best = {
                "onednn": _best_seconds(
                    lambda xs=xs: [
                        torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], pk, None, "none", [], "")
                        for w, pk in zip(weights, onednn)
                    ],
                    args.repeats,
                ),
                "panel": _best_seconds(
                    lambda xs=xs: [pw(xs[w.shape[1]]) for w, pw in zip(weights, panels)],
                    args.repeats,
                ),
            }
            print(
                f"{rows:>5} {best['onednn'] * 1e3:>10.1f} {best['panel'] * 1e3:>9.1f} "
                f"{best['panel'] / best['onednn']:>18.2f} "
                f"{flops_per_row * rows / best['panel'] / 1e9:>14.0f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
