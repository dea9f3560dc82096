"""ConnectorStartup: the start-up values both connector halves of one engine share."""

import pytest

from pdkv.kv_transfer.connector.startup import ConnectorStartup


def test_by_name_form_round_trips_and_keeps_the_address_list() -> None:
    address: list[str | int] = ["127.0.0.1", 0]
    start = ConnectorStartup(dcp_rank=1, dcp_size=2, rank=3, world_size=4, control_address=address)
    shared = start.as_shared()
    assert shared == {"dcp_rank": 1, "dcp_size": 2, "rank": 3, "world_size": 4,
                      "control_address": ["127.0.0.1", 0]}
    again = ConnectorStartup.from_shared(shared)
    assert again == start and again.control_address is address  # the worker half fills it in place
    assert ConnectorStartup.from_shared({}) == ConnectorStartup()
    assert ConnectorStartup().as_shared() == {"dcp_rank": 0, "dcp_size": 1}


@pytest.mark.parametrize(("shared", "words"), [
    ({"dcp_rank": "1"}, "dcp_rank must be an integer"),
    ({"control_address": "127.0.0.1:1"}, r"control_address must be \[host, port\]"),
    ({"control_endpoints": [["h", 1], 2]}, "control_endpoints must list"),
    ({"pool_store": object()}, "pool_store must be a KVPoolStore"),
    ({"typo": 1}, "unknown connector start-up values"),
])
def test_from_shared_names_what_is_wrong(shared: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ConnectorStartup.from_shared(shared)
