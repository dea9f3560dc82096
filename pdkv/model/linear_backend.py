"""`--cpu-linear auto`: one plain copy of each weight, the matmul kernel chosen per row count by a
table timed at start-up on the model's own projection shapes.

Backends (all read the same plain [out, in] weight; none keeps a second copy):

* "torch": `F.linear` (BLAS; MKL / OpenBLAS GEMM). Fastest at 1 row on most x86 CPUs.
* "onednn": `torch.ops.mkldnn._linear_pointwise` on the plain weight (oneDNN inner product,
  which blocks the weight per call). Wins at a few to a few hundred rows on AVX-512 CPUs; in
  bfloat16 it runs only where oneDNN has a bf16 kernel (pdkv/model/cpu_features.py), else it is
  not a candidate.
* "upcast": for bfloat16 / float16 weights only, `F.linear` on float32 copies of x and weight made
  per call, the result cast back. On CPUs without native bf16 this beats torch's emulated bf16
  GEMM once the rows amortise the weight conversion (measured 4x at 64 rows on an AVX2 EPYC).

`tune_linear` times each available backend on one layer's projections for each bucket
(pdkv/model/linear_table.py), on one thread in CPU time, in interleaved rounds: one untimed
warm-up round (oneDNN's kernel creation per shape), then timed rounds
until `budget_s` is spent (at least one); a cell is the sum over the layer's projections of each
projection's fastest call. The oneDNN
packed-weight path (`--cpu-linear onednn`) stays separate: its packed weights replace the plain
ones, so it cannot share a table with BLAS without a second copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdkv.model.linear_table import DEFAULT_BUCKETS, LinearTable, build_table

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
BACKEND_ORDER = ("torch", "onednn", "upcast")  # tie-break preference


def _torch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _upcast(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


BACKENDS: dict[str, LinearFn] = {"torch": _torch, "onednn": _onednn, "upcast": _upcast}


@dataclass(frozen=True)
class LinearDispatch:
    """A matmul that picks its backend by the row count of x (see LinearTable.backend_for).

    Stored in a layer's `packed` slots instead of a packed weight (pdkv.model.llama.linear calls
    it with the layer's plain weight)."""

    table: LinearTable

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, in] @ weight[out, in].T + bias with the backend of bucket(T)."""
        return BACKENDS[self.table.backend_for(x.shape[0])](x, weight, bias)


@dataclass(frozen=True)
class LinearTuning:
    """The outcome of tune_linear.

    Attributes:
        table: the chosen backend per bucket.
        timings: {bucket: {backend: seconds for one layer's projections}} (each projection's
            fastest call, summed).
        candidates: backends that ran on this CPU and dtype.
        rounds: timed rounds done.
        seconds: wall time of the whole tuning, warm-up included.
    """

    table: LinearTable
    timings: dict[int, dict[str, float]]
    candidates: tuple[str, ...]
    rounds: int
    seconds: float

    def describe(self) -> str:
        """One log line: the table, then per bucket the microseconds per backend."""
        cells = "; ".join(
            f"{b}: " + " ".join(f"{n} {t * 1e6:.0f}us" for n, t in self.timings[b].items())
            for b in self.timings
        )
        return (f"cpu-linear auto table [{self.table.describe()}] from {self.rounds} round(s) in "
                f"{self.seconds * 1e3:.0f} ms ({cells})")


def candidate_backends(weight: torch.Tensor) -> tuple[str, ...]:
    """Backends that run for `weight` ([out, in] on CPU) here: torch always; onednn when oneDNN
    is built in and accepts the dtype (probed with one call); upcast for non-float32 weights."""
    names = ["torch"]
    if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
        try:
            with torch.inference_mode():
                _onednn(torch.zeros(1, weight.shape[1], dtype=weight.dtype), weight, None)
            names.append("onednn")
        except RuntimeError:  # no oneDNN kernel for this dtype on this CPU
            pass
    if weight.dtype != torch.float32:
        names.append("upcast")
    return tuple(names)


def tune_linear(
    weights: Sequence[torch.Tensor],
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    budget_s: float = 0.3,
    candidates: Sequence[str] | None = None,
    clock: Callable[[], float] = time.thread_time,
    prune_ratio: float = 2.0,
) -> LinearTuning:
    """Time every candidate backend on `weights` (one layer's projections, [out, in] each) at
    each bucket's row count and build the table.

    Args:
        weights: the projection weights whose matmuls one step runs per layer.
        buckets: row counts (tokens) to measure, ascending.
        budget_s: seconds of timed rounds after the warm-up (at least one round runs, so the
            tuning can exceed it on a slow or loaded CPU; the result says how long it took).
        candidates: backends to time (default: candidate_backends of the first weight).
        prune_ratio: a backend slower than the bucket's best by more than this factor, and by
            more than at the bucket before, is not timed at larger buckets (it is losing further as
            rows grow; this bounds the cost of an emulated bf16 GEMM at 512 rows). Its cells there
            stay empty.
        clock: seconds source for the cells (tests inject one). The default, this thread's CPU
            time with torch on one thread for the tuning, does not count the time other
            processes hold the cores: on a shared, loaded CPU wall-clock cells are mostly noise.
            The budget is wall-clock time.

    Raises:
        ValueError: no weights or buckets, or an unknown backend.
    """
    if not weights or not buckets:
        raise ValueError("need weights and buckets")
    names = tuple(candidates) if candidates is not None else candidate_backends(weights[0])
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise ValueError(f"unknown backends {unknown}; known: {sorted(BACKENDS)}")
    w0 = weights[0]
    inputs = {
        b: {
            w.shape[1]: torch.randn(b, w.shape[1], dtype=w0.dtype, device=w0.device)
            for w in weights
        }
        for b in buckets
    }
    # Fastest call per (bucket, backend, weight); the backends of one weight run back to back so
    # that drift and other processes' bursts hit them alike.
    best: dict[tuple[int, str, int], float] = {}
    wall0 = time.monotonic()

    dropped: set[str] = set()
    last_ratio: dict[str, float] = {}

    def one_round(record: bool) -> None:
        for b in buckets:
            live = [n for n in names if n not in dropped]
            for i, w in enumerate(weights):
                x = inputs[b][w.shape[1]]
                for name in live:
                    if not record and name != "onednn":  # only oneDNN builds a kernel per shape
                        continue
                    t0 = clock()
                    BACKENDS[name](x, w, None)
                    dt = clock() - t0
                    if record:
                        key = (b, name, i)
                        best[key] = min(dt, best.get(key, dt))
            if record:
                sums = {n: sum(best[(b, n, i)] for i in range(len(weights))) for n in live}
                fastest = min(sums.values())
                for n, t in sums.items():
                    ratio = t / fastest if fastest > 0 else 1.0
                    if ratio > prune_ratio and ratio > last_ratio.get(n, float("inf")):
                        dropped.add(n)
                    last_ratio[n] = ratio

    rounds = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            one_round(record=False)
            timed_from = time.monotonic()
            while rounds == 0 or time.monotonic() - timed_from < budget_s:
                one_round(record=True)
                rounds += 1
    finally:
        torch.set_num_threads(threads)
    timings = {
        b: {
            n: sum(best[(b, n, i)] for i in range(len(weights))) for n in names if (b, n, 0) in best
        }
        for b in buckets
    }
    return LinearTuning(
        build_table(timings, BACKEND_ORDER), timings, names, rounds, time.monotonic() - wall0
    )
