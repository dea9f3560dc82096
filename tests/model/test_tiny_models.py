"""tiny-llama-kv1 / tiny-llama-kv2 / tiny-mla / tiny-gdn / tiny-kda-mla (pdkv/model/tiny.py):
pdkv's greedy output equals HF transformers' on the same folder (plain, chunked prefill,
prefix-cache resend); HF's greedy margins stay well above fp32 rounding; the folder is built once,
also when two resolvers race."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from pdkv import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT_LENS = (15, 16, 17, 33, 60)
NEW_TOKENS = 12
BLOCK = 16
# Smallest allowed top-1 minus top-2 logit at any greedy step (absolute, in logits) ...
MARGIN_MIN = 5e-3
# ... and as a multiple of how far fp32 logits are from fp64 ones on the same prompt, a stand-in for
# the rounding that a tp / dcp reduction order changes.
MARGIN_OVER_ROUNDING = 20.0  # measured: >= 40x (pdkv/model/tiny.py)
NAMES = ("tiny-llama-kv1", "tiny-llama-kv2", "tiny-mla", "tiny-gdn", "tiny-kda-mla")
# Support matrix cells the parity test verifies per model (and the hybrid-state row of its state).
HYBRID_ROWS = {"tiny-mla": ("hybrid-mla",), "tiny-gdn": ("hybrid-linear",),
               "tiny-kda-mla": ("hybrid-mla", "hybrid-linear")}
PARITY = [
    pytest.param(
        n,
        marks=pytest.mark.matrix(
            "colocated", "chunked-prefill", "prefix-caching", *HYBRID_ROWS.get(n, ()), model=n
        ),
    )
    for n in NAMES
]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def folders(tiny_llama_kv1, tiny_llama_kv2, tiny_mla, tiny_gdn, tiny_kda_mla) -> dict[str, str]:
    return {
        "tiny-llama-kv1": tiny_llama_kv1,
        "tiny-llama-kv2": tiny_llama_kv2,
        "tiny-mla": tiny_mla,
        "tiny-gdn": tiny_gdn,
        "tiny-kda-mla": tiny_kda_mla,
    }


@pytest.fixture(scope="module")
def hf_runs(folders, prompts) -> dict[str, list[dict[str, Any]]]:
    """Per model and prompt: HF greedy tokens (EOS not stopping, as ignore_eos), each step's
    top-1 minus top-2 logit, and the largest |fp32 - fp64| logit over those steps."""
    import torch
    from transformers import AutoModelForCausalLM

    runs: dict[str, list[dict[str, Any]]] = {}
    for name, folder in folders.items():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        model64 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
        runs[name] = []
        for p in prompts:
            with torch.inference_mode():
                out = model.generate(
                    torch.tensor([p]),
                    attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
                logits = torch.stack(out.logits)[:, 0].double()
                seq = out.sequences[:, :-1]
                ref64 = model64(seq).logits[0, len(p) - 1:]
            top2 = logits.topk(2, dim=-1).values
            runs[name].append({"tokens": out.sequences[0, len(p):].tolist(),
                               "margins": (top2[:, 0] - top2[:, 1]).tolist(),
                               "rounding": (logits - ref64).abs().max().item()})
    return runs


def tokens(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("name", PARITY)
def test_greedy_matches_hf_plain_chunked_and_cached(name, folders, prompts, hf_runs):
    ref = [r["tokens"] for r in hf_runs[name]]
    plain = LLM(folders[name], cpu_linear="torch", num_kv_blocks=64, max_model_len=128)
    assert tokens(plain, prompts)[0] == ref
    # A budget of 8 tokens a step: every prompt takes 2..8 prefill chunks.
    chunked = LLM(folders[name], cpu_linear="torch", num_kv_blocks=64, max_model_len=128,
                  max_num_batched_tokens=8)
    assert tokens(chunked, prompts)[0] == ref
    again, cached = tokens(chunked, prompts)
    assert again == ref
    # tiny-gdn / tiny-kda-mla: the linear state resumes from the checkpoint at the hit's block
    # boundary
    assert cached == [(len(p) - 1) // BLOCK * BLOCK for p in prompts]
    for pool in chunked.llm_engine.scheduler.kv_cache_manager.block_pools:  # every group: no leak
        assert pool.num_free_blocks == pool.num_usable_blocks


@pytest.mark.parametrize("name", NAMES)
def test_greedy_margins_are_not_razor_thin(name, hf_runs):
    for run in hf_runs[name]:
        assert len(run["margins"]) == NEW_TOKENS
        assert min(run["margins"]) >= MARGIN_MIN, run
        assert min(run["margins"]) >= MARGIN_OVER_ROUNDING * run["rounding"], run


def test_config_has_the_documented_shape(folders):
    import json

    for name, kv_heads in (("tiny-llama-kv1", 1), ("tiny-llama-kv2", 2)):
        with open(os.path.join(folders[name], "config.json")) as f:
            cfg = json.load(f)
        assert (
            cfg["num_hidden_layers"],
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
        ) == (4, 4, kv_heads)
        assert (cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]) == (128, 32, 256)
        assert (cfg["vocab_size"], cfg["max_position_embeddings"], cfg["tie_word_embeddings"]) == (
            49152,
            8192,
            True,
        )
        assert os.path.isfile(os.path.join(folders[name], "tokenizer.json"))


def test_second_resolve_reuses_the_folder(tiny_llama_cache, tiny_llama_kv1, monkeypatch):
    import pdkv.model.tiny as tiny
    from pdkv.model.registry import resolve_model

    def no_build(*args: object) -> None:
        raise AssertionError("rebuilt")

    mtimes = {
        f: os.stat(os.path.join(tiny_llama_kv1, f)).st_mtime_ns for f in os.listdir(tiny_llama_kv1)
    }
    monkeypatch.setenv("PDKV_CACHE", tiny_llama_cache)
    monkeypatch.setattr(tiny, "build_tiny_llama", no_build)
    assert resolve_model("tiny-llama-kv1") == tiny_llama_kv1
    assert {
        f: os.stat(os.path.join(tiny_llama_kv1, f)).st_mtime_ns for f in os.listdir(tiny_llama_kv1)
    } == mtimes


def test_racing_resolvers_build_once(tmp_path, model_path, monkeypatch):
    """A fake builder starts a second resolver while it holds the lock; that one must wait and
    then return the first one's folder without building again."""
    import pdkv.model.tiny as tiny
    from pdkv.model.registry import resolve_model

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / os.path.basename(model_path)).symlink_to(model_path)
    monkeypatch.setenv("PDKV_CACHE", str(tmp_path))
    builds: list[str] = []
    second: dict[str, str] = {}
    racer = threading.Thread(target=lambda: second.update(path=resolve_model("tiny-llama-kv2")))

    def fake_build(spec: tiny.TinyLlamaSpec, out_dir: str, tokenizer_dir: str) -> None:
        builds.append(out_dir)
        if len(builds) == 1:
            racer.start()
            racer.join(timeout=1.0)  # blocked on the lock: still running after the timeout
            assert racer.is_alive(), "the second resolver did not wait for the first build"
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{}")

    monkeypatch.setattr(tiny, "build_tiny_llama", fake_build)
    first = resolve_model("tiny-llama-kv2")
    racer.join(timeout=30)
    assert not racer.is_alive()
    assert len(builds) == 1
    assert second["path"] == first == str(tmp_path / "models" / "tiny-llama-kv2")
    assert sorted(os.listdir(tmp_path / "models")) == sorted(
        [os.path.basename(model_path), "tiny-llama-kv2", "tiny-llama-kv2.lock"]
    )  # no temp folder left
