"""`pdkv plan`'s prediction beside `pdkv compare`'s measurements (pure; the planner as a library).

Per row (all per request: the run's byte counters / completed requests):

* P/D rows: predicted handoff = `pdkv.plan.costs.handoff(P2P bytes, link, FixedCosts())` (the
  same arithmetic as `pdkv plan --kv-bytes B --link L`), beside the measured `transfer` phase
  (D's KV wait, the mean over the run's requests from `pdkv_timings`). The link is the transfer
  engine's preset (tcp → tcp-loopback, shm → shm; pdkv.bench.handoff.compare) or, on a capped
  link, the tbf rate (latency 0).
* pool rows: predicted pool load = pool bytes read / the tier's bandwidth (`TIER_BANDWIDTH`, an
  assumption printed in the report) beside the measured transfer group (D's or the colocated
  engine's KV wait; in P/D + pool it also holds the P2P pull, so the prediction adds the handoff).

Break-even statements (`pdkv.plan.planner.make_plan` on the model's config with the engine's KV
dtype and the prefill throughput measured in the run): "reload beats recompute above N tokens"
over the P/D link and "the pool pays above hit rate h" for each prompt length over the tier.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdkv.bench.handoff.compare import engine_link, fixed_from_probe
from pdkv.modelspec.hf_config import ModelSpec
from pdkv.plan import costs, links
from pdkv.plan.planner import Figure, PlanInputs, make_plan

#: Assumed effective read bandwidth of each pool tier, bytes/s, with where it comes from.
TIER_BANDWIDTH: dict[str, tuple[float, str]] = {
    "disk": (
        1.0e9,
        "disk tier: files in the page cache of this box, 1 GB/s assumed (read + "
        "deserialise, one process)",
    ),
    "redis": (0.5e9, "redis tier: one local redis over loopback TCP, 0.5 GB/s assumed"),
    "mooncake": (
        2.7e9,
        "mooncake tier: a local store over loopback, the tcp-loopback preset's 2.7 GB/s",
    ),
    "dram": (5.0e9, "dram tier: in-process copies, 5 GB/s assumed"),
}
#: The engine's KV element type on this CPU build (fp32: 2·30·3·64·4 = 46080 B/token for SmolLM2).
ENGINE_KV_DTYPE = "fp32"


@dataclass(frozen=True)
class PlanContext:
    """What the predictions need: the P/D transfer engine, the pool tier, the capped link rate
    (tc syntax, e.g. "1gbit") and its bytes/s, or None for loopback."""

    transfer: str
    pool_tier: str
    link_rate: str | None = None
    link_rate_bps: float | None = None


def pd_link(ctx: PlanContext, capped: bool) -> links.Link:
    """The P→D link of the prediction: the tbf rate when `capped`, else the engine's preset
    (tcp-loopback for an engine without one, e.g. mooncake over loopback)."""
    if capped and ctx.link_rate_bps:
        return engine_link("tcp", rate_bps=ctx.link_rate_bps, rate_name=ctx.link_rate or "")
    try:
        return engine_link(ctx.transfer)
    except ValueError:
        return links.link("tcp-loopback")


def tier_link(tier: str) -> links.Link:
    """The pool tier as a `Link` (assumed bandwidth from `TIER_BANDWIDTH`, latency 0)."""
    bw, note = TIER_BANDWIDTH.get(tier, TIER_BANDWIDTH["disk"])
    return links.Link(f"pool-{tier}", bw, 0.0, note)


def _per_request(row: Mapping[str, Any], key: str) -> float | None:
    v, n = row.get(key), row.get("completed") or 0
    return float(v) / n if v is not None and n > 0 else None


def calibrate_fixed(
    rows: Sequence[Mapping[str, Any]], ctx: PlanContext
) -> tuple[float, str] | None:
    """The per-handoff fixed cost F (s) measured in the run, as `pdkv bench handoff`'s probe
    does: a run's mean measured handoff (`pd`, loopback) minus its wire time and the handshake
    term (pdkv.bench.handoff.compare.fixed_from_probe), never below 0; F is the median over the
    warm runs, every `pd` run after the first one (the first after the engines start also pays
    first-use costs: one such run, as in a `--quick` run's shortest prompt, once calibrated F at
    27.8 ms where the handoffs took 5.6 ms). Only when a single run exists is it used, and the
    text says so. On this CPU build F is mostly scheduler steps (tens of ms each), which `pdkv
    plan`'s 2 ms default (a GPU step) leaves out. None when no run has a measured handoff."""
    cands = [r for r in rows if r["topology"] == "pd" and not r.get("link_rate")
             and (r.get("raw_phases") or {}).get("transfer") is not None
             and r.get("p2p_bytes") and r.get("completed")]
    if not cands:
        return None
    warm = cands[1:] or cands
    link = pd_link(ctx, False)
    f = statistics.median(
        fixed_from_probe(r["raw_phases"]["transfer"] / 1e3, r["p2p_bytes"] / r["completed"], link)
        for r in warm
    )
    handoffs = sum(int(r["completed"]) for r in warm)
    runs = ", ".join(f"{r['input_len']} tok {r['cache']} c{r['max_concurrency']}" for r in warm)
    which = (
        f"the median over {len(warm)} warm pd run(s) ({handoffs} handoffs: {runs}; the first pd "
        "run left out)"
        if warm is not cands
        else f"the only pd run ({handoffs} handoffs: {runs}; no warm run to calibrate on)"
    )
    return f, (
        f"F = {f * 1e3:.1f} ms: each run's mean measured handoff minus its wire time and "
        f"handshake, as `pdkv bench handoff`'s probe; {which}"
    )


