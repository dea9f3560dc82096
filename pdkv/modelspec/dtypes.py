"""KV and state element types: bytes per element and per-vector scale bytes (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ElementType:
    """One storage type of KV cache or recurrent state.

    Attributes:
        name: canonical name (fp32, bf16, fp16, fp8, int8).
        bytes: bytes per element.
        scale_bytes: bytes of scale stored per vector (one K or V head vector of one token in
            one layer, or one MLA latent vector). 0 for unquantized types; 4 (one fp32 scale
            per token-head vector, as int8/fp8 KV caches with per-token scales keep it) for the
            8-bit types. A per-tensor scale (vLLM's default fp8 KV) would make this 0.
    """

    name: str
    bytes: int
    scale_bytes: int = 0

    @property
    def quantized(self) -> bool:
        return self.scale_bytes > 0


_TYPES = {
    "fp32": ElementType("fp32", 4),
    "bf16": ElementType("bf16", 2),
    "fp16": ElementType("fp16", 2),
    "fp8": ElementType("fp8", 1, 4),
    "int8": ElementType("int8", 1, 4),
}
_ALIASES = {
    "float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8": "fp8",
}
NAMES = tuple(_TYPES)


def element_type(name: str) -> ElementType:
    """The ElementType for `name` (fp32/bf16/fp16/fp8/int8 or a torch/HF spelling such as bfloat16).

    Raises:
        ValueError: unknown name.
    """
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _TYPES:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(NAMES)}")
    return _TYPES[key]
