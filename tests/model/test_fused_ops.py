"""The C++ fused small ops (pdkv/model/fused_ops.py) against the torch ops they replace: random
shapes with odd sizes (vector tails), GQA head counts, strided q/k views of a qkv row; the
bfloat16 ops against the torch path in bfloat16; and the switch on a model (on when built, off
for --no-fused-ops / other dtypes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdkv.model import fused_ops
from pdkv.model.llama import LlamaArchConfig, LlamaForCausalLM, apply_rope, rms_norm, rope_cos_sin
from pdkv.worker.attn_metadata import build_attention_metadata

SIZES = [(1, 576), (7, 576), (33, 37), (5, 8), (3, 1), (129, 1536)]


@pytest.mark.parametrize(("t", "n"), SIZES)
def test_rms_norm_matches_torch(cpu_ops, t, n):
    g = torch.Generator().manual_seed(t * 1000 + n)
    x = torch.randn(t, 2 * n, generator=g)[:, ::2].contiguous() * 4  # a contiguous [t, n]
    w = torch.randn(n, generator=g)
    strided = torch.randn(t, n + 5, generator=g)[:, :n]  # rows with a stride > n
    for inp in (x, strided):
        torch.testing.assert_close(fused_ops.rms_norm(inp, w, 1e-5), rms_norm(inp, w, 1e-5),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("t", "n"), SIZES)
def test_add_rms_norm_updates_residual_in_place(cpu_ops, t, n):
    g = torch.Generator().manual_seed(t + n)
    residual, x = torch.randn(t, n, generator=g) * 3, torch.randn(t, n, generator=g)
    w = torch.randn(n, generator=g)
    ref_sum = residual + x
    ref = rms_norm(ref_sum, w, 1e-6)
    out = fused_ops.add_rms_norm_(residual, x, w, 1e-6)
    assert torch.equal(residual, ref_sum)  # the add is exact: same bits as torch's
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert out.data_ptr() != residual.data_ptr()


@pytest.mark.parametrize(
    ("t", "heads", "kv_heads", "d"), [(1, 9, 3, 64), (17, 8, 2, 128), (5, 3, 1, 10), (40, 4, 4, 6)]
)
def test_rope_in_place_equals_apply_rope(cpu_ops, t, heads, kv_heads, d):
    """q and k heads of a qkv row (strided view, v after them untouched), rotated in place, give
    apply_rope's bits."""
    g = torch.Generator().manual_seed(heads * d + t)
    cos, sin = rope_cos_sin(d, 10000.0, 4096, torch.device("cpu"))
    pos = torch.randint(0, 4096, (t,), generator=g)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g) * 5
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
    ref = apply_rope(qk.clone(), c, s)
    out = fused_ops.rope_(qk, c, s)
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(qk, ref)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)


@pytest.mark.parametrize(("t", "i"), [(1, 1536), (32, 1536), (3, 13), (2, 1), (65, 100)])
def test_silu_mul_matches_torch(cpu_ops, t, i):
    g = torch.Generator().manual_seed(t * i)
    gate_up = torch.randn(t, 2 * i, generator=g) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    torch.testing.assert_close(fused_ops.silu_mul(gate_up), ref, rtol=1e-6, atol=1e-6)


