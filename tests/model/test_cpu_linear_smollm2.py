"""`--cpu-linear auto` and `--dtype bfloat16` on SmolLM2 (issue 14), measured as `pdkv bench
dtype` does (pdkv/bench/model/dtype_parity.py): 3 prompts x 6 greedy tokens, prefilled in one batch
and decoded batched through the engine's model code, on one torch thread (small batches).

* auto == torch: a model under `--cpu-linear auto` (its table timed at load)
  and a forced table that alternates oneDNN and BLAS across buckets give exactly the greedy
  tokens of plain F.linear.
* bf16 within tolerance of float32. Stated thresholds (docs/SPEED.md, "Matmul per shape and bf16 on
  CPU", has the figures of a larger run): first-step max |logit difference| <= 1.5, all prompts
  but one with the same first token (of 3 here), greedy common-prefix agreement >= 0.5.
  Measured here (AVX2 EPYC, no native bf16): see docs/SPEED.md; bf16 rounds weights and
  activations to 8 mantissa bits, so tokens may diverge after a near-tie and everything after a
  divergence is a different continuation.
"""

from __future__ import annotations

import pytest

from pdkv.bench.model.dtype_parity import compare_dtypes, load_with_linear
from pdkv.bench.model.kv_quant import PROMPTS, greedy_run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

NUM_PROMPTS, MAX_TOKENS = 3, 6
MAX_LOGIT_DIFF, MIN_FIRST_SAME, MIN_PREFIX_AGREEMENT = 1.5, NUM_PROMPTS - 1, 0.5


@pytest.fixture(scope="module")
def prompts(model_path) -> list[list[int]]:
    from pdkv.tokenizer import Tokenizer

    tok = Tokenizer(model_path)
    return [tok.encode(t) for t in PROMPTS[:NUM_PROMPTS]]


@pytest.fixture(scope="module")
def torch_model(model_path):
    return load_with_linear(model_path, "float32", "torch")[0]


def test_auto_table_gives_the_tokens_of_plain_blas(torch_model, model_path, prompts):
    from pdkv.model.linear_backend import LinearDispatch
    from pdkv.model.linear_table import LinearTable

    auto, described = load_with_linear(model_path, "float32", "auto")
    assert described.startswith("1:") and set(auto.layers[0].packed.values()) != {None}, (
        described
    )  # the table ran
    assert (
        auto.head_packed is not None and not auto.layers[0].qkv.is_meta
    )  # one plain copy, dispatched
    ref_logits, ref, _ = greedy_run(torch_model, prompts, MAX_TOKENS, "auto")
    logits, toks, _ = greedy_run(auto, prompts, MAX_TOKENS, "auto")
    assert toks == ref
    assert float((logits - ref_logits).abs().max()) < 1e-2
    # every bucket boundary crossed by the prefill (many rows) and decode (3 rows: bucket 4, BLAS;
    # prefills of ~20 rows: bucket 64, oneDNN)
    mixed = LinearTable((1, 4, 64), ("onednn", "torch", "onednn"))
    torch_model.use_linear_dispatch(LinearDispatch(mixed))
    try:
        assert greedy_run(torch_model, prompts, MAX_TOKENS, "auto")[1] == ref
    finally:
        for layer in torch_model.layers:
            layer.packed = dict.fromkeys(layer.packed)
        torch_model.head_packed = None


@pytest.mark.parametrize("linear", ["auto", "panel"])
def test_bf16_stays_within_tolerance_of_float32(torch_model, model_path, prompts, linear):
    model, resolved = load_with_linear(model_path, "bfloat16", linear)
    if linear == "panel" and resolved != "panel":
        pytest.skip(f"panel kernel unavailable here (resolved to {resolved})")
    rows = compare_dtypes(
        {"float32": (torch_model, "torch"), "bfloat16": (model, resolved)}, prompts, MAX_TOKENS
    )
    bf16 = rows[1]
    assert bf16.dtype == "bfloat16"
    assert 0 < bf16.max_abs_logit_diff <= MAX_LOGIT_DIFF, bf16
    assert (
        bf16.first_token_same >= MIN_FIRST_SAME and bf16.prefix_agreement >= MIN_PREFIX_AGREEMENT
    ), bf16
