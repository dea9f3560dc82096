"""Fused small ops of a Llama layer on CPU (`csrc/fused_ops.cpp`, float32 and bfloat16).

A decode step of a small model runs several cheap elementwise ATen kernels per layer, each with
its own dispatch, temporaries and pass over memory: RMSNorm, the residual adds, rotate-half RoPE
(view, flip, two products, a sum) and SiLU(gate) * up (silu, a product). The C++ ops do each
group in one pass over its rows:

    rms_norm(x, w, eps)            = w * (x * 1/sqrt(mean(x^2) + eps))            (HF LlamaRMSNorm)
    add_rms_norm_(r, x, w, eps)    : r += x in place, returns rms_norm(r, w, eps)   (vLLM's
                                     fused_add_rms_norm, in place on the residual)
    rope_(qk, cos, signed_sin)     : qk [T, heads, D] rotated in place, q and k heads together
                                     (x * cos + swap_halves(x) * signed_sin, see llama.rope_cos_sin)
    silu_mul(gate_up)              = silu(gate) * up for gate_up [T, 2I] = [gate | up]   (vLLM's
                                     SiluAndMul)

Numerics against the torch ops (tests/model/test_fused_ops.py): the residual add and RoPE give
the same bits (products and sums rounded one by one, no FMA contraction); SiLU·mul uses ATen's
own vectorised exp and form, equal on the vector body (a scalar tail may differ in the last
bit); RMSNorm sums squares in a different order than ATen's reduction, so it agrees to a few
ulp (rtol 1e-6), not bit for bit — the torch path (`--no-fused-ops`) keeps HF's bits. Greedy
outputs on SmolLM2 equal HF's either way (tests/engine/test_hf_parity.py::test_batch_matches_hf).

bfloat16 (`--dtype bfloat16`): the ops compute in float32 and round to bfloat16 where the torch
path's ATen ops round (the residual sum; RoPE's two products and their sum; SiLU, then the
product; RMSNorm's x * inv, then the weight's product, as HF's LlamaRMSNorm), so they give the
torch path's bits except where RMSNorm's float32 sum of squares, in another order, moves a
rounding (within two bfloat16 ulps: x * inv, then the weight's product). Before these, a
bfloat16 layer ran the torch small ops: about a dozen more bfloat16 ATen kernels per layer at
batch 1.

Enabled by `set_fused_ops` for float32 and bfloat16 CPU Llama layers when pdkv's extension
(built by `make setup`, pdkv.model.paged_decode_build) loads; otherwise, and with
`--no-fused-ops`, the layers run the torch ops (the reference path).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] float32 or bfloat16 (last dim contiguous) -> [T, N]: RMSNorm with `weight` [N] of
    x's dtype."""
    return torch.ops.pdkv.fused_rms_norm(x, weight, eps)


def add_rms_norm_(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (in place, [T, N]); returns RMSNorm(residual) as a new [T, N] tensor."""
    return torch.ops.pdkv.fused_add_rms_norm_(residual, x, weight, eps)


def rope_(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate qk [T, heads, D] in place (any row / head strides, D contiguous); cos and
    signed_sin [T, 1, D] as `pdkv.model.llama.rope_cos_sin` gives. Returns qk."""
    torch.ops.pdkv.fused_rope_(qk, cos, signed_sin)
    return qk


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> [T, I]: silu(gate_up[:, :I]) * gate_up[:, I:]."""
    return torch.ops.pdkv.fused_silu_mul(gate_up)


def fused_ops_unsupported(device: str, dtype: torch.dtype) -> str | None:
    """Why the fused ops cannot run for this device and dtype (None: they can)."""
    if device != "cpu":
        return f"device {device}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (float32 and bfloat16 only)"
    return None


def set_fused_ops(model: Any, enabled: bool, allow_build: bool = False) -> bool:
    """Switch the model's Llama layers to the fused ops (or back to the torch ops).

    Args:
        model: a LlamaForCausalLM (or subclass); only its layers that have the `fused_ops`
            switch change (`LlamaLayer`; other layer kinds keep the torch ops).
        enabled: use the fused ops when possible (False: the torch reference path).
        allow_build: compile the extension when not cached (else fused ops need `make setup`).

    Returns:
        True when the layers now run the fused ops. Not possible (off CPU, neither float32 nor
        bfloat16, the extension not built or failing to load): False, with one log line saying why.
    """
    from pdkv.model.paged_decode_build import load

    # The layers with the switch (LlamaLayer.fused_ops): the model imports this module, not the
    # other way round.
    layers = [layer for layer in model.layers if hasattr(layer, "fused_ops")]
    on = False
    if enabled and layers:
        why = fused_ops_unsupported(model.rope_cos.device.type, model.rope_cos.dtype)
        if why is None:
            why = load(allow_build=allow_build)
        if why is None:
            on = True
        else:
            logger.info("fused ops off (%s): using the torch ops", why)
    for layer in layers:
        layer.fused_ops = on
    return on
