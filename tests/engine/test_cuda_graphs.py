"""Decode CUDA graphs (pdkv/worker/cuda_graphs.py): capture sizes and padding (pure), the padded
static-buffer decode path run eagerly on the CPU inside the host-sync guard (what a graph would
capture) giving the ordinary path's tokens, and on CUDA graph replay vs --enforce-eager."""

from __future__ import annotations

import pytest
import torch

from pdkv import LLM, SamplingParams
from pdkv.worker.cuda_graphs import capture_sizes, pad_rows, padded_size

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_capture_sizes_follow_vllm_defaults_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    big = capture_sizes(1000)
    assert (
        big[:5] == [1, 2, 4, 8, 16]
        and big[-1] == 512
        and 248 in big
        and 264 not in big
        and 272 in big
    )
    assert capture_sizes(128, max_capture_size=20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_padded_size_is_the_smallest_captured_size_that_fits():
    sizes = capture_sizes(32)
    assert [padded_size(b, sizes) for b in (1, 2, 3, 4, 5, 8, 9, 17, 32)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        24,
        32,
    ]
    assert padded_size(33, sizes) is None
    assert pad_rows([3, 7], 4) == [3, 7, 7, 7]
    with pytest.raises(ValueError):
        pad_rows([1, 2, 3], 2)


def _engine(path: str, **kw) -> LLM:
    return LLM(
        path,
        cpu_linear="torch",
        attention_backend="torch",
        num_kv_blocks=64,
        max_model_len=96,
        max_num_seqs=8,
        **kw,
    )


PROMPTS = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in (21, 9, 35, 17, 40)]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    """Batches of 1, 3 and 5 requests: decode steps of 1, 3 (padded to 4) and 5 (to 8) rows."""
    got = []
    for batch in (PROMPTS[:1], PROMPTS[1:4], PROMPTS):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], PARAMS)
        got += [list(o.outputs[0].token_ids) for o in outs]
    return got


@pytest.mark.parametrize("name", ["tiny_llama_kv2", "tiny_mla"])
def test_padded_static_decode_path_matches_the_eager_path(name, request):
    """Decode steps go through DecodeGraphs (padded to 1, 2, 4 or 8 rows, tables padded to
    max_model_len) with no host read inside; greedy tokens equal the ordinary path's."""
    from pdkv.model.host_sync import HostSyncGuard
    from pdkv.worker.cuda_graphs import DecodeGraphs

    path = request.getfixturevalue(name)
    llm = _engine(path, enable_prefix_caching=False)  # the second run recomputes every prompt
    want = _tokens(llm)
    runner = llm.llm_engine.runner
    assert runner.decode_graphs is None or runner.device.type == "cuda"  # the CPU is always eager
    sizes_run: list[int] = []

    def guarded(*args):
        sizes_run.append(args[0].shape[0])
        with HostSyncGuard():
            return runner.model(*args)

    runner.decode_graphs = DecodeGraphs(
        guarded,
        runner.kv_caches,
        len(runner.kv_cache_config.groups),
        runner.block_size,
        96,
        capture_sizes(8),
        runner.device,
        use_graphs=False,
    )
    assert _tokens(llm) == want
    assert {1, 4, 8} <= set(sizes_run) and set(sizes_run) <= {1, 2, 4, 8}  # padded sizes only
    llm.llm_engine.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replay_matches_enforce_eager(tiny_llama_kv2):
    kw = {"device": "cuda", "num_kv_blocks": 64, "max_model_len": 96, "max_num_seqs": 8}
    eager = LLM(tiny_llama_kv2, enforce_eager=True, **kw)
    assert eager.llm_engine.runner.decode_graphs is None
    want = _tokens(eager)
    graphed = LLM(tiny_llama_kv2, **kw)
    graphs = graphed.llm_engine.runner.decode_graphs
    assert graphs is not None
    assert _tokens(graphed) == want
    assert graphs.graphs  # some sizes were captured and replayed
