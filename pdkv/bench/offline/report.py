"""Plain-text report of a `pdkv bench offline` result, and the host CPU description it shows."""

from __future__ import annotations

from typing import Any


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def cpu_description() -> str:
    """CPU model and its widest vector extensions, from /proc/cpuinfo ("unknown" elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown"
    model = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
        "?",
    )
    flags = next(
        (ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []
    )
    ext = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(ext) or 'no avx2'})"


def format_table(result: dict[str, Any]) -> str:
    """Plain-text report of a `run_offline_bench` result (throughputs in tokens per second)."""
    lines = [
        f"pdkv offline benchmark  model={result['model']}  dtype={result['dtype']}  "
        f"device={result['device']}  threads={result['num_threads']}",
        f"input_len={result['input_len']} tok  output_len={result['output_len']} tok  "
        f"torch={result['torch_version']}  transformers={result['transformers_version']}  "
        f"repeats={result['repeats']} (best)",
        f"cpu: {result.get('host_cpu', 'unknown')}",
        "prefill tok/s = B*input_len / t(max_tokens=1);  "
        "decode tok/s = B*(output_len-1) / (t(output_len) - t(first tokens), inside one run)",
        "",
    ]
    cols = ["batch", "pdkv prefill tok/s", "HF prefill tok/s", "ratio",
            "pdkv decode tok/s", "HF decode tok/s", "ratio"]
    rows = []
    for e in result["results"]:
        hf = e["hf"] or {}
        rows.append([
            str(e["batch_size"]),
            _fmt(e["pdkv"]["prefill_tok_s"], ".1f"),
            _fmt(hf.get("prefill_tok_s"), ".1f"),
            _fmt(e["prefill_ratio"], ".2f"),
            _fmt(e["pdkv"]["decode_tok_s"], ".1f"),
            _fmt(hf.get("decode_tok_s"), ".1f"),
            _fmt(e["decode_ratio"], ".2f"),
        ])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines.append(" | ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    lines.append("-+-".join("-" * w for w in widths))
    for r in rows:
        lines.append(" | ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
    lines.append("")
    load = result.get("host_load_avg_1m")
    if load:
        lines.append(
            f"host load avg (1 min) before/after: {load[0]:.2f}/{load[1]:.2f} "
            f"on {result.get('host_cpu_count')} cpus"
        )
    gm = result["greedy_match"]
    lines.append(
        "greedy match (batch 1, pdkv vs HF token ids): "
        + ("n/a (no HF)" if gm is None else ("yes" if gm else "no"))
    )
    if result.get("llamacpp_skipped"):
        lines.append(result["llamacpp_skipped"])
    return "\n".join(lines)


# Issue 14's CPU targets, pdkv / llama.cpp throughput in one run: decode by batch size, and the
# batch-1 prefill of 512 prompt tokens.
DECODE_GOALS = {1: 1.0, 32: 2.0, 64: 2.5}
LONG_PREFILL_GOAL = (512, 1.5)


def goal_for(kind: str, batch_size: int, input_len: int) -> float | None:
    """The pdkv / llama.cpp goal of a workload ("decode" or "long_prefill"), None if none."""
    if kind == "decode":
        return DECODE_GOALS.get(batch_size)
    if kind == "long_prefill" and batch_size == 1 and input_len == LONG_PREFILL_GOAL[0]:
        return LONG_PREFILL_GOAL[1]
    return None


def _row(name: str, entry: dict[str, Any], metric: str, goal: float | None) -> dict[str, Any]:
    def tok_s(system: str) -> float | None:
        r = entry.get(system)
        return None if r is None else r.get(metric)

    r = ratio_or_none(tok_s("pdkv"), tok_s("llamacpp"))
    return {
        "workload": name,
        "pdkv": tok_s("pdkv"),
        "hf": tok_s("hf"),
        "llamacpp": tok_s("llamacpp"),
        "ratio": r,
        "goal": goal,
        "met": None if goal is None or r is None else r >= goal,
        "same_tokens": entry.get("greedy_match_requests_all"),
        "requests": entry["batch_size"],
    }


def ratio_or_none(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    return None if a is None or b is None or b == 0 else a / b


def workload_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 14's workload rows of a run with llama.cpp (throughputs in tokens per second).

    In order: the batch-1 prefill of result["long_prefill"] (when measured), decode per batch
    size (aggregate tok/s), then the one-step prefill of B prompts per batch size > 1. Each row:
    "workload", "pdkv" / "hf" / "llamacpp" (tok/s or None), "ratio" (pdkv / llama.cpp),
    "goal" and "met" (None without a goal), "same_tokens" of "requests" (requests whose greedy
    tokens are equal on every system).
    """
    rows = []
    lp = result.get("long_prefill")
    if lp:
        n = lp["input_len"]
        rows.append(
            _row(f"prefill {n}, batch 1", lp, "prefill_tok_s", goal_for("long_prefill", 1, n))
        )
    for e in result["results"]:
        b = e["batch_size"]
        name = "decode, batch 1" if b == 1 else f"decode, {b} sequences (aggregate)"
        rows.append(_row(name, e, "decode_tok_s", goal_for("decode", b, result["input_len"])))
    for e in result["results"]:
        b = e["batch_size"]
        if b > 1:
            rows.append(
                _row(f"prefill {b} x {result['input_len']} in one step", e, "prefill_tok_s", None)
            )
    return rows


def format_workload_table(result: dict[str, Any]) -> str:
    """The pdkv / HF / llama.cpp table of result["workloads"] with goals met or missed."""
    rows = result["workloads"]
    cols = ["workload (tok/s)", "pdkv", "HF", "llama.cpp", "pdkv / llama.cpp", "goal", "met",
            "same tokens"]
    text = []
    for r in rows:
        text.append([
            r["workload"],
            _fmt(r["pdkv"], ".1f"),
            _fmt(r["hf"], ".1f"),
            _fmt(r["llamacpp"], ".1f"),
            _fmt(r["ratio"], ".2f"),
            "" if r["goal"] is None else f">= {r['goal']:.1f}",
            "" if r["met"] is None else ("met" if r["met"] else "missed"),
            "n/a" if r["same_tokens"] is None else f"{r['same_tokens']}/{r['requests']}",
        ])
    widths = [max(len(c), *(len(t[i]) for t in text)) for i, c in enumerate(cols)]
    lines = [
        f"pdkv vs HF transformers vs llama.cpp (llama-cpp-python "
        f"{result.get('llama_cpp_python_version') or '?'}, GGUF {result['dtype']}), same token "
        f"ids, {result['num_threads']} thread{'s' if result['num_threads'] != 1 else ''} each",
        " | ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cols, widths, strict=True))
        ),
        "-+-".join("-" * w for w in widths),
    ]
    for t in text:
        lines.append(" | ".join(v.ljust(w) if i == 0 else v.rjust(w)
                                for i, (v, w) in enumerate(zip(t, widths, strict=True))))
    counted = [r for r in rows if r["same_tokens"] is not None]
    same = bool(counted) and all(r["same_tokens"] == r["requests"] for r in counted)
    lines.append("")
    lines.append("greedy tokens identical on all systems: " + ("yes, every row" if same else "no"))
    goals = [r for r in rows if r["met"] is not None]
    lines.append(f"goals (issue 14) met: {sum(r['met'] for r in goals)}/{len(goals)}")
    return "\n".join(lines)
