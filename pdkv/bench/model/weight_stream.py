"""`python -m pdkv.bench.model.weight_stream`: how fast a batch-1 decode step can stream a model's
packed weights, on 4 KiB pages and on 2 MiB pages (pdkv.model.hugepages).

The model is loaded as the engine loads it and its projections and LM head packed for the panel
kernel twice: with plain allocations (4 KiB pages) and into a HugePageArena. For each placement
it prints the best of `--repeats` timed passes of:

- every packed linear of one step, one row of x each, back to back from Python (the step's
  matmuls without the rest of the model: attention, norms, sampling), in ms and GB/s of weights;
- `torch.sum` over one float32 buffer of the same bytes, placed the same way (the read rate of
  `pdkv bench offline`'s limit row).

A decode step's linear time (`python -m pdkv.bench.model.profile_step`) above the first figure
is what the model step adds around the linears. Above the table: the CPU and its vector flags,
cores, the load average before and after, and the commit.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable, Sequence

import torch

from pdkv.bench.offline.limits import best_seconds
from pdkv.model.llama import LlamaForCausalLM
from pdkv.model.panel_linear import PanelWeight


def _warm_best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """One untimed call, then the fastest of `repeats` timed ones (seconds)."""
    fn()
    return best_seconds(fn, repeats)


def _panels(model: LlamaForCausalLM) -> list[PanelWeight]:
    """The PanelWeights of a packed model: every layer's projections, then the LM head."""
    out: list[object] = [p for layer in model.layers for p in layer.packed.values()]
    out.append(model.head_packed)
    return [p for p in out if isinstance(p, PanelWeight)]


def _step(panels: Sequence[PanelWeight], xs: dict[int, torch.Tensor]) -> None:
    """Every panel linear once, on one row of x."""
    for p in panels:
        p(xs[int(p.panels.shape[1])])


def measure(model_name: str, repeats: int) -> list[dict[str, float | str]]:
    """Rows of the table (placement, linears ms and GB/s, torch.sum GB/s), 4 KiB pages first.

    Raises:
        RuntimeError: the panel kernel cannot run here (why), or the model packed nothing.
    """
    from pdkv.model.hugepages import HugePageArena
    from pdkv.model.loader import load_model
    from pdkv.model.panel_linear import pack_panel_weight, panel_linear_unavailable
    from pdkv.model.registry import resolve_model

    path = resolve_model(model_name)
    rows: list[dict[str, float | str]] = []
    for placement in ("4 KiB pages", "2 MiB pages (arena)"):
        model = load_model(path, "float32", "cpu")
        why = panel_linear_unavailable(model.embed)
        if why is not None:
            raise RuntimeError(f"the panel kernel cannot run here: {why}")
        arena = HugePageArena() if placement.startswith("2") else None
        model.pack_cpu_weights(functools.partial(pack_panel_weight, arena=arena))
        panels = _panels(model)
        if not panels:
            raise RuntimeError(f"{model_name}: no projection was packed for the panel kernel")
        nbytes = sum(p.nbytes for p in panels)
        xs = {k: torch.randn(1, k) for k in {int(p.panels.shape[1]) for p in panels}}
        linear_s = _warm_best_seconds(functools.partial(_step, panels, xs), repeats)
        buf_arena = HugePageArena() if arena is not None else None
        buf = (buf_arena.empty((nbytes // 4,), torch.float32) if buf_arena is not None
               else torch.empty(nbytes // 4, dtype=torch.float32)).fill_(1.0)
        read_s = _warm_best_seconds(buf.sum, repeats)
        pages = "" if arena is None else (" (advised)" if arena.advised else " (not advised)")
        rows.append({"placement": placement + pages, "weights_mb": nbytes / 1e6,
                     "linears_ms": linear_s * 1e3, "linears_gb_s": nbytes / linear_s / 1e9,
                     "sum_gb_s": nbytes / read_s / 1e9})
        del model, panels, buf, buf_arena, arena
    return rows


def format_table(rows: Sequence[dict[str, float | str]]) -> str:
    """The markdown table of `measure`'s rows."""
    lines = ["| placement | weights MB | step's linears, batch 1 (ms) | their GB/s | "
             "torch.sum GB/s |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['placement']} | {r['weights_mb']:.0f} | {r['linears_ms']:.2f} | "
                     f"{r['linears_gb_s']:.1f} | {r['sum_gb_s']:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI (module doc). Returns 0, or 1 when the panel kernel cannot run here."""
    from pdkv.bench.header import host_facts, machine_lines

    parser = argparse.ArgumentParser(prog="python -m pdkv.bench.model.weight_stream",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-threads", type=int, default=2, help="torch threads")
    parser.add_argument("--repeats", type=int, default=10, help="timed passes (best kept)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.num_threads < 1:
        parser.error("--repeats and --num-threads must be >= 1")
    torch.set_num_threads(args.num_threads)
    host = host_facts()
    load_before = os.getloadavg()
    try:
        rows = measure(args.model, args.repeats)
    except RuntimeError as e:
        print(f"error: {e}")
        return 1
    lines, _ = machine_lines(host, load_before, os.getloadavg())
    print("\n".join([f"{args.model} float32, {args.num_threads} threads, best of "
                     f"{args.repeats}", *lines, "", format_table(rows)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
