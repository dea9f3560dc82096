"""A Llama layer of a decode step as one C++ call (`csrc/decode_layer.cpp`,
`torch.ops.pdkv.decode_layer_`).

At batch 1 a decode step of a small model is bound by reading the weights, and every
microsecond the main thread spends in Python between two kernels is a microsecond the memory
bus idles while the other thread waits. The Python layer (pdkv.model.llama.LlamaLayer.forward,
fused ops, panel kernel, cpu_paged attention) makes about ten op calls per layer plus the
slices, views and metadata lookups around them. The C++ op calls the same ops (RMSNorm, the
qkv / o / gate_up / down panel linears, RoPE in place, the KV write, paged decode, the fused
residual-add RMSNorm and SiLU·mul, the residual add) in the same order on the same tensors
through the dispatcher, so its results are bit-identical to the Python layer's
(tests/model/test_decode_layer.py), and the interpreter runs once per layer instead of ~10
times. Measured on SmolLM2-135M float32, 2 threads: about 2 ms less per step at batch 1, 8 and
64 (docs/SPEED.md).

The op runs a layer of a step whose requests all decode one token (`meta.all_decode`), with no
DCP or PCP, on a plain CPU KV cache tensor; any other step goes through the Python layer. It is
installed (`set_decode_layer_op`) on plain `LlamaLayer`s whose four projections are float32 or
bfloat16 panel weights (`--cpu-linear panel`, pdkv.model.panel_linear), with the fused ops on,
the cpu_paged attention backend and no tensor parallelism (the row-parallel outputs' all-reduce
sits between the ops). `--no-fused-ops` and every other `--cpu-linear` or `--attention-backend`
keep the Python layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pdkv.model.llama import LlamaLayer
from pdkv.model.panel_linear import PanelWeight

if TYPE_CHECKING:
    from pdkv.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeLayerOp:
    """One layer's weights and sizes for `torch.ops.pdkv.decode_layer_`.

    Attributes:
        input_norm, post_attn_norm: [hidden] RMSNorm weights (float32).
        eps: RMSNorm epsilon.
        qkv, o_proj, gate_up, down: the layer's panel weights (pdkv.model.panel_linear).
        qkv_bias: [q_size + 2 kv_size] or None.
        num_heads, num_kv_heads, head_dim: this layer's attention shape.
    """

    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    eps: float
    qkv: PanelWeight
    qkv_bias: torch.Tensor | None
    o_proj: PanelWeight
    gate_up: PanelWeight
    down: PanelWeight
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Run the layer on a decode step, updating `hidden` and `kv_cache` in place.

        Args:
            hidden: [B, hidden] float32 residual stream, one token per request.
            cos, sin: [B, 1, head_dim] RoPE tables at the tokens' positions
                (pdkv.model.llama.rope_cos_sin).
            kv_cache: this layer's [2, num_blocks, block_size, num_kv_heads, head_dim].
            meta: the step's metadata with `all_decode` set (slots, decode block tables and
                seq lens, sliding window).

        Returns:
            `hidden`, updated in place.

        Raises:
            RuntimeError: shapes or dtypes the ops refuse (each op's own checks), or a step
                that is not one token per request.
        """
        return torch.ops.pdkv.decode_layer_(
            hidden, self.input_norm, self.post_attn_norm, self.eps,
            self.qkv.panels, self.qkv.out_features, self.qkv_bias,
            self.o_proj.panels, self.o_proj.out_features,
            self.gate_up.panels, self.gate_up.out_features,
            self.down.panels, self.down.out_features,
            self.num_heads, self.num_kv_heads, self.head_dim, cos, sin, kv_cache,
            meta.slot_block_ids, meta.slot_offsets, meta.decode_block_tables,
            meta.decode_seq_lens, self.head_dim**-0.5, meta.sliding_window or 0,
        )


def decode_layer_unavailable(layer: Any, attention_backend: str) -> str | None:
    """Why `layer` cannot run its decode steps as one op (None: it can)."""
    if type(layer) is not LlamaLayer:
        return f"layer kind {type(layer).__name__}"
    if attention_backend != "cpu_paged":
        return f"attention backend {attention_backend}"
    if not layer.fused_ops:
        return "fused ops off"
    if layer.parallel.tp_size != 1:
        return f"tensor parallel size {layer.parallel.tp_size}"
    if not all(isinstance(w, PanelWeight) for w in layer.packed.values()):
        return "projections not on the panel kernel"
    if not hasattr(torch.ops.pdkv, "decode_layer_"):
        return "the extension has no decode_layer_"
    return None


def set_decode_layer_op(model: Any, enabled: bool, attention_backend: str) -> int:
    """Give each layer of `model` that can take it a DecodeLayerOp (or take them all away).

    Call after pdkv.model.cpu_linear.setup_cpu_linear, install_attention_backend and
    set_fused_ops: it reads what they chose.

    Args:
        model: a LlamaForCausalLM (or subclass); only plain LlamaLayers take the op.
        enabled: False removes the op from every layer (the Python layer runs).
        attention_backend: what install_attention_backend returned ("cpu_paged" or "torch").

    Returns:
        How many layers now run decode steps as one op (0 with one INFO line saying why).
    """
    count, why = 0, None
    for layer in model.layers:
        if not hasattr(layer, "decode_op"):
            continue
        reason = None if enabled else "off"
        if reason is None:
            reason = decode_layer_unavailable(layer, attention_backend)
        if reason is not None:
            layer.decode_op, why = None, why or reason
            continue
        pk = layer.packed
        layer.decode_op = DecodeLayerOp(
            input_norm=layer.input_norm, post_attn_norm=layer.post_attn_norm, eps=layer.eps,
            qkv=pk["qkv"], qkv_bias=layer.qkv_bias, o_proj=pk["o_proj"], gate_up=pk["gate_up"],
            down=pk["down"], num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
        )
        count += 1
    if count == 0 and enabled and why is not None:
        logger.info("decode layer op off (%s): decode steps run the Python layer", why)
    return count
