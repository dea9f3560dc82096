"""`pdkv compare`'s PNG plots (matplotlib, Agg backend): one bar or box per run (topology,
prompt length, concurrency, cache).

* `<prefix>phases.png`: stacked mean TTFT phase groups (pdkv.bench.compare.phases), ms;
* `<prefix>tpot_itl.png`: TPOT per request and every ITL gap, box plots, ms;
* `<prefix>bytes.png`: KV bytes moved per path (P2P, pool read, pool written), MiB;
* `<prefix>hit_rates.png`: pool hit rate (pool hit tokens / prompt tokens) and the mean of the
  engines' prefix cache hit rates, %.
A bytes or hit-rate plot whose every value is 0 (nothing of the kind ran: no pool, no hit) is not
drawn: an empty axis says nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from pdkv.bench.compare.explain import pool_hit_rate
from pdkv.bench.compare.phases import PHASE_GROUPS


def run_label(r: Mapping[str, Any]) -> str:
    """"pd\\n1024 c4 hot": topology, prompt tokens, concurrency, cache."""
    return f"{r['topology']}\n{r.get('input_len')} c{r.get('max_concurrency')} {r['cache']}"


def _prefix_rate(r: Mapping[str, Any]) -> float:
    rates = [v for v in (r.get("prefix_hit_rates") or {}).values() if v is not None]
    return sum(rates) / len(rates) if rates else 0.0


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
    labels = [run_label(r) for r in rows]
    xs = list(range(len(rows)))
    width = max(7.0, 0.55 * len(rows))
    names = []

    def save(fig: Any, ax: Any, name: str, title: str, unit: str) -> None:
        ax.set_xticks(xs, labels, fontsize=6, rotation=90)
        ax.set_ylabel(unit)
        ax.set_title(f"pdkv compare: {title}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fname = f"{prefix}{name}.png"
        fig.savefig(os.path.join(folder, fname), dpi=90)
        plt.close(fig)
        names.append(fname)

    fig, ax = plt.subplots(figsize=(width, 4.5))
    bottom = [0.0] * len(rows)
    for group in PHASE_GROUPS:
        vals = [float((r.get("phase_groups") or {}).get(group, 0.0)) for r in rows]
        ax.bar(xs, vals, 0.7, bottom=bottom, label=group)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(xs, [r["mean_ttft_ms"] for r in rows], "k_", markersize=14, label="client TTFT mean")
    save(fig, ax, "phases", "TTFT phases (mean per request)", "ms")

    fig, ax = plt.subplots(figsize=(width, 4.5))
    tp = [r.get("tpots_ms") or [0.0] for r in rows]
    it = [r.get("itls_ms") or [0.0] for r in rows]
    b1 = ax.boxplot(
        tp, positions=[x - 0.18 for x in xs], widths=0.3, showfliers=False, patch_artist=True
    )
    b2 = ax.boxplot(
        it, positions=[x + 0.18 for x in xs], widths=0.3, showfliers=False, patch_artist=True
    )
    for patch in b1["boxes"]:
        patch.set_facecolor("tab:blue")
    for patch in b2["boxes"]:
        patch.set_facecolor("tab:orange")
    ax.plot([], [], color="tab:blue", label="TPOT per request")
    ax.plot([], [], color="tab:orange", label="ITL gaps")
    save(fig, ax, "tpot_itl", "TPOT and ITL distributions (no outliers drawn)", "ms")

    for name, title, unit, series in (
        (
            "bytes",
            "KV bytes moved",
            "MiB",
            (
                ("p2p_bytes", "P2P"),
                ("pool_bytes_read", "pool read"),
                ("pool_bytes_written", "pool written"),
            ),
        ),
        (
            "hit_rates",
            "hit rates",
            "%",
            (("pool", "pool hit rate"), ("prefix", "prefix cache hit rate")),
        ),
    ):
        values: list[tuple[str, list[float]]] = []
        for key, label in series:
            if key == "pool":
                vals = [100.0 * (pool_hit_rate(r) or 0.0) for r in rows]
            elif key == "prefix":
                vals = [100.0 * _prefix_rate(r) for r in rows]
            else:
                vals = [(r.get(key) or 0.0) / (1 << 20) for r in rows]
            values.append((label, vals))
        if not any(v for _, vals in values for v in vals):
            continue  # nothing of this kind ran
        fig, ax = plt.subplots(figsize=(width, 4.0))
        w = 0.8 / len(series)
        for i, (label, vals) in enumerate(values):
            ax.bar([x + (i - (len(series) - 1) / 2) * w for x in xs], vals, w, label=label)
        save(fig, ax, name, title, unit)
    return names
