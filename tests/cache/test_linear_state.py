"""Linear-state KV cache groups (Gated DeltaNet): one state slot per request whatever its length,
freed at finish / preemption, never a prefix hit without checkpoints; with prefix caching a
checkpoint slot per block and hits that end on a cached checkpoint; the worker's per-request
source slot and segments; the group's spec, byte layout and the start-up
refusals of what is not built for it (pdkv/cache/specs.py LinearStateSpec,
single_type_manager.py LinearStateManager, pdkv/worker/kv_cache.py, connector factory)."""

from __future__ import annotations

import dataclasses

import pytest

from pdkv.cache.kv_cache_manager import KVCacheManager
from pdkv.cache.single_type_manager import LinearStateManager
from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, LinearStateSpec
from pdkv.request import Request
from pdkv.sampling_params import SamplingParams

BS = 4
LINEAR = LinearStateSpec(
    BS, conv_shape=(256, 3), recurrent_shape=(4, 32, 32), conv_dtype="bfloat16"
)


def make_manager(num_blocks: int = 16, caching: bool = False) -> KVCacheManager:
    groups = (KVCacheGroupSpec((1, 3), FullAttentionSpec(BS, num_kv_heads=2, head_size=32)),
              KVCacheGroupSpec((0, 2), LINEAR))
    return KVCacheManager(KVCacheConfig(num_blocks, groups), caching, 1 << 12)


def make_request(rid: str, n: int) -> Request:
    return Request(rid, [(i * 31 + 7) % 1000 for i in range(n)], SamplingParams(max_tokens=4), BS)


def test_spec_bytes_follow_the_formula():
    assert LINEAR.kind == "linear_state"
    assert LINEAR.conv_bytes == 256 * 3 * 2
    assert LINEAR.page_size_bytes == 256 * 3 * 2 + 4 * 32 * 32 * 4  # independent of block_size
    assert dataclasses.replace(LINEAR, block_size=64).page_size_bytes == LINEAR.page_size_bytes


