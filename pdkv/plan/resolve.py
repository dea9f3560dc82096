"""Find a model's config.json for `pdkv plan` without loading (or converting) the model.

Accepted: a path to a config.json (any file name), a folder holding config.json, a name of a
bundled config under pdkv/plan/configs/ (file name without .json), or a pdkv model alias
(pdkv.model.registry.ALIASES, e.g. smollm2) or tiny model (pdkv.model.tiny, e.g. tiny-swa) whose
folder is already in $PDKV_CACHE.
An alias not converted yet falls back to the bundled config of the same name: converting a GGUF
needs torch and minutes, which a cost model should not.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pdkv.model.registry import ALIASES, HF_IDS, cache_dir
from pdkv.model.tiny import TINY_MODELS

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def bundled_names() -> list[str]:
    """Names of the configs shipped under pdkv/plan/configs/."""
    return sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def load_config(model: str) -> tuple[dict[str, Any], str]:
    """The parsed config.json for `model` and a description of where it was read from.

    Raises:
        ValueError: nothing matches `model`, or the file is not a JSON object.
    """
    path = _find(model)
    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a JSON object")
    return cfg, path


def _find(model: str) -> str:
    if os.path.isfile(model):
        return model
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if os.path.isfile(path):
            return path
        raise ValueError(f"{model} has no config.json")
    model = HF_IDS.get(model.lower(), model)  # HuggingFaceTB/SmolLM2-135M-Instruct -> smollm2
    if model in ALIASES:
        path = os.path.join(cache_dir(), "models", ALIASES[model].folder_name, "config.json")
        if os.path.isfile(path):
            return path
    bundled = os.path.join(CONFIG_DIR, model.lower() + ".json")
    if os.path.isfile(bundled):
        return bundled
    if model in TINY_MODELS:
        path = os.path.join(cache_dir(), "models", model, "config.json")
        if os.path.isfile(path):
            return path
        raise ValueError(
            f"{model} is built on first use: run `pdkv generate --model {model} --prompt hi "
            "--max-tokens 1` once, then plan it"
        )
    raise ValueError(
        f"unknown model {model!r}: give a config.json path, a folder with config.json, or one of "
        f"{', '.join(bundled_names())}")
