"""pdkv's Qwen3-Next decoder (pdkv/model/qwen3_next.py, pdkv/model/gated_delta.py) against HF
transformers' on a small random config: a prompt prefilled in two chunks and then decoded token by
token (each step continues from the conv window and recurrent state left in the request's slot, and
reads the full-attention KV from scattered blocks) gives HF's full-forward logits; the chunked and
recurrent delta rules agree, and the batched decode step equals each request alone; a fresh slot
is zeroed whatever it held."""

from __future__ import annotations

import pytest
import torch

from pdkv.model.gated_delta import (
    LinearStateMetadata,
    causal_conv,
    causal_conv_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_step,
)
from pdkv.model.loader import load_model
from pdkv.worker.attn_metadata import build_attention_metadata

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 4


def _build(tmp_path, nk: int = 2, nv: int = 4):
    import transformers

    cfg = transformers.Qwen3NextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=nk,
        linear_key_head_dim=8,
        linear_num_value_heads=nv,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        mlp_only_layers=[0, 1, 2],
        num_experts=0,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Qwen3NextForCausalLM(cfg)
        for name, p in model.named_parameters():  # non-trivial (1 + w) norms
            if "norm" in name:
                p.data.normal_(0, 0.3)
        model.save_pretrained(tmp_path)
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()


@pytest.mark.slow  # HF transformers' model
def test_forward_matches_hf_over_two_chunks(tmp_path):
    hf = _build(tmp_path)
    n_tok = 75  # the first chunk spans more than one 64-token delta-rule chunk
    ids = torch.arange(n_tok) * 37 % 512
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
        model = load_model(str(tmp_path), "float32", "cpu")
        layer0 = model.layers[0]
        state_bytes = layer0.conv_bytes + 4 * 4 * 8 * 12
        states = torch.full(
            (3, 2, state_bytes), 64, dtype=torch.uint8
        )  # garbage (floats ~3): a fresh slot is zeroed
        attn_cache = torch.zeros(2, 48, BS, 1, 16)
        caches = [states[:, 0], attn_cache, states[:, 1]]
        table = [i * 7 % 48 for i in range(19)]  # scattered blocks
        got = []
        # two prefill chunks (the chunked rule), then three decodes (the recurrent rule)
        for c, n in ((0, 70), (70, 2), (72, 1), (73, 1), (74, 1)):
            meta = [build_attention_metadata([(0, n, c, table)], n, BS, torch.device("cpu")),
                    LinearStateMetadata(((0, n, 2 if c else -1, ((n, 2),)),))]
            got.append(model(ids[c : c + n], torch.arange(c, c + n), caches, meta, torch.arange(n)))
    # Logits reach ~11; the delta rule's chunked and recurrent paths round differently, and at the
    # worst row (the first decode) HF's own fp32 logits are 1.7e-4 off its fp64 ones, ours 7.5e-4.
    torch.testing.assert_close(torch.cat(got), ref, atol=2e-3, rtol=1e-4)


def test_chunked_rule_equals_recurrent_rule_with_a_carried_state():
    g = torch.Generator().manual_seed(1)
    n, hk, hv, dk, dv = 70, 2, 4, 8, 6
    q, k = torch.randn(n, hk, dk, generator=g), torch.randn(n, hk, dk, generator=g)
    v = torch.randn(n, hv, dv, generator=g)
    decay = -torch.rand(n, hv, generator=g) * 2
    beta = torch.rand(n, hv, generator=g)
    s0 = torch.randn(hv, dk, dv, generator=g)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, decay, beta, s0)
    out_c, s_c = chunk_gated_delta_rule(q, k, v, decay, beta, s0, chunk=16)
    torch.testing.assert_close(out_c, out_r, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_c, s_r, atol=1e-4, rtol=1e-4)
    # split in two at a non-chunk boundary: the state carries exactly
    out_a, s_a = chunk_gated_delta_rule(q[:23], k[:23], v[:23], decay[:23], beta[:23], s0, chunk=16)
    out_b, s_b = chunk_gated_delta_rule(
        q[23:], k[23:], v[23:], decay[23:], beta[23:], s_a, chunk=16
    )
    torch.testing.assert_close(torch.cat((out_a, out_b)), out_r, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_b, s_r, atol=1e-4, rtol=1e-4)


def test_causal_conv_carries_its_window():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 5, generator=g), torch.randn(5, 4, generator=g)
    whole, win = causal_conv(x, torch.zeros(5, 3), w)
    a, win_a = causal_conv(x[:4], torch.zeros(5, 3), w)
    b, win_b = causal_conv(x[4:], win_a, w)
    torch.testing.assert_close(torch.cat((a, b)), whole)
    torch.testing.assert_close(win_b, win)
    torch.testing.assert_close(win, x[-3:].t())


def test_batched_decode_step_equals_each_request_alone():
    g = torch.Generator().manual_seed(3)
    b, hk, hv, dk, dv, ch = 3, 2, 4, 8, 6, 5
    q, k = torch.randn(b, hk, dk, generator=g), torch.randn(b, hk, dk, generator=g)
    v = torch.randn(b, hv, dv, generator=g)
    decay, beta = -torch.rand(b, hv, generator=g), torch.rand(b, hv, generator=g)
    s0 = torch.randn(b, hv, dk, dv, generator=g)
    out, s = recurrent_step(q, k, v, decay, beta, s0)
    x, win, w = (
        torch.randn(b, ch, generator=g),
        torch.randn(b, ch, 3, generator=g),
        torch.randn(ch, 4, generator=g),
    )
    c, new_win = causal_conv_step(x, win, w)
    for i in range(b):
        o1, s1 = recurrent_gated_delta_rule(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], decay[i : i + 1], beta[i : i + 1], s0[i]
        )
        torch.testing.assert_close(out[i], o1[0])
        torch.testing.assert_close(s[i], s1)
        c1, w1 = causal_conv(x[i : i + 1], win[i], w)
        torch.testing.assert_close(c[i], c1[0])
        torch.testing.assert_close(new_win[i], w1)
