"""Compile-only check of pdkv's C++ CPU ops for every x86 ISA ATen's CPU dispatch knows.

`make setup` builds the ops once for the machine it runs on (`-march=native`,
pdkv.model.paged_decode_build), so a source that compiles on an AVX2 box can still fail on an
AVX-512 one (ATen's vec256 and vec512 headers include different things). This module compiles
every `csrc/*.cpp` with `-fsyntax-only` (no code generated, no linking, nothing run) for one
`-march` per ISA, so any x86 machine checks all of them:

| -march | ATen CPU_CAPABILITY | what it adds |
|---|---|---|
| x86-64-v2 | DEFAULT | SSE4.2 (ATen's scalar / SSE fallback) |
| x86-64-v3 | AVX2 | AVX2 + FMA (pdkv's panel kernel) |
| x86-64-v4 | AVX512 | AVX-512 F/BW/VL/DQ |
| sapphirerapids | AVX512 | AVX-512 + BF16 + AMX |

A check takes 8-17 s per file and target on 2 cores, so results are cached by a key of the
source, every csrc header, the target, the flags, torch's version and the compiler's
(`$PDKV_CACHE/csrc-isa/<key>.json`): a warm run of the 20 checks takes well under a second.
Failures are cached too (the same inputs fail the same way).

`python -m pdkv.model.csrc_isa [FILE.cpp ...] [--march M ...]` prints one row per file and target
and exits 1 when any fails (with the compiler's first error).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from pdkv.model.paged_decode_build import SOURCES, compiler, first_compiler_error

ISA_TARGETS: dict[str, str] = {
    "x86-64-v2": "DEFAULT (SSE4.2)",
    "x86-64-v3": "AVX2",
    "x86-64-v4": "AVX-512",
    "sapphirerapids": "AVX-512 + BF16 + AMX",
}
"""-march value -> the ISA it stands for (ATen's DEFAULT, AVX2 and AVX512 dispatch levels, and
the AVX-512 + AMX servers users run)."""
FLAGS = ("-fsyntax-only", "-std=c++20", "-fopenmp", "-DTORCH_EXTENSION_NAME=pdkv_isa_check",
         "-DTORCH_API_INCLUDE_EXTENSION_H")
"""Flags of one check besides -march and the include paths (the build's language and defines)."""
CHECK_TIMEOUT_S = 300.0
"""Deadline of one file's check for one target (seconds)."""


@dataclass(frozen=True)
class IsaCheck:
    """One file compiled for one target.

    Attributes:
        source: the .cpp file's name.
        march: the -march value.
        ok: it compiled.
        error: the compiler's first error line (None when ok).
        seconds: compile time (0.0 when read from the cache).
        cached: read from the cache.
    """

    source: str
    march: str
    ok: bool
    error: str | None
    seconds: float
    cached: bool


def _include_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return [
        f for p in [*include_paths(), sysconfig.get_paths()["include"]] for f in ("-isystem", p)
    ]


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return cxx


def _key(source: Path, march: str, headers: tuple[Path, ...], cxx_version: str) -> str:
    import torch

    h = hashlib.sha256()
    for part in (
        source.name.encode(),
        source.read_bytes(),
        *(f.name.encode() + f.read_bytes() for f in headers),
        march.encode(),
        " ".join(FLAGS).encode(),
        torch.__version__.encode(),
        cxx_version.encode(),
    ):
        h.update(part)
    return h.hexdigest()[:24]


def check_one(
    source: Path, march: str, cxx: str, cache: Path | None, cxx_version: str = ""
) -> IsaCheck:
    """Compile `source` with -fsyntax-only for `march` (or read the cached result).

    Args:
        source: a .cpp file; `#include "..."` resolves from its own folder.
        march: a gcc -march value.
        cxx: the compiler.
        cache: result folder (None: no cache).
        cxx_version: the compiler's `--version` text (part of the cache key).
    """
    headers = tuple(sorted(source.parent.glob("*.h")))
    path = (
        cache / f"{_key(source, march, headers, cxx_version)}.json" if cache is not None else None
    )
    if path is not None and path.exists():
        data = json.loads(path.read_text())
        return IsaCheck(source.name, march, data["ok"], data["error"], 0.0, True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run([cxx, *FLAGS, f"-march={march}", *_include_flags(), str(source)],
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
        ok = proc.returncode == 0
        error = None if ok else (first_compiler_error(proc.stderr) or proc.stderr.strip()[-300:] or
                                 f"exit status {proc.returncode}")
    except subprocess.TimeoutExpired:
        # A deadline is not a property of the source: never cached.
        return IsaCheck(source.name, march, False, f"timed out after {CHECK_TIMEOUT_S:.0f} s",
                        time.monotonic() - t0, False)
    result = IsaCheck(source.name, march, ok, error, time.monotonic() - t0, False)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"ok": ok, "error": error}))
        tmp.replace(path)
    return result


def check(sources: tuple[Path, ...] = SOURCES, targets: tuple[str, ...] = tuple(ISA_TARGETS),
          cache_dir: str | None = None, jobs: int = 2) -> list[IsaCheck]:
    """Compile every source for every target (syntax only), `jobs` compilers at a time.

    Args:
        sources: .cpp files (default: every pdkv/model/csrc/*.cpp).
        targets: -march values (default: ISA_TARGETS).
        cache_dir: base cache folder (None: $PDKV_CACHE or ~/.cache/pdkv); results in csrc-isa/.
        jobs: compilers run at once.

    Returns:
        One IsaCheck per (source, target), in that order.

    Raises:
        RuntimeError: no C++ compiler ($CXX or c++).
    """
    from pdkv.model.registry import cache_dir as cache_root

    cxx = compiler()
    if cxx is None:
        raise RuntimeError(
            "no C++ compiler ($CXX or c++): install g++ (scripts/system-packages.sh)"
        )
    version = _compiler_version(cxx)
    cache = Path(cache_dir or cache_root()) / "csrc-isa"
    pairs = [(s, m) for s in sources for m in targets]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda sm: check_one(sm[0], sm[1], cxx, cache, version), pairs))


def main(argv: list[str] | None = None) -> int:
    """`python -m pdkv.model.csrc_isa`: check the ops (or the given files) for every ISA."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "files", nargs="*", type=Path, help="C++ files to check (default: pdkv/model/csrc/*.cpp)"
    )
    p.add_argument("--march", action="append", choices=tuple(ISA_TARGETS),
                   help="a target (repeatable; default: all)")
    p.add_argument("-j", "--jobs", type=int, default=2, help="compilers at once")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    results = check(tuple(args.files) or SOURCES, tuple(args.march or ISA_TARGETS), jobs=args.jobs)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=1))
    else:
        for r in results:
            how = "cached" if r.cached else f"{r.seconds:.1f} s"
            line = (
                f"{r.source:20s} {r.march:15s} {ISA_TARGETS[r.march]:22s} "
                f"{'ok' if r.ok else 'FAILED'} ({how})"
            )
            print(line + (f"\n    {r.error}" if r.error else ""))
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)} of {len(results)} compiled", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