def test_one_slot_per_request_whatever_its_length_freed_at_finish():
    mgr = make_manager()
    lin = mgr.managers[1]
    assert isinstance(lin, LinearStateManager)
    free0 = mgr.block_pools[1].num_free_blocks
    a, b = make_request("a", 30), make_request("b", 3)
    for req, chunks in ((a, (8, 8, 8, 6)), (b, (3,))):
        for k in chunks:
            assert mgr.allocate_slots(req, k) is not None
            req.num_computed_tokens += k
            assert len(lin.req_to_blocks[req.request_id]) == 1
    for _ in range(10):  # decodes: the slot stays, full attention grows
        a.append_output_token_ids([5])
        assert mgr.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    ids = mgr.get_block_ids("a")
    assert len(ids[1]) == 1 and len(ids[0]) == -(-a.num_tokens // BS)
    assert ids[1] != mgr.get_block_ids("b")[1]
    assert mgr.block_pools[1].num_free_blocks == free0 - 2
    mgr.free(a)
    mgr.free(b)  # finish and preemption both free through here
    assert mgr.block_pools[1].num_free_blocks == free0


def prefill(mgr: KVCacheManager, req: Request, chunk: int = 8) -> None:
    while req.num_computed_tokens < req.num_tokens:
        k = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert mgr.allocate_slots(req, k) is not None
        req.num_computed_tokens += k


def test_checkpoints_one_slot_per_block_and_a_hit_ends_on_a_cached_checkpoint():
    mgr = make_manager(caching=True)
    first = make_request("a", 21)
    prefill(mgr, first)
    lin = mgr.managers[1]
    assert len(lin.req_to_blocks["a"]) == 6  # a slot per block: the state at every block end
    assert sum(b.block_hash is not None for b in lin.req_to_blocks["a"]) == 5  # full blocks
    mgr.free(first)
    again = make_request("b", 21)
    hits, num = mgr.get_computed_blocks(again)
    assert num == 20  # capped at num_tokens - 1: the checkpoint after block 4
    assert [b.is_null for b in hits.blocks[1]] == [True] * 4 + [False]
    assert hits.blocks[1][4].block_hash == again.block_hashes[4]
    # a prompt that diverges inside block 2 resumes from the checkpoint after block 1
    tokens = list(again.all_token_ids)
    tokens[10] += 1
    other = Request("c", tokens, SamplingParams(max_tokens=4), BS)
    assert mgr.get_computed_blocks(other)[1] == 8
    # after the shared checkpoint the hit request writes only new slots
    new = mgr.allocate_slots(again, 1, hits, num)
    assert new is not None and len(new.blocks[1]) == 1 and not new.blocks[1][0].is_null
    mgr.free(again)


def test_without_checkpoints_a_hybrid_model_never_hits():
    mgr = make_manager()
    lin = mgr.managers[1]
    first = make_request("a", 21)
    prefill(mgr, first)
    assert len(lin.req_to_blocks["a"]) == 1
    mgr.free(first)
    assert lin.find_longest_cache_hit(make_request("b", 21).block_hashes, 20) == []
    assert all(b.block_hash is None for b in mgr.block_pools[1].blocks)  # no slot was ever cached


def test_linear_state_metadata_reads_the_state_before_and_writes_every_block_end():
    from pdkv.worker.attn_metadata import build_linear_state_metadata

    one_slot = build_linear_state_metadata([(0, 9, 0, [7]), (9, 1, 30, [7])], BS)
    assert one_slot.requests == ((0, 9, -1, ((9, 7),)), (9, 1, 7, ((1, 7),)))
    table = [10, 11, 12, 13, 14, 15, 16]
    meta = build_linear_state_metadata([(3, 20, 5, table), (23, 1, 8, table)], BS)
    # tokens 5..24: state after 5 tokens is in block 1's slot; writes at 8, 12, 16, 20, 24, 25
    assert meta.requests[0] == (3, 20, 11, ((3, 11), (4, 12), (4, 13), (4, 14), (4, 15), (1, 16)))
    # a decode that starts a new block reads the checkpoint of the previous one
    assert meta.requests[1] == (23, 1, 11, ((1, 12),))


def test_make_kv_cache_config_puts_the_linear_group_last_and_counts_its_slot(tiny_gdn):
    import torch

    from pdkv.model.arch_config import LlamaArchConfig
    from pdkv.parallel.layout import ParallelLayout
    from pdkv.worker.kv_cache import KVCacheSizing, allocate_kv_cache, make_kv_cache_config

    def sizing(**kw: object) -> KVCacheSizing:
        return KVCacheSizing(block_size=16, dtype="float32", max_model_len=128, **kw)

    arch = LlamaArchConfig.from_hf_folder(tiny_gdn)
    cfg = make_kv_cache_config(arch, sizing(num_kv_blocks=9))
    assert [g.layer_indices for g in cfg.groups] == [(1, 3), (0, 2)]
    spec = cfg.groups[1].spec
    assert isinstance(spec, LinearStateSpec)
    assert spec.conv_shape == (2 * 2 * 32 + 4 * 32, 3) and spec.recurrent_shape == (4, 32, 32)
    assert cfg.block_bytes(1) == 2 * (256 * 3 * 4 + 4 * 32 * 32 * 4)
    groups, views = allocate_kv_cache(cfg, torch.float32, torch.device("cpu"))
    assert groups[1].dtype == torch.uint8 and tuple(groups[1].shape) == (9, 2, spec.page_size_bytes)
    # one contiguous row per slot: what P/D and the pool would move
    assert groups[1][3].is_contiguous() and views[0].data_ptr() == groups[1].data_ptr()
    budget = make_kv_cache_config(
        arch, sizing(kv_cache_memory_bytes=10 * (cfg.block_bytes(0) + cfg.block_bytes(1))))
    assert budget.num_blocks == 10
    # 128 tokens = 8 blocks of 16, plus the linear pool's null block
    with pytest.raises(
        ValueError, match=r"cannot hold one request of max_model_len=128 tokens \(9 blocks\)"
    ):
        make_kv_cache_config(arch, sizing(num_kv_blocks=8))
    with pytest.raises(
        ValueError, match="decode_context_parallel_size=2 is not supported with linear-attention"
    ):
        make_kv_cache_config(arch, sizing(
            num_kv_blocks=8, layout=ParallelLayout(dcp_size=2, dcp_replicated=True)))


def test_connectors_refuse_a_linear_state_group():
    from pdkv.config import KVTransferConfig
    from pdkv.kv_transfer.connector.base import KVConnectorRole
    from pdkv.kv_transfer.connector.factory import create_connector
    from pdkv.kv_transfer.connector.spec import CONNECTORS, connector_spec

    cfg = make_manager().config
    for name in CONNECTORS:
        if name in (
            "P2PConnector",
            "KVPoolConnector",
        ):  # they move the state slot (test_pd_gdn.py, test_pool_gdn_engine.py)
            continue
        with pytest.raises(ValueError, match="does not move per-request state slots"):
            create_connector(
                connector_spec(KVTransferConfig(
                    kv_connector=name, kv_role="kv_both", kv_connector_extra_config=(
                        {"connectors": [{"kv_connector": "P2PConnector"}]}
                        if name == "MultiConnector" else {})), 16),
                KVConnectorRole.SCHEDULER,
                cfg,
                {},
                {},
            )
