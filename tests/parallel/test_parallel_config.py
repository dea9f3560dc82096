"""Start-up checks of TP/DCP configurations (issue 10, acceptance 5): with any KV connector the
DCP interleave must equal the block size; the interleave must divide the block size; vLLM-mode
DCP must divide TP. Refused before any weight loads or worker starts, naming the values."""

from __future__ import annotations

import json

import pytest

from pdkv.cli import main
from pdkv.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, ParallelConfig

P2P = {"kv_connector": "P2PConnector", "kv_role": "kv_consumer"}
POOL = {"kv_connector": "KVPoolConnector", "kv_role": "kv_both"}


def refused(capsys, argv: list[str]) -> str:
    assert main(["generate", "--prompt", "hi", "--max-tokens", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: "), err
    return err


@pytest.mark.parametrize("connector", [P2P, POOL], ids=["p2p", "pool"])
def test_interleave_other_than_block_size_with_a_connector_is_refused(
    capsys, model_path, connector
):
    err = refused(capsys, ["--model", model_path, "-dcp", "2", "--block-size", "16",
                           "--kv-transfer-config", json.dumps(connector)])
    assert "cp_kv_cache_interleave_size=1 must equal block_size=16" in err
    assert "--cp-kv-cache-interleave-size 16" in err


def test_interleave_equal_to_block_size_with_a_connector_is_accepted():
    cfg = EngineConfig(
        ModelConfig(model="m", path="/m"),
        CacheConfig(block_size=16),
        parallel_config=ParallelConfig(
            decode_context_parallel_size=2, cp_kv_cache_interleave_size=16
        ),
        kv_transfer_config=KVTransferConfig(**P2P),
    )
    assert cfg.scheduler_block_size == 32 and cfg.parallel_config.world_size == 2


def test_interleave_must_divide_the_block_size():
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size=5 must divide block_size=16"):
        EngineConfig(
            ModelConfig(model="m", path="/m"),
            CacheConfig(block_size=16),
            parallel_config=ParallelConfig(
                decode_context_parallel_size=2, cp_kv_cache_interleave_size=5
            ),
        )


def test_dcp_mode_and_world_size():
    assert ParallelConfig(decode_context_parallel_size=2).dcp_replicated  # tp 1: replicated weights
    vllm = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2)
    assert not vllm.dcp_replicated and vllm.world_size == 2
    both = ParallelConfig(
        tensor_parallel_size=2, decode_context_parallel_size=2, dcp_replicate_weights=True
    )
    assert both.world_size == 4
    with pytest.raises(ValueError, match="must divide tensor_parallel_size=3"):
        ParallelConfig(tensor_parallel_size=3, decode_context_parallel_size=2)


def test_a_dcp_pool_too_small_for_one_request_is_refused_before_workers_start(
    capsys, tiny_llama_kv2
):
    err = refused(
        capsys,
        ["--model", tiny_llama_kv2, "-dcp", "2", "--num-kv-blocks", "8", "--max-model-len", "512"],
    )
    assert (
        "KV cache of 8 blocks x 16 tokens x 2 DCP ranks cannot hold one request of "
        "max_model_len=512"
        in err
    )
    assert "Traceback" not in err and "WorkerDiedError" not in err


def test_a_pool_chunk_that_is_not_a_whole_number_of_dcp_logical_blocks_is_refused(
    capsys, tiny_llama_kv2
):
    """At dcp 2 and block 16 the scheduler's block is 32 tokens: a 48-token chunk fits the
    physical block but not the logical one, and is refused at start-up (not at the first
    request)."""
    pool = {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_size": 48}}
    err = refused(capsys, ["--model", tiny_llama_kv2, "-dcp", "2", "--block-size", "16",
                           "--cp-kv-cache-interleave-size", "16",
                           "--kv-transfer-config", json.dumps(pool)])
    assert "chunk_size 48 must be a multiple of the block size 32" in err
    assert "Traceback" not in err and "WorkerDiedError" not in err


@pytest.mark.parametrize(("model", "kind"), [("tiny_swa", "sliding_window"), ("tiny_mla", "mla"),
                                             ("tiny_gdn", "linear_state")])
def test_the_pool_on_a_hybrid_model_with_worker_processes_is_refused_before_workers_start(
    capsys, request, model, kind
):
    pool = {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_size": 64}}
    path = request.getfixturevalue(model)  # built on first use (its progress bar: dropped)
    capsys.readouterr()
    err = refused(capsys, ["--model", path, "-tp", "2", "--kv-transfer-config", json.dumps(pool)])
    assert "supports full-attention KV cache groups only so far" in err and kind in err
    assert "Traceback" not in err and "WorkerDiedError" not in err


def test_group_kinds_are_the_kinds_the_kv_cache_gets(tiny_swa, tiny_mla, tiny_gdn, tiny_llama_kv2):
    from pdkv.model.arch_config import LlamaArchConfig
    from pdkv.parallel.layout import ParallelLayout
    from pdkv.worker.kv_cache import KVCacheSizing, group_kinds, make_kv_cache_config

    sizing = KVCacheSizing(block_size=16, dtype="float32", max_model_len=256, cache_dtype="auto",
                           num_kv_blocks=64, kv_cache_memory_bytes=0, layout=ParallelLayout())
    for path in (tiny_swa, tiny_mla, tiny_gdn, tiny_llama_kv2):
        arch = LlamaArchConfig.from_hf_folder(path)
        built = {g.spec.kind for g in make_kv_cache_config(arch, sizing).groups}
        assert group_kinds(arch) == built, path
