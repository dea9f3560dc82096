"""Per-layer hooks of the model forward (vLLM's `wait_for_kv_layer_from_connector` /
`maybe_save_kv_layer_to_connector` around each attention layer).

The model runner passes the KV connector (or None) into the model's `forward` as `layer_hooks`;
the forward's one layer loop calls `wait_for_layer_load(i)` before layer i reads its KV cache and
`save_kv_layer(i)` after layer i wrote it. Nothing here is global: a forward without hooks pays
one `is not None` test per layer. Steps replayed from a CUDA graph never call hooks: graphs are
not used at all while a KV connector is set (`pdkv.worker.cuda_graphs.graphable`).
"""

from __future__ import annotations

from typing import Protocol


class LayerHooks(Protocol):
    """What the layer loop calls; a KV connector's worker half implements it
    (`pdkv.kv_transfer.connector.base.KVConnectorBase`). Both methods are called on the engine
    loop thread, inside the forward pass, in layer order, once per layer per step; layer_index
    is the model's layer index (0 .. num_layers - 1), not the index within a KV cache group."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Before layer `layer_index` reads its KV cache; may block until that layer's KV has
        been loaded (layer-wise loads)."""

    def save_kv_layer(self, layer_index: int) -> None:
        """After layer `layer_index` wrote this step's K/V into its KV cache; must not block on
        the network (layer-wise saves hand the bytes to a sender thread)."""
