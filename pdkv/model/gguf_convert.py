"""Convert a llama-architecture GGUF file into an HF-format folder (done once, then cached).

Weights are dequantized with the `gguf` package; q/k weights are un-permuted (llama.cpp's
converter permutes them for its interleaved RoPE: `reshape(heads, 2, d/2, in).swapaxes(1, 2)`
in llama.cpp convert_hf_to_gguf.py; the inverse is applied here). Tokenizer and chat template
are converted by transformers' GGUF tokenizer support.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import save_file

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. w: [num_heads * head_dim, in] -> same shape."""
    out_dim = w.shape[0]
    return (
        w.reshape(num_heads, out_dim // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _field(reader, key: str):  # type: ignore[no-untyped-def]
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def convert_gguf_to_hf(gguf_path: str, out_dir: str) -> None:
    """Write config.json, model.safetensors (float32) and tokenizer files into `out_dir`.

    Raises:
        ValueError: the GGUF is not a llama-architecture model.
    """
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not supported (need 'llama')")
    n_layers = int(_field(reader, "llama.block_count"))
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv"))
    hidden = int(_field(reader, "llama.embedding_length"))

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        name = t.name
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, kind, _ = name.split(".")
            if kind not in _LAYER_NAMES:
                raise ValueError(f"{gguf_path}: unexpected tensor {name}")
            if kind == "attn_q":
                w = unpermute_qk(w, n_heads)
            elif kind == "attn_k":
                w = unpermute_qk(w, n_kv)
            key = f"model.layers.{idx}.{_LAYER_NAMES[kind]}.weight"
        else:
            raise ValueError(f"{gguf_path}: unexpected tensor {name}")
        tensors[key] = torch.from_numpy(np.ascontiguousarray(w))

    vocab = tensors["model.embed_tokens.weight"].shape[0]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_heads,
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id") or 0),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "pdkv_source": os.path.basename(gguf_path),
    }
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, f
        )

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
    )
    tok.save_pretrained(out_dir)
