"""With the oneDNN packed-weight path a model holds one copy of each weight: every packed
projection (and an untied LM head) drops its plain tensor; the embedding table is read from a map
of the weights file (a tied LM head is packed from it, the lookup reads the file's pages).
Logits equal the plain-weight model's to the last bits."""

from __future__ import annotations

import pytest
import torch

from pdkv.model.llama import LlamaForCausalLM, pack_linear_weight
from pdkv.model.loader import load_model
from pdkv.model.panel_linear import PanelWeight, pack_panel_weight, panel_linear_unavailable
from pdkv.worker.attn_metadata import build_attention_metadata

BLOCK, NUM_BLOCKS, PROMPT_LEN = 16, 4, 20
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def folder(request, tmp_path_factory) -> tuple[str, bool]:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=512,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=request.param,
    )
    path = str(tmp_path_factory.mktemp("one_copy"))
    HFLlama(cfg).save_pretrained(path)
    return path, request.param


def _in_file_map(t: torch.Tensor, file_name: str) -> bool:
    """Whether t's memory lies in a mapping of a file named file_name (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= t.data_ptr() < hi:
                return line.rstrip().endswith("/" + file_name)
    return False


def _logits(model: LlamaForCausalLM) -> torch.Tensor:
    cfg = model.cfg
    caches = [
        torch.empty(2, NUM_BLOCKS, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        for _ in range(cfg.num_layers)
    ]
    meta = build_attention_metadata(
        [(0, PROMPT_LEN, 0, list(range(NUM_BLOCKS)))], PROMPT_LEN, BLOCK, torch.device("cpu")
    )
    ids = torch.tensor([(37 * i + 11) % cfg.vocab_size for i in range(PROMPT_LEN)])
    with torch.inference_mode():
        return model(ids, torch.arange(PROMPT_LEN), caches, meta, torch.arange(PROMPT_LEN))


@pytest.mark.parametrize("kind", ["onednn", "panel"])
def test_packed_model_keeps_one_copy_and_same_logits(folder, kind):
    path, tied = folder
    if kind == "onednn" and pack_linear_weight(torch.zeros(2, 2)) is None:
        pytest.skip("oneDNN is not available in this torch build")
    if kind == "panel" and (why := panel_linear_unavailable(torch.zeros(2, 2))) is not None:
        pytest.skip(f"panel kernel unavailable: {why}")
    packer = pack_panel_weight if kind == "panel" else pack_linear_weight
    plain = load_model(path, "float32", "cpu")
    packed = load_model(path, "float32", "cpu")
    assert packed.pack_cpu_weights(packer) and packed.pack_cpu_weights(
        packer
    )  # a second call keeps them
    for layer in packed.layers:
        for name in PROJECTIONS:
            assert getattr(layer, name).is_meta and layer.packed[name] is not None, name
            assert isinstance(layer.packed[name], PanelWeight) == (kind == "panel")
            assert getattr(layer, name).shape == getattr(plain.layers[0], name).shape
    assert packed.head_packed is not None and not packed.embed.is_meta
    assert _in_file_map(packed.embed, "model.safetensors") and _in_file_map(
        plain.embed, "model.safetensors"
    )
    assert (packed.lm_head is None) == tied and (tied or packed.lm_head.is_meta)
    torch.testing.assert_close(_logits(packed), _logits(plain), rtol=1e-4, atol=1e-4)
