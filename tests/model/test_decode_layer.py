"""The decode layer op (pdkv/model/decode_layer.py, csrc/decode_layer.cpp) against the Python
layer it replaces: the same logits and the same K/V in the cache, bit for bit, for decode steps
of one and of several requests (GQA, qkv bias, odd widths, a sliding window); the steps it must
not take (prefill, mixed) run the Python layer; and where it is installed."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pdkv.model import decode_layer
from pdkv.model.cpu_linear import setup_cpu_linear
from pdkv.model.fused_ops import set_fused_ops
from pdkv.model.llama import LlamaArchConfig, LlamaForCausalLM
from pdkv.model.paged_prefill import install_attention_backend
from pdkv.model.panel_linear import panel_linear_unavailable
from pdkv.worker.attn_metadata import build_attention_metadata

BLOCK = 4
NUM_BLOCKS = 24


def _tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Three random layers, GQA 6:2, odd widths (head 10, hidden 40, intermediate 36), qkv bias."""
    cfg = LlamaArchConfig(
        architecture="LlamaForCausalLM", vocab_size=97, hidden_size=40, intermediate_size=36,
        num_layers=3, num_heads=6, num_kv_heads=2, head_dim=10, rope_theta=10000.0,
        rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=True, qkv_bias=True,
        bos_token_id=None, eos_token_id=None,
    )
    model = LlamaForCausalLM(cfg, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model


def _engine_setup(dtype: torch.dtype) -> LlamaForCausalLM:
    """The tiny Llama as the engine sets it up: panel weights, cpu_paged attention, fused ops
    and the decode layer op on every layer."""
    m = _tiny_llama(dtype=dtype)
    why = panel_linear_unavailable(m.embed)
    if why is not None:
        pytest.skip(f"panel kernel unavailable: {why}")
    setup_cpu_linear(m, "panel", str(dtype).removeprefix("torch."), "cpu")
    backend = install_attention_backend(m, "cpu_paged", "cpu", "auto", 1, False)
    assert set_fused_ops(m, True)
    assert decode_layer.set_decode_layer_op(m, True, backend) == m.cfg.num_layers
    return m


@pytest.fixture
def model(cpu_ops) -> LlamaForCausalLM:
    """The float32 tiny Llama with the decode layer op on every layer."""
    return _engine_setup(torch.float32)


class _Counting:
    """Wraps a layer's DecodeLayerOp and counts its calls."""

    def __init__(self, op: Any) -> None:
        self.op, self.calls = op, 0

    def __call__(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        return self.op(*args)


def _step(model: LlamaForCausalLM, reqs: list[tuple[int, int]], window: int | None = None,
          use_op: bool = True) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """One step of requests (new tokens, cached tokens) over a seeded random cache: logits of each
    request's last token, the caches after it and how many layer calls took the op."""
    ops = [layer.decode_op for layer in model.layers]
    counters = [_Counting(op) for op in ops]
    for layer, c in zip(model.layers, counters):
        layer.decode_op = c if use_op else None
    g = torch.Generator().manual_seed(7)
    dtype = model.rope_cos.dtype
    caches = [torch.randn(2, NUM_BLOCKS, BLOCK, 2, 10, generator=g).to(dtype) for _ in model.layers]
    flat, ids, pos, start, last = [], [], [], 0, []
    for b, (new, context) in enumerate(reqs):
        per = -(-(context + new) // BLOCK)
        flat.append((start, new, context, list(range(1 + 7 * b, 1 + 7 * b + per))))
        ids += [(13 * b + 5 * p) % 97 for p in range(new)]
        pos += list(range(context, context + new))
        start += new
        last.append(start - 1)
    meta = build_attention_metadata(flat, start, BLOCK, torch.device("cpu"), window)
    try:
        with torch.inference_mode():
            logits = model(torch.tensor(ids), torch.tensor(pos), caches, meta, torch.tensor(last))
    finally:
        for layer, op in zip(model.layers, ops):
            layer.decode_op = op
    return logits, caches, sum(c.calls for c in counters)


@pytest.mark.parametrize(
    ("reqs", "window"),
    [
        pytest.param([(1, 9)], None, id="batch-1"),
        pytest.param([(1, 0)], None, id="first-token-after-empty-context"),
        pytest.param([(1, 3), (1, 16), (1, 22)], None, id="three-requests"),
        pytest.param([(1, 3), (1, 16), (1, 22)], 6, id="sliding-window-6"),
    ],
)
def test_decode_steps_are_bit_identical_to_the_python_layer(model, reqs, window):
    ref_logits, ref_caches, calls = _step(model, reqs, window, use_op=False)
    assert calls == 0
    logits, caches, calls = _step(model, reqs, window)
    assert calls == model.cfg.num_layers  # every layer of the step took the op
    assert torch.equal(logits, ref_logits)
    for got, ref in zip(caches, ref_caches):
        assert torch.equal(got, ref)  # the new K/V written to the same slots, same bits


def test_bfloat16_decode_steps_are_bit_identical_to_the_python_layer(cpu_ops):
    """--dtype bfloat16: the op calls the same bfloat16 fused ops and panel kernel (bfloat16 x
    widened, y rounded once) as the Python layer."""
    m = _engine_setup(torch.bfloat16)
    reqs = [(1, 3), (1, 16), (1, 22)]
    ref_logits, ref_caches, calls = _step(m, reqs, use_op=False)
    logits, caches, calls = _step(m, reqs)
    assert calls == m.cfg.num_layers
    assert torch.equal(logits, ref_logits)
    for got, ref in zip(caches, ref_caches):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("reqs", [[(5, 0)], [(3, 4), (1, 9)]], ids=["prefill", "mixed"])
def test_steps_with_a_prefill_run_the_python_layer(model, reqs):
    _, _, calls = _step(model, reqs)
    assert calls == 0


def test_the_op_refuses_a_step_that_is_not_one_token_per_request(model):
    layer, op = model.layers[0], model.layers[0].decode_op
    meta = build_attention_metadata([(0, 1, 3, [1])], 1, BLOCK, torch.device("cpu"))
    cos = model.rope_cos[torch.tensor([3, 4])].unsqueeze(1)
    sin = model.rope_sin[torch.tensor([3, 4])].unsqueeze(1)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 10)
    with pytest.raises(RuntimeError, match="one token per request"):
        op(torch.randn(2, 40), cos, sin, cache, meta)
    assert layer.decode_op is op


def test_set_decode_layer_op_installs_only_where_it_can(model, caplog):
    """Off with the fused ops off, on the torch attention backend, off the panel kernel and with
    tensor parallelism, each named in one INFO line; enabled=False takes it away."""
    caplog.set_level(logging.INFO, logger="pdkv.model.decode_layer")
    layers = model.layers
    assert decode_layer.set_decode_layer_op(model, False, "cpu_paged") == 0
    assert all(layer.decode_op is None for layer in layers)
    assert decode_layer.set_decode_layer_op(model, True, "torch") == 0
    assert "attention backend torch" in caplog.text
    set_fused_ops(model, False)
    assert decode_layer.set_decode_layer_op(model, True, "cpu_paged") == 0
    assert "fused ops off" in caplog.text
    set_fused_ops(model, True)
    parallel = layers[0].parallel
    layers[0].parallel = SimpleNamespace(tp_size=2)
    try:
        assert decode_layer.set_decode_layer_op(model, True, "cpu_paged") == 2
        assert layers[0].decode_op is None
        assert decode_layer.decode_layer_unavailable(layers[0], "cpu_paged") == (
            "tensor parallel size 2")
    finally:
        layers[0].parallel = parallel
    other = _tiny_llama()
    setup_cpu_linear(other, "torch", "float32", "cpu")
    set_fused_ops(other, True)
    assert decode_layer.set_decode_layer_op(other, True, "cpu_paged") == 0
    assert "projections not on the panel kernel" in caplog.text
