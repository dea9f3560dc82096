"""KVLayout: the worker's KV layout, built once, converted to / from its wire form at the edge."""

import pytest

from pdkv.cache.kv_layout import KVLayout, StateGeometry

WIRE = {"model_digest": "m", "dtype": "float32", "block_size": 16, "num_layers": 2,
        "num_kv_heads": 4, "head_size": 8, "kv_layout": "cross_layer"}


def test_wire_round_trip_keeps_exactly_the_stated_fields() -> None:
    full = {**WIRE, "kv_cache_dtype": "int8",
            "linear_state": StateGeometry(1, 3, (4, 4, 8), 6, 2, 64).to_layout(),
            "kv_quant": "int8:per_token_head_absmax", "tp_size": 2, "dcp_size": 1, "interleave": 1,
            "dcp_replicated": False, "num_local_kv_heads": 2}
    for wire in (WIRE, full, {**WIRE, "interleave": 16, "dcp_replicated": True}):
        layout = KVLayout.from_wire(wire)
        assert layout.to_wire() == wire
        assert KVLayout.from_wire(layout.to_wire()) == layout
    plain = KVLayout.from_wire(WIRE)
    assert (plain.cache_dtype, plain.tp, plain.dcp, plain.local_kv_heads) == ("auto", 1, 1, 4)
    sharded = KVLayout.from_wire(full)
    assert (sharded.cache_dtype, sharded.tp, sharded.local_kv_heads) == ("int8", 2, 2)
    assert sharded.linear_state == StateGeometry(1, 3, (4, 4, 8), 6, 2, 64)


@pytest.mark.parametrize(("wire", "words"), [
    ({k: v for k, v in WIRE.items() if k != "dtype"}, "lacks ['dtype']"),
    ({**WIRE, "typo": 1}, "unknown KV layout fields ['typo']"),
    ({**WIRE, "block_size": 0}, "block_size must be an integer >= 1"),
    ({**WIRE, "num_layers": "2"}, "num_layers must be an integer"),
    ({**WIRE, "dtype": 4}, "dtype must be a string"),
    ({**WIRE, "dcp_replicated": 1}, "dcp_replicated must be true or false"),
    ({**WIRE, "linear_state": {"group": 1}}, "malformed linear_state"),
])
def test_from_wire_names_what_is_wrong(wire: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        KVLayout.from_wire(wire)
