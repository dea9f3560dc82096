"""`--cpu-linear auto` (pdkv/model/linear_backend.py): the start-up timing builds the table from
what it measures (fake backends on a fake clock), prunes a backend that keeps losing, and every
real backend computes x @ W.T (+ b) on the one plain weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdkv.model import linear_backend as lb
from pdkv.model.linear_table import LinearTable


class FakeCost:
    """A clock that only advances when a fake backend runs: by cost[name](rows) seconds."""

    def __init__(self, cost: dict) -> None:
        self.now = 0.0
        self.cost = cost
        self.calls: list[tuple[str, int]] = []

    def clock(self) -> float:
        return self.now

    def backend(self, name: str):
        def run(x, w, b):
            self.calls.append((name, x.shape[0]))
            self.now += self.cost[name](x.shape[0])
            return x
        return run


def test_table_follows_the_measured_costs_and_prunes_a_growing_loser(monkeypatch):
    fake = FakeCost({"torch": lambda t: 1.0 * t, "upcast": lambda t: 50.0 + 0.2 * t})
    for name in fake.cost:
        monkeypatch.setitem(lb.BACKENDS, name, fake.backend(name))
    weights = [torch.zeros(4, 3), torch.zeros(3, 4)]
    tuning = lb.tune_linear(weights, buckets=(1, 8, 64, 512, 1024), budget_s=0.0,
                            candidates=("torch", "upcast"), clock=fake.clock)
    assert tuning.rounds == 1 and tuning.candidates == ("torch", "upcast")
    # per bucket: sum over the two weights of one call each
    assert tuning.timings[1] == pytest.approx({"torch": 2.0, "upcast": 100.4})
    assert tuning.timings[64] == pytest.approx({"torch": 128.0, "upcast": 125.6})
    assert tuning.table.backends == ("torch", "torch", "upcast", "upcast", "upcast")
    # torch lost by 3.4x at 512 and more than at 64: not timed at 1024 (nor warmed: only oneDNN is)
    assert tuning.timings[1024].keys() == {"upcast"}
    assert ("torch", 1024) not in fake.calls
    # upcast lost by 50x at 1 row and less after: kept
    assert all(("upcast", b) in fake.calls for b in (1, 8, 64, 512, 1024))


def test_unknown_backend_or_nothing_to_time_is_refused():
    w = [torch.zeros(2, 2)]
    with pytest.raises(ValueError):
        lb.tune_linear(w, candidates=("blas9000",))
    with pytest.raises(ValueError):
        lb.tune_linear([], budget_s=0.0)
    with pytest.raises(ValueError):
        lb.tune_linear(w, buckets=(), budget_s=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_backend_computes_the_same_linear(dtype):
    torch.manual_seed(0)
    w = (torch.randn(48, 32) * 0.1).to(dtype)
    b = torch.randn(48).to(dtype)
    names = lb.candidate_backends(w)
    assert names[0] == "torch" and ("upcast" in names) == (dtype != torch.float32)
    ref = F.linear(torch.randn(5, 32).double(), w.double(), b.double())
    for rows in (1, 5, 40):
        x = torch.randn(rows, 32).to(dtype)
        ref = F.linear(x.double(), w.double(), b.double())
        for name in names:
            table = LinearTable((1, 1000), (name, name))
            out = lb.LinearDispatch(table)(x, w, b)
            assert out.dtype == dtype and out.shape == (rows, 48)
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            assert torch.allclose(out.double(), ref, atol=tol, rtol=tol), (name, rows)


def test_dispatch_runs_the_backend_of_the_row_bucket(monkeypatch):
    seen: list[str] = []
    for name in ("torch", "onednn"):
        monkeypatch.setitem(lb.BACKENDS, name, lambda x, w, b, name=name: seen.append(name) or x)
    d = lb.LinearDispatch(LinearTable((1, 8, 64), ("torch", "onednn", "torch")))
    for rows in (1, 2, 3, 20, 40, 500):
        d(torch.zeros(rows, 2), torch.zeros(2, 2))
    assert seen == ["torch", "torch", "onednn", "onednn", "torch", "torch"]


def test_real_tuning_on_small_weights_gives_a_table_for_every_bucket():
    weights = [torch.randn(64, 32), torch.randn(32, 64)]
    tuning = lb.tune_linear(weights, buckets=(1, 16), budget_s=0.0)
    assert tuning.table.buckets == (1, 16) and set(tuning.table.backends) <= set(tuning.candidates)
    assert all(t > 0 for cells in tuning.timings.values() for t in cells.values())
    assert "cpu-linear auto table [1:" in tuning.describe()
    assert torch.get_num_threads() >= 1


def test_panel_is_the_default_and_unknown_modes_are_refused():
    import argparse

    from pdkv.config import ModelConfig
    from pdkv.engine.arg_utils import EngineArgs

    args = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args([])
    assert (
        EngineArgs.from_cli_args(args).cpu_linear
        == "panel"
        == ModelConfig(model="m", path="p").cpu_linear
    )
    with pytest.raises(ValueError, match="cpu_linear"):
        ModelConfig(model="m", path="p", cpu_linear="blas")


def test_cpu_linear_bench_table_has_prefill_and_decode_rows_with_ratios():
    from pdkv.bench.offline.backends import format_backend_table

    def tp(pre: float, dec: float) -> dict:
        return {"prefill_tok_s": pre, "decode_tok_s": dec}

    result = {
        "model": "smollm2",
        "dtype": "float32",
        "num_threads": 2,
        "input_len": 128,
        "output_len": 16,
        "host_cpu": "cpu",
        "backends": ["torch", "auto"],
        "knob": "cpu_linear",
        "backends_used": {"torch": "torch", "auto": "1:torch 8:onednn"},
        "results": [
            {
                "batch_size": 8,
                "torch": tp(100.0, 20.0),
                "auto": tp(150.0, 30.0),
                "prefill_ratio": {"torch": 1.0, "auto": 1.5},
                "decode_ratio": {"torch": 1.0, "auto": 1.5},
                "greedy_equal": {"torch": True, "auto": True},
            }
        ],
        "host_load_avg_1m": [3.5, 3.9],
        "host_cpu_count": 2,
    }
    table = format_backend_table(result)
    assert "| 8 | prefill | 100.0 | 150.0 | 1.50x | yes |" in table
    assert "| 8 | decode | 20.0 | 30.0 | 1.50x | yes |" in table
    assert "auto (ran 1:torch 8:onednn)" in table


def test_onednn_without_a_kernel_for_the_dtype_falls_back_to_the_table(monkeypatch):
    """`--cpu-linear onednn` packs where oneDNN has a kernel for the dtype; where it has none
    (bf16 without AVX-512 / AMX) the weights stay plain and auto's table picks the kernels."""
    from pdkv.model import cpu_linear

    class Model:
        packed = False

        def pack_cpu_weights(self) -> bool:
            return self.packed

        def linear_weights(self) -> list:
            return []  # nothing to time: the setup reports the mode it resolved to

    model = Model()
    assert cpu_linear.setup_cpu_linear(model, "onednn", "bfloat16", "cpu").mode == "auto"  # type: ignore[arg-type]
    model.packed = True
    assert cpu_linear.setup_cpu_linear(model, "onednn", "float32", "cpu").mode == "onednn"  # type: ignore[arg-type]


