"""tiny-v4 (DeepSeek-V4: sliding-window + CSA + HCA attention with the Lightning Indexer and
sinks, mHC, hash / top-k MoE; pdkv/model/deepseek_v4.py) against transformers'
`DeepseekV4ForCausalLM` on the same folder: greedy parity offline with whole and chunked
prefills (chunks of 13 end inside the rate-4 and rate-16 compression windows and inside the
24-token sliding window) and batched decodes, and through the server; its state as KV cache
groups: prefix hits restore the compressed entries of the hit's blocks and the compressor state
checkpointed at its end (block size 8: hits inside the rate-16 windows; 16: at their edge) and
give the cold output; preempted and aborted requests give every block back; the refusals of
what is not built yet (CPU offload, TP / DCP, quantized KV). P/D and the KV pool:
tests/kv_transfer/test_pd_v4.py, tests/kvpool/test_pool_v4.py."""

from __future__ import annotations

import json

import pytest
import torch

from pdkv import LLM, SamplingParams
from pdkv.matrix.catalog import DETAIL_PROPERTY

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 12
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
LENGTHS = (15, 40, 100)


def prompts() -> list[list[int]]:
    return [[(i * 7919 + 31 * n) % 45000 + 100 for i in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_v4(tiny_v4):
    import transformers

    return transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_v4, dtype=torch.float32).eval()


def hf_greedy(model, ids: list[int], n: int = NEW) -> list[int]:
    """HF's greedy tokens with its own V4 cache (compressor buffers and entries)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out: list[int] = []
    with torch.no_grad():
        logits = model(torch.tensor([ids]), cache=cache, use_cache=True).logits
        for _ in range(n):
            out.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits
    return out


@pytest.fixture(scope="module")
def reference(hf_v4) -> list[list[int]]:
    return [hf_greedy(hf_v4, p) for p in prompts()]


def run(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], PARAMS)
    return [list(o.outputs[0].token_ids) for o in outs]


def all_free(llm: LLM) -> bool:
    """Every block of every group (window, compressed entries, indexer keys, state slots) is
    free again."""
    pools = llm.llm_engine.scheduler.kv_cache_manager.block_pools
    return all(p.num_free_blocks == p.num_usable_blocks for p in pools)


@pytest.mark.matrix("colocated", "chunked-prefill", model="tiny-v4")
def test_greedy_parity_with_transformers_whole_and_chunked_prefill(tiny_v4, reference):
    whole = LLM(tiny_v4, max_model_len=256, num_kv_blocks=64, enable_prefix_caching=False)
    assert run(whole, prompts()) == reference
    assert all_free(whole)
    chunked = LLM(tiny_v4, max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=13,
                  enable_chunked_prefill=True)
    assert run(chunked, prompts()) == reference
    assert all_free(chunked)


@pytest.mark.matrix("preemption", model="tiny-v4")
def test_preempted_requests_restart_with_fresh_compressor_state(tiny_v4, reference):
    # 10 blocks of 16 tokens: the three requests (up to 112 tokens each, a 24-token window)
    # do not all fit while they prefill, so some wait or are preempted and recomputed.
    small = LLM(tiny_v4, max_model_len=128, num_kv_blocks=10, max_num_batched_tokens=32,
                enable_chunked_prefill=True)
    assert run(small, prompts()) == reference
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert all_free(small)


def test_an_aborted_request_gives_its_blocks_back(tiny_v4):
    llm = LLM(tiny_v4, max_model_len=256, num_kv_blocks=64)
    eng = llm.llm_engine
    eng.add_request(*eng.make_request({"prompt_token_ids": prompts()[1]}, SamplingParams(
        temperature=0, max_tokens=50, ignore_eos=True), request_id="a"))
    for _ in range(3):
        eng.step()
    assert not all_free(llm)
    eng.abort_request(["a"])
    assert all_free(llm)


@pytest.mark.matrix("prefix-caching", "hybrid-v4", model="tiny-v4")
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefix_hits_restore_entries_and_compressor_state(tiny_v4, block_size):
    """Hits of 32 and 40 tokens (block size 8: 40 is inside a rate-16 window, 8 tokens pending;
    16: 32, the edge of every window) and of 64 tokens written partly during decode give the
    cold engine's output."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def go(llm: LLM, ps: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
        return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]

    def cold(ps: list[list[int]]) -> list[list[int]]:
        return go(LLM(tiny_v4, max_model_len=128, num_kv_blocks=128, block_size=block_size,
                      enable_prefix_caching=False), ps)[0]

    base = [(i * 7919) % 40000 + 100 for i in range(60)]
    variants = [base[:35] + [500 + j] * (3 + 7 * j) for j in range(2)] + [base[:45] + [900] * 6]
    want = cold([base, *variants])
    hot = LLM(tiny_v4, max_model_len=128, num_kv_blocks=128, block_size=block_size,
              max_num_batched_tokens=24)
    assert go(hot, [base]) == (want[:1], [0])
    got, cached = go(hot, variants)  # several hits in one step, chunked after the hit
    assert got == want[1:]
    assert cached == ([32, 32, 40] if block_size == 8 else [32, 32, 32])
    extended = base + want[0] + [77] * 5  # blocks up to 64 computed by `base`, some in decode
    assert go(hot, [extended]) == (cold([extended]), [64])
    assert all_free(hot)  # cached blocks stay evictable, held by no request
    kv = hot.llm_engine.scheduler.kv_cache_manager
    assert all(b.ref_cnt == 0 for pool in kv.block_pools for b in pool.blocks)


