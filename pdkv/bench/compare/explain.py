"""`pdkv compare`'s "when it does not pay" section, generated from the measured rows (pure).

Every sentence is built from the rows it names (topology, prompt length, concurrency, cache), so
the report says what this run measured, not what is expected:

* P/D vs colocated, cold, per prompt length and concurrency: mean TTFT and TPOT of both, and the
  hold + transfer that P/D adds;
* a pool vs the same topology without one: cold (hit rate 0: the saves are pure cost) and hot
  (the pool hit rate, tokens served by the pool / prompt tokens);
* CPU offload (colocated+offload vs colocated, hot);
* a capped link (pd over `--link-rate` vs pd over loopback and colocated), with the plan's
  handoff prediction beside the measured one.

A difference within the run's own noise is called "no clear difference": the largest |hot / cold
− 1| of mean TTFT over the topologies without a pool (where hot repeats cold: a control), never
below `NOISE` (`measured_noise`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Row = Mapping[str, Any]
NOISE = 0.10


def pool_hit_rate(row: Row) -> float | None:
    """Pool hit tokens / prompt tokens of the run (None without a pool counter)."""
    hits, n = row.get("pool_hit_tokens"), (row.get("completed") or 0) * (row.get("input_len") or 0)
    return None if hits is None or n <= 0 else float(hits) / n


def measured_noise(rows: Sequence[Row]) -> float:
    """The largest relative TTFT gap between a control topology's hot and cold runs at the same
    point (no pool, no offload, no capped link: hot repeats cold), at least `NOISE`."""
    idx = _index(rows)
    gaps = [abs(hot["mean_ttft_ms"] / cold["mean_ttft_ms"] - 1)
            for (topo, n, c, cache), cold in idx.items()
            if cache == "cold" and "+" not in topo and not cold.get("link_rate")
            and (hot := idx.get((topo, n, c, "hot"))) is not None and cold["mean_ttft_ms"] > 0]
    return max([NOISE, *gaps])


def _index(rows: Sequence[Row]) -> dict[tuple[str, int, int, str], Row]:
    return {(r["topology"], int(r["input_len"]), int(r["max_concurrency"] or 0), r["cache"]): r
            for r in rows}


def _verdict(new: float, base: float, noise: float = NOISE) -> str:
    """"+35% slower" / "-20% faster" / "no clear difference (+4%)" (within `noise`)."""
    change = new / base - 1 if base > 0 else 0.0
    if abs(change) <= noise:
        return f"no clear difference ({change:+.0%})"
    return f"{change:+.0%}, {'slower' if change > 0 else 'faster'}"


def _ms(v: Any) -> str:
    return "-" if v is None else f"{float(v):.0f} ms"


def _group(r: Row, name: str) -> float:
    return float((r.get("phase_groups") or {}).get(name, 0.0))


def explain_pd(rows: Sequence[Row], noise: float = NOISE) -> list[str]:
    """P/D vs colocated, cold runs, one line per (prompt length, concurrency) both ran."""
    idx, out = _index(rows), []
    for (topo, n, c, cache), colo in sorted(idx.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        pd = idx.get(("pd", n, c, "cold"))
        if topo != "colocated" or cache != "cold" or pd is None:
            continue
        added = _group(pd, "hold") + _group(pd, "transfer") + _group(pd, "d_first_step")
        pays = pd["mean_ttft_ms"] < colo["mean_ttft_ms"] * (1 - noise)
        out.append(
            f"{n}-token prompts, concurrency {c}: P/D TTFT {_ms(pd['mean_ttft_ms'])} vs colocated "
            f"{_ms(colo['mean_ttft_ms'])} "
            f"({_verdict(pd['mean_ttft_ms'], colo['mean_ttft_ms'], noise)}); "
            f"P/D adds hold + transfer + D first step = {added:.0f} ms per request; TPOT "
            f"{pd['mean_tpot_ms']:.0f} vs {colo['mean_tpot_ms']:.0f} ms "
            f"({_verdict(pd['mean_tpot_ms'], colo['mean_tpot_ms'], noise)}). "
            + (
                "P/D pays on TTFT here."
                if pays
                else "P/D does not pay on TTFT here"
                + (
                    " (it may on TPOT: decode no longer waits behind prefills)."
                    if pd["mean_tpot_ms"] < colo["mean_tpot_ms"] * (1 - noise)
                    else "."
                )
            )
        )
    return out


def explain_pool(rows: Sequence[Row], noise: float = NOISE) -> list[str]:
    """Each `X+pool...` topology against `X` (same prompt length and concurrency)."""
    idx, out = _index(rows), []
    for (topo, n, c, cache), r in sorted(
        idx.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])
    ):
        if "+pool" not in topo or cache != "cold":
            continue
        base_name = topo.split("+pool")[0]
        base = idx.get((base_name, n, c, "cold"))
        hot = idx.get((topo, n, c, "hot"))
        if base is None or hot is None:
            continue
        h = pool_hit_rate(hot)
        rate = f"{h or 0.0:.0%}"
        pays = hot["mean_ttft_ms"] < base["mean_ttft_ms"] * (1 - noise)
        line = (
            f"`{topo}`, {n}-token prompts, concurrency {c}: cold (hit rate 0: the pool only costs "
            f"its saves) TTFT {_ms(r['mean_ttft_ms'])} vs `{base_name}` "
            f"{_ms(base['mean_ttft_ms'])} "
            f"({_verdict(r['mean_ttft_ms'], base['mean_ttft_ms'], noise)}); hot (pool hit "
            f"rate {rate}) TTFT {_ms(hot['mean_ttft_ms'])} "
            f"({_verdict(hot['mean_ttft_ms'], base['mean_ttft_ms'], noise)} vs `{base_name}` "
            "cold). "
        )
        if not h:
            line += ("The pool served no token of these prompts (a prompt must span more than one "
                     "whole chunk): it cannot pay at this length.")
        else:
            line += "The pool pays here." if pays else "The pool does not pay here."
        out.append(line)
    return out


def explain_offload(rows: Sequence[Row], noise: float = NOISE) -> list[str]:
    """colocated+offload (hot: served from the host store) vs colocated hot."""
    idx, out = _index(rows), []
    for (topo, n, c, cache), r in sorted(idx.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        base = idx.get(("colocated", n, c, "hot"))
        if topo != "colocated+offload" or cache != "hot" or base is None:
            continue
        share = r.get("offload_wait_share")
        out.append(
            f"CPU offload, {n}-token prompts, concurrency {c}: hot TTFT {_ms(r['mean_ttft_ms'])} "
            f"vs colocated {_ms(base['mean_ttft_ms'])} "
            f"({_verdict(r['mean_ttft_ms'], base['mean_ttft_ms'], noise)})"
            + ("" if share is None else f"; copies' exposed wait {share:.1%} of the run")
            + ". "
            + (
                "Offload pays here."
                if r["mean_ttft_ms"] < base["mean_ttft_ms"] * (1 - noise)
                else "Offload does not pay here."
            )
        )
    return out


def explain_link(rows: Sequence[Row], noise: float = NOISE) -> list[str]:
    """pd over the capped link vs pd over loopback and colocated, cold, per prompt length."""
    idx, out = _index(rows), []
    for (topo, n, c, cache), r in sorted(idx.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if not r.get("link_rate") or cache != "cold":
            continue
        pd, colo = idx.get(("pd", n, c, "cold")), idx.get(("colocated", n, c, "cold"))
        parts = [
            f"`{topo}` ({r['link_rate']}), {n}-token prompts, concurrency {c}: TTFT "
            f"{_ms(r['mean_ttft_ms'])}"
        ]
        if pd is not None:
            parts.append(
                f"pd over loopback {_ms(pd['mean_ttft_ms'])} "
                f"({_verdict(r['mean_ttft_ms'], pd['mean_ttft_ms'], noise)})"
            )
        if colo is not None:
            parts.append(
                f"colocated {_ms(colo['mean_ttft_ms'])} "
                f"({_verdict(r['mean_ttft_ms'], colo['mean_ttft_ms'], noise)})"
            )
        line = "; ".join(parts) + (f"; handoff measured {_ms(r.get('meas_handoff_ms'))}, plan "
                                   f"{_ms(r.get('pred_handoff_ms'))}. ")
        if pd is not None:
            line += (
                f"The capped link adds {r['mean_ttft_ms'] - pd['mean_ttft_ms']:+.0f} ms to TTFT "
                f"({_group(r, 'transfer') - _group(pd, 'transfer'):+.0f} ms in the transfer "
                "phase). "
            )
        if colo is not None:
            line += (
                "P/D over this link still pays on TTFT."
                if r["mean_ttft_ms"] < colo["mean_ttft_ms"] * (1 - noise)
                else "P/D over this link does not pay on TTFT."
            )
        out.append(line)
    return out


def explain(rows: Sequence[Row]) -> list[str]:
    """All generated statements (Markdown bullets' text): the noise threshold, then P/D, pool,
    offload, link in order."""
    noise = measured_noise(rows)
    head = [
        f"Differences within ±{noise:.0%} are called no clear difference: the largest gap between "
        "hot and cold mean TTFT of a topology without a pool (hot repeats cold there) in this run, "
        f"at least {NOISE:.0%}."
    ]
    body = (explain_pd(rows, noise) + explain_pool(rows, noise) + explain_offload(rows, noise)
            + explain_link(rows, noise))
    return head + body if body else []
