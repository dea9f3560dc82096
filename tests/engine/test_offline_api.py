"""vLLM's offline API habits: LLM(gpu_memory_utilization=..., enforce_eager=...), a progress bar
by default, metrics.finished_time on every way a request can finish."""

from __future__ import annotations

import inspect

import pytest

from pdkv import LLM, SamplingParams
from pdkv.worker.memory import free_memory_bytes

pytestmark = pytest.mark.slow

TARGET_BLOCKS = 64


@pytest.fixture(scope="module")
def llm():
    import torch

    # A utilization that gives ~TARGET_BLOCKS blocks of this box's available RAM (0.75 MiB each).
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4  # layers x K/V x block x kv heads x head size x fp32
    util = TARGET_BLOCKS * block_bytes / free_memory_bytes(torch.device("cpu"))
    return LLM("smollm2", max_model_len=256, gpu_memory_utilization=util, enforce_eager=True)


def test_offline_api_like_vllm(llm, capfd):
    blocks = llm.llm_engine.runner.kv_cache_config.num_blocks
    assert TARGET_BLOCKS // 2 <= blocks <= TARGET_BLOCKS * 2  # RAM use moves a little meanwhile
    assert inspect.signature(LLM.chat).parameters["use_tqdm"].default is True
    prompt = "The history of the bicycle begins in the early nineteenth century, when"
    outs = llm.generate([prompt, prompt], [
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),  # length
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[" "]),  # stop string
    ])
    assert "Processed prompts: 100%" in capfd.readouterr().err  # use_tqdm defaults to True
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "stop"]
    for o in outs:
        m = o.metrics
        assert m is not None and m.finished_time is not None
        assert m.last_token_time is not None and m.finished_time >= m.last_token_time