def predict_row(row: Mapping[str, Any], ctx: PlanContext,
                fixed_s: float | None = None) -> dict[str, float | None]:
    """Predictions for one summary row (see the module doc); ms and bytes per request. `fixed_s`:
    the per-handoff fixed cost (s; `calibrate_fixed`), else `pdkv plan`'s default scheduling term.

    Returns:
        {"p2p_bytes_per_request", "pred_handoff_ms", "pool_bytes_per_request", "pred_pool_ms",
        "pred_transfer_ms" (handoff + pool load), "meas_transfer_ms" (the `transfer` group),
        "meas_handoff_ms" (D's `transfer` phase in P/D)}; a value is None where it does not apply.
    """
    fixed = costs.FixedCosts() if fixed_s is None else costs.FixedCosts(scheduling=fixed_s)
    out: dict[str, float | None] = dict.fromkeys(("p2p_bytes_per_request", "pred_handoff_ms",
                                                  "pool_bytes_per_request", "pred_pool_ms",
                                                  "pred_transfer_ms", "meas_transfer_ms",
                                                  "meas_handoff_ms"))
    p2p = _per_request(row, "p2p_bytes")
    pool = _per_request(row, "pool_bytes_read")
    parts = []
    if p2p:
        link = pd_link(ctx, bool(row.get("link_rate")))
        out["p2p_bytes_per_request"] = p2p
        handoff_ms = 1e3 * costs.handoff(p2p, link, fixed).total
        out["pred_handoff_ms"] = handoff_ms
        parts.append(handoff_ms)
        out["meas_handoff_ms"] = (row.get("raw_phases") or {}).get("transfer")
    if pool:
        out["pool_bytes_per_request"] = pool
        pool_ms = 1e3 * costs.handoff(pool, tier_link(ctx.pool_tier),
                                      costs.FixedCosts(scheduling=0.0)).total
        out["pred_pool_ms"] = pool_ms
        parts.append(pool_ms)
    if parts:
        out["pred_transfer_ms"] = sum(parts)
        out["meas_transfer_ms"] = (row.get("phase_groups") or {}).get("transfer")
    return out


def measured_prefill_tps(rows: Sequence[Mapping[str, Any]]) -> tuple[float, str] | None:
    """Prefill throughput (tokens/s) measured in the run: input_len / the prefill group of a
    cold run without a pool, the longest prompt at the lowest concurrency (colocated preferred,
    else P/D's P); None when no such row has phases."""
    best: tuple[tuple[int, int, int], float, str] | None = None
    for r in rows:
        pre = (r.get("phase_groups") or {}).get("prefill")
        if r.get("cache") != "cold" or "pool" in r["topology"] or "offload" in r["topology"] \
                or r.get("link_rate") or not pre:
            continue
        key = (
            int(r["topology"].startswith("colocated")),
            int(r["input_len"]),
            -int(r["max_concurrency"] or 0),
        )
        if best is None or key > best[0]:
            tps = r["input_len"] / (pre / 1e3)
            best = (key, tps, f"{r['input_len']} tokens / {pre:.0f} ms mean prefill phase of "
                              f"{r['topology']} cold at concurrency {r['max_concurrency']}")
    return None if best is None else (best[1], best[2])


def _figure(figs: Sequence[Figure], key: str) -> Figure | None:
    return next((f for f in figs if f.key == key), None)


