"""Load an HF-format safetensors folder into `LlamaForCausalLM` (fusing q/k/v and gate/up)."""

from __future__ import annotations

import glob
import hashlib
import json
import os

import torch
from safetensors import safe_open

from pdkv.model.llama import LlamaArchConfig, LlamaForCausalLM

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_model(path: str, dtype: str, device: str) -> LlamaForCausalLM:
    """Build the model from `path` (config.json + *.safetensors) in `dtype` on `device`.

    Raises:
        ValueError: unsupported architecture, or a missing / mis-shaped weight (named).
    """
    cfg = LlamaArchConfig.from_hf_folder(path)
    tdtype = TORCH_DTYPES[dtype]
    dev = torch.device(device)
    model = LlamaForCausalLM(cfg, tdtype, dev)
    tensors = _read_safetensors(path)

    def take(name: str) -> torch.Tensor:
        try:
            return tensors.pop(name)
        except KeyError:
            raise ValueError(f"weight {name!r} missing from {path}") from None

    def put(param: torch.nn.Parameter, value: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
        param.data.copy_(value.to(tdtype))

    put(model.embed, take("model.embed_tokens.weight"), "embed_tokens")
    put(model.norm, take("model.norm.weight"), "norm")
    if model.lm_head is not None:
        put(model.lm_head, take("lm_head.weight"), "lm_head")
    else:
        tensors.pop("lm_head.weight", None)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        put(layer.input_norm, take(p + "input_layernorm.weight"), p + "input_layernorm")
        put(layer.post_attn_norm, take(p + "post_attention_layernorm.weight"), p + "post_attention_layernorm")
        qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        put(layer.qkv, qkv, p + "qkv")
        if layer.qkv_bias is not None:
            bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            put(layer.qkv_bias, bias, p + "qkv_bias")
        put(layer.o_proj, take(p + "self_attn.o_proj.weight"), p + "o_proj")
        gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        put(layer.gate_up, gate_up, p + "gate_up")
        put(layer.down, take(p + "mlp.down_proj.weight"), p + "down_proj")
    leftovers = [k for k in tensors if "rotary_emb" not in k]
    if leftovers:
        raise ValueError(f"unexpected weights in {path}: {leftovers[:5]}")
    return model.to(dev).eval()


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    out: dict[str, torch.Tensor] = {}
    for fname in files:
        with safe_open(fname, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[key] = f.get_tensor(key)
    return out


def model_digest(path: str) -> str:
    """Short sha256 over config.json and the safetensors headers + sizes: identifies the
    weights (for KV compatibility checks) without reading every byte."""
    h = hashlib.sha256()
    with open(os.path.join(path, "config.json"), "rb") as f:
        h.update(json.dumps(json.load(f), sort_keys=True).encode())
    for fname in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with open(fname, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(header_len))
        h.update(str(os.path.getsize(fname)).encode())
    return h.hexdigest()[:16]
