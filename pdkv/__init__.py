"""pdkv: an LLM serving system for P/D disaggregation, DCP and a tiered KV pool."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdkv.engine.arg_utils import EngineArgs
    from pdkv.engine.llm import LLM
    from pdkv.engine.llm_engine import LLMEngine
    from pdkv.outputs import CompletionOutput, RequestOutput
    from pdkv.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"

# Imported lazily (PEP 562) so that the torch-free parts (pdkv.cache, pdkv.sched, pdkv.request,
# ...) can be imported without pulling in torch through the engine.
_LAZY = {
    "LLM": "pdkv.engine.llm",
    "CompletionOutput": "pdkv.outputs",
    "EngineArgs": "pdkv.engine.arg_utils",
    "LLMEngine": "pdkv.engine.llm_engine",
    "RequestOutput": "pdkv.outputs",
    "SamplingParams": "pdkv.sampling_params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pdkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