def breakeven_lines(
    model: ModelSpec | None,
    input_lens: Sequence[int],
    prefill: tuple[float, str] | None,
    ctx: PlanContext,
    capped: bool = False,
    fixed_s: float | None = None,
    pool_ran: bool = True,
) -> list[str]:
    """The plan's break-even statements, one line each, with their inputs (Markdown); `fixed_s`:
    the per-transfer fixed cost (s; `calibrate_fixed`), else `pdkv plan`'s default; `pool_ran`:
    whether the run had a pool topology (else no pool-tier lines: nothing measured them).

    Raises:
        ValueError: from the planner on invalid numbers.
    """
    if model is None:
        return ["break-even: no model config for the planner (see `pdkv plan --model`)."]
    if prefill is None:
        return ["break-even: no cold run with TTFT phases measured a prefill throughput."]
    tps, how = prefill
    out = [f"prefill throughput P = {tps:.0f} tokens/s ({how}); KV dtype {ENGINE_KV_DTYPE} "
           "(the engine's on this build)."]
    pd_what = f"P/D link capped at {ctx.link_rate}" if capped and ctx.link_rate else "P/D link"
    targets = [(pd_link(ctx, capped), pd_what)] + (
        [(tier_link(ctx.pool_tier), "pool tier")] if pool_ran else []
    )
    for link, what in targets:
        for n in input_lens:
            fixed = costs.FixedCosts() if fixed_s is None else costs.FixedCosts(scheduling=fixed_s)
            figs = make_plan(
                PlanInputs(
                    link=link,
                    model=model,
                    prompt_len=n,
                    kv_dtype=ENGINE_KV_DTYPE,
                    prefill_tps=tps,
                    fixed=fixed,
                )
            )
            if n == input_lens[0]:
                be = _figure(figs, "breakeven_tokens")
                if be is not None:
                    claim = (
                        f"reload beats recompute above {be.value} tokens"
                        if be.value is not None
                        else "reload never beats recompute"
                    )
                    name = "" if link.name == "custom" else f" `{link.name}`"
                    out.append(f"{what}{name} ({link.bandwidth / 1e9:.3g} GB/s): {claim} "
                               f"({be.assumption}).")
            hr = _figure(figs, "pool_breakeven_hit_rate")
            if hr is not None and what == "pool tier":
                claim = ("no hit rate pays" if hr.value is None else
                         f"the pool pays above hit rate {float(hr.value):.3g}" +
                         (" (above 1: never at this length)" if float(hr.value) > 1 else ""))
                out.append(f"{n}-token prompts over the {link.name} tier: {claim}.")
    return out


def plan_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table of the rows that have a prediction (rows carry `predict_row`'s keys); the
    pool columns only when some row read from a pool."""
    from pdkv.bench.compare.report import format_bytes

    pool = any(r.get("pool_bytes_per_request") for r in rows)
    head = (
        "| topology | prompt | conc | cache | KV P2P / req | plan handoff (ms) | measured handoff "
        "(ms) "
        + ("| pool read / req | plan pool load (ms) " if pool else "")
        + "| plan transfer (ms) | measured transfer (ms) |"
    )
    lines = [head, "|" + "---|" * (11 if pool else 9)]

    def ms(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}"

    for r in rows:
        if r.get("pred_transfer_ms") is None:
            continue
        pool_cells = (
            f"{format_bytes(r.get('pool_bytes_per_request'))} | {ms(r.get('pred_pool_ms'))} | "
            if pool
            else ""
        )
        lines.append(
            f"| {r['topology']} | {r['input_len']} | {r['max_concurrency']} | {r['cache']} | "
            f"{format_bytes(r.get('p2p_bytes_per_request'))} | {ms(r.get('pred_handoff_ms'))} | "
            f"{ms(r.get('meas_handoff_ms'))} | {pool_cells}{ms(r.get('pred_transfer_ms'))} | "
            f"{ms(r.get('meas_transfer_ms'))} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def plan_assumptions(
    ctx: PlanContext, fixed: tuple[float, str] | None = None, pool_ran: bool = True
) -> list[str]:
    """The assumptions behind the predictions, for the report notes (`fixed`: `calibrate_fixed`;
    `pool_ran`: a pool topology ran, else no pool-load note)."""
    pd = pd_link(ctx, False)
    f_s = fixed[0] if fixed else costs.FixedCosts().scheduling
    how = fixed[1] if fixed else "`pdkv plan`'s default scheduling term"
    out = [
        f"plan handoff: `pdkv plan --kv-bytes <P2P bytes per request> --link {pd.name} "
        f"--sched-overhead {f_s:.4g}` arithmetic: bytes / {pd.bandwidth:.3g} B/s + handshake 2 × "
        f"{pd.latency:g} s + F ({how}; link: {pd.note}).",
        *(
            [
                "plan pool load: pool bytes read per request / "
                f"{tier_link(ctx.pool_tier).bandwidth:.3g} B/s "
                f"({tier_link(ctx.pool_tier).note}); in P/D + pool the plan transfer is handoff + "
                "pool load."
            ]
            if pool_ran
            else []
        ),
        "measured handoff: D's `transfer` phase (its KV wait: claim, pull, done, and the scheduler "
        "steps around them); measured transfer: the transfer group (see the phases plot).",
    ]
    if ctx.link_rate_bps:
        out.append(f"capped link: {ctx.link_rate} = {ctx.link_rate_bps:.4g} B/s (tbf) taken as the "
                   "effective rate, latency 0.")
    return out
