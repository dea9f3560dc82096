"""A P2P producer on the shm transfer engine in a process of its own, for
test_shm_hosts.py (run under `ip netns exec`: a producer on another host).

    python shm_producer_proc.py HOST

Binds its control server to HOST, holds blocks [1, 2] of request "r" under a fresh grant, prints
one JSON line {"port", "nonce", "digest", "host_id"}, then steps until the grant ends (the
consumer's release or done) and prints "ended r", or exits 1 after 60 s."""

from __future__ import annotations

import json
import secrets
import sys
import time

import torch

from pdkv.cache.kv_layout import KVLayout
from pdkv.config import KVTransferConfig
from pdkv.kv_transfer.connector.p2p_messages import P2PConnectorMetadata, SendSpec, prompt_digest
from pdkv.kv_transfer.connector.p2p_worker import P2PConnectorWorker
from pdkv.kv_transfer.connector.spec import connector_spec

LAYOUT = {"model_digest": "m", "dtype": "float32", "block_size": 4, "num_layers": 1,
          "num_kv_heads": 1, "head_size": 8, "kv_layout": "cross_layer"}
SHAPE = (16, 1, 2, 4, 1, 8)  # 256 B per block
TOKENS = list(range(100, 112))


def shm_worker(role: str, engine_id: str, host: str = "127.0.0.1") -> tuple[P2PConnectorWorker,
                                                                           torch.Tensor]:
    """A P2P worker on the shm engine with a registered CPU KV cache of SHAPE (the producer's
    in shared memory, filled with 0, 1, 2, ...; the consumer's zeros)."""
    cfg = KVTransferConfig("P2PConnector", role, engine_id=engine_id,
                           kv_connector_extra_config={"transfer": "shm", "kv_host": host,
                                                      "transfer_timeout": 10.0})
    w = P2PConnectorWorker(connector_spec(cfg, 4), KVLayout.from_wire(LAYOUT), [host, 0])
    n = torch.Size(SHAPE).numel()
    buf = w.kv_cache_buffer(0, n * 4)
    if buf is None:
        kv = torch.zeros(SHAPE)
    else:
        kv = torch.frombuffer(buf, dtype=torch.float32, count=n).reshape(SHAPE)
        kv.copy_(torch.arange(n, dtype=torch.float32).reshape(SHAPE))
    w.register_kv_caches([kv])
    return w, kv


def hold(prod: P2PConnectorWorker, rid: str, blocks: list[int]) -> tuple[str, str]:
    """Hold `blocks` under a new grant for TOKENS; returns (nonce, prompt digest)."""
    nonce, digest = secrets.token_hex(16), prompt_digest(TOKENS, None)
    prod.start_load_kv(
        P2PConnectorMetadata(reqs_to_send=[SendSpec(rid, (blocks,), 30.0, nonce, digest)]))
    return nonce, digest


def main(host: str) -> int:
    prod, _ = shm_worker("kv_producer", "P", host)
    try:
        nonce, digest = hold(prod, "r", [1, 2])
        print(json.dumps({"port": prod.control_address[1], "nonce": nonce, "digest": digest,
                          "host_id": prod.engine.peer_info()["host_id"]}), flush=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if "r" in prod.get_finished()[0]:
                print("ended r", flush=True)
                return 0
            time.sleep(0.02)
        return 1
    finally:
        prod.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
