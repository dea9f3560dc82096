"""Greedy outputs are token-for-token those of HF transformers (SmolLM2, float32, CPU).

Prompts are real chat prompts whose lengths include block multiples and multiples +-1
(block size 16), submitted together as one batch.
"""

from __future__ import annotations

import pytest
from conftest import NUM_NEW_TOKENS, assert_no_leak, hf_greedy
from system_packages import require

from pdkv import LLM, SamplingParams
from pdkv.model.panel_linear import PanelWeight, panel_linear_unavailable

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS)


def _generate(llm: LLM, prompts: list[list[int]]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)


def _assert_matches(outputs, reference) -> None:
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} ({len(out.prompt_token_ids)} tokens)"


def test_prompt_lengths_cover_block_boundaries(parity_prompts):
    lengths = {len(p) for p in parity_prompts}
    assert len(parity_prompts) >= 8
    for k in (4, 6, 8):  # 64, 96, 128 and their neighbours
        assert {16 * k - 1, 16 * k, 16 * k + 1} <= lengths


@pytest.mark.matrix("colocated")
@pytest.mark.parametrize(("cpu_linear", "attention_backend", "fused_ops"),
                         [pytest.param("panel", "cpu_paged", True, id="panel"),
                          pytest.param("onednn", "cpu_paged", True, id="onednn"),
                          pytest.param("torch", "torch", False, id="torch")])
def test_batch_matches_hf(parity_prompts, hf_reference, cpu_linear, attention_backend, fused_ops):
    llm = LLM("smollm2", block_size=16, num_kv_blocks=256, max_model_len=512, cpu_linear=cpu_linear,
              attention_backend=attention_backend, fused_ops=fused_ops)
    model = llm.llm_engine.runner.model
    # cpu_paged: decode reads K/V from the blocks in place; fused ops: C++ RMSNorm / RoPE /
    # SiLU-mul (the extension is built by then: cpu_paged builds it); torch only where no
    # compiler exists.
    if attention_backend == "cpu_paged":
        require("g++", "python3-dev")  # the ops are built then (fails under CI without a compiler)
    assert llm.llm_engine.runner.attention_backend == attention_backend
    assert llm.llm_engine.runner.fused_ops == fused_ops
    if cpu_linear == "torch":
        assert model.head_packed is None
    elif cpu_linear == "panel":
        why = panel_linear_unavailable(model.embed)
        if why is not None:
            pytest.skip(f"panel kernel unavailable: {why}")
        assert isinstance(model.head_packed, PanelWeight)
        assert all(
            isinstance(p, PanelWeight) for layer in model.layers for p in layer.packed.values()
        )
        # Decode steps run each layer as one C++ op (pdkv/model/decode_layer.py).
        assert llm.llm_engine.runner.decode_layer_ops == model.cfg.num_layers
    elif model.head_packed is None:
        pytest.skip("oneDNN is not available in this torch build")
    if cpu_linear != "panel":
        assert llm.llm_engine.runner.decode_layer_ops == 0
    outputs = _generate(llm, parity_prompts)
    _assert_matches(outputs, hf_reference)
    assert all(len(o.outputs[0].token_ids) >= 32 for o in outputs)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outputs)
    assert_no_leak(llm)


@pytest.mark.matrix("chunked-prefill")
def test_chunked_prefill_matches_hf(parity_prompts, hf_reference):
    budget = 48
    assert budget < max(len(p) for p in parity_prompts)
    llm = LLM("smollm2", num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=budget)
    scheduler = llm.llm_engine.scheduler
    chunks: list[dict[str, int]] = []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        chunks.append(dict(out.num_scheduled_tokens))
        return out

    scheduler.schedule = recording_schedule
    outputs = _generate(llm, parity_prompts)
    _assert_matches(outputs, hf_reference)
    assert max(sum(step.values()) for step in chunks) <= budget
    # The longest prompt really was split: it appears in several prefill steps.
    longest = max(outputs, key=lambda o: len(o.prompt_token_ids)).request_id
    prefill_steps = [s[longest] for s in chunks if s.get(longest, 0) > 1]
    assert len(prefill_steps) >= 2
    assert_no_leak(llm)


