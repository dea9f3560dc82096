"""Converters from a benchmark's JSON result to a figure's table, for the commands whose printed
table is not a pipe table or grid (`Figure.convert = "pdkv.report.convert:NAME"`). Each takes the
command's output ({"stdout", "files", "json"}) and returns {"table": {"columns", "rows",
"align"}}; a result without the keys it reads raises KeyError."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MIB = 1 << 20


def _table(columns: list[str], rows: list[list[str]]) -> dict[str, Any]:
    return {"table": {"columns": columns, "rows": rows, "align": [""] * len(columns)}}


def transfer(output: Mapping[str, Any]) -> dict[str, Any]:
    """`pdkv bench transfer --result-json`: one row per (size, method), GB/s (GB = 1e9 B) best
    and median over the timed repeats, the engine's best over its peer's (raw socket, memcpy)."""
    rows = []
    for s in output["json"]["sizes"]:
        for name, m in s["methods"].items():
            peer = "raw" if f"{name}/raw_socket" in s["ratios"] else "memcpy"
            r = s["ratios"].get(f"{name}/raw_socket") or s["ratios"].get(f"{name}/memcpy")
            rows.append([f"{s['size_mib']} MiB", name, f"{m['best_gbps']:.2f}",
                         f"{m['median_gbps']:.2f}", f"{r['best']:.2f} /{peer}" if r else ""])
    return _table(["size", "method", "best GB/s", "median GB/s", "ratio (best)"], rows)


def _context(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def dcp(output: Mapping[str, Any]) -> dict[str, Any]:
    """`pdkv bench dcp --json`: one row per context length; the KV per rank of each config (MiB),
    the last config's KV ratio to the first, decode step p50 / p90 (ms) per config and the last
    config's all-gather + merge share of a step."""
    result = output["json"]
    configs: list[str] = []
    by_len: dict[int, dict[str, Mapping[str, Any]]] = {}
    for r in result["rows"]:
        if r["config"] not in configs:
            configs.append(r["config"])
        by_len.setdefault(int(r["context_len"]), {})[r["config"]] = r
    last = configs[-1]
    columns = (["context (tokens)"] + [f"KV per rank {c}" for c in configs] + ["ratio"]
               + [f"decode step p50 / p90 {c}" for c in configs]
               + [f"all-gather + merge share at {last}"])
    rows = []
    for n in sorted(by_len):
        got = by_len[n]

        def cell(c: str, fmt: str, got: dict[str, Mapping[str, Any]] = got) -> str:
            return fmt.format(**got[c]) if c in got else "-"

        rows.append([_context(n)]
                    + [f"{got[c]['kv_bytes_per_rank'] / MIB:.2f} MiB" if c in got else "-"
                       for c in configs]
                    + [cell(last, "{kv_ratio:.2f}")]
                    + [cell(c, "{step_median_ms:.1f} / {step_p90_ms:.1f} ms") for c in configs]
                    + [f"{100 * got[last]['comm_share']:.0f} %" if last in got else "-"])
    return _table(columns, rows)


def groups(output: Mapping[str, Any]) -> dict[str, Any]:
    """`pdkv bench groups --json`: per (model, prompt length), each group's blocks × bytes per
    block, the MiB moved (equal to the formula's, else "BYTES"), the pull's p50 (ms) and the
    bytes and time against the full-attention peer's row of the same length."""
    rows = []
    for r in output["json"]["rows"]:
        moved = f"{r['bytes_received'] / MIB:,.2f}"
        if r["bytes_received"] != r["formula_bytes"]:
            moved += f" (formula {r['formula_bytes'] / MIB:,.2f}: BYTES)"
        rows.append([
            str(r["model"]), str(r["prompt_tokens"]),
            "; ".join(f"{g['kind'].replace('_', ' ')} {g['blocks']} × {g['block_bytes']:,}"
                      for g in r["groups"]),
            moved, f"{r['transfer_s'] * 1e3:.2f}",
            f"{r['bytes_ratio']:.3f}" if "bytes_ratio" in r else "-",
            f"{r['time_ratio']:.2f}" if "time_ratio" in r else "-",
        ])
    return _table(["model", "prompt", "groups (blocks × bytes)", "MiB moved (= formula)",
                   "xfer p50 ms", "bytes × peer", "time × peer"], rows)


def _numeric(tokens: list[str]) -> bool:
    try:
        [float(t.replace(",", "")) for t in tokens]
    except ValueError:
        return False
    return True


