"""The soak's plot: the samples over time, one panel each for RSS, RSS change since the warm-up,
open fds, threads, free KV blocks, queue depths and pool bytes (PNG, matplotlib)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes

MB = 1e6


def plot_samples(samples: Sequence[dict[str, float]], processes: Sequence[str],
                 engines: Sequence[str], warmup_s: float, title: str, path: str) -> str | None:
    """Write the PNG to `path`; returns a note instead when matplotlib is not installed (it is a
    dev extra) or there are no samples."""
    if not samples:
        return "no samples to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    minutes = [s["t"] / 60.0 for s in samples]
    fig, axes = plt.subplots(7, 1, figsize=(11, 19), sharex=True)

    def series(ax: Axes, key: str, label: str, scale: float = 1.0) -> None:
        pts = [(m, s[key] / scale) for m, s in zip(minutes, samples) if key in s]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label)

    for name in processes:
        series(axes[0], f"{name}.rss_bytes", name, MB)
        key = f"{name}.rss_bytes"
        base = next((s[key] for s in samples if s["t"] >= warmup_s and key in s), None)
        if base:  # the change since the warm-up ended, where the slope is judged
            pts = [(m, (s[key] / base - 1.0) * 100.0) for m, s in zip(minutes, samples)
                   if key in s and s["t"] >= warmup_s]
            axes[1].plot([p[0] for p in pts], [p[1] for p in pts], label=name)
        series(axes[2], f"{name}.fds", name)
        series(axes[3], f"{name}.threads", name)
    for name in engines:
        series(axes[4], f"{name}.free_blocks", name)
        series(axes[5], f"{name}.waiting", f"{name} waiting")
        series(axes[5], f"{name}.running", f"{name} running")
        series(axes[6], f"{name}.pool_bytes_in_use", f"{name} pool bytes in use (own writes)", MB)
    series(axes[5], "client.inflight", "client: requests in flight")
    series(axes[6], "redis.used_memory", "redis used_memory", MB)
    axes[0].set_yscale("log")
    for ax, ylabel in zip(axes, ("RSS (MB, log)", "RSS change since warm-up (%)", "open fds",
                                 "threads", "free KV blocks", "requests", "pool (MB)")):
        ax.set_ylabel(ylabel)
        if warmup_s / 60.0 <= minutes[-1]:  # (a run shorter than the warm-up has no line)
            ax.axvline(warmup_s / 60.0, color="grey", linestyle=":", linewidth=1)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    if not axes[1].lines:
        axes[1].text(0.5, 0.5, f"the run ended within the warm-up ({warmup_s / 60:.0f} min)",
                     transform=axes[1].transAxes, ha="center", va="center", fontsize=9)
    axes[-1].set_xlabel("minutes since the load started (dotted: end of the warm-up)")
    fig.suptitle(textwrap.fill(title, 130), fontsize=9)
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 0.97))  # room for the three-line title
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None
