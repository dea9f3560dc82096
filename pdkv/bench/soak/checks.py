"""What the soak asserts at its end (torch-free): no server error, greedy answers equal to their
colocated reference (but at near ties), structured answers valid, free blocks back to their start
values, open fds back to their idle value, and RSS flat after the warm-up."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdkv.bench.soak.client import Outcome
from pdkv.bench.soak.workload import divergence, structured_ok


@dataclass(frozen=True)
class Reference:
    """A greedy item's answer from the idle colocated engine: its text and (token text, gap
    between the two best log-probabilities in nats) per output token."""

    text: str
    tokens: list[tuple[str, float]]


@dataclass(frozen=True)
class Limits:
    """The thresholds of the checks.

    Attributes:
        tie_margin: a greedy divergence where the reference's two best log-probabilities are
            closer than this (nats) is a near tie, not a failure.
        fd_slack: open fds a process may hold at the idle end above its idle start.
        max_rss_slope_pct_per_h: RSS growth allowed after the warm-up (% of its mean per hour).
        warmup_s: samples before this (seconds into the load) are left out of the RSS slope.
        min_slope_window_s: the RSS slope is checked only over at least this many seconds
            after the warm-up (a shorter window is reported, not judged).
    """

    tie_margin: float = 0.01
    fd_slack: int = 16
    max_rss_slope_pct_per_h: float = 5.0
    warmup_s: float = 600.0
    min_slope_window_s: float = 600.0


@dataclass
class GreedyTally:
    """Greedy answers compared with their reference: equal, diverging at a near tie, or wrong
    (the first few wrong ones kept for the report)."""

    compared: int = 0
    equal: int = 0
    near_ties: int = 0
    wrong: list[str] = field(default_factory=list)
    wrong_count: int = 0


def compare_greedy(outcomes: Sequence[Outcome], refs: dict[str, Reference],
                   tie_margin: float) -> GreedyTally:
    """Every answered greedy request against its item's reference (each choice; a request the
    client cancelled is not compared)."""
    t = GreedyTally()
    for o in outcomes:
        if not o.req.greedy or o.answer is None or o.req.item.key not in refs:
            continue
        ref = refs[o.req.item.key]
        for i in range(o.req.n):
            got = o.answer.texts.get(i, "")
            t.compared += 1
            d = divergence(ref.text, ref.tokens, got)
            if d is None:
                t.equal += 1
            elif d.gap < tie_margin:
                t.near_ties += 1
            else:
                t.wrong_count += 1
                if len(t.wrong) < 5:
                    t.wrong.append(
                        f"{o.req.target} {o.req.item.key} {'stream' if o.req.stream else 'whole'}:"
                        f" token {d.token} (gap {d.gap:.3g}): got {got!r}, reference {ref.text!r}")
    return t


def bad_structured(outcomes: Sequence[Outcome]) -> list[str]:
    """Answered structured requests whose text breaks their grammar (at most 5 described)."""
    bad = []
    for o in outcomes:
        if o.answer is None or not o.req.item.structured:
            continue
        for i in range(o.req.n):
            text, finish = o.answer.texts.get(i, ""), o.answer.finish.get(i)
            if not structured_ok(o.req.item, text, finish):
                bad.append(f"{o.req.item.key} choice {i} ({finish}): {text!r}")
    return bad


def slope_pct_per_hour(ts: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of `values` over `ts` (seconds), as % of their mean per hour.

    Raises:
        ValueError: fewer than 2 points, all at one time, or a mean of 0.
    """
    n = len(ts)
    if n < 2 or n != len(values):
        raise ValueError("need at least 2 (t, value) points")
    mt, mv = sum(ts) / n, sum(values) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0 or mv == 0:
        raise ValueError("the points span no time or average 0")
    slope = sum((t - mt) * (v - mv) for t, v in zip(ts, values)) / var
    return slope * 3600.0 / mv * 100.0