def panel_linear(output: Mapping[str, Any]) -> dict[str, Any]:
    """`python -m pdkv.model.panel_linear`'s printed rows (rows, oneDNN ms, panel ms, their
    ratio, panel GFLOP/s), read from its stdout.

    Raises:
        ValueError: no row was printed.
    """
    rows = [line.split() for line in str(output["stdout"]).splitlines()]
    rows = [r for r in rows if len(r) == 5 and _numeric(r)]
    if not rows:
        raise ValueError("panel_linear printed no rows")
    return _table(["rows", "oneDNN packed ms", "panel ms", "panel / oneDNN time",
                   "panel GFLOP/s"], rows)


def memory(output: Mapping[str, Any]) -> dict[str, Any]:
    """`pdkv bench memory`'s printed table (RSS in MB = 10^6 bytes after start and after one
    request, its anon / file / shmem parts, torch loaded, the goal, met), read from its stdout.

    Raises:
        ValueError: no process row was printed.
    """
    rows = []
    for line in str(output["stdout"]).splitlines():
        label, rest = line[:22].strip(), line[22:].split()
        if label.startswith("pdkv ") and len(rest) == 8:
            rows.append([label, *(f"{x} MB" if i < 5 or i == 6 else x
                                  for i, x in enumerate(rest))])
    if not rows:
        raise ValueError("bench memory printed no process rows")
    return _table(["process", "started", "after one request", "anon", "file", "shmem",
                   "torch loaded", "goal", "met"], rows)


def _count(x: float | int | None) -> str:
    return "?" if x is None else f"{x:,.0f}"


def _span(seconds: float) -> str:
    """"10 min" for whole minutes, else "20 s"."""
    return f"{seconds / 60:g} min" if seconds % 60 == 0 else f"{seconds:g} s"


def _idle_pairs(pairs: Mapping[str, Any]) -> str:
    """"name a → b, ..." of {name: [idle start, idle end]} (None: not read)."""
    return ", ".join(f"{n} {_count(a)} → {_count(b)}" for n, (a, b) in pairs.items())


def soak(output: Mapping[str, Any]) -> dict[str, Any]:
    """`pdkv bench soak --output-dir {dir}`'s summary.json (collected from `{dir}`): what the
    run's checks looked at, one row each; requests and counts, fds, RSS in MB (10^6 bytes) at the
    idle start and end, RSS slopes in %/h after the warm-up (or why they were not judged), P's
    lease expirations, the processes' log lines, then the failed checks or "passed".

    Raises:
        KeyError: the command wrote no summary.json, or it lacks a key read here.
    """
    import json

    s = json.loads(output["files"]["summary.json"])
    status = s["by_status"]
    errors = {k: status.get(k, 0) for k in ("5xx", "stream_error", "no_answer", "4xx")}
    g = s["greedy"]
    limits = s["limits"]
    start, end = s["free_blocks_start"], s["free_blocks_end"]
    if all(end.get(e) == start[e] for e in start) and len(set(start.values())) == 1:
        blocks = f"{_count(next(iter(end.values())))} / {_count(next(iter(start.values())))} " \
                 f"on {', '.join(start)}"
    else:
        blocks = ", ".join(f"{e} {_count(end.get(e))} / {_count(start[e])}" for e in start)
    slopes = ", ".join(f"{n} {v:g}" for n, v in s["rss_slope_pct_per_h"].items())
    if not s["rss_slope_judged"]:
        slopes = (f"not judged: {s['rss_slope_window_s']:g} s after the warm-up < "
                  f"{limits['min_slope_window_s']:g} s")
    leases = sum(c.get("kv_lease_expirations", 0) for c in s["engine_counters"].values())
    logs = "; ".join(f"{n}: {v['warnings']} warnings, {v['errors']} errors, "
                     f"{v['tracebacks']} tracebacks" for n, v in s["log_lines"].items())
    rows = [
        ["requests", f"{s['requests']:,} in {s['duration_s']:,.0f} s ({s['requests_per_s']}/s): "
         + ", ".join(f"{_count(v)} {k}" for k, v in sorted(status.items()))],
        ["5xx, stream errors, missing answers, 4xx", " / ".join(map(_count, errors.values()))],
        ["greedy answers compared with the reference",
         f"{g['compared']:,}: {g['equal']:,} equal, {g['near_ties']:,} near ties, "
         f"{g['wrong']:,} wrong"],
        ["structured answers that break their grammar",
         f"{s['structured_invalid']:,} of {s['by_kind'].get('structured', 0):,} structured "
         "requests"],
        ["free blocks at the idle end", blocks],
        ["open fds, idle start → idle end",
         f"{_idle_pairs(s['fds_idle'])} (slack {limits['fd_slack']})"],
        ["RSS, idle start → idle end (MB)", _idle_pairs(s["rss_mb"])],
        [f"RSS slope after the first {_span(limits['warmup_s'])} (%/h; limit "
         f"{limits['max_rss_slope_pct_per_h']:g})", slopes],
        ["P's lease expirations", f"{_count(leases)}, of {_count(status.get('cancelled', 0))} "
         "cancels"],
        ["log lines", logs],
        ["checks", "; ".join(s["failures"]) or "passed"],
    ]
    return _table(["what", "result"], rows)


