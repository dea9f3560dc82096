"""`pdkv compare`'s view of the TTFT decomposition (pure): the servers' per-request
`pdkv_timings` phases (pdkv.serve.timings, pdkv.router.timings, aggregated by
pdkv.bench.serve.phases) folded into seven groups that every topology shares, and the TPOT / ITL
samples of a run.

Groups (each the sum of the mean of its phases over the run's requests, in ms; a phase a request
lacks counts as 0, so the groups add up to the mean client TTFT):

    queue           proxy, p_input, p_queue; colocated: input, queue
    prefill         p_prefill; colocated: prefill (the engine's own compute of the prompt)
    hold            p_output, p_residual, proxy_between (P answered → D asked: P holds the blocks)
    transfer        transfer (D's KV wait: pull from P and/or pool load), p_kv_wait (P's pool
                    load); colocated: kv_wait (a pool or offload load)
    d_queue         d_input, d_queue
    d_first_step    d_first_step (D's step that recomputes the last prompt token)
    residual        d_output, d_residual, residual, output, client_residual and any phase not
                    named above (HTTP, SSE parsing, the client)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PHASE_GROUPS: tuple[str, ...] = ("queue", "prefill", "hold", "transfer", "d_queue", "d_first_step",
                                 "residual")
_GROUP_OF: dict[str, str] = {
    "proxy": "queue", "p_input": "queue", "p_queue": "queue", "input": "queue", "queue": "queue",
    "p_prefill": "prefill", "prefill": "prefill",
    "p_output": "hold", "p_residual": "hold", "proxy_between": "hold",
    "transfer": "transfer", "p_kv_wait": "transfer", "kv_wait": "transfer",
    "d_input": "d_queue", "d_queue": "d_queue",
    "d_first_step": "d_first_step",
}


def group_of(phase: str) -> str:
    """The group of one phase name (unknown names: "residual")."""
    return _GROUP_OF.get(phase, "residual")


def phase_groups(ttft_phases: Mapping[str, Any] | None) -> dict[str, float] | None:
    """{group: mean ms} in `PHASE_GROUPS` order from `run_serve_bench`'s `ttft_phases` (None when
    the server sent no `pdkv_timings`)."""
    if not ttft_phases:
        return None
    out = dict.fromkeys(PHASE_GROUPS, 0.0)
    for name, v in ttft_phases.get("phases", {}).items():
        out[group_of(name)] += float(v["mean_ms"])
    return out


def raw_phase_means(ttft_phases: Mapping[str, Any] | None) -> dict[str, float]:
    """{phase: mean ms} of every phase as the servers named it ({} when none)."""
    if not ttft_phases:
        return {}
    return {name: float(v["mean_ms"]) for name, v in ttft_phases.get("phases", {}).items()}


def latency_samples(result: Mapping[str, Any]) -> dict[str, list[float]]:
    """{"tpots_ms": per-request TPOT, "itls_ms": every inter-token gap} in ms from a
    `run_serve_bench` result (failed requests and TPOT of <= 1 output token left out)."""
    tpots = [1e3 * t for t in result.get("tpots") or [] if t is not None]
    itls = [1e3 * g for gaps in result.get("itls") or [] for g in gaps]
    return {"tpots_ms": tpots, "itls_ms": itls}


def stacked_totals(rows: Sequence[Mapping[str, Any]]) -> list[float]:
    """Sum of the phase groups of each row (ms; 0 for a row without phases)."""
    return [sum((r.get("phase_groups") or {}).values()) for r in rows]


def phase_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table of the mean phase groups (ms) of every row that has them ("" if none)."""
    lines = [
        "| topology | prompt | conc | cache | "
        + " | ".join(PHASE_GROUPS)
        + " | sum | client TTFT |",
        "|" + "---|" * (len(PHASE_GROUPS) + 6),
    ]
    for r in rows:
        g = r.get("phase_groups")
        if not g:
            continue
        cells = " | ".join(f"{g.get(k, 0.0):.0f}" for k in PHASE_GROUPS)
        lines.append(
            f"| {r['topology']} | {r.get('input_len')} | {r.get('max_concurrency')} | {r['cache']} "
            f"| {cells} | {sum(g.values()):.0f} | {r['mean_ttft_ms']:.0f} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""
