"""pdkv's Kimi-Linear decoder (pdkv/model/kimi_linear.py, pdkv/model/kimi_delta.py) against HF
transformers' on a small random config: a prompt prefilled in two chunks and then decoded token by
token (each step continues from the conv window and recurrent state left in the request's slot, and
reads the MLA latents from scattered blocks) gives HF's full-forward logits; the chunked and
recurrent KDA rules agree from a carried state (also under strong per-channel decay), and the
batched decode step equals each request alone."""

from __future__ import annotations

import pytest
import torch

from pdkv.model.gated_delta import LinearStateMetadata
from pdkv.model.kimi_delta import chunk_kda, kda_step, recurrent_kda
from pdkv.model.loader import load_model
from pdkv.worker.attn_metadata import build_attention_metadata

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 4


def _build(tmp_path):
    import transformers

    cfg = transformers.KimiLinearConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=24,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense"] * 3,
        linear_num_heads=2,
        linear_head_dim=8,
        linear_conv_kernel_dim=4,
        model_max_length=256,
        initializer_range=0.3,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.KimiLinearForCausalLM(cfg)
        for name, p in model.named_parameters():  # non-trivial norms
            if "norm" in name:
                p.data.normal_(1, 0.3)
        model.save_pretrained(tmp_path)
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()


@pytest.mark.slow  # HF transformers' model
def test_forward_matches_hf_over_two_chunks(tmp_path):
    hf = _build(tmp_path)
    n_tok = 75  # the first chunk spans more than one 64-token chunk of the rule
    ids = torch.arange(n_tok) * 37 % 512
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
        model = load_model(str(tmp_path), "float32", "cpu")
        layer0 = model.layers[0]
        state_bytes = layer0.conv_bytes + 2 * 8 * 8 * 4
        states = torch.full(
            (3, 2, state_bytes), 64, dtype=torch.uint8
        )  # garbage: a fresh slot is zeroed
        latents = torch.zeros(48, BS, 24 + 8)
        caches = [states[:, 0], latents, states[:, 1]]
        table = [i * 7 % 48 for i in range(19)]  # scattered blocks
        got = []
        # two prefill chunks (the chunked rule), then three decodes (the recurrent rule)
        for c, n in ((0, 70), (70, 2), (72, 1), (73, 1), (74, 1)):
            meta = [build_attention_metadata([(0, n, c, table)], n, BS, torch.device("cpu")),
                    LinearStateMetadata(((0, n, 2 if c else -1, ((n, 2),)),))]
            got.append(model(ids[c : c + n], torch.arange(c, c + n), caches, meta, torch.arange(n)))
    torch.testing.assert_close(torch.cat(got), ref, atol=2e-3, rtol=1e-4)


def _inputs(n: int, h: int, dk: int, dv: int, decay_scale: float, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, h, dk, generator=g), torch.randn(n, h, dk, generator=g)
    v = torch.randn(n, h, dv, generator=g)
    decay = -torch.rand(n, h, dk, generator=g) * decay_scale
    beta = torch.rand(n, h, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g)
    return q, k, v, decay, beta, s0


@pytest.mark.parametrize("decay_scale", [2.0, 60.0])  # 60: exp(-cum) would overflow within a chunk
def test_chunked_rule_equals_recurrent_rule_with_a_carried_state(decay_scale):
    q, k, v, decay, beta, s0 = _inputs(70, 2, 8, 6, decay_scale)
    want, want_s = recurrent_kda(q, k, v, decay, beta, s0)
    got, got_s = chunk_kda(q, k, v, decay, beta, s0, chunk=16)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_s, want_s, atol=1e-4, rtol=1e-4)


def test_decay_is_per_channel():
    """A channel whose decay is -inf forgets its row of the state; the others keep theirs."""
    q, k, v, decay, beta, s0 = _inputs(1, 1, 4, 3, 0.0)
    decay[0, 0, 1] = -1e4
    _, s = recurrent_kda(q, k, v, decay, torch.zeros_like(beta), s0)
    torch.testing.assert_close(s[0, 1], torch.zeros(3))
    torch.testing.assert_close(s[0, [0, 2, 3]], s0[0, [0, 2, 3]])


def test_batched_decode_step_equals_each_request_alone():
    q, k, v, decay, beta, _ = _inputs(3, 2, 8, 6, 2.0)
    states = torch.randn(3, 2, 8, 6, generator=torch.Generator().manual_seed(5))
    out, new = kda_step(q, k, v, decay, beta, states)
    for b in range(3):
        o, s = recurrent_kda(
            q[b, None], k[b, None], v[b, None], decay[b, None], beta[b, None], states[b]
        )
        torch.testing.assert_close(out[b], o[0])
        torch.testing.assert_close(new[b], s)
