"""D's push windows (pdkv/kv_transfer/connector/p2p_push.py, PushReceiver) without engines: a
window whose lease passes while an accepted write is still receiving is failed only after that
write ended (its blocks are never freed for reuse while bytes arrive); a window whose units all
landed succeeds with the bytes of each unit counted once."""

from __future__ import annotations

import time

from pdkv.kv_transfer.connector.p2p_messages import WindowSpec
from pdkv.kv_transfer.connector.p2p_push import PushReceiver
from pdkv.kv_transfer.connector.p2p_results import WorkerResults

LAYERS, BB = 2, 64  # two layers per block: 32 bytes per (block, layer)


def receiver(lease_s: float) -> tuple[PushReceiver, WorkerResults]:
    results = WorkerResults(lambda: None)
    rx = PushReceiver(results, [BB], [LAYERS])
    rx.open([WindowSpec("r", "n", ([3, 5],), lease_s)])
    return rx, results


def test_expiry_waits_for_an_accepted_write_to_end():
    rx, results = receiver(0.01)
    assert rx.authorize(("r", "n"), "g0", [(3 * BB, 32)]) is None  # accepted, now receiving
    time.sleep(0.02)
    rx.expire()
    assert results.take_finished() == (set(), set())  # still the window's: not failed yet
    rx.on_written(("r", "n"), "g0", [(3 * BB, 32)], False)  # the stream broke
    rx.expire()
    assert results.take_finished() == (set(), {"r"})
    assert results.take_errors()["r"].startswith("push window deadline passed")
    assert results.take_bad_blocks() == {(0, 3), (0, 5)}


def test_all_units_landed_succeeds_and_counts_bytes_once():
    rx, results = receiver(30.0)
    units = [(b * BB + j * 32, 32) for b in (3, 5) for j in range(LAYERS)]
    for off, n in units:
        assert rx.authorize(("r", "n"), "g0", [(off, n)]) is None
        assert results.take_finished() == (set(), set())
        rx.on_written(("r", "n"), "g0", [(off, n)], True)
    assert results.take_finished() == (set(), {"r"})
    stats, _ = results.take_stats()
    assert stats["kv_bytes_received"] == 4 * 32
    assert rx.authorize(("r", "n"), "g0", [(3 * BB, 32)]) is not None  # window closed
    stats, _ = results.take_stats()
    assert stats["kv_push_refused"] == 1


def test_a_push_engine_at_tp_or_dcp_above_one_does_not_start():
    """Refused when the connector is built (start-up), naming pull, not at each request."""
    import dataclasses

    import pytest

    from pdkv.cache.kv_layout import KVLayout
    from pdkv.kv_transfer.connector.p2p_config import P2PConfig
    from pdkv.kv_transfer.connector.p2p_scheduler import P2PConnectorScheduler
    from tests.kv_transfer.p2p_sched_utils import BS, LAYOUT, PRODUCER_ADDR, consumer_spec

    spec = consumer_spec()
    push = dataclasses.replace(spec, p2p=P2PConfig.from_extra({"transfer_mode": "push"}))
    for extra in ({"tp_size": 2}, {"dcp_size": 2, "interleave": BS}):
        layout = KVLayout.from_wire({**LAYOUT, **extra})
        with pytest.raises(ValueError, match="needs tp 1 and dcp 1.*transfer_mode 'pull'"):
            P2PConnectorScheduler(push, layout, BS, list(PRODUCER_ADDR))
        P2PConnectorScheduler(spec, layout, BS, list(PRODUCER_ADDR))  # pull: fine


def test_a_grant_for_another_layout_names_p_as_producer_and_d_as_consumer():
    """A layout field other than the block size differs: refused naming both values (P the
    producer, D the consumer); a block size is re-blocked, but not on MLA latent blocks."""
    import msgspec
    import pytest

    from pdkv.kv_transfer.connector.p2p_compat import MLA_KV_LAYOUT
    from pdkv.kv_transfer.connector.p2p_messages import PushGrant
    from tests.kv_transfer.p2p_sched_utils import LAYOUT, make

    def refusal(p_layout: dict, d_layout: dict) -> str:
        p = make("kv_producer", layout=p_layout)
        p.pushes.enabled = True
        grant = PushGrant(engine_id="d", request_id="r", nonce="n", block_ids=[[1]],
                          first_block=0, prompt_digest="x", host="127.0.0.1", port=1,
                          lease_s=5.0, num_tokens=8, block_size=int(d_layout["block_size"]),
                          layout=d_layout)
        with pytest.raises(ValueError) as e:
            p.pushes.validate(None, {"do_remote_decode": True,  # type: ignore[arg-type]
                                     "push_grant": msgspec.to_builtins(grant)})
        return str(e.value)

    said = refusal(LAYOUT, {**LAYOUT, "dtype": "float32"})
    assert "dtype: producer='float16' consumer='float32'" in said
    bs = LAYOUT["block_size"]
    mla = {**LAYOUT, "kv_layout": MLA_KV_LAYOUT}
    said = refusal(mla, {**mla, "block_size": 2 * bs})
    assert f"prefill block_size={bs} and decode block_size={2 * bs}" in said
    assert "MLA latent blocks" in said and "use equal block sizes" in said
