"""CPU instruction-set flags that decide whether bfloat16 matmuls are native (torch-free).

Native bf16 on x86 needs AVX512_BF16 (Cooper Lake, Zen 4+) or AMX-BF16 (Sapphire Rapids+); oneDNN
also runs bf16 with AVX512BW/VL/DQ or AVX-NE-CONVERT by converting, slower. Without any of these,
torch computes bf16 matmuls in a generic loop (measured 4-5x slower than float32 at 64 tokens on
an AVX2-only EPYC). Like vLLM's CPU backend (`avx512_bf16` "optional"), pdkv then still allows
`--dtype bfloat16` and warns; `--cpu-linear auto` measures a float32-upcast matmul for it
(pdkv/model/linear_backend.py).

Flags come from the `flags` line of /proc/cpuinfo (Linux names: amx_bf16, avx512_bf16, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

# Flags under which oneDNN has a bf16 kernel (native or by conversion), Linux /proc/cpuinfo names.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
CONVERT_BF16_FLAGS = (("avx512bw", "avx512vl", "avx512dq"), ("avx_ne_convert",))


@dataclass(frozen=True)
class CpuFeatures:
    """The flags of the first CPU in /proc/cpuinfo that matter for bf16.

    Attributes:
        flags: every flag of that CPU (lower case).
    """

    flags: frozenset[str]

    @property
    def native_bf16(self) -> bool:
        """AMX-BF16 or AVX512-BF16: bf16 dot products in hardware."""
        return any(f in self.flags for f in NATIVE_BF16_FLAGS)

    @property
    def onednn_bf16(self) -> bool:
        """oneDNN has a bf16 matmul kernel here (native, or AVX-512 / AVX-NE-CONVERT converting)."""
        return self.native_bf16 or any(
            all(f in self.flags for f in group) for group in CONVERT_BF16_FLAGS
        )

    def describe(self) -> str:
        """The bf16-relevant flags present, e.g. "amx_bf16 avx512_bf16 avx512f" or "none"."""
        names = [
            f
            for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx_ne_convert", "avx2")
            if f in self.flags
        ]
        return " ".join(names) or "none"


def parse_cpuinfo(text: str) -> CpuFeatures:
    """CpuFeatures from /proc/cpuinfo text (the first `flags` line; no such line: no flags)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return CpuFeatures(frozenset(value.lower().split()))
    return CpuFeatures(frozenset())


def read_cpu_features(path: str = "/proc/cpuinfo") -> CpuFeatures:
    """This machine's CpuFeatures; no flags when `path` cannot be read (non-Linux)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return CpuFeatures(frozenset())


def dtype_warning(dtype: str, device: str, features: CpuFeatures) -> str | None:
    """The start-up warning for running `dtype` on this CPU, or None when it is fine.

    bfloat16 / float16 on a CPU without native bf16 run (vLLM allows them too), but slowly.
    """
    if not device.startswith("cpu") or dtype == "float32":
        return None
    if dtype == "bfloat16" and features.native_bf16:
        return None
    return (
        f"--dtype {dtype} on a CPU without {' / '.join(NATIVE_BF16_FLAGS)} "
        f"(flags: {features.describe()}): torch / oneDNN matmuls are emulated and slower than "
        "float32 (--cpu-linear panel, the default, reads bfloat16 weights and computes in "
        "float32; auto picks an upcast kernel where faster)"
    )
