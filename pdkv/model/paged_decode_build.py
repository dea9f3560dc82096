"""Build, cache and load pdkv's C++ CPU ops: one extension of every `csrc/*.cpp` (paged decode
attention `csrc/paged_decode.cpp`, varlen paged prefill attention `csrc/paged_prefill.cpp`, the
fused small ops `csrc/fused_ops.cpp`).

The extension is compiled once per machine with `torch.utils.cpp_extension` (gcc + ninja) into
`$PDKV_CACHE/ext/paged_decode-<key>/` (default `~/.cache/pdkv/ext/...`); <key> hashes the sources,
the compile flags, the torch and Python versions and the CPU's flags, so a changed source, torch
or machine builds a new copy and never loads a stale one. `make setup` builds it
(`python -m pdkv.model.paged_decode_build --build`), so test processes only load the `.so`.

The compiler runs in a child process under an exclusive `fcntl.flock` on `<dir>.lock` (released
by the kernel if the builder dies), with a deadline: two processes never build at once, the
second loads what the first built. A failed build leaves `<dir>/FAILED` (the compiler's first
error, then its last lines); later processes then skip the build (`--build` retries) and the caller
falls back to the torch path. `make setup` fails on a failed build when a compiler is present;
without one it prints one warning line and the engine runs the torch paths.

`PDKV_CPU_OPS=0` hides the extension from every caller (`load` is the one place that reads it):
the engine then runs exactly what a machine without a compiler runs (torch attention, torch small
ops, oneDNN or plain torch linears), which is how the suite tests the fallbacks on a machine that
has the ops. `pdkv.model.csrc_isa` compiles the same sources for every x86 ISA (syntax only).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCES = tuple(sorted((Path(__file__).with_name("csrc")).glob("*.cpp")))
"""The extension's sources: every .cpp under csrc/ (one defines the `pdkv` op library with
TORCH_LIBRARY, the others add to it with TORCH_LIBRARY_FRAGMENT)."""
HEADERS = tuple(sorted((Path(__file__).with_name("csrc")).glob("*.h")))
"""Headers the sources include (csrc/*.h): hashed into the build key with the sources."""
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fopenmp-simd")
_MODULE = "pdkv.model.paged_decode_build"
BUILD_TIMEOUT_S = 900.0
"""Deadline of one build, and of waiting for another process's build (seconds)."""


CPU_OPS_ENV = "PDKV_CPU_OPS"
"""Environment switch: "0" hides pdkv's C++ CPU ops from the engine (read only by `load`)."""


def cpu_ops_hidden() -> bool:
    """True when $PDKV_CPU_OPS is "0" (or "false" / "off" / "no"): callers then take the paths of
    a machine without the extension."""
    return os.environ.get(CPU_OPS_ENV, "1").strip().lower() in ("0", "false", "off", "no")


def compiler() -> str | None:
    """Path of the C++ compiler torch's cpp_extension runs ($CXX, else `c++`), or None."""
    return shutil.which(os.environ.get("CXX") or "c++")


def first_compiler_error(output: str) -> str | None:
    """The first line of a compiler's output that reports an error (gcc / clang / ld: "error:"),
    or None."""
    for line in output.splitlines():
        if "error:" in line or "fatal error" in line or "undefined reference" in line:
            return line.strip()
    return None


@dataclass(frozen=True)
class BuildPaths:
    """Where one version of the op lives.

    Attributes:
        directory: build directory (ninja files, objects, the `.so`).
        name: extension name (also the `.so` file's stem).
    """

    directory: Path
    name: str

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"

    @property
    def failed(self) -> Path:
        return self.directory / "FAILED"

    @property
    def lock(self) -> Path:
        return self.directory.with_suffix(".lock")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def build_paths(cache_dir: str | None = None) -> BuildPaths:
    """Build directory and name for these sources, flags, torch, Python and CPU.

    Args:
        cache_dir: base cache folder (None: $PDKV_CACHE or ~/.cache/pdkv).
    """
    from pdkv.model.registry import cache_dir as cache_root

    h = hashlib.sha256()
    for part in (
        *(f.name.encode() + f.read_bytes() for f in (*SOURCES, *HEADERS)),
        " ".join(CFLAGS).encode(),
        torch.__version__.encode(),
        sys.version.encode(),
        platform.machine().encode(),
        _cpu_flags().encode(),
    ):
        h.update(part)
    key = h.hexdigest()[:16]
    base = Path(cache_dir or cache_root()) / "ext"
    return BuildPaths(base / f"paged_decode-{key}", f"pdkv_paged_decode_{key}")


def _compile(paths: BuildPaths) -> None:
    """Compile in this process (called in the child; raises on a compiler error)."""
    from torch.utils import cpp_extension

    paths.directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=paths.name, sources=[str(f) for f in SOURCES], extra_cflags=list(CFLAGS),
        extra_ldflags=["-fopenmp"], build_directory=str(paths.directory),
        is_python_module=False, verbose=False,
    )


def build(paths: BuildPaths, force: bool = False, timeout_s: float = BUILD_TIMEOUT_S) -> str | None:
    """Make sure `paths.library` exists: build it under the lock unless present.

    Args:
        force: build again after a recorded failure.
        timeout_s: deadline for waiting on the lock plus compiling (seconds).

    Returns:
        None when the library is there, else why not (one line).
    """
    if paths.library.exists():
        return None
    if paths.failed.exists() and not force:
        first = paths.failed.read_text().splitlines()[:1]
        return (f"an earlier build failed ({first[0] if first else 'no log'}; see {paths.failed}; "
                f"rebuild: python -m {_MODULE} --build)")
    deadline = time.monotonic() + timeout_s
    paths.directory.parent.mkdir(parents=True, exist_ok=True)
    with open(paths.lock, "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return (
                        f"timed out after {timeout_s:.0f} s waiting for another build "
                        f"({paths.lock})"
                    )
                time.sleep(0.2)
        try:
            if paths.library.exists():  # another process built it while we waited
                return None
            env = dict(os.environ)
            # ninja from the venv (the `ninja` package) when the venv is not activated.
            env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", _MODULE, "--compile", str(paths.directory), paths.name],
                    env=env, capture_output=True, text=True,
                    timeout=max(1.0, deadline - time.monotonic()),
                )
            except subprocess.TimeoutExpired:
                return f"build timed out after {timeout_s:.0f} s"
            if proc.returncode != 0 or not paths.library.exists():
                output = f"{proc.stdout}\n{proc.stderr}".strip()
                first = first_compiler_error(output)
                tail = output.splitlines()[-40:]
                paths.directory.mkdir(parents=True, exist_ok=True)
                paths.failed.write_text("\n".join([f"first error: {first}", *tail]) + "\n")
                return (
                    "build failed: "
                    f"{first or (tail[-1] if tail else f'exit status {proc.returncode}')}"
                )
            if paths.failed.exists():
                paths.failed.unlink()
            return None
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load(cache_dir: str | None = None, allow_build: bool = True) -> str | None:
    """Load the ops into this process (`torch.ops.pdkv.*`: paged_decode, paged_prefill, the fused
    ops), building them if needed.

    Args:
        cache_dir: base cache folder (None: $PDKV_CACHE or ~/.cache/pdkv).
        allow_build: compile when no cached library exists (else report it missing).

    Returns:
        None when the op is loaded, else why not (one line; the caller warns and falls back).
        With $PDKV_CPU_OPS=0 always "hidden by PDKV_CPU_OPS=0", even when loaded earlier.
    """
    if cpu_ops_hidden():
        return f"hidden by {CPU_OPS_ENV}=0"
    paths = build_paths(cache_dir)
    if not paths.library.exists():
        if not allow_build:
            return f"not built ({paths.library} missing; build: python -m {_MODULE} --build)"
        why = build(paths)
        if why is not None:
            return why
    try:
        torch.ops.load_library(str(paths.library))
    except OSError as e:
        return f"loading {paths.library} failed: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    """`python -m pdkv.model.paged_decode_build --build`: build (or rebuild after a failure)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--build", action="store_true", help="build the op if not cached, even after a failure"
    )
    p.add_argument("--compile", nargs=2, metavar=("DIR", "NAME"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compile:
        _compile(BuildPaths(Path(args.compile[0]), args.compile[1]))
        return 0
    paths = build_paths()
    isa = f"-march=native, ATen vector ISA {native_isa()}"
    if compiler() is None:
        print(
            f"pdkv C++ CPU ops: no C++ compiler ({os.environ.get('CXX') or 'c++'} not found): the "
            "engine will run the torch paths (install one: scripts/system-packages.sh)",
            file=sys.stderr,
        )
        return 0
    t0 = time.monotonic()
    why = build(paths, force=args.build)
    if why is not None:
        print(f"pdkv C++ CPU ops ({isa}): {why}\n  full log: {paths.failed}", file=sys.stderr)
        return 1
    print(f"pdkv C++ CPU ops ({isa}): {paths.library} ({time.monotonic() - t0:.1f} s)")
    return 0


def native_isa() -> str:
    """The ATen vector ISA the ops compile for on this CPU (csrc/cpu_vec.h's CPU_CAPABILITY):
    "AVX512" (avx512f/bw/vl/dq), "AVX2" (avx2 + fma) or "DEFAULT"; " + AMX" / " + AVX512_BF16"
    when the CPU has them (the compiler may use them; ATen's vectors do not)."""
    flags = set(_cpu_flags().split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        isa = "AVX512"
    elif {"avx2", "fma"} <= flags:
        isa = "AVX2"
    else:
        isa = "DEFAULT"
    extras = [
        name
        for flag, name in (("avx512_bf16", "AVX512_BF16"), ("amx_tile", "AMX"))
        if flag in flags
    ]
    return " + ".join([isa, *extras])


if __name__ == "__main__":
    sys.exit(main())
