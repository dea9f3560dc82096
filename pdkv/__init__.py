"""pdkv: an LLM serving system for P/D disaggregation, DCP and a tiered KV pool."""

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