def rss_slopes(samples: Sequence[dict[str, float]], names: Sequence[str],
               limits: Limits) -> tuple[dict[str, float], float]:
    """Each process's RSS slope (%/h) over the samples after the warm-up, and the window's
    length (s). Empty when fewer than 2 samples are after the warm-up."""
    after = [s for s in samples if s["t"] >= limits.warmup_s]
    if len(after) < 2:
        return {}, 0.0
    window = after[-1]["t"] - after[0]["t"]
    out = {}
    for name in names:
        pts = [(s["t"], s[f"{name}.rss_bytes"]) for s in after if f"{name}.rss_bytes" in s]
        if len(pts) >= 2:
            out[name] = slope_pct_per_hour([p[0] for p in pts], [p[1] for p in pts])
    return out, window


def failures(tally_status: dict[str, int], greedy: GreedyTally, structured: list[str],
             blocks_start: dict[str, float], blocks_end: dict[str, float | None],
             idle_start: dict[str, float], idle_end: dict[str, float], names: Sequence[str],
             slopes: dict[str, float], window_s: float, limits: Limits,
             first_failed: str = "") -> list[str]:
    """The failed checks, each one line (empty: the soak passed). `idle_start` / `idle_end` are
    samples taken with no request in flight, before the load and after the drain;
    `first_failed` describes the first request that failed (a server error or a 4xx), which
    the server-error (or 4xx) line quotes."""
    out = []
    errors = {k: v for k, v in tally_status.items() if k in ("5xx", "stream_error", "no_answer")}
    first = f"; first: {first_failed}" if first_failed else ""
    if sum(errors.values()):
        out.append(f"server errors: {errors}{first}")
        first = ""
    if tally_status.get("4xx"):
        out.append(f"{tally_status['4xx']} requests got a 4xx (every soak request is valid)"
                   + first)
    if greedy.compared == 0:
        out.append("no greedy answer was compared with its reference")
    if greedy.wrong_count:
        out.append(f"{greedy.wrong_count} greedy answers differ from the colocated reference "
                   f"away from a near tie: {greedy.wrong[:2]}")
    if structured:
        out.append(f"{len(structured)} structured answers break their grammar: {structured[:2]}")
    for name, start in blocks_start.items():
        if blocks_end.get(name) != start:
            out.append(f"{name}: free blocks {blocks_end.get(name)} at the end, {start} at start")
    for name in names:
        a, b = idle_start.get(f"{name}.fds"), idle_end.get(f"{name}.fds")
        if a is None or b is None:
            out.append(f"{name}: open fds not read at the idle start or end (process gone?)")
        elif b > a + limits.fd_slack:
            out.append(f"{name}: {b:.0f} open fds at the idle end, {a:.0f} at the idle start "
                       f"(slack {limits.fd_slack})")
    if window_s >= limits.min_slope_window_s:
        for name, slope in slopes.items():
            if slope >= limits.max_rss_slope_pct_per_h:
                out.append(f"{name}: RSS grows {slope:.1f} %/h after the warm-up (limit "
                           f"{limits.max_rss_slope_pct_per_h} %/h)")
    return out


@dataclass
class LogFindings:
    """What one process's log holds: WARNING and ERROR lines, tracebacks, and the distinct
    messages (timestamp and request ids left out; at most 5 kept, with their counts)."""

    warnings: int = 0
    errors: int = 0
    tracebacks: int = 0
    messages: dict[str, int] = field(default_factory=dict)


def scan_log(path: str) -> LogFindings:
    """Count a pdkv log's WARNING / ERROR lines ("<date> <time> LEVEL logger: message") and
    tracebacks; a missing file counts nothing."""
    found = LogFindings()
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return found
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            found.tracebacks += 1
            continue
        parts = line.split(" ", 3)
        if len(parts) < 4 or parts[2] not in ("WARNING", "ERROR"):
            continue
        if parts[2] == "WARNING":
            found.warnings += 1
        else:
            found.errors += 1
        message = " ".join(w if not any(ch.isdigit() for ch in w) else "#"
                           for w in parts[3].split())[:160]
        if message in found.messages or len(found.messages) < 5:
            found.messages[message] = found.messages.get(message, 0) + 1
    return found
