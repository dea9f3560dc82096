"""pdkv's DeepSeek-V3 decoder (pdkv/model/deepseek.py) against HF transformers' on small random
configs, one forward over a paged cache: logits of a prompt prefilled in two chunks (the second
reads the first's latents from scattered blocks) equal HF's full forward, with and without a q
LoRA rank and with either rope layout (interleaved pairs or rotate-half)."""

from __future__ import annotations

import pytest
import torch

from pdkv.model.loader import load_model
from pdkv.worker.attn_metadata import build_attention_metadata

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 4


@pytest.mark.slow  # HF transformers' model
@pytest.mark.parametrize(
    ("q_lora_rank", "interleave"), [(None, True), (24, False)], ids=["no-q-lora", "q-lora"]
)
def test_forward_matches_hf_over_two_chunks(tmp_path, q_lora_rank, interleave):
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        first_k_dense_replace=2,
        n_routed_experts=1,
        rope_interleave=interleave,
        max_position_embeddings=64,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.arange(11) * 37 % 512
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
        model = load_model(str(tmp_path), "float32", "cpu")
        caches = [torch.zeros(8, BS, 16 + 8) for _ in range(2)]
        table = [5, 2, 7]  # scattered blocks
        got = []
        for c, n in ((0, 6), (6, 5)):
            meta = build_attention_metadata([(0, n, c, table)], n, BS, torch.device("cpu"))
            got.append(model(ids[c : c + n], torch.arange(c, c + n), caches, meta, torch.arange(n)))
    torch.testing.assert_close(torch.cat(got), ref, atol=2e-4, rtol=1e-4)
