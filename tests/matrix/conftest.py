"""A tiny random Llama (2 layers, hidden 64, SmolLM2's tokenizer) for the matrix's `tiny-llama`
row, and its HF transformers greedy reference. Made once per session in a temp folder."""

from __future__ import annotations

import os
import shutil

import pytest
from tiny_model import TINY_NEW_TOKENS, TINY_PROMPT_LENS


@pytest.fixture(scope="session")
def tiny_llama_hf(tmp_path_factory, model_path):
    """(folder, HF model): random weights (seed 0, initializer_range 0.2 so that greedy picks are
    clear-cut), saved with save_pretrained; tokenizer files copied from SmolLM2."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = str(tmp_path_factory.mktemp("tiny-llama"))
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                      initializer_range=0.2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(model_path, name)):
            shutil.copy(os.path.join(model_path, name), out)
    return out, model


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_hf) -> str:
    """Folder of the tiny random Llama (config.json, model.safetensors, tokenizer)."""
    return tiny_llama_hf[0]


@pytest.fixture(scope="session")
def tiny_prompts() -> list[list[int]]:
    """Prompts of 15, 16, 17 (around one block), 33 and 50 tokens."""
    return [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in TINY_PROMPT_LENS]


@pytest.fixture(scope="session")
def tiny_reference(tiny_llama_hf, tiny_prompts) -> list[list[int]]:
    """HF transformers' greedy continuation (TINY_NEW_TOKENS tokens) of each prompt."""
    import torch

    model, out = tiny_llama_hf[1], []
    with torch.inference_mode():
        for p in tiny_prompts:
            ids = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=TINY_NEW_TOKENS,
                do_sample=False,
            )
            out.append(ids[0, len(p):].tolist())
    return out