@pytest.mark.matrix("preemption")
def test_preemption_matches_hf(parity_prompts, hf_reference):
    # 20 blocks x 16 tokens = 320 tokens of KV for ten requests of ~100-170 tokens each.
    llm = LLM("smollm2", num_kv_blocks=20, max_model_len=256)
    outputs = _generate(llm, parity_prompts)
    _assert_matches(outputs, hf_reference)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert any(o.metrics.num_preemptions > 0 for o in outputs)
    assert_no_leak(llm)


@pytest.mark.matrix("prefix-caching")
def test_prefix_cache_hit_matches_hf(parity_prompts, hf_reference):
    llm = LLM("smollm2", num_kv_blocks=256, max_model_len=512, enable_prefix_caching=True)
    first = _generate(llm, parity_prompts)
    _assert_matches(first, hf_reference)
    # Within the first batch only the shared chat-template head can hit (in the same step).
    shared = 0
    while all(p[shared] == parity_prompts[0][shared] for p in parity_prompts):
        shared += 1
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens <= shared // 16 * 16 for o in first)
    again = _generate(llm, parity_prompts)
    _assert_matches(again, hf_reference)
    for out in again:
        n = len(out.prompt_token_ids)
        whole_block_prefix = (n - 1) // 16 * 16  # one token is always recomputed
        assert out.num_cached_tokens == whole_block_prefix > 0
    assert_no_leak(llm)


def test_chat_matches_hf(hf_model, hf_tokenizer):
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name three primary colors and explain how to mix green."}],
        [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Why do leaves change color in autumn?"},
        ],
    ]
    llm = LLM("smollm2", num_kv_blocks=128, max_model_len=512)
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=24))
    for conv, out in zip(conversations, outputs):
        text = hf_tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, 24)
        assert out.outputs[0].text == hf_tokenizer.decode(
            out.outputs[0].token_ids, skip_special_tokens=True
        )
    assert "Paris" in outputs[0].outputs[0].text
    assert_no_leak(llm)


def test_batched_prefill_op_matches_hf(parity_prompts, hf_model, monkeypatch):
    """cpu_paged: all prefill runs of a step in one op call (several requests, chunk
    continuations and prefix hits: runs with context), greedy tokens those of HF."""
    require("g++", "python3-dev")  # cpu_paged falls back to the torch path without a compiler
    import pdkv.model.paged_prefill as pp

    calls: list[tuple[int, int]] = []  # (runs, largest context) per op call
    op = pp.paged_prefill

    def recording_op(q, kv_cache, cu_seqlens, context_lens, *args, **kwargs):
        calls.append((len(context_lens), int(context_lens.max())))
        return op(q, kv_cache, cu_seqlens, context_lens, *args, **kwargs)

    monkeypatch.setattr(pp, "paged_prefill", recording_op)
    llm = LLM(
        "smollm2",
        block_size=16,
        num_kv_blocks=64,
        max_model_len=256,
        attention_backend="cpu_paged",
        enable_prefix_caching=True,
        max_num_batched_tokens=80,
    )
    assert llm.llm_engine.runner.attention_backend == "cpu_paged"
    prompts, n = parity_prompts[3:6], 4  # 63, 64 and 65 tokens: 80-token steps split them
    reference = [hf_greedy(hf_model, p, n) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=n)
    for _ in range(2):  # the second round hits the first's cached blocks
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for i, out in enumerate(outputs):
            assert out.outputs[0].token_ids == reference[i], f"prompt {i}"
    assert all(o.num_cached_tokens > 0 for o in outputs)
    assert max(r for r, _ in calls) >= 2  # several requests' runs in one call
    assert max(c for _, c in calls) > 0  # runs with context (chunk continuations, prefix hits)
    assert_no_leak(llm)
