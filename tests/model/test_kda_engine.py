"""tiny-kda-mla (Kimi-Linear-style KDA linear attention + MLA) in the colocated engine: two KV cache
groups, an MLA latent group and a linear-state group whose slot holds the q/k/v conv windows and
the recurrent state (bytes as the spec's formula); a prefix hit resumes from the state checkpoint
at its block boundary (and reads the MLA latents of the hit) and gives the cold output. Refusals
at start-up: TP / DCP and KV connectors."""

from __future__ import annotations

import pytest

from pdkv import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def test_groups_are_mla_and_linear_state_with_the_spec_bytes(tiny_kda_mla):
    from pdkv.cache.specs import LinearStateSpec, MLASpec
    from pdkv.model.arch_config import LlamaArchConfig
    from pdkv.worker.kv_cache import KVCacheSizing, make_kv_cache_config

    cfg = make_kv_cache_config(LlamaArchConfig.from_hf_folder(tiny_kda_mla), KVCacheSizing(
        block_size=16, dtype="float32", max_model_len=128, num_kv_blocks=64))
    (mla, lin) = cfg.groups
    assert isinstance(mla.spec, MLASpec) and mla.layer_indices == (1, 3)
    assert isinstance(lin.spec, LinearStateSpec) and lin.layer_indices == (0, 2)
    assert lin.spec.conv_shape == (3 * 2 * 32, 3) and lin.spec.recurrent_shape == (2, 32, 32)
    # per block: MLA 16 tokens x (48 + 16) x 4 B; per slot: conv 192 x 3 x 4 B + state
    # 2 x 32 x 32 x 4 B
    assert (mla.spec.page_size_bytes, lin.spec.page_size_bytes) == (
        4096,
        192 * 3 * 4 + 2 * 32 * 32 * 4,
    )


def test_prefix_hit_resumes_from_a_checkpoint_with_the_cold_output(tiny_kda_mla):
    base = [(i * 7919) % 40000 + 100 for i in range(40)]
    # share 35 tokens with `base` (checkpoints after 16 and 32), then diverge
    variants = [base[:35] + [500 + j] * (3 + 7 * j) for j in range(2)]
    cold, _ = run(LLM(tiny_kda_mla, cpu_linear="torch", num_kv_blocks=64, max_model_len=96,
                      enable_prefix_caching=False), [base, *variants])
    hot = LLM(
        tiny_kda_mla,
        cpu_linear="torch",
        num_kv_blocks=64,
        max_model_len=96,
        max_num_batched_tokens=24,
    )
    first, cached = run(hot, [base])
    assert first == cold[:1] and cached == [0]
    got, cached = run(hot, variants)  # hits in one step, chunked after the hit
    assert got == cold[1:]
    assert cached == [32, 32]


def test_parallel_and_connectors_are_refused_at_start_up(tiny_kda_mla):
    import json

    from pdkv.model.arch_config import LlamaArchConfig
    from pdkv.model.loader import load_model
    from pdkv.parallel.context import ParallelContext
    from pdkv.parallel.layout import ParallelLayout
    from pdkv.worker.kv_cache import KVCacheSizing, make_kv_cache_config

    # P2P and the pool move its state (tests/kv_transfer/test_pd_kda_mla.py); offload does not.
    with pytest.raises(ValueError, match="does not move per-request state slots"):
        LLM(
            tiny_kda_mla,
            cpu_linear="torch",
            num_kv_blocks=8,
            max_model_len=64,
            kv_transfer_config=json.dumps(
                {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
            ),
        )
    with pytest.raises(
        ValueError, match="not supported with linear-attention \\(Kimi Delta Attention\\)"
    ):
        load_model(
            tiny_kda_mla,
            "float32",
            "cpu",
            ParallelContext(layout=ParallelLayout(tp_size=2), tp_ranks=(0, 1)),
        )
    with pytest.raises(
        ValueError, match="decode_context_parallel_size=2 is not supported with linear-attention"
    ):
        make_kv_cache_config(
            LlamaArchConfig.from_hf_folder(tiny_kda_mla),
            KVCacheSizing(block_size=16, dtype="float32", max_model_len=128, num_kv_blocks=64,
                          layout=ParallelLayout(dcp_size=2, dcp_replicated=True)),
        )