def _few_ulps_apart(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of bfloat16 elements that differ; raises if any differs by more than two ulps
    (bfloat16 values n ulps apart have 16-bit patterns n apart, same sign). RMSNorm rounds twice
    (x * inv, then weight * that), so an inv one float32 ulp off can move x * inv one bfloat16
    ulp and the weight's product by up to two."""
    a, b = got.view(torch.int16).int(), ref.view(torch.int16).int()
    assert (a - b).abs().max().item() <= 2
    return (a != b).float().mean().item()


@pytest.mark.parametrize(("t", "n"), [(1, 576), (7, 576), (33, 37), (129, 1536)])
def test_bfloat16_ops_give_the_torch_paths_bits(cpu_ops, t, n):
    """The residual add, RoPE and SiLU·mul in bfloat16 equal the torch ops in bfloat16 bit for bit
    (the same roundings, in the same places); RMSNorm's float32 sum of squares is summed in
    another order, so an element may land a bfloat16 ulp or two away, and few do."""
    bf = torch.bfloat16
    g = torch.Generator().manual_seed(t * 7 + n)
    x = (torch.randn(t, n, generator=g) * 4).to(bf)
    w = (torch.randn(n, generator=g) + 1).to(bf)
    assert _few_ulps_apart(fused_ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5)) < 0.02
    residual = (torch.randn(t, n, generator=g) * 3).to(bf)
    delta = torch.randn(t, n, generator=g).to(bf)
    ref_sum = residual + delta
    out = fused_ops.add_rms_norm_(residual, delta, w, 1e-6)
    assert torch.equal(residual, ref_sum)
    assert _few_ulps_apart(out, rms_norm(ref_sum, w, 1e-6)) < 0.02
    gate_up = (torch.randn(t, 2 * n, generator=g) * 6).to(bf)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fused_ops.silu_mul(gate_up), F.silu(gate) * up)
    heads, d = 3, 64
    cos, sin = rope_cos_sin(d, 10000.0, 4096, torch.device("cpu"))
    pos = torch.randint(0, 4096, (t,), generator=g)
    c, s = cos[pos].unsqueeze(1).to(bf), sin[pos].unsqueeze(1).to(bf)
    qkv = (torch.randn(t, (heads + 1) * d, generator=g) * 5).to(bf)
    qk = qkv[:, : heads * d].view(t, heads, d)
    ref = apply_rope(qk.clone(), c, s)
    fused_ops.rope_(qk, c, s)
    assert torch.equal(qk, ref)


def test_ops_reject_wrong_inputs(cpu_ops):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fused_ops.silu_mul(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="weight is Float, the input BFloat16"):
        fused_ops.rms_norm(torch.randn(2, 8).to(torch.bfloat16), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="of qk's dtype"):
        cs = torch.ones(2, 1, 8)
        fused_ops.rope_(torch.randn(2, 1, 8).to(torch.bfloat16), cs, cs)
    with pytest.raises(RuntimeError, match="even"):
        fused_ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="shapes differ"):
        fused_ops.add_rms_norm_(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)


def _tiny_llama(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Two random layers, GQA 4:2, odd widths (head 10, hidden 40, intermediate 36)."""
    cfg = LlamaArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=97,
        hidden_size=40,
        intermediate_size=36,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=10,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        qkv_bias=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = LlamaForCausalLM(cfg, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_layer_with_fused_ops_matches_torch_layer(cpu_ops, dtype, tol):
    """A step with a prefill (5 tokens) and a decode (context 7) through two layers: logits and
    the K/V written to the cache agree with the torch path (bfloat16: RMSNorm's one-ulp
    differences, carried through two layers)."""
    model = _tiny_llama(dtype)
    reqs = [(0, 5, 0, [1, 2]), (5, 1, 7, [3, 4])]  # (start, new tokens, context, block table)
    meta = build_attention_metadata(reqs, 6, 4, torch.device("cpu"))
    ids, pos = torch.tensor([3, 14, 15, 92, 65, 35]), torch.tensor([0, 1, 2, 3, 4, 7])
    cache0 = [
        torch.randn(2, 5, 4, 2, 10, generator=torch.Generator().manual_seed(i)).to(dtype)
        for i in range(2)
    ]
    runs = {}
    for on in (False, True):
        assert fused_ops.set_fused_ops(model, on) == on
        caches = [c.clone() for c in cache0]
        with torch.inference_mode():
            runs[on] = model(ids, pos, caches, meta, torch.tensor([4, 5])), caches
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=tol, atol=tol)
    for a, b in zip(runs[True][1], runs[False][1]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_set_fused_ops_switches_llama_layers(cpu_ops):
    """On when built, off when asked or for a dtype the ops do not take."""
    model = _tiny_llama()
    assert fused_ops.set_fused_ops(model, True)
    assert all(layer.fused_ops for layer in model.layers)
    assert not fused_ops.set_fused_ops(model, False)
    assert not any(layer.fused_ops for layer in model.layers)
    assert fused_ops.set_fused_ops(_tiny_llama(torch.bfloat16), True)
    assert not fused_ops.set_fused_ops(_tiny_llama(torch.float16), True)


def test_no_fused_ops_flag_and_bench_names():
    """`--no-fused-ops` reaches the engine args (default on); the offline bench's
    `NAME:no-fused` backends run the same attention backend without the fused ops."""
    import argparse

    from pdkv.bench.offline.backends import split_backend
    from pdkv.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).fused_ops
    assert not EngineArgs.from_cli_args(parser.parse_args(["--no-fused-ops"])).fused_ops
    assert split_backend("cpu_paged:no-fused") == ("cpu_paged", False)
    assert split_backend("torch") == ("torch", True)