OFFLOAD = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
REFUSED = [
    pytest.param("offload", {"kv_transfer_config": json.dumps(OFFLOAD)},
                 "does not move per-request state slots .*compressor_state", id="offload"),
    pytest.param("tp", {"tensor_parallel_size": 2}, "DeepSeek-V4 runs on one rank only",
                 id="tp"),
    pytest.param("dcp", {"decode_context_parallel_size": 2}, "DeepSeek-V4 runs on one rank only",
                 id="dcp"),
    pytest.param("quantized-kv", {"kv_cache_dtype": "int8"},
                 "kv_cache_dtype='int8' is not supported for DeepSeek-V4", id="int8"),
]


def test_push_mode_is_refused_naming_pull(tiny_v4):
    push = json.dumps({"kv_connector": "P2PConnector", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"transfer": "tcp", "transfer_mode": "push"}})
    with pytest.raises(ValueError, match="8 caches beyond its 4 layers.*transfer_mode 'pull'"):
        LLM(tiny_v4, max_model_len=64, num_kv_blocks=16, kv_transfer_config=push)


@pytest.mark.parametrize("feature, kwargs, match", [
    pytest.param(*p.values, id=p.id, marks=pytest.mark.matrix(p.values[0], model="tiny-v4",
                                                              expect="unsupported"))
    for p in REFUSED])
def test_what_is_not_built_is_refused_at_start_up(tiny_v4, feature, kwargs, match,
                                                  record_property):
    with pytest.raises(ValueError, match=match) as err:
        LLM(tiny_v4, max_model_len=64, num_kv_blocks=8, **kwargs)
    record_property(DETAIL_PROPERTY, str(err.value))


def test_server_answers_equal_the_offline_engine(tiny_v4, reference):
    """`pdkv serve` on tiny-v4: two concurrent completions (token-id prompts, greedy) give the
    offline engine's text, whose tokens equal transformers' (the parity test above)."""
    import os
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serve"))
    from server_utils import RemoteServer

    offline = LLM(tiny_v4, max_model_len=256, num_kv_blocks=64)
    outs = offline.generate([{"prompt_token_ids": p} for p in prompts()[1:]], PARAMS)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference[1:]
    with RemoteServer(["serve", "--model", tiny_v4, "--served-model-name", "tiny-v4",
                       "--max-model-len", "256", "--num-kv-blocks", "64"]) as srv:
        def ask(p: list[int]) -> str:
            r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "model": "tiny-v4", "prompt": p, "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        with ThreadPoolExecutor(2) as pool:
            texts = list(pool.map(ask, prompts()[1:]))
    assert texts == [o.outputs[0].text for o in outs]
