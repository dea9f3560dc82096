"""`connector_spec`: --kv-transfer-config parsed once into a typed spec per connector, and the
engine refusing a bad setting before it loads the model."""

from __future__ import annotations

import pytest

from pdkv.config import KVTransferConfig
from pdkv.kv_transfer.connector.p2p_config import P2PConfig
from pdkv.kv_transfer.connector.spec import (
    MultiSpec,
    OffloadSpec,
    P2PSpec,
    PoolSpec,
    connector_spec,
)


def spec(name: str, role: str = "kv_both", **extra: object):
    return connector_spec(KVTransferConfig(name, role, engine_id="e0",
                                           kv_connector_extra_config=dict(extra)), 16)


def test_each_connector_gets_its_own_typed_settings():
    p2p = spec("P2PConnector", "kv_producer", transfer="shm", kv_lease_duration=5)
    assert isinstance(p2p, P2PSpec)
    assert (p2p.p2p.transfer, p2p.p2p.kv_lease_duration) == ("shm", 5.0)
    assert p2p.p2p.transfer_timeout == P2PConfig().transfer_timeout  # defaults in one place
    assert (p2p.kv_role, p2p.engine_id, p2p.is_kv_producer, p2p.is_kv_consumer) == (
        "kv_producer", "e0", True, False)
    pool = spec("KVPoolConnector", chunk_size=32)
    assert isinstance(pool, PoolSpec) and pool.pool.chunk_size == 32
    off = spec("OffloadingConnector", cpu_bytes_to_use=1024)
    assert isinstance(off, OffloadSpec) and off.offload.cpu_bytes_to_use == 1024
    multi = spec("MultiConnector", connectors=[{"kv_connector": "KVPoolConnector"},
                                               {"kv_connector": "P2PConnector",
                                                "kv_role": "kv_consumer"}])
    assert isinstance(multi, MultiSpec)
    assert [type(c) for c in multi.children] == [PoolSpec, P2PSpec]
    assert [(c.kv_role, c.engine_id) for c in multi.children] == [
        ("kv_both", "e0"), ("kv_consumer", "e0")]


def test_the_load_failure_policy_is_the_connectors_default_unless_set():
    assert spec("KVPoolConnector").load_failure_policy == "recompute"  # best effort
    assert spec("P2PConnector").load_failure_policy == "fail"  # vLLM's default on decode
    cfg = KVTransferConfig("P2PConnector", "kv_consumer", kv_load_failure_policy="recompute")
    assert connector_spec(cfg, 16).load_failure_policy == "recompute"


@pytest.mark.parametrize("name, role, extra, match", [
    ("NoSuchConnector", "kv_both", {}, "unknown kv_connector 'NoSuchConnector'"),
    ("P2PConnector", "kv_producer", {"kv_port": -1}, "kv_port"),
    ("P2PConnector", "kv_producer", {"kv_portt": 5}, "unknown P2PConnector settings"),
    ("KVPoolConnector", "kv_both", {"chunk_size": 24}, "multiple of the block size 16"),
    ("KVPoolConnector", "kv_both", {"chunk": 16}, "unknown KVPoolConnector settings"),
    ("OffloadingConnector", "kv_producer", {}, "kv_both"),
    ("MultiConnector", "kv_both", {"connectors": [{"kv_connector": "P2PConnector",
                                                   "kv_port": "x"}]}, "kv_port"),
])
def test_bad_settings_are_refused_with_their_name(name, role, extra, match):
    with pytest.raises(ValueError, match=match):
        connector_spec(KVTransferConfig(name, role, kv_connector_extra_config=extra), 16)


def test_the_engine_refuses_a_bad_setting_before_it_loads_the_model(monkeypatch):
    from pdkv.engine.arg_utils import EngineArgs
    from pdkv.engine.llm_engine import LLMEngine
    from pdkv.worker import model_runner

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the connector settings were checked")

    monkeypatch.setattr(model_runner, "load_model", no_load)
    config = EngineArgs(
        model="tiny-llama-kv2", kv_transfer_config=(
            '{"kv_connector": "P2PConnector", "kv_role": "kv_consumer", '
            '"kv_connector_extra_config": {"transfer_timeout": -1}}'),
    ).create_engine_config()
    with pytest.raises(ValueError, match="transfer_timeout"):
        LLMEngine(config)
