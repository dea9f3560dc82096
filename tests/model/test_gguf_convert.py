"""The GGUF -> HF conversion equals transformers' own GGUF loading, weight for weight."""

import importlib.util
import os

import numpy as np
import pytest
import torch

from pdkv.model.gguf_convert import unpermute_qk
from pdkv.model.registry import ALIASES, resolve_model


def test_unpermute_inverts_llamacpp_permutation():
    rng = np.random.default_rng(0)
    heads, head_dim, inp = 3, 8, 5
    w = rng.standard_normal((heads * head_dim, inp)).astype(np.float32)
    # llama.cpp convert_hf_to_gguf.py permute(): reshape(heads, 2, d/2, in).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, inp).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_qk(permuted, heads), w)


def test_unknown_model_name_is_rejected():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        resolve_model("no-such-model")


@pytest.mark.slow
def test_converted_weights_equal_transformers_gguf_load():
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    spec = ALIASES["smollm2"]
    pkg_dir = list(importlib.util.find_spec(spec.package).submodule_search_locations)[0]
    ref = AutoModelForCausalLM.from_pretrained(
        pkg_dir, gguf_file=spec.filename, dtype=torch.float32
    ).state_dict()
    ours = load_file(os.path.join(resolve_model("smollm2"), "model.safetensors"))
    names = [k for k in ref if k != "lm_head.weight"]  # tied to the embedding
    assert sorted(names) == sorted(ours)
    for name in names:
        torch.testing.assert_close(ours[name], ref[name], rtol=0, atol=0, msg=name)
