"""P/D with a KV pool (MultiConnector on both engines, a disk tier both share): outputs equal
the colocated engine's; a prompt of k·C + 1 tokens sent again with D's prefix cache reset is
loaded from the pool and pulls 0 bytes from P (P is told to release); blocks return to baseline."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pd_utils import decode, prefill, settle, shutdown

from pdkv import LLM, SamplingParams

pytestmark = pytest.mark.slow

CHUNK = 64
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def multi(role: str, pool_dir: str) -> str:
    p2p: dict[str, Any] = {
        "kv_connector": "P2PConnector",
        "kv_connector_extra_config": {"transfer": "tcp"},
    }
    pool = {
        "kv_connector": "KVPoolConnector",
        "kv_connector_extra_config": {
            "chunk_size": CHUNK,
            "tiers": [{"name": "disk", "path": pool_dir, "capacity_bytes": 1 << 30}],
        },
    }
    children = [p2p, pool] if role == "kv_producer" else [pool, p2p]
    return json.dumps({"kv_connector": "MultiConnector", "kv_role": role,
                       "kv_connector_extra_config": {"connectors": children}})


BLOCK_BYTES = 737_280  # SmolLM2 fp32, block 16: 30 layers · 2 · 16 · 3 heads · 64 · 4 B


@pytest.mark.matrix("pd-pool")
def test_pd_with_a_pool_matches_colocated_and_pulls_from_p_only_what_the_pool_lacks(tmp_path):
    plain = LLM("smollm2", num_kv_blocks=128, max_model_len=1024)
    tok = plain.get_tokenizer()
    text = " ".join(f"Note {i}: rivers carry water and silt to the sea." for i in range(80))
    ids = tok(text)["input_ids"]
    mixed = ids[100 : 100 + 2 * CHUNK + 30]  # the pool has 2 chunks, P sends the other 30 tokens
    whole = ids[: 3 * CHUNK + 1]  # k·C + 1 tokens: the pool has all but the last token
    want = [o.outputs[0].token_ids for o in plain.generate(
        [{"prompt_token_ids": mixed}, {"prompt_token_ids": whole}], GREEDY)]
    shutdown(plain)
    p = LLM("smollm2", num_kv_blocks=128, max_model_len=1024,
            kv_transfer_config=multi("kv_producer", str(tmp_path)))
    d = LLM("smollm2", num_kv_blocks=128, max_model_len=1024,
            kv_transfer_config=multi("kv_consumer", str(tmp_path)))
    p_store = p.llm_engine.runner.connector.children[1].store  # type: ignore[union-attr]
    d_stats = d.llm_engine.scheduler.kv_stats

    def through_pd(prompt: list[int]) -> Any:
        params = prefill(p, {"prompt_token_ids": prompt}).kv_transfer_params
        assert params and params["do_remote_prefill"]
        assert p_store.flush(30.0)  # P's chunks are in the pool before D looks
        out = decode(p, d, [{"prompt_token_ids": prompt}], [params], GREEDY)[0]
        settle(p, d)  # P freed what it held (read or released), both back to baseline
        return out

    try:
        out = through_pd(mixed)
        assert out.outputs[0].token_ids == want[0]
        assert out.kv_load_bytes == {"pool": 8 * BLOCK_BYTES, "p2p": 2 * BLOCK_BYTES}
        received = d_stats["kv_bytes_received"]
        for _ in range(2):  # the second time with D's prefix cache reset
            out = through_pd(whole)
            assert out.outputs[0].token_ids == want[1]
            assert out.num_cached_tokens == 3 * CHUNK
            assert out.kv_load_bytes == {"pool": 12 * BLOCK_BYTES}  # 0 bytes from P
            assert d.reset_prefix_cache()
        assert d_stats["kv_bytes_received"] == received
    finally:
        shutdown(p, d)
