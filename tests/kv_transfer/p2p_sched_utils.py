"""Builders shared by the P2P scheduler-half tests: configs, requests, params and blocks made by
hand (torch-free)."""

from __future__ import annotations

from typing import Any

from pdkv.cache.block_pool import KVCacheBlock
from pdkv.cache.kv_cache_manager import KVCacheBlocks
from pdkv.cache.kv_layout import KVLayout
from pdkv.config import KVTransferConfig
from pdkv.kv_transfer.connector.p2p_messages import (
    P2PConnectorMetadata,
    RemoteEngine,
    prompt_digest,
)
from pdkv.kv_transfer.connector.p2p_scheduler import P2PConnectorScheduler
from pdkv.kv_transfer.connector.spec import P2PSpec, connector_spec
from pdkv.request import Request, RequestStatus
from pdkv.sampling_params import SamplingParams

BS = 4
LEASE = 30.0
LAYOUT = {
    "model_digest": "sha-abc",
    "dtype": "float16",
    "block_size": BS,
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_size": 8,
    "kv_layout": "cross_layer",
}
PRODUCER_ADDR = ["10.1.2.3", 47001]
REMOTE = RemoteEngine("prefill-0", "10.1.2.3", 47001)


def consumer_spec() -> P2PSpec:
    """A P2P consumer's spec with default settings."""
    spec = connector_spec(KVTransferConfig("P2PConnector", "kv_consumer"), BS)
    assert isinstance(spec, P2PSpec)
    return spec


def make(role: str, engine_id: str = "engine-0", layout: dict[str, Any] | None = None,
         lease: float = LEASE) -> P2PConnectorScheduler:
    cfg = connector_spec(KVTransferConfig("P2PConnector", role, engine_id=engine_id,
                                          kv_connector_extra_config={"kv_lease_duration": lease}),
                         BS)
    return P2PConnectorScheduler(cfg, KVLayout.from_wire(layout or LAYOUT), BS, list(PRODUCER_ADDR))


def req(rid: str, n: int = 10, params: dict[str, Any] | None = None,
        status: RequestStatus | None = None) -> Request:
    r = Request(rid, list(range(20, 20 + n)), SamplingParams(max_tokens=8), BS,
                kv_transfer_params=params)
    if status is not None:
        r.status = status
    return r


def remote_params(n: int = 10, remote_block_ids: list[list[int]] | None = None,
                  **over: Any) -> dict[str, Any]:
    p: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-0",
        "remote_request_id": "p-" + str(n),
        "remote_block_ids": remote_block_ids or [[50, 51, 52]],
        "remote_host": "10.1.2.3",
        "remote_port": 47001,
        "remote_nonce": "nonce-" + str(n),
        "prompt_digest": prompt_digest(list(range(20, 20 + n)), None),  # the prompt of req(.., n)
        "tp_size": 1,
        "block_size": BS,
        "num_tokens": n,
        "layout": dict(LAYOUT),
    }
    p.update(over)
    return p


def blocks(*groups: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(tuple([KVCacheBlock(i, ref_cnt=1) for i in g] for g in groups))


def empty_meta(meta: P2PConnectorMetadata) -> bool:
    return not (meta.reqs_to_send or meta.reqs_to_recv or meta.notifications)
