"""pdkv's panel linear kernel (csrc/panel_linear.cpp, pdkv/model/panel_linear.py) against a
float64 reference: every row-block remainder of the micro-kernel (6 rows with AVX2, 12 with
AVX-512), K past and short of
one chunk (K in chunks of at most 4,096), N not a multiple of 16, a bias, strided x; a row's
result independent of its batch; bfloat16 panels (widened exactly, or AVX512-BF16's dot products
for a bfloat16 x); the packing round trip; clear errors; and `--cpu-linear panel` in a real
engine."""

from __future__ import annotations

import pytest
import torch

from pdkv.model.panel_linear import (
    NR,
    PanelWeight,
    pack_panels,
    panel_linear_unavailable,
    unpack_panels,
)

pytestmark = pytest.mark.usefixtures("cpu_ops")


@pytest.fixture(autouse=True)
def _needs_panel_kernel(cpu_ops):
    why = panel_linear_unavailable(torch.zeros(1))
    if why is not None:
        pytest.skip(f"panel kernel unavailable: {why}")


def _error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A float32 dot product of length K is within K * eps * sum|x_k w_k| of the exact value
    (the standard bound for recursive summation, Higham, Accuracy and Stability, §3.1)."""
    k = x.shape[1]
    return k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize(
    ("n", "k"), [(16, 8), (40, 576), (576, 256), (100, 300), (33, 1000), (20, 4096), (21, 9001)],
)
def test_matches_float64_for_every_row_block_remainder(n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    pw = PanelWeight(pack_panels(w), n)
    for m in [*range(1, 26), 37]:  # every remainder after full blocks of 6 (AVX2) or 12 (AVX-512)
        x = torch.randn(m, k, generator=g)
        ref = x.double() @ w.double().T
        y = pw(x)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert ((y.double() - ref).abs() <= _error_bound(x, w)).all(), (m, n, k)
        yb = pw(x, None, bias)
        assert ((yb.double() - (ref + bias.double())).abs() <= _error_bound(x, w) + 1e-6).all()


def test_a_rows_result_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(200, 600, generator=g), torch.randn(29, 600, generator=g)
    pw = PanelWeight(pack_panels(w), 200)
    y = pw(x)
    for i in range(29):
        assert torch.equal(pw(x[i : i + 1]), y[i : i + 1]), i
    assert torch.equal(pw(x[3:17]), y[3:17])


def test_row_blocks_of_a_long_prefill_change_no_bit():
    # More rows than one block of the kernel's row loop (192), with a remainder: every row equals
    # the row computed alone, also in slices that start inside a block or span two, and the whole
    # product stays within the float32 bound of the float64 one.
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(88, 600, generator=g), torch.randn(421, 600, generator=g)
    pw = PanelWeight(pack_panels(w), 88)
    y = pw(x)
    for i in (0, 5, 191, 192, 193, 383, 384, 420):
        assert torch.equal(pw(x[i : i + 1]), y[i : i + 1]), i
    for lo, hi in ((180, 200), (7, 400), (190, 421)):
        assert torch.equal(pw(x[lo:hi]), y[lo:hi]), (lo, hi)
    ref = x.double() @ w.double().T
    assert ((y.double() - ref).abs() <= _error_bound(x, w)).all()


def test_strided_and_empty_inputs():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=g)
    pw = PanelWeight(pack_panels(w), 48)
    wide = torch.randn(5, 128, generator=g)
    x = wide[:, ::2]  # not contiguous
    assert torch.equal(pw(x), pw(x.contiguous()))
    assert pw(torch.empty(0, 64)).shape == (0, 48)


def test_packing_round_trip_and_padding():
    w = torch.randn(37, 24)
    panels = pack_panels(w)
    assert panels.shape == (3, 24, NR) and panels.is_contiguous()
    assert torch.equal(panels[0, 5], w[:16, 5]) and torch.equal(panels[2, 7, :5], w[32:, 7])
    assert not panels[2, :, 5:].any()  # rows past N are zero
    assert torch.equal(unpack_panels(panels, 37), w)


def test_bad_inputs_raise_with_the_shapes():
    pw = PanelWeight(pack_panels(torch.randn(32, 64)), 32)
    with pytest.raises(RuntimeError, match="x has 63 columns"):
        pw(torch.randn(2, 63))
    with pytest.raises(RuntimeError, match="x must be \\[T, K\\] float32"):
        torch.ops.pdkv.panel_linear(torch.randn(2, 64, dtype=torch.float64), pw.panels, 32, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.pdkv.panel_linear(torch.randn(2, 64), pw.panels.half(), 32, None)
    with pytest.raises(RuntimeError, match="cannot hold 40 outputs"):
        torch.ops.pdkv.panel_linear(torch.randn(2, 64), pw.panels, 40, None)


def test_bfloat16_panels_widen_exactly_and_accumulate_in_float32():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(72, 520, generator=g).to(torch.bfloat16)
    pw = PanelWeight(pack_panels(w), 72)
    assert pw.panels.dtype == torch.bfloat16 and pw.nbytes == 5 * 520 * 16 * 2
    wide = PanelWeight(pack_panels(w.float()), 72)
    # A float32 x: up to 3 micro-kernel calls widen each weight row in registers per call; from
    # 3 calls (18 rows on AVX2, 36 on AVX-512) a chunk is widened once into a float32 buffer;
    # past 192 rows in row blocks. Every way, the bits of float32 panels of the same (exactly
    # widened) weights.
    for m in (1, 6, 7, 17, 18, 35, 36, 37, 200):
        x = torch.randn(m, 520, generator=g)
        y = torch.ops.pdkv.panel_linear(x, pw.panels, 72, None)  # float32 x, float32 sums
        ref = x.double() @ w.double().T  # bf16 -> float is exact
        assert ((y.double() - ref).abs() <= _error_bound(x, w.float())).all(), m
        assert torch.equal(y, wide(x)), m
        if torch.ops.pdkv.panel_linear_isa() != "avx512_bf16":
            # the engine's bf16 activations: widened, summed, rounded once (AVX512-BF16: below)
            xb = x.to(torch.bfloat16)
            widened = torch.ops.pdkv.panel_linear(xb.float(), pw.panels, 72, None)
            assert torch.equal(pw(xb), widened.to(torch.bfloat16))


@pytest.mark.parametrize("k", [520, 521, 9001])
def test_bfloat16_x_on_avx512_bf16_dot_products(k):
    # A bfloat16 x on bfloat16 panels runs VDPBF16PS: pairs of k per 32-bit lane, an odd K's last
    # k paired with zero, a chunk read by more than one micro-kernel call (13+ rows) paired once.
    # Every path: within the float32 summation bound of float64 before the final rounding to
    # bfloat16, a row's bits independent of its batch, and nearly every output equal to the
    # widened float32 path's (they differ in the order of each pair's two additions only).
    if torch.ops.pdkv.panel_linear_isa() != "avx512_bf16":
        pytest.skip("the CPU has no AVX512-BF16: bfloat16 x is widened (the test above)")
    g = torch.Generator().manual_seed(k)
    w = torch.randn(72, k, generator=g).to(torch.bfloat16)
    pw = PanelWeight(pack_panels(w), 72)
    bias = torch.randn(72, generator=g).to(torch.bfloat16)
    differ = total = 0
    for m in (1, 2, 11, 12, 13, 25, 37, 200):
        xb = torch.randn(m, k, generator=g).to(torch.bfloat16)
        y = pw(xb, None, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 72)
        ref = xb.double() @ w.double().T + bias.double()
        # float32 sums within the recursive-summation bound, then one rounding to bfloat16
        bound = _error_bound(xb.float(), w.float()) + ref.abs() * 2.0**-8
        assert ((y.double() - ref).abs() <= bound).all(), m
        for i in (0, m // 2, m - 1):
            assert torch.equal(pw(xb[i : i + 1], None, bias), y[i : i + 1]), (m, i)
        widened = torch.ops.pdkv.panel_linear(xb.float(), pw.panels, 72, bias.float())
        differ += int((y != widened.to(torch.bfloat16)).sum())
        total += y.numel()
    assert differ <= 0.01 * total, (differ, total)


def test_unavailable_for_other_dtypes():
    assert "float32 and bfloat16 only" in str(
        panel_linear_unavailable(torch.zeros(1, dtype=torch.float16))
    )
    assert panel_linear_unavailable(torch.zeros(1, dtype=torch.bfloat16)) is None


@pytest.mark.slow
def test_engine_default_packs_every_projection_once(tiny_llama_kv2):
    """The default `--cpu-linear`: every projection and the LM head run the panel kernel and each
    plain weight is gone (meta: one copy). Greedy parity with HF on this path:
    tests/engine/test_hf_parity.py::test_batch_matches_hf[panel]."""
    from pdkv import LLM, SamplingParams

    llm = LLM(tiny_llama_kv2, max_model_len=128, num_kv_blocks=64)
    model = llm.llm_engine.runner.model
    assert llm.llm_engine.runner.cpu_linear.mode == "panel"
    assert isinstance(model.head_packed, PanelWeight)
    for layer in model.layers:
        assert all(isinstance(p, PanelWeight) for p in layer.packed.values())
        assert all(getattr(layer, name).is_meta for name in layer.packed)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(range(5, 40))}], sp, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 8