def handoff_pulls(output: Mapping[str, Any]) -> dict[str, Any]:
    """The per-pull lines of `pdkv bench handoff` in a command's stdout (the fixed-cost probe and
    one line per prompt length: prefill, handoff measured / predicted), each without the `pdkv
    plan` command it prints after the prediction.

    Raises:
        ValueError: no such line was printed.
    """
    import re

    pull = re.compile(r"^\[\w+\] (probe: |\d+ tokens: prefill )")
    lines = [re.sub(r" \(pdkv plan [^)]*\)$", "", line)
             for line in str(output["stdout"]).splitlines() if pull.match(line)]
    if not lines:
        raise ValueError("pdkv bench handoff printed no probe or prompt line")
    return {"text": lines}


# Where the generated notes of a `pdkv compare` report start (pdkv/bench/compare/output.py):
# the first of these lines after its tables.
COMPARE_NOTES_START = ("## Break-even", "## When it does not pay", "How to read it:")


def compare_notes(output: Mapping[str, Any]) -> dict[str, Any]:
    """The generated text of the report `pdkv compare --out {dir}/COMPARE.md` writes around its
    tables, as markdown lines: its workload line, its skipped topologies (listed right after
    the first table), then everything from the first of `COMPARE_NOTES_START` on (break-even,
    when it does not pay, how to read it, the plot links).

    Raises:
        KeyError: the command wrote no COMPARE.md.
        ValueError: the report has no workload line or none of those sections.
    """
    lines = str(output["files"]["COMPARE.md"]).rstrip("\n").split("\n")
    workload = [x.removeprefix("- workload: ") for x in lines if x.startswith("- workload: ")]
    start = next((i for i, x in enumerate(lines) if x.startswith(COMPARE_NOTES_START)), None)
    if not workload or start is None:
        raise ValueError("COMPARE.md has no workload line or no notes after its tables")
    skipped: list[str] = []
    if "Skipped topologies:" in lines:
        i = lines.index("Skipped topologies:")
        skipped = [lines[i]]
        while i + 1 < len(lines) and lines[i + 1].startswith("- "):
            i += 1
            skipped.append(lines[i])
        skipped.append("")
    return {"text": [f"Workload: {workload[0]}.", "", *skipped, *lines[start:]]}


def routing(output: Mapping[str, Any]) -> dict[str, Any]:
    """docs/ROUTING.md's table from `python -m pdkv.bench.compare.routing --result-json`: per
    policy, requests done, prefix-cache hit rate and tokens, TTFT mean / p50 / p99, wrong
    predictions of the KV-aware index (– for a policy without one) and the routing decisions
    by reason (most first).

    Raises:
        KeyError: the result has no "policies" or a policy lacks a field read here.
    """
    rows = []
    for p in output["json"]["policies"]:
        preds = p["predictions"]
        wrong = (f"{int(sum(n for k, n in preds.items() if k != 'exact'))} of "
                 f"{int(sum(preds.values()))}" if preds else "–")
        decisions = ", ".join(f"{k} {int(n)}" for k, n in
                              sorted(p["decisions"].items(), key=lambda kv: (-kv[1], kv[0])))
        rows.append([p["routing"], f"{p['completed']}/{p['requests']}", f"{p['hit_rate']:.3f}",
                     f"{int(p['prefix_hits']):,} / {int(p['prompt_tokens']):,}",
                     f"{p['ttft_mean_ms']:,.0f} ms", f"{p['ttft_p50_ms']:,.0f} ms",
                     f"{p['ttft_p99_ms']:,.0f} ms", wrong, decisions])
    return _table(["policy", "done", "hit rate", "hit tokens / prompt tokens", "TTFT mean",
                   "TTFT p50", "TTFT p99", "predictions wrong", "decisions"], rows)
