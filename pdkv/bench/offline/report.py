"""Plain-text report of a `pdkv bench offline` result, and the host CPU description it shows."""

from __future__ import annotations

from typing import Any


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


# The vector and matrix extensions a CPU figure depends on (Linux /proc/cpuinfo names), printed
# beside every figure so tables from different ISAs are never mixed.
ISA_FLAGS = ("fma", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_description() -> str:
    """CPU model and its vector / matrix extensions (ISA_FLAGS), from /proc/cpuinfo ("unknown"
    elsewhere), e.g. "AMD EPYC (fma, avx2)"."""
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
    ext = [f for f in ISA_FLAGS if f in flags]
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


def _grid(cols: list[str], text: list[list[str]]) -> list[str]:
    """Header, rule and rows of a plain-text table, first column left-aligned."""
    widths = [max(len(c), *(len(t[i]) for t in text)) for i, c in enumerate(cols)]

    def line(vals: list[str]) -> str:
        return " | ".join(v.ljust(w) if i == 0 else v.rjust(w)
                          for i, (v, w) in enumerate(zip(vals, widths, strict=True)))

    return [line(cols), "-+-".join("-" * w for w in widths), *(line(t) for t in text)]


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f} %"


def format_workload_table(result: dict[str, Any]) -> str:
    """The pdkv / HF / llama.cpp table of result["workloads"], the limit rows above it
    (result["limits"], when measured) and the goals table below it (result["goals"])."""
    rows = result["workloads"]
    cols = ["workload (tok/s)", "pdkv", "HF", "llama.cpp", "pdkv / llama.cpp", "pdkv / HF",
            "roofline", "pdkv of it", "llama.cpp of it", "same tokens"]
    text = [[
        r["workload"],
        _fmt(r["pdkv"], ".1f"),
        _fmt(r["hf"], ".1f"),
        _fmt(r["llamacpp"], ".1f"),
        _fmt(r["ratio"], ".2f"),
        _fmt(r.get("hf_ratio"), ".2f"),
        _fmt(r.get("limit"), ".1f"),
        _pct(r.get("pdkv_of_limit")),
        _pct(r.get("llamacpp_of_limit")),
        "n/a" if r["same_tokens"] is None else f"{r['same_tokens']}/{r['requests']}",
    ] for r in rows]
    systems = ["pdkv"]
    if any(r["hf"] is not None for r in rows):
        systems.append("HF transformers")
    if any(r["llamacpp"] is not None for r in rows):
        systems.append(f"llama.cpp (llama-cpp-python "
                       f"{result.get('llama_cpp_python_version') or '?'}, GGUF {result['dtype']})")
    threads = f"{result['num_threads']} thread{'s' if result['num_threads'] != 1 else ''}"
    lines = [
        " vs ".join(systems) + f", same token ids, {threads} each" if len(systems) > 1
        else f"pdkv alone (no peer ran), {result['dtype']}, {threads}",
        f"cpu: {result.get('host_cpu', 'unknown')}",
    ]
    if result.get("limits"):
        from pdkv.bench.offline.limits import format_limits

        lines.append(format_limits(result["limits"]))
    lines += _grid(cols, text)
    counted = [r for r in rows if r["same_tokens"] is not None]
    same = bool(counted) and all(r["same_tokens"] == r["requests"] for r in counted)
    lines.append("")
    lines.append("greedy tokens identical on all systems: " + (
        "n/a (no peer ran)" if not counted else "yes, every row" if same else "no"))
    goals = result.get("goals") or []
    if goals:
        lines.append("")
        lines.append(format_goals(goals, result.get("dtype", "float32")))
    return "\n".join(lines)


_MEASURE_NAMES = {
    "vs_llamacpp": "pdkv / llama.cpp",
    "vs_hf": "pdkv / HF",
    "of_limit": "pdkv / roofline",
    "of_fma_peak": "pdkv FLOP / FMA peak",
}


def format_goals(goals: list[dict[str, Any]], dtype: str = "float32") -> str:
    """The goals table (`pdkv.bench.offline.workloads.evaluate_goals` rows) of a `dtype` run and
    its tally."""
    def val(g: dict[str, Any], x: float | None) -> str:
        if x is None:
            return "n/a"
        return _pct(x) if g["measure"].startswith("of_") else f"{x:.2f}"

    text = [[
        g["workload"],
        _MEASURE_NAMES.get(g["measure"], g["measure"]),
        val(g, g["value"]),
        ">= " + val(g, g["goal"]),
        "" if g["floor"] is None else ">= " + val(g, g["floor"]),
        "n/a" if g["met"] is None else ("met" if g["met"] else "missed"),
        "" if g["floor_held"] is None else ("holds" if g["floor_held"] else "BROKEN"),
    ] for g in goals]
    lines = _grid([f"goal ({dtype})", "measure", "value", "goal", "floor", "goal met", "floor"],
                  text)
    judged = [g for g in goals if g["met"] is not None]
    floors = [g for g in goals if g["floor_held"] is not None]
    lines.append(
        f"goals met: {sum(g['met'] for g in judged)}/{len(judged)}; floors held: "
        f"{sum(g['floor_held'] for g in floors)}/{len(floors)}"
        + (f" ({len(goals) - len(judged)} not measurable in this run)"
           if len(judged) < len(goals) else "")
    )
    return "\n".join(lines)