def test_bf16_warning_only_where_matmuls_are_emulated(monkeypatch):
    """On a CPU without native bf16 the panel kernel reads bf16 weights without emulation (no
    warning); the other modes warn."""
    import torch

    from pdkv.model import cpu_linear
    from pdkv.model.cpu_features import CpuFeatures

    monkeypatch.setattr(
        cpu_linear, "read_cpu_features", lambda: CpuFeatures(frozenset({"avx2", "fma"}))
    )
    monkeypatch.setattr(cpu_linear, "panel_linear_unavailable", lambda w: None)

    class Model:
        embed = torch.zeros(1, dtype=torch.bfloat16)

        def pack_cpu_weights(self, packer=None) -> bool:
            return True

    panel = cpu_linear.setup_cpu_linear(Model(), "panel", "bfloat16", "cpu")  # type: ignore[arg-type]
    assert panel.mode == "panel" and panel.dtype_warning is None
    onednn = cpu_linear.setup_cpu_linear(Model(), "onednn", "bfloat16", "cpu")  # type: ignore[arg-type]
    assert onednn.mode == "onednn" and "emulated" in str(onednn.dtype_warning)
    monkeypatch.setattr(cpu_linear, "panel_linear_unavailable", lambda w: "no AVX2")
    fallback = cpu_linear.setup_cpu_linear(Model(), "panel", "bfloat16", "cpu")  # type: ignore[arg-type]
    assert fallback.mode == "onednn" and fallback.dtype_warning is not None
