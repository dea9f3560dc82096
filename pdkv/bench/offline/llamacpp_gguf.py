"""GGUF files of a pdkv model for the llama.cpp peer of `pdkv bench offline`.

`make llama-cpp` builds llama-cpp-python from its sdist and then runs this module, which converts
the model's HF folder (`pdkv.model.registry.resolve_model`) to GGUF with llama.cpp's own converter:
`convert_hf_to_gguf.py` and its `conversion/` package from the sdist's `vendor/llama.cpp`, with the
sdist's `gguf-py` on PYTHONPATH (so the GGUF writer matches the llama.cpp that reads it). It needs
torch, transformers, numpy and sentencepiece (the converter imports it even for a BPE tokenizer).

Files: `$PDKV_CACHE/gguf/<model>-<f32|bf16>.gguf` (default `~/.cache/pdkv/gguf/`), e.g.
`smollm2-f32.gguf`; `gguf_path` is the one place both this converter and the benchmark peer
(`pdkv.bench.offline.llamacpp`) take the name from.

Usage::

    python -m pdkv.bench.offline.llamacpp_gguf --sdist llama_cpp_python-0.3.36.tar.gz \\
        --model smollm2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile

from pdkv.model.registry import cache_dir

# Benchmark dtype -> the converter's --outtype (also the file-name suffix).
GGUF_OUTTYPES = {"float32": "f32", "bfloat16": "bf16"}

MAKE_TARGET = "make llama-cpp"

# Parts of the sdist's vendor/llama.cpp the converter needs.
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def gguf_path(model: str, dtype: str, cache: str | None = None) -> str:
    """Path of the GGUF file of `model` (alias or folder) in `dtype`.

    Args:
        model: pdkv model alias (e.g. "smollm2") or a model folder (its base name is used).
        dtype: "float32" or "bfloat16".
        cache: base cache folder (None: $PDKV_CACHE or ~/.cache/pdkv).

    Raises:
        ValueError: a dtype without a GGUF conversion (float16).
    """
    if dtype not in GGUF_OUTTYPES:
        raise ValueError(f"no llama.cpp GGUF for dtype {dtype!r}; one of {sorted(GGUF_OUTTYPES)}")
    name = os.path.basename(os.path.normpath(model)).lower()
    return os.path.join(cache or cache_dir(), "gguf", f"{name}-{GGUF_OUTTYPES[dtype]}.gguf")


def extract_converter(sdist: str, dest: str) -> str:
    """Unpack the converter parts of a llama-cpp-python sdist into `dest`; returns the folder
    holding `convert_hf_to_gguf.py` (reused when already unpacked).

    Raises:
        FileNotFoundError: `sdist` missing or without vendor/llama.cpp/convert_hf_to_gguf.py.
    """
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        root = f"{top}/vendor/llama.cpp/"
        out = os.path.join(dest, root)
        if os.path.isfile(os.path.join(out, "convert_hf_to_gguf.py")):
            return out
        members = [m for m in tar.getmembers()
                   if m.name.startswith(root) and m.name[len(root):].startswith(_CONVERTER_PARTS)]
        if not any(m.name.endswith("convert_hf_to_gguf.py") for m in members):
            raise FileNotFoundError(f"{sdist} has no {root}convert_hf_to_gguf.py")
        tar.extractall(dest, members=members, filter="data")
    return out


def convert(converter_dir: str, model_dir: str, outtype: str, outfile: str) -> None:
    """Run llama.cpp's converter on an HF folder; writes `outfile` atomically (temp + rename).

    Raises:
        subprocess.CalledProcessError: the converter failed (its output went to stderr).
    """
    os.makedirs(os.path.dirname(outfile), exist_ok=True)
    tmp = outfile + ".tmp"
    env = dict(os.environ, PYTHONPATH=os.path.join(converter_dir, "gguf-py"))
    cmd = [sys.executable, os.path.join(converter_dir, "convert_hf_to_gguf.py"), model_dir,
           "--outtype", outtype, "--outfile", tmp]
    subprocess.run(cmd, check=True, env=env)
    os.replace(tmp, outfile)


def main(argv: list[str] | None = None) -> int:
    """Convert `--model` to each `--dtypes` GGUF that is not there yet; prints the paths."""
    from pdkv.model.registry import resolve_model

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sdist", required=True, help="llama_cpp_python-<version>.tar.gz")
    p.add_argument("--model", default="smollm2", help="pdkv model alias or HF folder")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32,bfloat16")
    p.add_argument("--force", action="store_true", help="convert again even if the file exists")
    args = p.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    model_dir = resolve_model(args.model)
    converter = extract_converter(args.sdist, os.path.join(cache_dir(), "llama-cpp", "src"))
    for dtype in dtypes:
        out = gguf_path(args.model, dtype)
        if args.force or not os.path.isfile(out):
            convert(converter, model_dir, GGUF_OUTTYPES[dtype], out)
        print(out, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
