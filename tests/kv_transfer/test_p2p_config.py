"""P2PConfig: kv_connector_extra_config parsed once, defaults in one place, bad values named."""

import pytest

from pdkv.kv_transfer.connector.p2p_config import P2PConfig


def test_defaults_and_values() -> None:
    assert P2PConfig.from_extra({}) == P2PConfig()
    assert P2PConfig().kv_lease_duration == 30.0
    cfg = P2PConfig.from_extra({"transfer": "shm", "kv_port": 5000, "kv_lease_duration": 2,
                                "transfer_port": None})
    got = (cfg.transfer, cfg.kv_port, cfg.kv_lease_duration, cfg.transfer_port)
    assert got == ("shm", 5000, 2.0, 0)
    with pytest.raises(ValueError, match=r"unknown P2PConnector settings \['other'\]"):
        P2PConfig.from_extra({"transfer": "shm", "other": object()})  # a typo is not ignored


@pytest.mark.parametrize(("key", "value"), [
    ("kv_lease_duration", -1.0), ("kv_lease_duration", "30"), ("kv_port", 1.5), ("kv_port", True),
    ("kv_pull_threads", -2), ("transfer", 3),
])
def test_bad_values_are_named(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"P2PConnector {key} must be"):
        P2PConfig.from_extra({key: value})


@pytest.mark.parametrize("transfer", ["tcp", "shm", "mooncake"])
def test_push_is_taken_over_the_transfer_engines_that_write(transfer: str) -> None:
    cfg = P2PConfig.from_extra({"transfer": transfer, "transfer_mode": "push"})
    assert (cfg.transfer, cfg.transfer_mode) == (transfer, "push")
    assert P2PConfig.from_extra({"transfer": transfer}).transfer_mode == "pull"


def test_push_over_an_engine_that_cannot_write_names_those_that_can() -> None:
    with pytest.raises(ValueError, match="tcp, shm, mooncake transfer engines only"):
        P2PConfig.from_extra({"transfer": "nccl", "transfer_mode": "push"})
