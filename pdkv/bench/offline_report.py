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
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
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
        "decode tok/s = B*(output_len-1) / (t(output_len) - t(max_tokens=1))",
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
    return "\n".join(lines)
