"""`pdkv compare`'s PNG plots (matplotlib, Agg backend), each answering one question and
readable at a guide's width (at most `MAX_WIDTH_IN` inches at `DPI`, however many runs): one
panel per (prompt length, concurrency) point, one horizontal bar (or pair of boxes) per
topology and cache in it, labelled on the y axis.

* `<prefix>phases.png`: where TTFT goes per topology: stacked mean TTFT phase groups
  (pdkv.bench.compare.phases) and the client's mean TTFT, ms;
* `<prefix>tpot_itl.png`: how decode runs: TPOT per request and every ITL gap, box plots, ms;
* `<prefix>bytes.png`: what moved: KV bytes per completed request per path (P2P, pool read,
  pool written), MiB;
* `<prefix>hit_rates.png`: what hit: pool hit rate (pool hit tokens / prompt tokens) and the
  mean of the engines' prefix cache hit rates, %.
A bytes or hit-rate plot whose every value is 0 (nothing of the kind ran: no pool, no hit) is not
drawn: an empty axis says nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdkv.bench.compare.explain import pool_hit_rate
from pdkv.bench.compare.phases import PHASE_GROUPS

MAX_WIDTH_IN = 10.0  # inches: 900 px at DPI, a guide's width
DPI = 90
BAR_IN = 0.24  # inches of panel height per labelled bar


def run_label(r: Mapping[str, Any]) -> str:
    """"pd\\n1024 c4 hot": topology, prompt tokens, concurrency, cache."""
    return f"{r['topology']}\n{r.get('input_len')} c{r.get('max_concurrency')} {r['cache']}"


def _prefix_rate(r: Mapping[str, Any]) -> float:
    rates = [v for v in (r.get("prefix_hit_rates") or {}).values() if v is not None]
    return sum(rates) / len(rates) if rates else 0.0


def panels(rows: Sequence[Mapping[str, Any]]
           ) -> tuple[list[Any], list[Any], dict[tuple[Any, Any], list[Mapping[str, Any]]]]:
    """The grid of `rows`: concurrencies (grid rows) and prompt lengths (grid columns), each in
    first-seen order, and the runs of each (length, concurrency) point in row order."""
    lens: list[Any] = []
    concs: list[Any] = []
    cells: dict[tuple[Any, Any], list[Mapping[str, Any]]] = {}
    for r in rows:
        n, c = r.get("input_len"), r.get("max_concurrency")
        if n not in lens:
            lens.append(n)
        if c not in concs:
            concs.append(c)
        cells.setdefault((n, c), []).append(r)
    return concs, lens, cells


def write_plots(rows: Sequence[Mapping[str, Any]], folder: str, prefix: str) -> list[str]:
    """Write the plots into `folder` (the bytes and hit-rate plots only when some value is not
    0); returns the file names written.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    # boxplot's `vert` is deprecated from matplotlib 3.11; `orientation` came in 3.10
    major_minor = tuple(int(x) for x in matplotlib.__version__.split(".")[:2])
    horizontal: dict[str, Any] = ({"orientation": "horizontal"} if major_minor >= (3, 10)
                                  else {"vert": False})
    concs, lens, cells = panels(rows)
    tallest = max((len(v) for v in cells.values()), default=1)
    panel_h = 0.9 + BAR_IN * tallest
    names: list[str] = []

    def grid(title: str, unit: str,
             draw: Callable[[Any, list[Mapping[str, Any]], list[float]], None]) -> Any:
        fig, axes = plt.subplots(len(concs), len(lens), squeeze=False, sharex="col",
                                 figsize=(MAX_WIDTH_IN, 0.9 + panel_h * len(concs)))
        for i, c in enumerate(concs):
            for j, n in enumerate(lens):
                ax = axes[i][j]
                runs = cells.get((n, c), [])
                ys = [float(k) for k in range(len(runs))]
                draw(ax, runs, ys)
                ax.set_yticks(ys, [f"{r['topology']} {r['cache']}" for r in runs], fontsize=8)
                ax.set_ylim(len(runs) - 0.5, -0.5)  # the first run on top
                ax.set_title(f"{n}-token prompts, concurrency {c}", fontsize=9)
                ax.tick_params(axis="x", labelsize=8)
                ax.grid(axis="x", alpha=0.3)
                if i == len(concs) - 1:
                    ax.set_xlabel(unit, fontsize=8)
        fig.suptitle(f"pdkv compare: {title}", fontsize=11)
        return fig, axes

    def save(fig: Any, axes: Any, name: str) -> None:
        handles, labels = axes[0][0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8,
                       frameon=False)
        fig.tight_layout(rect=(0.0, 0.07 if handles else 0.0, 1.0, 1.0))
        fname = f"{prefix}{name}.png"
        fig.savefig(os.path.join(folder, fname), dpi=DPI)
        plt.close(fig)
        names.append(fname)

    def phases(ax: Any, runs: list[Mapping[str, Any]], ys: list[float]) -> None:
        left = [0.0] * len(runs)
        for k, group in enumerate(PHASE_GROUPS):
            vals = [float((r.get("phase_groups") or {}).get(group, 0.0)) for r in runs]
            ax.barh(ys, vals, 0.7, left=left, label=group, color=f"C{k}")
            left = [a + v for a, v in zip(left, vals)]
        ax.plot([r["mean_ttft_ms"] for r in runs], ys, "k|", markersize=14,
                label="client TTFT mean")

    fig, axes = grid("where TTFT goes (mean per request)", "ms", phases)
    save(fig, axes, "phases")

    def decode(ax: Any, runs: list[Mapping[str, Any]], ys: list[float]) -> None:
        for values, shift, color, label in (("tpots_ms", -0.18, "tab:blue", "TPOT per request"),
                                            ("itls_ms", 0.18, "tab:orange", "ITL gaps")):
            data = [r.get(values) or [0.0] for r in runs]
            box = ax.boxplot(data, positions=[y + shift for y in ys], widths=0.3,
                             showfliers=False, patch_artist=True, manage_ticks=False,
                             **horizontal)
            for patch in box["boxes"]:
                patch.set_facecolor(color)
            ax.plot([], [], color=color, linewidth=6, label=label)

    fig, axes = grid("TPOT and ITL (no outliers drawn)", "ms", decode)
    save(fig, axes, "tpot_itl")

    def per_request(r: Mapping[str, Any], key: str) -> float:
        done = r.get("completed") or 0
        return (r.get(key) or 0.0) / done / (1 << 20) if done else 0.0

    for name, title, unit, series in (
        ("bytes", "KV bytes moved per request", "MiB per completed request",
         (("p2p_bytes", "P2P"), ("pool_bytes_read", "pool read"),
          ("pool_bytes_written", "pool written"))),
        ("hit_rates", "hit rates", "%",
         (("pool", "pool hit rate"), ("prefix", "prefix cache hit rate"))),
    ):
        def value(r: Mapping[str, Any], key: str) -> float:
            if key == "pool":
                return 100.0 * (pool_hit_rate(r) or 0.0)
            if key == "prefix":
                return 100.0 * _prefix_rate(r)
            return per_request(r, key)

        if not any(value(r, key) for r in rows for key, _ in series):
            continue  # nothing of this kind ran

        def grouped(ax: Any, runs: list[Mapping[str, Any]], ys: list[float],
                    series: tuple[tuple[str, str], ...] = series,
                    value: Callable[[Mapping[str, Any], str], float] = value) -> None:
            h = 0.8 / len(series)
            for k, (key, label) in enumerate(series):
                ax.barh([y + (k - (len(series) - 1) / 2) * h for y in ys],
                        [value(r, key) for r in runs], h, label=label, color=f"C{k}")

        fig, axes = grid(title, unit, grouped)
        save(fig, axes, name)
    return names
