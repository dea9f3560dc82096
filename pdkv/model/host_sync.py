"""A guard that turns every device -> host synchronisation inside a region into an error.

On a GPU, reading a tensor value on the host (`int(t)`, `t.item()`, `t.tolist()`, `if t:`, using
a tensor as a Python index or slice bound, shape-dependent ops such as `nonzero` or boolean-mask
indexing) waits for every kernel queued before it, and a CUDA graph cannot contain it. Building a
tensor from host lists (`torch.tensor([...])`) inside the forward is a host -> device copy per
call that a graph would freeze to its captured values. The model forward must therefore get every
host-side number (sequence lengths, slot lists, decode batches) from the per-step metadata the
model runner builds (pdkv.worker.attn_metadata), not read it back from device tensors.

`HostSyncGuard` is a `torch.overrides.TorchFunctionMode`: the torch functions listed in
`SYNC_FUNCTIONS` (and `Tensor.__getitem__` with a boolean / integer-tensor-bounded slice) raise
`HostSyncError` while it is active. It works the same on CPU, where nothing really waits, so
tests catch a sync that would stall a GPU (tests/model/test_no_host_sync.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class HostSyncError(RuntimeError):
    """A device -> host read (or a host -> device list copy) inside a guarded region."""


def _sync_functions() -> dict[Callable[..., Any], str]:
    t = torch.Tensor
    funcs: dict[Callable[..., Any], str] = {
        t.__int__: "int(tensor)", t.__index__: "tensor used as a Python index",
        t.__bool__: "bool(tensor) / `if tensor`", t.__float__: "float(tensor)",
        t.item: "tensor.item()", t.tolist: "tensor.tolist()", t.cpu: "tensor.cpu()",
        t.numpy: "tensor.numpy()", t.nonzero: "tensor.nonzero()", torch.nonzero: "torch.nonzero",
        torch.argwhere: "torch.argwhere", torch.masked_select: "torch.masked_select",
        t.masked_select: "tensor.masked_select", torch.unique: "torch.unique",
        torch.unique_consecutive: "torch.unique_consecutive",
        torch.tensor: "torch.tensor(host data)",
        torch.as_tensor: "torch.as_tensor(host data)",
    }
    return funcs


SYNC_FUNCTIONS = _sync_functions()
"""torch function -> what it does (the error message) for every call the guard refuses."""


def _syncing_index(index: Any) -> bool:
    """True for a `__getitem__` index whose result shape depends on tensor values: a bool
    tensor (mask) or a slice with a tensor bound."""
    items = index if isinstance(index, tuple) else (index,)
    for it in items:
        if isinstance(it, torch.Tensor) and it.dtype == torch.bool:
            return True
        if isinstance(it, slice) and any(
            isinstance(b, torch.Tensor) for b in (it.start, it.stop, it.step)
        ):
            return True
    return False


class HostSyncGuard(TorchFunctionMode):
    """`with HostSyncGuard(): model(...)` raises HostSyncError at the first host sync.

    Only calls made while the mode is active are checked; tensors built before (the step's
    metadata) are free to use host data.

    Args:
        allow_host_to_device: let `torch.tensor` / `torch.as_tensor` of host data through (a
            host -> device copy, not a wait for the device: the sampler builds its small
            per-row parameter tensors so); device -> host reads still raise.
    """

    def __init__(self, allow_host_to_device: bool = False) -> None:
        super().__init__()
        self.allowed = (torch.tensor, torch.as_tensor) if allow_host_to_device else ()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        what = None if func in self.allowed else SYNC_FUNCTIONS.get(func)
        if (
            what is None
            and func is torch.Tensor.__getitem__
            and len(args) > 1
            and _syncing_index(args[1])
        ):
            what = "boolean-mask or tensor-bounded slice indexing"
        if what is not None:
            raise HostSyncError(f"host sync in a guarded region (the model forward): {what}")
        return func(*args, **(kwargs or {}))
