"""KVPoolConnector in TP and DCP engines (issue 31, acceptance 1 and 2): each rank stores and loads
its own shard of every chunk under its rank's namespace; cold then hot is token-identical to a
single rank without a pool; each rank writes exactly its share of the KV (half at tp 2 or dcp 2,
read from the stored values themselves); a chunk one rank lost is a miss for every rank, counted
in "pool:all:rank_misses", recomputed and stored again.

Reference: the single-rank engine without a pool (greedy). Block 16, chunk 64: at dcp 2 the
logical block is 32 tokens, so a chunk is 2 logical blocks, 32 tokens on each rank.
"""

from __future__ import annotations

import json
import struct
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pdkv import LLM, SamplingParams
from pdkv.kvpool.codec import ChunkHeader

pytestmark = pytest.mark.slow  # worker processes

BLOCK, CHUNK = 16, 64
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LENS = (130, 150)  # 2 loadable chunks each: 128 tokens
DCP2 = {"decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": BLOCK}
TP2 = {"tensor_parallel_size": 2}


def prompts(lens: tuple[int, ...] = LENS) -> list[list[int]]:
    return [[(i * 7919 + 13 * n) % 30000 + 100 for i in range(n)] for n in lens]


def engine(model: str, tiers: list[dict[str, Any]] | None = None, **kw: Any) -> LLM:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_model_len", 512)
    if tiers is not None:
        kw["kv_transfer_config"] = json.dumps({
            "kv_connector": "KVPoolConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_size": CHUNK, "tiers": tiers}})
    return LLM(model, cpu_linear="torch", block_size=BLOCK, **kw)


