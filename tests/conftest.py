"""Shared fixtures: the real model (SmolLM2), its tokenizer, chat prompts and HF references."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

NUM_NEW_TOKENS = 40


def pytest_configure(config: pytest.Config) -> None:
    """On a pytest-xdist worker: one torch thread in this process, and $PDKV_NUM_THREADS=1
    (unless set) for the servers tests start, so N workers on N cores do not oversubscribe."""
    if hasattr(config, "workerinput"):
        import torch

        torch.set_num_threads(1)
        os.environ.setdefault("PDKV_NUM_THREADS", "1")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook (which pytest 9.2 defeats, see set_group)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a `--dist loadgroup` xdist worker, put every item in its group (tests/xdist_groups.py):
    a module's tests stay on one worker, and so do the modules sharing an expensive session
    fixture. Serial runs (and the pytest that `pdkv matrix` starts) are left alone."""
    if getattr(config.option, "loadgroup", False):  # set by xdist on its workers
        from xdist_groups import assign_groups

        assign_groups(items)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the schema fuzzing case counts the tests recorded (`record_property("schema_fuzz",
    line)`; it travels with the report from an xdist worker)."""
    lines = [str(value) for reports in terminalreporter.stats.values() for r in reports
             if getattr(r, "when", "") == "call"
             for name, value in getattr(r, "user_properties", ()) if name == "schema_fuzz"]
    if lines:
        terminalreporter.section("schema fuzzing")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def model_path() -> str:
    from pdkv.model.registry import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def parity_prompts(hf_tokenizer) -> list[list[int]]:
    from prompts import parity_prompts as build

    return build(hf_tokenizer)


@pytest.fixture(scope="session")
def hf_model(model_path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers greedy continuation of one prompt (batch 1, no padding)."""
    import torch

    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def hf_reference(hf_model, parity_prompts) -> list[list[int]]:
    """HF greedy outputs (NUM_NEW_TOKENS tokens, EOS included when reached) per prompt."""
    return [hf_greedy(hf_model, p, NUM_NEW_TOKENS) for p in parity_prompts]


@pytest.fixture(scope="session")
def smollm2_reference():
    """One colocated SmolLM2 engine (256 blocks of 16 tokens, max_model_len 1024) whose outputs the
    P/D and server tests compare against, loaded once per session. Tests only generate on it."""
    from pdkv import LLM

    llm = LLM("smollm2", num_kv_blocks=256, max_model_len=1024)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="session")
def parity_reference_24(smollm2_reference, parity_prompts) -> list:
    """The colocated engine's greedy RequestOutputs (24 new tokens) for parity_prompts."""
    from pdkv import SamplingParams

    return smollm2_reference.generate([{"prompt_token_ids": p} for p in parity_prompts],
                                      SamplingParams(temperature=0, max_tokens=24))


def assert_no_leak(llm) -> None:
    """Every block of every group is free again (ref counts all 0)."""
    kv = llm.llm_engine.scheduler.kv_cache_manager
    for pool in kv.block_pools:
        assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
        assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.fixture(scope="session")
def tiny_llama_cache(tmp_path_factory, model_path) -> str:
    """A session-private $PDKV_CACHE holding the tiny Llamas (the user's cache is left alone);
    smollm2's converted folder is linked in, so building them copies its tokenizer, not converts."""
    cache = tmp_path_factory.mktemp("pdkv-cache")
    (cache / "models").mkdir()
    (cache / "models" / os.path.basename(model_path)).symlink_to(model_path)
    return str(cache)


def _build_tiny(cache: str, name: str) -> str:
    from pdkv.model.registry import resolve_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDKV_CACHE", cache)
        return resolve_model(name)


@pytest.fixture(scope="session")
def tiny_llama_kv1(tiny_llama_cache) -> str:
    """Folder of `tiny-llama-kv1` (4 q heads, 1 KV head; pdkv/model/tiny.py), built once per
    session."""
    return _build_tiny(tiny_llama_cache, "tiny-llama-kv1")


@pytest.fixture(scope="session")
def tiny_llama_kv2(tiny_llama_cache) -> str:
    """Folder of `tiny-llama-kv2` (4 q heads, 2 KV heads; pdkv/model/tiny.py), built once per
    session."""
    return _build_tiny(tiny_llama_cache, "tiny-llama-kv2")


@pytest.fixture(scope="session")
def tiny_swa(tiny_llama_cache) -> str:
    """Folder of `tiny-swa` (tiny-llama-kv2's shape as a Qwen2 whose layers alternate sliding
    window 40 / full attention; pdkv/model/tiny.py), built once per session."""
    return _build_tiny(tiny_llama_cache, "tiny-swa")


@pytest.fixture(scope="session")
def tiny_mla(tiny_llama_cache) -> str:
    """Folder of `tiny-mla` (DeepSeek-V3-style MLA, 4 heads, latent 48 + rope 16, dense MLPs;
    pdkv/model/tiny.py), built once per session."""
    return _build_tiny(tiny_llama_cache, "tiny-mla")


@pytest.fixture(scope="session")
def tiny_gdn(tiny_llama_cache) -> str:
    """Folder of `tiny-gdn` (Qwen3-Next-style: Gated DeltaNet linear attention and gated full
    attention alternating, dense MLPs; pdkv/model/tiny.py), built once per session."""
    return _build_tiny(tiny_llama_cache, "tiny-gdn")


@pytest.fixture(scope="session")
def tiny_kda_mla(tiny_llama_cache) -> str:
    """Folder of `tiny-kda-mla` (Kimi-Linear-style: KDA linear attention and MLA alternating,
    dense MLPs; pdkv/model/tiny.py), built once per session."""
    return _build_tiny(tiny_llama_cache, "tiny-kda-mla")


@pytest.fixture(scope="session")
def tiny_v4(tiny_llama_cache) -> str:
    """Folder of `tiny-v4` (DeepSeek-V4-style: sliding / CSA / HCA / CSA attention, MoE with a
    hash-routed first layer, mHC; pdkv/model/tiny.py), built once per session."""
    return _build_tiny(tiny_llama_cache, "tiny-v4")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread while a module's tests run (a model this small only loses to thread
    hand-offs on a busy machine); the previous count is restored for the rest of the session.
    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)



@pytest.fixture(scope="module")
def cpu_ops() -> None:
    """pdkv's C++ CPU ops loaded into this process (paged decode / prefill attention, fused small
    ops: pdkv/model/paged_decode_build.py); skips without a C++ compiler (the engine then falls
    back to the torch paths; under CI=true that fails: CI installs one)."""
    from system_packages import require

    from pdkv.model.paged_decode_build import load

    require("g++", "python3-dev")
    why = load()
    assert why is None, why
