"""Start-up wiring of `--cpu-linear` (panel | onednn | torch | auto) and the CPU dtype check.

* panel (the default): weights packed in 16-row panels for pdkv's AVX2 kernel, replacing the
  plain ones (pdkv/model/panel_linear.py); float32 or bfloat16: elsewhere (another dtype, no
  AVX2 / FMA, the extension not built) it is onednn.
* onednn: packed oneDNN weights replacing the plain ones (LlamaForCausalLM.pack_cpu_weights);
  where oneDNN has no kernel for the dtype, auto.
* torch: plain weights, F.linear.
* auto: plain weights, the kernel per row count from a table timed here
  (pdkv/model/linear_backend.py).

Off CPU every mode is torch. Projections a model cannot pack (layers without packed slots, such
as the linear-attention layers of the hybrid models) run through auto's table.

bfloat16 / float16 on a CPU without native bf16 run, with a warning (pdkv/model/cpu_features.py).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from pdkv.model.cpu_features import dtype_warning, read_cpu_features
from pdkv.model.hugepages import HugePageArena, release_freed_heap
from pdkv.model.linear_backend import LinearDispatch, LinearTuning, tune_linear
from pdkv.model.linear_table import DEFAULT_BUCKETS
from pdkv.model.llama import LlamaForCausalLM
from pdkv.model.panel_linear import pack_panel_weight, panel_linear_unavailable

logger = logging.getLogger(__name__)

CPU_LINEARS = ("panel", "onednn", "auto", "torch")


@dataclass(frozen=True)
class CpuLinearSetup:
    """What `--cpu-linear` resolved to.

    Attributes:
        mode: what ran: "panel" or "onednn" (packed; with a tuning when some projections could
            not be packed), "torch" or "auto".
        tuning: auto's timed table (None otherwise, or when the model has no plain projections).
        dtype_warning: the CPU dtype warning logged, if any.
    """

    mode: str
    tuning: LinearTuning | None = None
    dtype_warning: str | None = None

    def describe(self) -> str:
        """One line for logs and bench tables."""
        return self.tuning.table.describe() if self.tuning is not None else self.mode


def setup_cpu_linear(model: LlamaForCausalLM, mode: str, dtype: str, device: str,
                     budget_s: float = 0.3) -> CpuLinearSetup:
    """Apply `mode` to `model` (see the module docstring) and log the outcome.

    Args:
        budget_s: timed seconds for auto's table (tune_linear; a warm-up round comes first).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in CPU_LINEARS:
        raise ValueError(f"cpu_linear must be one of {CPU_LINEARS}, got {mode!r}")
    if not device.startswith("cpu"):
        return CpuLinearSetup("torch")
    why = panel_linear_unavailable(model.embed) if mode == "panel" else "not asked for"
    # The panel kernel widens bf16 weights in registers: nothing is emulated, no warning.
    warning = (
        None
        if why is None and dtype == "bfloat16"
        else dtype_warning(dtype, device, read_cpu_features())
    )
    if warning:
        logger.warning(warning)
    if mode == "panel":
        if why is None:
            arena = HugePageArena()
            packed = model.pack_cpu_weights(functools.partial(pack_panel_weight, arena=arena))
            release_freed_heap()  # the plain weights the panels were copied from
            logger.info("cpu-linear panel: %s", arena.describe())
            if packed:
                return CpuLinearSetup(mode, None, warning)
            mode = "auto"  # the projections left plain (hybrid layers) get the table
        else:
            logger.info("cpu-linear panel unavailable (%s): onednn", why)
            mode = "onednn"
    if mode == "onednn":
        if model.pack_cpu_weights():
            return CpuLinearSetup(mode, None, warning)
        mode = (
            "auto"  # no oneDNN kernel for this dtype here (bf16 without AVX-512 / AMX): the table
        )
    weights = model.linear_weights() if mode == "auto" else []
    if not weights:
        return CpuLinearSetup("torch" if mode == "torch" else "auto", None, warning)
    tuning = tune_linear(weights, DEFAULT_BUCKETS, budget_s)
    model.use_linear_dispatch(LinearDispatch(tuning.table))
    logger.info(tuning.describe())
    return CpuLinearSetup(mode, tuning, warning)


def main(argv: list[str] | None = None) -> int:
    """`python -m pdkv.model.cpu_linear --model smollm2 --dtype bfloat16`: print auto's table and
    its timings (microseconds of one layer's projections per bucket and backend) for a model."""
    import argparse

    from pdkv.model.cpu_features import read_cpu_features
    from pdkv.model.loader import load_model
    from pdkv.model.registry import resolve_model

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--budget-s", type=float, default=0.3, help="timed seconds after the warm-up")
    args = p.parse_args(argv)
    model = load_model(resolve_model(args.model), args.dtype, "cpu")
    print(f"{args.model} {args.dtype}; CPU flags: {read_cpu_features().describe()}")
    print(tune_linear(model.linear_weights(), DEFAULT_BUCKETS, args.budget_s).describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