def run(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


_REFERENCE: dict[str, list[list[int]]] = {}


def reference(model: str) -> list[list[int]]:
    if model not in _REFERENCE:
        llm = engine(model)
        try:
            _REFERENCE[model] = run(llm, prompts())
        finally:
            llm.llm_engine.shutdown()
    return _REFERENCE[model]


def kv_bytes_per_token(model: str) -> int:
    """Bytes of one token's KV over all layers (K and V, every KV head, fp32)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4


def payload_bytes(value: bytes) -> int:
    """The KV bytes in a stored value (its header's group lengths; `pdkv.kvpool.codec`)."""
    (n,) = struct.unpack_from("<I", value, 4)
    header = msgspec.msgpack.decode(value[8 : 8 + n], type=ChunkHeader)
    return sum(header.group_lengths)


def by_rank(entries: dict[str, bytes]) -> dict[str, dict[str, int]]:
    """{fingerprint: {chunk hash: payload bytes}} of stored values keyed "pdkv:<fp>:<hash>"."""
    out: dict[str, dict[str, int]] = defaultdict(dict)
    for key, value in entries.items():
        _, fp, h = key.split(":")
        out[fp][h] = payload_bytes(value)
    return dict(out)


def disk_entries(path: Path) -> dict[str, bytes]:
    """Stored values by key (the disk tier's files are named pdkv_<fp>_<hash>.kv)."""
    return {"pdkv:" + f.stem.removeprefix("pdkv_").replace("_", ":"): f.read_bytes()
            for f in path.iterdir() if f.name.startswith("pdkv_") and f.suffix == ".kv"}


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Poll `cond` until true (the ranks' stores write on their own threads)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.05)


def reset_local(llm: LLM) -> None:
    assert llm.llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()


def assert_blocks_free(llm: LLM) -> None:
    for pool in llm.llm_engine.scheduler.kv_cache_manager.block_pools:
        assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    assert not llm.llm_engine.has_unfinished_requests()


def check_shards(stored: dict[str, dict[str, int]], per_token: int) -> None:
    """Two ranks, each holding every chunk (4), each chunk's shard half of its KV."""
    assert len(stored) == 2, f"one namespace per rank, got {sorted(stored)}"
    a, b = stored.values()
    assert set(a) == set(b) and len(a) == 2 * len(LENS)
    for shard in (a, b):
        assert all(n == CHUNK * per_token // 2 for n in shard.values()), shard


KV2 = "tiny-llama-kv2"
LAYOUTS = [pytest.param(DCP2, id="dcp2", marks=pytest.mark.matrix("dcp-pool", model=KV2)),
           pytest.param(TP2, id="tp2", marks=pytest.mark.matrix("tp-pool", model=KV2))]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dram_pool_cold_then_hot_each_rank_writing_its_half(tiny_llama_kv2, layout):
    """Each rank's DRAM tier lives in its own process: the lookups reach it only through the
    rank's lookup server."""
    want = reference(tiny_llama_kv2)
    llm = engine(tiny_llama_kv2, [{"name": "dram", "capacity_bytes": 1 << 26}], **layout)
    try:
        assert run(llm, prompts()) == want
        reset_local(llm)
        assert run(llm, prompts()) == want
        stats = llm.llm_engine.scheduler.kv_stats
        assert stats["pool:all:hit_tokens"] == 2 * 128
        # 4 chunks, each stored as two halves (one per rank): the KV of 4 chunks in all, plus
        # each value's header (well under 1 %); every half read back once.
        kv = 4 * CHUNK * kv_bytes_per_token(tiny_llama_kv2)
        assert stats["pool:dram:chunks_written"] == stats["pool:dram:chunks_read"] == 2 * 4
        assert kv < stats["pool:dram:bytes_written"] < 1.01 * kv
        assert stats["pool:dram:bytes_read"] == stats["pool:dram:bytes_written"]
        assert_blocks_free(llm)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(("model", "layout"), [
    pytest.param("tiny_llama_kv2", DCP2, id="kv2-dcp2",
                 marks=pytest.mark.matrix("dcp-pool", model=KV2)),
    pytest.param("tiny_llama_kv2", TP2, id="kv2-tp2",
                 marks=pytest.mark.matrix("tp-pool", model=KV2)),
    pytest.param("model_path", DCP2, id="smollm2-dcp2",
                 marks=pytest.mark.matrix("dcp-pool", model="smollm2")),
])
def test_disk_pool_each_rank_stores_its_shard_and_a_lost_shard_is_a_miss_for_all(
    request, tmp_path, model, layout
):
    tiny_llama_kv2 = request.getfixturevalue(model)  # the model's folder
    want = reference(tiny_llama_kv2)
    path = tmp_path / "pool"
    llm = engine(tiny_llama_kv2, [{"name": "disk", "path": str(path)}], **layout)
    try:
        assert run(llm, prompts()) == want  # cold: every chunk stored by both ranks
        stats = llm.llm_engine.scheduler.kv_stats
        assert stats["pool:all:hit_tokens"] == 0
        wait_for("8 shards on disk", lambda: len(disk_entries(path)) == 2 * 2 * len(LENS))
        entries = disk_entries(path)
        stored = by_rank(entries)
        check_shards(stored, kv_bytes_per_token(tiny_llama_kv2))

        reset_local(llm)
        assert run(llm, prompts()) == want  # hot: every loadable chunk from the pool
        assert stats["pool:all:hit_tokens"] == 2 * 128
        assert stats.get("pool:all:rank_misses", 0) == 0
        # The ranks' write counters, summed by the executor, are the bytes found above.
        assert stats["pool:disk:bytes_written"] == sum(len(v) for v in entries.values())

        # One rank loses one chunk: that chunk is a miss for both ranks (and the chunks after
        # it in the same prompt are not loaded), recomputed, and stored again.
        fp = sorted(stored)[1]
        lost = sorted(stored[fp])[0]
        (path / f"pdkv_{fp}_{lost}.kv").unlink()
        # The disk tier notices files removed behind its back at its next put (its index is
        # refreshed from the directory then; `pdkv.kvpool.tiers.disk`): store another chunk.
        assert run(llm, prompts((70,)))
        wait_for("the other chunk stored", lambda: len(disk_entries(path)) == 2 * 2 * len(LENS) + 1)
        reset_local(llm)
        assert run(llm, prompts()) == want
        assert stats["pool:all:rank_misses"] == 1
        assert stats["pool:all:hit_tokens"] in (2 * 128 + 128, 2 * 128 + 192)
        wait_for("the recomputed chunk stored again",
                 lambda: lost in by_rank(disk_entries(path)).get(fp, {}))
        assert_blocks_free(llm)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(("model", "layout"), [
    pytest.param("model_path", DCP2, id="smollm2-dcp2",
                 marks=pytest.mark.matrix("dcp-pool", model="smollm2")),
    pytest.param("tiny_llama_kv2", DCP2, id="kv2-dcp2",
                 marks=pytest.mark.matrix("dcp-pool", model=KV2)),
    pytest.param("tiny_llama_kv2", TP2, id="kv2-tp2",
                 marks=pytest.mark.matrix("tp-pool", model=KV2)),
])
def test_redis_pool(request, redis_service, model, layout):
    import redis

    model_path = request.getfixturevalue(model)  # the model's folder
    client = redis.Redis.from_url(redis_service.address)
    client.flushdb()
    want = reference(model_path)
    llm = engine(model_path, [{"name": "redis", "url": redis_service.address}], **layout)
    try:
        assert run(llm, prompts()) == want
        stats = llm.llm_engine.scheduler.kv_stats
        wait_for("8 shards in redis", lambda: len(client.keys("pdkv:*")) == 2 * 2 * len(LENS))
        stored = by_rank({k.decode(): client.get(k) for k in client.keys("pdkv:*")})
        check_shards(stored, kv_bytes_per_token(model_path))
        reset_local(llm)
        assert run(llm, prompts()) == want
        assert stats["pool:all:hit_tokens"] == 2 * 128
        # One rank's shard gone from redis: a miss for both ranks.
        fp = sorted(stored)[0]
        client.delete(f"pdkv:{fp}:{sorted(stored[fp])[0]}")
        reset_local(llm)
        assert run(llm, prompts()) == want
        assert stats["pool:all:rank_misses"] == 1
        assert_blocks_free(llm)
    finally:
        llm.llm_engine.shutdown()
        client.flushdb()


@pytest.mark.parametrize("layout", [
    pytest.param(DCP2, id="dcp2", marks=pytest.mark.matrix("dcp-pd-pool", model=KV2)),
    pytest.param(TP2, id="tp2", marks=pytest.mark.matrix("tp-pd-pool", model=KV2))])
def test_pd_with_a_pool_into_a_dcp_decode_loads_the_pool_prefix_then_p_rest(
    tiny_llama_kv2, tmp_path, layout
):
    """D (dcp 2, or tp 2) runs MultiConnector [pool kv_both, P2P consumer]: the first handoff
    pulls the whole prompt from P and D's ranks store their shards; sent again with D's prefix
    cache reset, each rank loads the pool's 2 chunks and pulls only the rest from P. Output
    equals the single-rank engine's both times."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
    from pd_tp_utils import NEW_TOKENS, decode, kv_config, prefill

    prompt = prompts((150,))[0]
    want = reference(tiny_llama_kv2)[1][:NEW_TOKENS]  # LENS[1] == 150; greedy: a prefix
    d_config = json.dumps({
        "kv_connector": "MultiConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {
                 "chunk_size": CHUNK, "tiers": [{"name": "disk", "path": str(tmp_path)}]}},
            {"kv_connector": "P2PConnector", "kv_connector_extra_config": {"transfer": "tcp"}},
        ]}})
    per_token = kv_bytes_per_token(tiny_llama_kv2)
    p = engine(tiny_llama_kv2, kv_transfer_config=kv_config("kv_producer"))
    d = engine(tiny_llama_kv2, kv_transfer_config=d_config, **layout)
    try:
        params, _ = prefill(p, prompt)
        out = decode(p, d, prompt, params)[0]
        assert list(out.outputs[0].token_ids) == want
        # D computes the last prompt token itself: 149 tokens' KV came from P, whole blocks of
        # 16 tokens (10 blocks: the last partial one included).
        assert out.kv_load_bytes == {"p2p": 10 * 16 * per_token}
        wait_for("D's 4 shards on disk", lambda: len(disk_entries(tmp_path)) == 2 * 2)
        check_one = by_rank(disk_entries(tmp_path))
        assert len(check_one) == 2 and all(len(c) == 2 for c in check_one.values())

        assert d.reset_prefix_cache()
        params, _ = prefill(p, prompt)
        out = decode(p, d, prompt, params)[0]
        assert list(out.outputs[0].token_ids) == want
        # The pool's 128 tokens (both ranks' halves), then P's blocks 8 and 9 (tokens 128-149).
        assert out.kv_load_bytes == {"pool": 128 * per_token, "p2p": 2 * 16 * per_token}
        assert_blocks_free(d)
    finally:
        d.llm_engine.shutdown()
        p.llm_engine.shutdown()
