"""The per-shape matmul choice of `--cpu-linear auto` as a pure table (torch-free).

A step's projections all see the same number of rows T (tokens of the step; for the LM head,
sampled sequences). Start-up timing (pdkv/model/linear_backend.py) fills one cell per (bucket,
backend) with the seconds one layer's projections took at T = bucket; `build_table` keeps the
fastest backend per bucket; at run time `LinearTable.backend_for(T)` maps T to the bucket nearest
on a log scale (boundaries at the geometric means of neighbours, e.g. 1 | 2.8 | 8 | 16 | 32 ...)
and returns its backend.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_BUCKETS = (1, 8, 32, 64, 512)


@dataclass(frozen=True)
class LinearTable:
    """{bucket -> backend}, buckets ascending (tokens).

    Attributes:
        buckets: token counts measured, strictly ascending, >= 1.
        backends: the backend chosen for each bucket (same length).

    Raises:
        ValueError: empty, unsorted or mismatched.
    """

    buckets: tuple[int, ...]
    backends: tuple[str, ...]
    _bounds: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.buckets or len(self.buckets) != len(self.backends):
            raise ValueError(f"need one backend per bucket, got {self.buckets} / {self.backends}")
        if self.buckets[0] < 1 or any(a >= b for a, b in zip(self.buckets, self.buckets[1:])):
            raise ValueError(f"buckets must be ascending token counts >= 1, got {self.buckets}")
        bounds = tuple(math.sqrt(a * b) for a, b in zip(self.buckets, self.buckets[1:]))
        object.__setattr__(self, "_bounds", bounds)

    def bucket_index(self, tokens: int) -> int:
        """Index of the bucket nearest to `tokens` on a log scale (ties go to the larger)."""
        return bisect.bisect_right(self._bounds, tokens)

    def backend_for(self, tokens: int) -> str:
        """The backend for a matmul of `tokens` rows."""
        return self.backends[self.bucket_index(tokens)]

    def describe(self) -> str:
        """One line, e.g. "1:torch 8:onednn 32:onednn 64:onednn 512:torch"."""
        return " ".join(f"{b}:{n}" for b, n in zip(self.buckets, self.backends))


def build_table(
    timings: Mapping[int, Mapping[str, float]], order: Sequence[str] = ()
) -> LinearTable:
    """The fastest backend per bucket.

    Args:
        timings: {bucket tokens: {backend: seconds}}; a backend missing from a bucket was not
            measured there (unavailable).
        order: tie-break preference (earlier wins an exact tie); backends not listed come after,
            by name.

    Raises:
        ValueError: no buckets, or a bucket without any timing.
    """
    if not timings:
        raise ValueError("no timings")
    rank = {n: i for i, n in enumerate(order)}
    buckets = tuple(sorted(timings))
    chosen = []
    for b in buckets:
        cells = timings[b]
        if not cells:
            raise ValueError(f"bucket {b} has no timings")
        chosen.append(min(cells, key=lambda n: (cells[n], rank.get(n, len(rank)), n)))
    return LinearTable(buckets, tuple(chosen))
